"""The study files shipped with hpsearch (read with importlib.resources)."""
