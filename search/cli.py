"""The `hpsearch` command. Each command parses, calls a library function, and prints.

Library errors (HpsearchError) become one line on stderr and exit code 1 (a worker stopped
by a full disk: EXIT_DISK_FULL, 74).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import io
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO, TypeVar

import click
from hpsearch import __version__
from hpsearch.errors import (
    EXIT_CONFIG,
    EXIT_DATA_ERROR,
    EXIT_DISK_FULL,
    DatasetError,
    DiskFullError,
    HpsearchError,
    HpsearchWarning,
    StudyNotFoundError,
)

F = TypeVar("F", bound=Callable[..., Any])
_T = TypeVar("_T")


def _edge(fn: F) -> F:
    """Turn library errors into click errors: one line, exit code 1 (DiskFullError: 74; a
    DatasetError: 65, which a launcher does not restart), no traceback. A database error the
    library passed on as it came (a permission Optuna's own calls lack) too."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HpsearchError as exc:
            err = click.ClickException(str(exc))
            if isinstance(exc, DiskFullError):
                err.exit_code = EXIT_DISK_FULL  # the launcher restarts it once there is room
            elif isinstance(exc, DatasetError):
                err.exit_code = EXIT_DATA_ERROR  # the same data for each restart: none
            raise err from exc
        except OSError as exc:
            # A full disk or a folder it may not write, met outside the library's own checks
            # (the launcher's last writes to a journal, say): one line, not a traceback.
            # Permission errors only with their file: a signal to a foreign process is a bug.
            if exc.errno not in _FOLDER_ERRNOS or (exc.errno in _PERM_ERRNOS and not exc.filename):
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            raise click.ClickException(f"{where}{exc.strerror or exc}") from exc
        except Exception as exc:
            if not _database_error(exc):
                raise
            from hpsearch.storage import _one_line
            from hpsearch.tracking.server import scrub

            raise click.ClickException(f"storage: {scrub(_one_line(exc))}") from exc

    return wrapper  # type: ignore[return-value]


_PERM_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
_FOLDER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}) | _PERM_ERRNOS


def _database_error(exc: BaseException) -> bool:
    """SQLAlchemy's errors and Optuna's StorageInternalError (which wraps them), from
    modules already imported (a command that never touched a database imports none)."""
    kinds = [
        getattr(sys.modules.get("sqlalchemy.exc"), "SQLAlchemyError", None),
        getattr(sys.modules.get("optuna.exceptions"), "StorageInternalError", None),
    ]
    return any(isinstance(k, type) and isinstance(exc, k) for k in kinds)


def _study_options(fn: F) -> F:
    opts = [
        click.option("--study", "-s", required=True, help="Study name in studies/ or a YAML path."),
        click.option(
            "--set", "overrides", multiple=True, metavar="KEY=VALUE",
            help="Override a study field, e.g. --set budget.max_epochs=2 (repeatable).",
        ),
        click.option("--data-dir", type=_Folder(), default=None,
                     help="Dataset root (else --set dataset.root, else HPSEARCH_DATA_DIR, "
                          "else the study file)."),
        click.option("--download", is_flag=True, default=None,
                     help="Allow downloading the dataset if it is missing."),
        click.option("--workdir", type=_Folder(path_type=Path),
                     default=Path(".hpsearch"), show_default=True, envvar="HPSEARCH_WORKDIR",
                     help="Work folder: journal storage, data cache, checkpoints, MLflow store "
                          "(else HPSEARCH_WORKDIR)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                     show_default=True, help="Where trials train."),
    ]  # fmt: skip
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _workdir_option(fn: F) -> F:
    return click.option(
        "--workdir", type=_Folder(path_type=Path),
        default=Path(".hpsearch"), envvar="HPSEARCH_WORKDIR",
        help="Work folder (journal storage, MLflow store); else HPSEARCH_WORKDIR, "
             "else ./.hpsearch.",
    )(fn)  # fmt: skip


def _not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An empty --storage (an unset shell variable: --storage "$DB") would read the journal
    file in --workdir, another study's storage, without a word; an empty --tracking-uri
    took the embedded server, an empty --host listened on every interface (QA)."""
    if value is not None and not value.strip():
        what = {"storage": "a URL", "tracking_uri": "a URI", "host": "an address"}.get(
            param.name or "", "a value"
        )
        raise click.BadParameter(f"empty; give {what}, or leave the option out", ctx, param)
    return value


def _printable(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A name that status prints on one line: no newline or other control character."""
    if any(not ch.isprintable() for ch in value):
        raise click.BadParameter(f"{value!r}: only printable characters", ctx, param)
    return value


class _Folder(click.Path):
    """click.Path of a folder that refuses an empty value: "" was the current folder (an
    unset variable, --workdir "$W", put the work folder's files there), or no data dir."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(file_okay=False, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("empty; give a folder, or leave the option out", param, ctx)
        return super().convert(value, param, ctx)


def _storage_option(fn: F) -> F:
    return click.option(
        "--storage", default=None, metavar="URL", callback=_not_empty,
        help="Optuna storage URL (postgresql://user@host/db); else HPSEARCH_STORAGE, "
        "else the journal file in --workdir.",
    )(fn)  # fmt: skip


class _Seconds(click.FloatRange):
    """A number of seconds >= 0 (> 0 with min_open): click's FloatRange lets nan through,
    which compares false with every deadline, so the limit was silently off."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r}: must be a finite number of seconds", param, ctx)
        return number


class _WorkersType(click.ParamType):
    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip().lower()
        if text.isascii() and text.isdigit() and int(text) > MAX_WORKERS:
            self.fail(f"{value!r}: at most {MAX_WORKERS} workers per launch", param, ctx)
        if text == "auto" or (text.isascii() and text.isdigit() and int(text) >= 1):
            return text
        self.fail(f"{value!r}: expected a whole number >= 1 or 'auto'", param, ctx)


MAX_WORKERS = 256  # per launch: 8 GPUs x 32 packed workers; more only exhausts the machine


_WORKERS = _WorkersType()


def _trial_options(fn: F) -> F:
    """Options shared by `launch` and `worker`: how trials run and recover."""
    opts = [
        click.option("--timeout", type=_Seconds(min=0, min_open=True), default=None,
                     help="Stop handing out trials after SEC seconds."),
        click.option("--max-retries", type=click.IntRange(min=0), default=2, show_default=True,
                     help="Retries (resumed from checkpoint) of a trial whose worker died; "
                     "a trial a launch stops (Ctrl-C, SIGTERM, once or twice), or a worker "
                     "hands back on its first one, is resumed and uses none (one killed when "
                     "--grace runs out uses one, as a hung trial)."),
        click.option("--heartbeat", type=click.IntRange(min=1, max=3600), default=10,
                     show_default=True,
                     help="Trial heartbeat in seconds (PostgreSQL); a dead worker's trial is "
                     "failed and re-queued within twice that."),
        click.option("--train-fn", default="", hidden=True,
                     help="module:function replacing the trainer (tests, benchmarks)."),
    ]  # fmt: skip
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _tracking_options(fn: F) -> F:
    fn = click.option("--no-tracking", is_flag=True, help="Do not log to MLflow at all.")(fn)
    return click.option(
        "--tracking-uri", default=None, metavar="URI", callback=_not_empty,
        help="MLflow tracking server; else MLFLOW_TRACKING_URI, else the work folder's "
        "embedded server (launch starts it; a worker joins it when it runs).",
    )(fn)  # fmt: skip


def _check_tracking(tracking_uri: str | None, no_tracking: bool) -> None:
    """Two options that contradict each other: one of them would be ignored."""
    if no_tracking and tracking_uri:
        from hpsearch.errors import ConfigError

        raise ConfigError("--no-tracking and --tracking-uri: give one of them")


def _stored(study: str, read: Callable[[str], _T]) -> tuple[str, _T]:
    """The stored study a reader's `--study` names (`config.study_name`: a study file is
    read for its `name`), and `read` of it. A name that no stored study has, but that names
    a study file in ./studies (or a shipped one) of another `name`, reads that one, as
    `launch --study NAME` made it."""
    from hpsearch.config import find_study_file, load_config, study_name
    from hpsearch.errors import ConfigError

    try:
        name = study_name(study)
    except ConfigError:  # a file by that name that is no study file: then it is a name
        if os.sep in study or Path(study).suffix.lower() in (".yaml", ".yml"):
            raise
        name = study
    try:
        return name, read(name)
    except StudyNotFoundError as exc:
        try:
            other = load_config(find_study_file(study)).name if name == study else name
        except HpsearchError:
            raise exc from None
        if other == name:
            raise
        try:
            return other, read(other)
        except StudyNotFoundError:
            raise exc from None


def _load(study: str, overrides: tuple[str, ...], data_dir: str | None, download: bool | None,
          trials: int | None = None, stored: tuple[str | None, Path] | None = None,
          relaunch: tuple[str | None, Path] | None = None, join: bool = False) -> Any:  # fmt: skip
    """The study file's config, with --set and --trials on top. `stored` (storage, workdir):
    a plain name that no study file has may be a study in that storage, whose stored
    config is taken (`runner.stored_config`: a worker joining by the study's name); with
    `join` (a worker), a shipped study file's name too, where the storage holds that study.
    `relaunch` or `stored`: a file a rule for new study files refuses is taken with a
    warning when its study is in that storage (launched from it before the rule)."""
    import optuna
    from hpsearch.config import find_study_file, is_shipped, parse_overrides

    # Optuna's "[I ...] A new study created" / "Using an existing study" lines: the
    # commands say what they open in their own words, and an error stays one line.
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    sets = list(overrides)
    if trials is not None:
        for key, value in parse_overrides(overrides):
            key = key.strip()
            budget = value if key == "budget" and isinstance(value, dict) else {}
            given = value if key == "budget.n_trials" else budget.get("n_trials", trials)
            if given != trials:  # one of the two would be ignored without a word
                from hpsearch.errors import ConfigError

                raise ConfigError(
                    f"--trials {trials} and --set {key}: n_trials={given!r} disagree; "
                    "give one of them"
                )
        sets.append(f"budget.n_trials={trials}")
    try:
        if stored is not None:
            try:
                found = find_study_file(study)
            except HpsearchError as missing:
                from hpsearch.runner import stored_config

                if Path(study).suffix.lower() in (".yaml", ".yml"):  # a file's: not a name
                    raise
                cfg = stored_config(study, *stored, sets, data_dir, download)
                if cfg is None:
                    raise type(missing)(
                        f"{missing}; nor is {study!r} a study in the storage with a config "
                        "a launch stored"
                    ) from missing
                return cfg
            renamed = any(key.strip() == "name" for key, _ in parse_overrides(overrides))
            if join and is_shipped(found) and not renamed:
                # A study of a shipped file's name in the storage: its launch may have set
                # values on top (--set), which a worker joining by the name alone takes too.
                # A database still starting is waited for, as the worker's own start does
                # (else it trained the file's config for good); a stored config that no
                # longer loads leaves the file's (the worker says how its trials differ).
                from hpsearch.errors import ConfigError
                from hpsearch.runner import stored_config
                from hpsearch.storage import (
                    resolve_storage,
                    transient_connect_error,
                    with_db_retry,
                )

                with contextlib.suppress(ConfigError):
                    if cfg := with_db_retry(
                        lambda: stored_config(study, *stored, sets, data_dir, download),
                        what=f"storage {resolve_storage(*stored).display}",
                        transient=transient_connect_error,
                    ):
                        return cfg
        return _file_config(study, sets, data_dir, download, stored or relaunch)
    except HpsearchError as exc:  # the budget the message blames came from --trials
        given = f"(from --set budget.n_trials={trials})"
        if trials is None or not str(exc).endswith(given):
            raise
        raise type(exc)(str(exc).removesuffix(given) + f"(from --trials {trials})") from exc


def _file_config(
    study: str, sets: list[str], data_dir: str | None, download: bool | None,
    storage: tuple[str | None, Path] | None,
) -> Any:  # fmt: skip
    """`_load`'s study file. A launch's worker loads the launch's resolved file, which the
    launch checked, as a stored config is (`lenient`)."""
    from hpsearch.config import load_config
    from hpsearch.errors import ConfigError
    from hpsearch.launcher import LAUNCHED_ENV

    lenient = os.environ.get(LAUNCHED_ENV) == "1"
    try:
        return load_config(study, sets, data_dir=data_dir, download=download, lenient=lenient)
    except ConfigError as exc:
        refused = exc
    if storage is None:
        raise refused
    try:  # a rule for new files only, when the file loads as a stored config would
        cfg = load_config(study, sets, data_dir=data_dir, download=download, lenient=True)
    except ConfigError:
        raise refused from None
    from hpsearch.config import config_to_yaml
    from hpsearch.runner import stored_config

    try:
        launched = stored_config(cfg.name, *storage)
    except HpsearchError:  # not in a storage that answers: a new study, as far as we know
        launched = None
    # Only as its study was launched from it (budget.n_trials and where the data is aside):
    # an edit is held to the rules of today.
    if launched is None or config_to_yaml(cfg, True) != config_to_yaml(launched, True):
        raise refused
    warnings.warn(
        f"{refused}; allowed for study {cfg.name}, launched from it before this rule "
        "(a new study file is refused so)",
        HpsearchWarning,
        stacklevel=2,
    )
    return cfg


def _n(count: int, noun: str) -> str:
    """`1 trial`, `2 trials`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            from hpsearch.errors import DeviceError

            raise DeviceError("--device: 'cuda': CUDA is not available on this machine")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpsearch")
def cli() -> None:
    """Hyperparameter search for image classifiers: Optuna + PostgreSQL + MLflow.

    \b
    Example:
      hpsearch launch --study flowers102 --workers 4 --data-dir ../shared/datasets
    """


@cli.command()
@_study_options
@_storage_option
@_tracking_options
@_trial_options
@click.option(
    "--workers",
    "-w",
    type=_WORKERS,
    default="1",
    show_default=True,
    help="Worker processes on this machine, or 'auto': probe the study's largest trials "
    "on a GPU and pack as many per GPU as memory and utilization allow.",
)
@click.option(
    "--max-per-gpu",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="With --workers auto: at most this many workers share one GPU.",
)
@click.option(
    "--trials",
    "-n",
    type=click.IntRange(min=1),
    default=None,
    help="Total trials of the study (all launches together); else the study file.",
)
@click.option(
    "--gpus",
    default=None,
    metavar="0,1,...",
    help="GPUs to use, counted among those visible (CUDA_VISIBLE_DEVICES); workers are "
    "placed round-robin (several may share one).",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Restarts of a worker that crashed, or was stopped from outside (its trial resumes).",
)
@click.option(
    "--grace",
    type=_Seconds(min=0),
    default=120.0,
    show_default=True,
    help="Seconds the first Ctrl-C waits for running trials to checkpoint; a trial "
    "still running then is killed as a hung one: its retry counts against --max-retries.",
)
@_edge
def launch(study: str, overrides: tuple[str, ...], data_dir: str | None, download: bool | None,
           workdir: Path, device: str, storage: str | None, tracking_uri: str | None,
           no_tracking: bool, workers: str, max_per_gpu: int, trials: int | None,
           timeout: float | None, gpus: str | None, max_restarts: int, max_retries: int,
           grace: float, heartbeat: int, train_fn: str) -> None:  # fmt: skip
    """Create or resume a study and run WORKERS supervised worker processes.

    \b
    Examples:
      hpsearch launch --study flowers102 --workers 4 --data-dir ../shared/datasets
      hpsearch launch --study tiny --workers 3 --trials 6 \\
          --storage postgresql://postgres@127.0.0.1/test --set budget.max_epochs=1
      hpsearch launch --study flowers102 --workers auto --data-dir ../shared/datasets
    """
    started = time.monotonic()  # --timeout counts from here: loading and probing included
    _check_tracking(tracking_uri, no_tracking)
    source = click.get_current_context().get_parameter_source("max_per_gpu")
    if workers != "auto" and source is not click.core.ParameterSource.DEFAULT:
        from hpsearch.errors import ConfigError

        raise ConfigError(f"--max-per-gpu {max_per_gpu}: only with --workers auto")
    from hpsearch.config import config_to_yaml, direction_note, pruning_note, warmup_note
    from hpsearch.launcher import (
        Launcher,
        LaunchOptions,
        Progress,
        auto_workers,
        check_gpus,
        format_best,
        format_progress,
        hold_launch_lock,
        packing_path,
        parse_gpus,
    )
    from hpsearch.packing import gpus_through_mask, place_workers, visible_gpus
    from hpsearch.runner import ensure_workdir
    from hpsearch.storage import resolve_storage
    from hpsearch.tracking.server import resolve_tracking_uri

    # Before the --workers auto probe (minutes): a URI that cannot work is said at once.
    uri = None if no_tracking else resolve_tracking_uri(tracking_uri)
    cfg = _load(study, overrides, data_dir, download, trials, relaunch=(storage, workdir))
    if uri is not None:  # (the launcher checks again as it starts, a moment later)
        from hpsearch.tracking.server import check_tracking_uri

        check_tracking_uri(uri)
    gpu_list = parse_gpus(gpus)
    if gpu_list or device == "cuda":
        import torch

        check_gpus(gpu_list, torch.cuda.device_count(), device)
    if gpu_list:
        gpu_list = gpus_through_mask(gpu_list)  # the ids each worker's mask must name
    spec = resolve_storage(storage, workdir)
    if not train_fn:
        from hpsearch.runner import check_dataset, check_weights

        check_dataset(cfg, light=True)  # each worker checks fully
        check_weights(cfg)
    else:
        from hpsearch.worker import check_train_fn

        check_train_fn(train_fn)
    from hpsearch.runner import check_relaunch

    check_relaunch(cfg, storage, workdir, classes=not train_fn)
    # After every check (QA: a refused launch left an empty work folder, and a note before
    # its error line).
    ensure_workdir(workdir)
    for note in (pruning_note(cfg), warmup_note(cfg), direction_note(cfg)):
        if note is not None:
            click.echo(f"note: {note}", err=True)
    # Without --gpus, workers spread over every visible GPU rather than all on the first
    # (not with --device cuda:N, which names one GPU of those visible).
    use_gpus = gpu_list or (visible_gpus() if device in ("auto", "cuda") else [])
    placement, packing = None, None
    last: dict[str, Any] = {"line": "", "at": 0.0}

    def show(p: Progress) -> None:
        if p.message:
            click.echo(p.message)
            return
        stale = p.stale_s is not None
        state = repr((p.counts, p.best_value, [(w.trial, w.state) for w in p.workers], stale))
        # A line when something changed, else every 30 s: a log, not a ticker.
        if state != last["line"] or p.elapsed_s - last["at"] >= 30:
            click.echo(format_progress(p))
            last["line"], last["at"] = state, p.elapsed_s

    # Before anything is written or probed: a second launch of this study is refused
    # without touching the first's study file and packing plan, or its GPUs.
    launch_lock = hold_launch_lock(workdir, cfg.name)
    try:
        if workers == "auto":
            if not use_gpus:
                n_workers = 1
                click.echo("--workers auto: no GPU visible; running 1 worker")
            else:
                study_file = workdir / "run" / f"{cfg.name}.yaml"
                study_file.parent.mkdir(parents=True, exist_ok=True)
                study_file.write_text(config_to_yaml(cfg))
                plan = auto_workers(study_file, use_gpus, workdir, max_per_gpu)
                placement = place_workers({g: plan.workers_on(g) for g in use_gpus})
                n_workers, packing = len(placement), packing_path(study_file)
                click.echo(f"--workers auto: {plan.reason}")
        else:
            n_workers = int(workers)
            if use_gpus and not gpu_list:
                placement = [use_gpus[i % len(use_gpus)] for i in range(n_workers)]
            affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
            cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
            if not use_gpus and not train_fn and n_workers > cores:
                click.echo(
                    f"note: --workers {n_workers} on {cores} CPU cores and no GPU: the workers "
                    f"share the cores, so they train no more in all than {cores} would",
                    err=True,
                )
        opts = LaunchOptions(
            workers=n_workers,
            placement=placement,
            packing=packing,
            workdir=workdir,
            gpus=gpu_list,
            device=device,
            tracking_uri=uri,
            tracking=not no_tracking,
            timeout_s=timeout if timeout is not None else cfg.budget.timeout_s,
            train_fn=train_fn,
            max_restarts=max_restarts,
            max_retries=max_retries,
            heartbeat_interval_s=heartbeat,
            grace_s=grace,
            started_at=started,
        )

        click.echo(f"study {cfg.name}: {_n(cfg.budget.n_trials, 'trial')}, "
                   f"{_n(n_workers, 'worker')}, "
                   f"storage {spec.display}")  # fmt: skip
        launcher = Launcher(cfg, spec, opts, on_progress=show, launch_lock=launch_lock)
    except BaseException:
        launch_lock.close()  # the launcher releases it once it runs
        raise
    signals = _on_signals(launcher.stop, "launch")
    # Each retry's line, between the progress lines, which say the database is away and
    # how long since their figures were read. For the process: a `catch_warnings` around
    # the run is undone or kept by other threads' own (it is not thread-safe).
    warnings.filterwarnings("ignore", r".*database unreachable, retrying in", HpsearchWarning)
    summary = launcher.run()
    c = summary.counts
    best = format_best(summary.best_value, summary.best_trial, summary.pareto)
    click.echo(f"done ({summary.stopped_by}): complete {c['complete']} pruned {c['pruned']} "
               f"failed {c['fail']} waiting {c['waiting']} | best {best}")  # fmt: skip
    if summary.tracking_uri:
        from hpsearch.tracking.server import redact_uri

        embedded = opts.tracking_uri is None  # the work folder's server: `ui` serves it again
        hint = f" (hpsearch ui --workdir {shlex.quote(str(workdir))})" if embedded else ""
        click.echo(f"MLflow: {redact_uri(summary.tracking_uri)}{hint}")
    if summary.stopped_by == "workers_failed" and summary.disk_full:
        err = click.ClickException(f"every worker stopped: {summary.disk_full}")
        err.exit_code = EXIT_DISK_FULL  # as each worker's, and as README says
        raise err
    if summary.stopped_by == "workers_failed" and summary.data_error:
        from hpsearch.errors import DatasetError  # exit 65, as a dataset refused up front

        raise DatasetError(f"every worker stopped, its data failed: {summary.data_error}")
    if summary.stopped_by == "workers_failed":
        raise click.ClickException("every worker crashed; see the messages above and "
                                   f"{workdir}/logs/")  # fmt: skip
    if summary.stopped_by == "interrupted":
        # As `worker` and `train`: 130, 143 or 129 for Ctrl-C, SIGTERM or SIGHUP, so that a
        # supervisor tells its own stop from a user's (QA: SIGTERM gave 130).
        sys.exit(128 + signals[0] if signals else 130)
    if summary.stopped_by == "stopped":
        raise click.ClickException("the workers stopped with trials of the budget left; "
                                   "launch again to resume")  # fmt: skip


SAME_STOP_S = 2.0  # s: a SIGTERM this soon after another is the same stop (see _on_signals)


def _on_signals(
    stop: Callable[[], None],
    what: str,
    die_on_second: bool = False,
    first: str = "stopping after the current epoch (Ctrl-C again to kill)",
    raise_on_second: bool = False,
) -> list[int]:
    """First Ctrl-C/SIGTERM/SIGHUP: graceful stop; second: immediate. The launcher's `stop` kills
    its workers when called again, and a third signal ends the launcher at once (it may be
    waiting on a server or the database). A worker (`die_on_second`) dies by the second
    signal itself, once a trial being handed back is (its trial, left RUNNING, is failed
    and resumed once its heartbeat is stale); a third kills it at once. To a worker, a
    SIGTERM within `SAME_STOP_S` of the first is the same stop: a job scheduler or systemd
    signals every process of the job, and the launcher relays its own. (The launcher takes
    every signal: a bench's second SIGTERM a second after the first kills its workers.)
    Returns the signals received, as they come."""
    count = {"n": 0}
    received: list[int] = []
    last_term = {"at": -math.inf}

    def handler(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if die_on_second and signum == signal.SIGTERM:
            if count["n"] == 1 and now - last_term["at"] < SAME_STOP_S:
                return  # the same stop, twice (from the first counted one, not the last)
            last_term["at"] = now
        count["n"] += 1
        received.append(signum)
        if count["n"] == 1:
            said = first
        elif die_on_second:
            said = "killing now"
        else:
            said = "killing now (again to exit at once)" if count["n"] == 2 else "exiting"
        click.echo(f"\n{what}: {said}", err=True)
        if count["n"] == 2 and raise_on_second:  # (`train`: its clean-up runs on the way out)
            raise KeyboardInterrupt
        if count["n"] > 2 and not die_on_second:
            signal.signal(signum, signal.SIG_DFL)  # (main thread only)
            os.kill(os.getpid(), signum)
            return
        if count["n"] > 1 and die_on_second:
            from hpsearch.worker import HANDBACK

            signal.signal(signum, signal.SIG_DFL)  # (main thread only) a third: at once

            def die_once_handed_back() -> None:
                with HANDBACK:
                    os.kill(os.getpid(), signum)

            # Held from here on: nothing is handed back half-way after.
            if HANDBACK.acquire(blocking=False):
                os.kill(os.getpid(), signum)
            else:  # a trial is being handed back (on this thread, maybe): once it is
                threading.Thread(target=die_once_handed_back, daemon=True).start()
            return
        # Off the handler: it runs on the main thread between two bytecodes, maybe where
        # that thread holds a lock `stop` takes (an Event's, the launcher's).
        threading.Thread(target=stop, daemon=True, name="stop").start()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    # A closed terminal or SSH session (SIGHUP) is a stop like Ctrl-C; its default ended the
    # process at once, leaving the study's MLflow run RUNNING and the embedded server up.
    # Not under nohup, which ignores it for us. The terminal is gone: what was written to it
    # goes to /dev/null from then on (the writes would fail); a file keeps its lines.
    ttys = [fd for fd in (1, 2) if _isatty(fd)]

    def hangup(signum: int, frame: Any) -> None:
        # One hang-up is one stop: a closing shell resends SIGHUP to its jobs, and the
        # kernel sends the terminal's own, which counted as a second Ctrl-C (kill now).
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (main thread only)
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_WRONLY)
            for fd in ttys:
                os.dup2(null, fd)
            os.close(null)
        handler(signum, frame)

    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, hangup)
    return received


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


@cli.command()
@_study_options
@_storage_option
@_tracking_options
@_trial_options
@click.option(
    "--worker-id", default="", callback=_printable,
    help="Name shown in status and tags (default host:pid).",
)  # fmt: skip
@click.option(
    "--trials",
    "-n",
    type=click.IntRange(min=1),
    default=None,
    help="Set the study's total trials, as --set budget.n_trials=N does (else the budget "
    "the last launch set).",
)
@click.option(
    "--max-trials",
    type=click.IntRange(min=1),
    default=None,
    help="Stop this worker after N trials.",
)
@click.option(
    "--deadline",
    type=float,
    default=None,
    hidden=True,
    help="Stop asking at this Unix time (the launcher's --timeout, start-up included).",
)
@click.option(
    "--await-study-run",
    type=_Seconds(min=0),
    default=0.0,
    hidden=True,
    help="Wait up to S seconds for the launcher to open the study's MLflow run.",
)
@click.option(
    "--server-answered",
    is_flag=True,
    hidden=True,
    help="The launcher's MLflow server answered before this worker started: found down, "
    "it is waited for no longer once a trial ends.",
)
@click.option(
    "--packing",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    hidden=True,
    help="The launcher's --workers auto plan: reserve GPU memory by it.",
)
@click.option(
    "--sampler-stream",
    type=click.IntRange(min=0),
    default=None,
    help="Which stream of the study's sampler seed this worker draws from (default: one "
    "of its own; 0 on a fresh study is the seed itself). Workers sharing one propose the "
    "same parameters.",
)
@_edge
def worker(study: str, overrides: tuple[str, ...], data_dir: str | None, download: bool | None,
           workdir: Path, device: str, storage: str | None, tracking_uri: str | None,
           no_tracking: bool, worker_id: str, trials: int | None, max_trials: int | None,
           deadline: float | None, await_study_run: float, server_answered: bool,
           packing: Path | None, sampler_stream: int | None, timeout: float | None,
           max_retries: int, heartbeat: int, train_fn: str) -> None:  # fmt: skip
    """Join a study (created with Optuna's tables where missing) from any machine and run
    trials until its budget is spent.

    \b
    Example:
      hpsearch worker --study flowers102 --storage postgresql://user@db-host/optuna \\
          --tracking-uri http://mlflow-host:5000 --data-dir /data
    """
    from hpsearch.config import parse_overrides
    from hpsearch.launcher import LAUNCHED_ENV
    from hpsearch.runner import ensure_workdir
    from hpsearch.storage import resolve_storage
    from hpsearch.tracking.server import (
        join_server,
        resolve_tracking_uri,
        store_lock,
        told_embedded,
    )
    from hpsearch.worker import WorkerOptions, run_worker

    if os.environ.get(LAUNCHED_ENV) == "1":
        # A launch's worker writes to its log in the work folder: on a full disk its notes
        # and errors are dropped, not its work (QA: a failed `note:` line ended it, exit 1,
        # with an empty log, where its disk check says 74 and the launch waits for room).
        sys.stdout, sys.stderr = _BestEffort(sys.stdout), _BestEffort(sys.stderr)
    _check_tracking(tracking_uri, no_tracking)
    if train_fn:
        from hpsearch.worker import load_train_fn

        try:
            load_train_fn(train_fn)
        except HpsearchError as exc:  # the same after each restart: the launcher makes none
            err = click.ClickException(str(exc))
            err.exit_code = EXIT_CONFIG
            raise err from exc
    cfg = _load(study, overrides, data_dir, download, trials, stored=(storage, workdir), join=True)
    _check_device(device)
    spec = resolve_storage(storage, workdir)
    if not train_fn:
        from hpsearch.runner import check_dataset, check_weights

        check_dataset(cfg)  # a DatasetError: exit 65, as a trial's (below)
        check_weights(cfg)
    uri = None if no_tracking else resolve_tracking_uri(tracking_uri)
    if uri and not await_study_run:
        # A worker of its own (a launch's workers wait for the run it checked): a folder,
        # an unknown scheme or a server that refuses every call (401, 403) left its
        # trials untracked. One that does not answer now may later: its runs are kept.
        from hpsearch.tracking.server import check_tracking_uri

        check_tracking_uri(uri, answer=False)
    ensure_workdir(workdir)  # after the checks: a refused worker leaves no folder
    shared = None
    if not no_tracking and uri is None:
        # The work folder's embedded server, when a launch or `hpsearch ui` runs it: as one
        # of its users, so that it runs until this worker is done with it too.
        with store_lock(workdir):
            shared = join_server(workdir)
        uri = shared.url if shared is not None else None
        if uri is None:  # not silently: the README says workers there use its server
            click.echo(
                f"note: no MLflow server runs for {workdir} and none was given "
                "(--tracking-uri, MLFLOW_TRACKING_URI): trials are not tracked; start "
                f"`hpsearch ui --workdir {shlex.quote(str(workdir))}` first, or pass --no-tracking",
                err=True,
            )
    # Its launch's embedded server (the launch says so), or the one it joined.
    embedded = shared is not None or told_embedded(os.environ, tracking_uri)
    opts = WorkerOptions(
        workdir=workdir,
        worker_id=worker_id,
        device=device,
        tracking_uri=uri,
        embedded_tracking=embedded and uri is not None,
        max_trials=max_trials,
        timeout_s=timeout,
        deadline=deadline,
        await_study_run_s=await_study_run,
        server_answered=server_answered,
        heartbeat_interval_s=heartbeat,
        max_retries=max_retries,
        train_fn=train_fn,
        set_budget=trials is not None
        or any(key.strip() == "budget.n_trials" for key, _ in parse_overrides(overrides)),
        packing=packing,
        sampler_stream=sampler_stream,
        joined=os.environ.get(LAUNCHED_ENV) != "1",
        launched=os.environ.get(LAUNCHED_ENV) == "1",
    )
    stop = threading.Event()
    signals = _on_signals(stop.set, "worker", die_on_second=True)
    # Every trial carries the memory constraint (GP refuses a study whose trials differ in
    # theirs); CMA-ES reads none, and said so at every tell. For the process, as above.
    warnings.filterwarnings("ignore", "Constraints have been set, but CmaEsSampler", UserWarning)

    def show(number: int, outcome: str, message: str) -> None:
        # Its log (a launch's worker's) may be on the full disk the trials stop for: the
        # study holds the outcome, and the worker goes on to its disk check (exit 74).
        with contextlib.suppress(OSError):
            click.echo(f"trial {number}: {outcome}" + (f": {message}" if message else ""))

    try:
        summary = run_worker(cfg, spec, opts, stop=stop, on_trial=show)
    finally:
        if shared is not None and shared.release() == "stopped":
            click.echo(f"MLflow server at {shared.url} stopped: this worker was its last user")
    click.echo(f"worker {summary.worker_id}: {_n(len(summary.trials), 'trial')} "
               f"({summary.stopped_by})")  # fmt: skip
    if summary.stopped_by == "errors":
        raise click.ClickException(
            f"worker {summary.worker_id}: stopped after repeated trial errors"
            + (f"; the last: {summary.last_error}" if summary.last_error else "")
        )
    if summary.stopped_by == "data_error":  # the launcher restarts it not: the same data
        err = click.ClickException(f"worker {summary.worker_id}: {summary.last_error}")
        err.exit_code = EXIT_DATA_ERROR
        raise err
    if summary.stopped_by == "interrupted" and signals:
        # Not 0: a restart policy (Docker's on-failure, a Kubernetes Job) then starts it
        # again after a node's drain or a daemon's restart; its trial waits to resume.
        sys.exit(128 + signals[0])


@cli.command()
@click.option(
    "--study",
    "-s",
    required=True,
    help="Study name, or the study file it was launched from (the file's `name`).",
)
@_storage_option
@_workdir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_edge
def status(study: str, storage: str | None, workdir: Path, as_json: bool) -> None:  # fmt: skip
    """Trial counts per state, the best trial, and running trials with their host/worker.

    \b
    Example:
      hpsearch status --study flowers102 --storage postgresql://postgres@127.0.0.1/test
    """
    from dataclasses import asdict

    from hpsearch.query import study_status

    _, st = _stored(study, lambda name: study_status(name, storage, workdir))
    if as_json:
        click.echo(_json(asdict(st)))
        return
    counts = " ".join(f"{k} {v}" for k, v in st.counts.items())
    click.echo(f"study {st.name} ({st.storage}): {counts}")
    if st.best and st.pareto_size is not None:  # no single best: the front, and one of it
        click.echo(f"pareto front: {st.pareto_size} trials; first by the first objective: "
                   f"trial {st.best['number']} values {format_value(st.best['value'])} "
                   f"params {_params_of(st.best)}")  # fmt: skip
    elif st.best:
        click.echo(f"best: trial {st.best['number']} value {format_value(st.best['value'])} "
                   f"params {_params_of(st.best)}")  # fmt: skip
    else:
        click.echo("best: - (no completed trial yet)")
    if st.budget is not None:
        click.echo(f"budget: {_n(st.budget, 'trial')} (finished, running and queued count), "
                   f"room for {st.room} more")  # fmt: skip
    for r in st.running:
        pid = f", pid {r['pid']}" if r["pid"] is not None else ""
        gone = (
            " | its worker is gone: failed and retried by a worker's stale check or the next launch"
            if r["worker_alive"] is False
            else ""
        )
        click.echo(f"running: trial {r['number']} on {r['worker'] or '-'} ({r['host'] or '-'}"
                   f"{pid}), last epoch {_or_dash(r['last_epoch'])}{gone}")  # fmt: skip
    if st.startup_s_median is not None:
        click.echo(f"per-trial start-up (ask to first step): median {st.startup_s_median:.2f} s")


def _jsonable(value: Any) -> Any:
    """`value` as strict JSON values (RFC 8259, which jq and JavaScript read): a non-finite
    float (a diverged val_loss of inf, NaN) -> null, timestamps -> ISO strings."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if hasattr(value, "item"):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _json(value: Any) -> str:
    return json.dumps(_jsonable(value), indent=2, allow_nan=False, default=str)


def format_value(value: Any) -> str:
    """A trial's objective value for the terminal: one number, or a list of them in a
    multi-objective study."""
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return f"{float(value):.6g}"


def _params_of(row: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("params_"): v for k, v in row.items() if k.startswith("params_")}


@cli.command()
@click.option(
    "--study",
    "-s",
    required=True,
    help="Study name, or the study file it was launched from (the file's `name`).",
)
@_storage_option
@_workdir_option
@click.option(
    "-k", "k", type=click.IntRange(min=1), default=5, show_default=True, help="How many trials."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_edge
def best(study: str, storage: str | None, workdir: Path, k: int, as_json: bool) -> None:
    """The top-k trials with their value, params and MLflow run ids.

    \b
    Example:
      hpsearch best --study flowers102 -k 3 --json
    """
    from hpsearch.query import top_trials

    _, rows = _stored(study, lambda name: top_trials(name, storage, k, workdir))
    if as_json:
        click.echo(_json(rows))
        return
    if not rows:
        click.echo("no completed trials yet")
        return
    for r in rows:
        run = r.get("mlflow_run_id") or "-"
        value = format_value(r["value"])
        click.echo(f"trial {r['number']}: value {value} run {run} params {_params_of(r)}")


@cli.command()
@click.option(
    "--study",
    "-s",
    required=True,
    help="Study name, or the study file it was launched from (the file's `name`).",
)
@_storage_option
@_workdir_option
@click.option(
    "--params",
    "params_json",
    required=True,
    metavar="JSON",
    help='Searched hyperparameters to try, e.g. \'{"lr": 0.1, "batch_size": 64}\'.',
)
@click.option(
    "--trials",
    "n_trials",
    type=click.IntRange(min=1),
    default=None,
    help="Set the study's budget.n_trials to N first, in the same step (its running "
    "launches and workers take it up): room for this trial once the budget is spent.",
)
@_edge
def enqueue(
    study: str, storage: str | None, workdir: Path, params_json: str, n_trials: int | None
) -> None:
    """Queue a trial of PARAMS in a study, to run before the sampler draws another.

    Optuna's enqueue_trial: the study's workers (a running launch's too) take it next. The
    params are checked against the search space the study was launched with; those left
    out are drawn. Params the study already holds are not queued again, and none past its
    budget.n_trials (`--trials N` sets it first).

    \b
    Example:
      hpsearch enqueue --study flowers102 --params '{"lr": 0.1, "batch_size": 256}'
      hpsearch enqueue --study flowers102 --params '{"lr": 0.05}' --trials 41
    """
    from hpsearch.config import params_from_json
    from hpsearch.query import enqueue_trial

    params = params_from_json(params_json)
    study, done = _stored(
        study, lambda name: enqueue_trial(name, params, storage, workdir, n_trials=n_trials)
    )
    shown = json.dumps(done.params)  # as --params takes them
    if done.queued:
        click.echo(f"queued trial {done.number} of study {study}: {shown}")
    else:
        click.echo(f"not queued: trial {done.number} of study {study} ({done.state}) already "
                   f"has these params: {shown}")  # fmt: skip


@cli.command("init-storage")
@_storage_option
@_workdir_option
@_edge
def init_storage_cmd(storage: str | None, workdir: Path) -> None:
    """Create Optuna's tables in the storage (nothing when they are there).

    Run once on a team's database before workers start at once; hpsearch's own processes
    also create them, under a lock, as they first connect.

    \b
    Example:
      hpsearch init-storage --storage postgresql://postgres@127.0.0.1/test
    """
    from hpsearch.storage import init_storage

    spec = init_storage(storage, workdir)
    click.echo(f"Optuna tables ready in {spec.display}")


@cli.command()
@_storage_option
@_workdir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_edge
def studies(storage: str | None, workdir: Path, as_json: bool) -> None:
    """The studies in the storage, with trial counts and best values.

    \b
    Example:
      hpsearch studies --storage postgresql://postgres@127.0.0.1/test
    """
    from hpsearch.query import list_studies

    # The default folder not there yet: no studies (a --workdir given that is not there is
    # a typo, and said so).
    given = click.get_current_context().get_parameter_source("workdir")
    rows = list_studies(
        storage, workdir if given is not click.core.ParameterSource.DEFAULT else None
    )
    if as_json:
        click.echo(_json(rows))
        return
    if not rows:
        from hpsearch.storage import has_optuna_tables, resolve_storage

        spec = resolve_storage(storage, workdir)
        # Said where: a forgotten --storage read the work folder's journal, which has none.
        why = "" if has_optuna_tables(spec) else (
            " (no journal there yet)" if spec.kind == "journal" else " (no Optuna tables there)"
        )  # fmt: skip
        click.echo(f"no studies in {spec.display}{why}")
    for r in rows:
        best_v = (
            f"{format_value(r['best_value'])} (trial {r['best_trial']})"
            if r["best_value"] is not None
            else f"pareto {r['pareto_size']}"
            if r["pareto_size"]
            else "-"
        )
        states = ", ".join(f"{n} {state}" for state, n in r["counts"].items() if n)
        click.echo(f"{r['name']}: {_n(r['n_trials'], 'trial')} ({states or 'none yet'}), "
                   f"best {best_v}")  # fmt: skip


@cli.command()
@_study_options
@_storage_option
@_tracking_options
@click.option(
    "--params",
    "params_json",
    default=None,
    metavar="JSON",
    help='Fixed hyperparameters, e.g. \'{"lr": 0.1, "batch_size": 64}\'.',
)
@click.option(
    "--trial",
    "trial_number",
    type=int,
    default=None,
    help="Take the params of trial N of the study in --storage.",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**32 - 1),
    default=None,
    help="Seed (default: trial N's with --trial, as its worker seeded it; else the study's "
    "trainer.seed).",
)
@_edge
def train(study: str, overrides: tuple[str, ...], data_dir: str | None, download: bool | None,
          workdir: Path, device: str, storage: str | None, tracking_uri: str | None,
          no_tracking: bool, params_json: str | None, trial_number: int | None,
          seed: int | None) -> None:  # fmt: skip
    """One training run with fixed params, no search: for debugging and reproducing a trial.
    Its MLflow run (in the study's experiment, tagged hpsearch.role=train) sits beside the
    trials' for comparison; without --tracking-uri, on the work folder's embedded server
    (started for the run when none serves it).

    \b
    Examples:
      hpsearch train --study tiny --params '{"lr": 0.05, "batch_size": 32}'
      hpsearch train --study flowers102 --trial 7 --storage postgresql://postgres@127.0.0.1/test
    """
    from hpsearch.runner import (
        TrainServer,
        check_dataset,
        check_weights,
        ensure_workdir,
        fixed_params,
        run_fixed,
        trial_config,
    )
    from hpsearch.tracking.server import check_tracking_uri, redact_uri, resolve_tracking_uri

    _check_tracking(tracking_uri, no_tracking)
    uri = None if no_tracking else resolve_tracking_uri(tracking_uri)
    cfg = _load(study, overrides, data_dir, download, stored=(storage, workdir))
    _check_device(device)
    if trial_number is not None and params_json is None:  # run_fixed refuses both
        cfg = trial_config(cfg, storage, workdir, overrides, download, trial_number)
    # Its errors before a server starts and a run is made for nothing.
    params = fixed_params(cfg, params_json, trial_number, storage, workdir, warn=False)
    check_dataset(cfg, light=True)
    check_weights(cfg, cfg.resolve_params(params).arch)  # this run's arch
    if uri is not None:
        check_tracking_uri(uri)
    ensure_workdir(workdir)  # after the checks: a refused run leaves no folder
    server = TrainServer(workdir) if not no_tracking and uri is None else None
    uri = server.url if server is not None else uri
    shown = redact_uri(uri) if uri is not None else ""

    def epoch_done(r: Any) -> None:
        click.echo(f"epoch {r.epoch}: train_loss {r.train_loss:.4f} train_acc {r.train_acc:.4f} "
                   + (f"val_loss {r.val_loss:.4f} " if r.val_loss is not None else "")
                   + (f"val_acc {r.val_acc:.4f} " if r.val_acc is not None else "")
                   + f"lr {r.lr:.4g} {r.images_per_second:.0f} img/s")  # fmt: skip
        if server is not None and (said := server.keep()):
            click.echo(said, err=True)

    # Ctrl-C, SIGTERM or SIGHUP (a closed terminal; not under nohup): the epoch ends and the
    # run with it, KILLED, its server stopped; a second signal interrupts at once, as a
    # KeyboardInterrupt that still ends both (the default action left them up, RUNNING).
    stopping = threading.Event()
    signals = _on_signals(stopping.set, "train", raise_on_second=True)
    result = None
    try:
        result = run_fixed(
            cfg, params_json, trial_number, storage, workdir, device, seed,
            on_epoch=epoch_done, tracking_uri=uri,
            on_run=lambda run_id: click.echo(f"MLflow run {run_id} at {shown}"),
            should_interrupt=stopping.is_set,
        )  # fmt: skip

        def shown(value: Any) -> str:
            return "-" if value is None else str(value)

        click.echo(
            f"{result.stop_reason}: best_val_acc {shown(result.best_val_acc)} "
            f"best_val_loss {shown(result.best_val_loss)} test_acc {shown(result.test_acc)} "
            f"epochs {result.epochs_run} best model {shown(result.best_model_path)}"
            # The resume checkpoint is deleted once the run finished: named only while kept.
            + (f" checkpoint {result.checkpoint_path}" if result.checkpoint_path else "")
            + (f" ({result.message})" if result.message else "")
        )
    except KeyboardInterrupt:
        if not signals:
            raise
    finally:
        if server is not None and server.close():
            click.echo(f"MLflow server at {server.url} stopped (`hpsearch ui` shows the run)")
    if signals and (result is None or result.stop_reason == "interrupted"):
        sys.exit(128 + signals[0])  # (a stop in its last epoch: it finished, exit 0)
    if result is not None and result.stop_reason in ("diverged", "out_of_memory"):
        # No model to use: a script took exit 0 for a trained one (QA). (In a study, such
        # a trial is told PRUNED and the search goes on.)
        raise click.ClickException(f"the run {result.stop_reason}: {result.message or 'no model'}")
    from hpsearch.trainer.types import NO_ROOM, unsaved_note

    note = unsaved_note(result.message) if result is not None else None
    if result is not None and result.best_model_path is None and note is not None:
        # Trained, its best model's write failed (a full disk): no model to use (QA: exit 0).
        err = click.ClickException(f"the run trained, and kept no model: {note}")
        if any(words in note for words in NO_ROOM):
            err.exit_code = EXIT_DISK_FULL
        raise err


@cli.command()
@_workdir_option
@click.option(
    "--host", default="127.0.0.1", show_default=True, callback=_not_empty, help="Address to bind."
)
@click.option(
    "--port", type=click.IntRange(1, 65535), default=5000, show_default=True, help="Port."
)
@_edge
def ui(workdir: Path, host: str, port: int) -> None:
    """Open the MLflow UI on the embedded store of a work folder.

    \b
    Example:
      hpsearch ui --workdir .hpsearch --port 5000
    """
    from hpsearch.tracking.server import (
        LocalServer,
        SharedServer,
        join_server,
        serve_ui,
        store_lock,
    )

    # A work folder named on purpose that is not there is a typo: it served an empty store
    # made there. (The default is made, so that `ui` may start before the first launch.)
    source = click.get_current_context().get_parameter_source("workdir")
    if source is not click.core.ParameterSource.DEFAULT and not workdir.is_dir():
        from_env = source is click.core.ParameterSource.ENVIRONMENT
        given = "HPSEARCH_WORKDIR" if from_env else "--workdir"
        raise click.ClickException(
            f"{given}: {workdir}: no such folder (launch a study there first, or create it)"
        )
    server: LocalServer | SharedServer
    with _stop_signals_exit(), store_lock(workdir):
        server = join_server(workdir) or serve_ui(workdir, host, port)
    from urllib.parse import urlsplit

    asked = click.get_current_context().get_parameter_source("port")
    moved = asked is not click.core.ParameterSource.DEFAULT and urlsplit(server.url).port != port
    unused = f"; --port {port} not used: one server per work folder's store" if moved else ""
    if server.shared():  # a search's: the last of its users stops it
        server.release()
        click.echo(
            f"MLflow UI: {server.url} (already served for a running search, worker or train"
            f"{unused})"
        )
        return
    # (One a search left running, joined: this `ui` stops it. QA: its port went unsaid.)
    click.echo(f"MLflow UI: {server.url} (Ctrl-C to stop{unused})")
    stop = threading.Event()
    signals = _on_signals(stop.set, "ui", first="stopping")
    try:
        while not stop.wait(1.0):
            if not server.is_running():
                raise click.ClickException("the MLflow server exited")
    finally:
        if server.release() == "in use":
            click.echo(f"MLflow server at {server.url} left running: a search still uses it")
    if signals:  # as launch, worker and train: 130, 143 or 129 by the stop's signal
        sys.exit(128 + signals[0])


@contextlib.contextmanager
def _stop_signals_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP end the process meanwhile as Ctrl-C does (SystemExit 143 or 129,
    not the default death): a server being started is stopped on the way out (QA: a `ui`
    stopped during its 15 s start left its MLflow server running)."""

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    before = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@cli.command()
@_storage_option
@_workdir_option
@click.option(
    "--host", default="127.0.0.1", show_default=True, callback=_not_empty, help="Address to bind."
)
@click.option(
    "--port", type=click.IntRange(1, 65535), default=8080, show_default=True, help="Port."
)
@_edge
def dashboard(storage: str | None, workdir: Path, host: str, port: int) -> None:
    """Start optuna-dashboard on the configured storage.

    \b
    Example:
      hpsearch dashboard --storage postgresql://postgres@127.0.0.1/test --port 8080
    """
    from hpsearch.dashboard import run_dashboard

    with warnings.catch_warnings():
        # Each wait for the database on a line of its own (Python shows a warning's first
        # occurrence only, in two lines with its source line).
        warnings.filterwarnings("always", message=r".*retrying in")
        warnings.showwarning = _warning_line
        run_dashboard(
            storage, workdir, host, port,
            on_listening=lambda url: click.echo(f"optuna-dashboard: {url} (Ctrl-C to stop)"),
        )  # fmt: skip


def _warning_line(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    with contextlib.suppress(OSError):  # a closed stderr: dropped, as Python's own printer
        click.echo(f"warning: {message}", err=True)


def _one_line_warnings() -> None:
    """hpsearch's own warnings (HpsearchWarning) as `warning: ...`, one line without the
    source line Python adds; any other warning as Python shows it."""
    shown = warnings.showwarning

    def show(
        message: Warning | str, category: type[Warning], filename: str, lineno: int,
        file: TextIO | None = None, line: str | None = None,
    ) -> None:  # fmt: skip
        if issubclass(category, HpsearchWarning):
            _warning_line(message, category, filename, lineno, file, line)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


# Click 8.2 and later raise it for a group called without a command (8.1 shows the help
# and exits 0 itself); its message is the whole help, not a one-line error.
_NO_ARGS: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


class _BestEffort(io.TextIOBase):
    """A text stream whose writes and flushes a full (or gone) disk refuses are dropped."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError):
            return self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding


def main() -> None:
    """Console entry point: every error, click's own included, is one line and a non-zero exit."""
    # MLflow draws a progress bar for each artifact download (the launcher copies the best
    # trial's ONNX file to the study run) into the progress lines; a user's setting wins.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    _one_line_warnings()
    try:
        cli.main(standalone_mode=False)
    except _NO_ARGS as exc:  # `hpsearch` alone: its help, as click shows it
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        msg = exc.format_message()
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            msg = f"{exc.ctx.command_path}: {msg}"
        try:
            click.echo(f"Error: {' '.join(msg.split())}", err=True)
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:
            # Output to a full disk (a launch's worker's log): the exit code still says why
            # (74), where the interpreter's own exit would fail its flush and give 120 (QA).
            with contextlib.suppress(Exception):
                atexit._run_exitfuncs()  # as a normal exit: logging's, MLflow's, servers' own
            os._exit(exc.exit_code)
        sys.exit(exc.exit_code)
    except SystemExit:
        raise
    if "torch" in sys.modules or "mlflow" in sys.modules:
        _exit_without_teardown()


def _exit_without_teardown() -> None:
    """Exit 0 after a command that finished its work, skipping the interpreter's teardown:
    with torch loaded, freeing every module's objects takes 1-2 s per process (a worker),
    and 0.6 s with MLflow, Optuna and matplotlib (the launcher), after the last result is
    stored. What a normal exit waits for still happens: non-daemon threads are joined,
    atexit handlers run (logging, MLflow's own), stdio is flushed."""
    # What a normal exit does first: threading's own exit hooks wake idle thread pools
    # (an MLflow artifact download leaves one behind, unreachable but not yet collected),
    # then every non-daemon thread is joined. Joining without the hooks would wait forever.
    shutdown = getattr(threading, "_shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
    except Exception as exc:  # a library's exit hook: the command's work is done and kept
        with contextlib.suppress(OSError, ValueError):
            click.echo(f"warning: at exit: {type(exc).__name__}: {exc}", err=True)
        shutdown = None
    if shutdown is None:  # not CPython, or its hooks failed: join what is left
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
