"""`hpsearch train`: one run with fixed params, outside any search."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpsearch.config import READ_ONLY_WITH, StudyConfig, params_from_json, unused_hyperparams
from hpsearch.errors import ConfigError, DatasetError, HpsearchError, HpsearchWarning

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial


def flowers_layout_message(root: Path, problem: str = "not found or incomplete") -> str:
    return (
        f"dataset flowers102: {root / 'flowers-102'} {problem}; expected "
        f"<root>/flowers-102/{{jpg/,imagelabels.mat,setid.mat}}; pass --download or --data-dir"
    )


def flowers_layout_error(root: Path) -> str | None:
    """The one-line complaint about `<root>/flowers-102/`, or None when its layout is there."""
    base = root / "flowers-102"
    if all([(base / "jpg").is_dir(), (base / "setid.mat").is_file(),
            (base / "imagelabels.mat").is_file()]):  # fmt: skip
        return None
    return flowers_layout_message(root)


def ensure_workdir(path: Path) -> Path:
    """The work folder, created when missing and checked writable: ConfigError when it
    cannot be (a path under a file or under /proc, no permission, a read-only disk)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"--workdir: {path}: cannot create or write there: {exc.strerror or exc}"
        ) from exc
    return path


def check_dataset(cfg: StudyConfig, light: bool = False) -> None:
    """Fail fast, before any trial or storage write, when the data is missing or has the
    wrong layout (DataError, one line). With download allowed, this is where it downloads:
    once, not once per worker.

    light: only the files' presence where that can be told without torch (Flowers-102 on
    disk): `launch` checks so, and each worker it starts checks fully (it needs torch anyway).
    """
    weights = cfg.model.weights
    if weights is not None and not Path(weights).expanduser().is_file():
        # Else every trial fails on it when it builds its model, in every worker.
        raise ConfigError(f"{cfg.source or cfg.name}: model.weights: {weights!r}: no such file")
    ds = cfg.dataset
    if light and ds.name == "flowers102" and not ds.download:
        message = flowers_layout_error(Path(ds.root or "data").expanduser())
        if message is not None:
            raise DatasetError(message)
        return
    from hpsearch.trainer.data import get_source

    for split in ("train", "val"):
        get_source(cfg, split)


def check_relaunch(
    cfg: StudyConfig, storage: str | None, workdir: Path, classes: bool = True
) -> None:
    """A launch of a study already in the storage, refused before it writes anything: its
    workers found a changed search space or an image folder's changed classes (`classes`;
    not for a --train-fn's own data) only after the launch had replaced the study's config
    and budget and reopened its MLflow run, so that a worker joining by the name then
    trained the refused config. Nothing for a new study (or journal file). A database that
    refuses or is not there is said now too, before the launch writes its first file (QA:
    its workers' logs were there first). Raises ConfigError, DatasetError or StorageError."""
    from hpsearch.errors import StorageError, StudyNotFoundError
    from hpsearch.query import reading_study
    from hpsearch.storage import resolve_storage, storage_file
    from hpsearch.study import CLASSES_ATTR, check_space_fits

    spec = resolve_storage(storage, workdir)
    if (file := storage_file(spec)) is not None and not file.exists():  # the launch makes it
        if spec.kind == "rdb" and not file.parent.is_dir():  # (a journal's: with the folder)
            raise StorageError(
                f"storage {spec.display}: cannot connect: folder {file.parent} does not exist"
            )
        return
    try:
        with reading_study(cfg.name, storage, workdir) as study:  # its connection closed after
            check_space_fits(cfg, study.get_trials(deepcopy=False))
            trained = study.user_attrs.get(CLASSES_ATTR)
    except StudyNotFoundError:
        return
    except StorageError:
        if spec.kind == "rdb":
            raise
        return  # a journal the launch makes
    if not classes or trained is None or cfg.dataset.name != "imagefolder":  # others: fixed
        return
    from hpsearch.trainer.data import class_change, get_source

    src = get_source(cfg, "train")
    if src is not None and (changed := class_change(list(trained), src.class_names)):
        raise DatasetError(f"dataset {cfg.dataset.name}: {changed}")


def check_weights(cfg: StudyConfig, arch: str | None = None) -> None:
    """`model.weights` against every arch the study trains (the default's, or each searched
    choice; `arch` alone when given: one run's), before any worker starts: a file of another
    architecture failed every trial alike, three in a row per worker and three restarts
    (twelve failed trials for a budget of one). Loads torch and the file once per arch.
    Raises ConfigError."""
    if not cfg.model.weights:
        return
    import torchvision
    from hpsearch.config import CategoricalParam
    from hpsearch.trainer.models import load_weights_file

    space = cfg.search_space.get("arch")
    searched = isinstance(space, CategoricalParam)
    arches = [str(c) for c in space.choices] if searched else [cfg.resolve_params({}).arch]
    if arch is not None:
        arches, searched = [arch], False
    path = Path(cfg.model.weights).expanduser()
    src = cfg.source or cfg.name
    for arch in dict.fromkeys(arches):
        model = torchvision.models.get_model(arch, weights=None)
        try:
            load_weights_file(model, path)
        except ConfigError as exc:
            searched_note = " (searched: one weights file serves one arch)" if searched else ""
            raise ConfigError(f"{src}: {exc} (for arch {arch}{searched_note})") from exc


def trial_config(
    cfg: StudyConfig,
    storage: str | None,
    workdir: Path,
    overrides: Sequence[str] = (),
    download: bool | None = None,
    trial_number: int | None = None,
) -> StudyConfig:
    """The config trial `trial_number` of `cfg`'s study ran with (the resolved config its
    worker recorded on the study; for a trial from before those were recorded, or none
    given, the one its last launch stored), with today's `--set` on top (a study launched
    with `--set dataset.image_size=64` was reproduced at the study file's size), its data
    found where `cfg` finds it (the file, --data-dir, HPSEARCH_DATA_DIR). A study with no
    stored config (made by plain Optuna) keeps `cfg`."""
    from hpsearch.config import config_from_yaml, load_yaml
    from hpsearch.query import reading_study
    from hpsearch.study import CONFIG_ATTR, trial_config_yaml

    with reading_study(cfg.name, storage, workdir) as study:
        attrs = study.user_attrs
        trial = _trial(study, trial_number) if trial_number is not None else None
    stored = trial_config_yaml(attrs, trial) if trial is not None else attrs.get(CONFIG_ATTR)
    if not stored:
        return cfg
    src = f"study {cfg.name} (the config " + (
        "it was launched with)" if trial is None else f"trial {trial_number} ran with)"
    )
    # A trial's recorded config says nothing of downloads: the file's (or --download) does.
    allowed = download if download is not None else cfg.dataset.download
    # Nor of where its data is: the file's (--data-dir, HPSEARCH_DATA_DIR), else where the
    # launch found it (review: `./data` was looked for, beside the launch's own folder).
    root = cfg.dataset.root or _launch_root(attrs.get(CONFIG_ATTR), load_yaml)
    return config_from_yaml(str(stored), src, overrides, root, allowed)


def _launch_root(launched: Any, load: Callable[[str], Any]) -> str | None:
    """`dataset.root` of a study's stored config (its last launch's), or None."""
    try:
        data = load(str(launched)) if launched else None
    except Exception:  # (yaml's errors) a config that does not parse names no root
        return None
    root = data.get("dataset", {}).get("root") if isinstance(data, dict) else None
    return root if isinstance(root, str) and root else None


def stored_config(
    name: str,
    storage: str | None,
    workdir: Path,
    overrides: Sequence[str] = (),
    data_dir: str | None = None,
    download: bool | None = None,
) -> StudyConfig | None:
    """The config study `name`'s last launch stored on it, with `overrides` on top and its
    data found where --data-dir or HPSEARCH_DATA_DIR say (else where the launch's host
    found it): what a worker joining by the study's name alone trains with, as the
    launch's workers do (a teammate's host without the file rebuilt it, and its trials
    trained otherwise). None when the storage holds no such study, or one without a stored
    config (made by plain Optuna)."""
    from hpsearch.config import config_from_yaml
    from hpsearch.errors import StorageError, StudyNotFoundError
    from hpsearch.query import load_study
    from hpsearch.study import CONFIG_ATTR

    try:
        study = load_study(name, storage, workdir)
    except StudyNotFoundError:
        return None
    except StorageError:
        from hpsearch.storage import resolve_storage

        if resolve_storage(storage, workdir).kind == "journal":  # no journal: no study
            return None
        raise  # a database not up (yet): said as such, not "no such study"
    stored = study.user_attrs.get(CONFIG_ATTR)
    if not stored:
        return None
    src = f"study {name} (the config its last launch stored)"
    return config_from_yaml(str(stored), src, overrides, data_dir, download)


def _trial(study: optuna.Study, number: int) -> FrozenTrial:
    matches = [t for t in study.get_trials(deepcopy=False) if t.number == number]
    if not matches:
        raise HpsearchError(f"--trial: {number}: no such trial in study {study.study_name!r}")
    return matches[0]


def fixed_params(
    cfg: StudyConfig, params_json: str | None, trial_number: int | None, storage: str | None,
    workdir: Path, warn: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """A fixed run's params: --params checked by the study's rules (ConfigError), a value
    outside its search space or one the run would not read warned of (`warn`), or trial
    `trial_number`'s."""
    if params_json is not None and trial_number is not None:
        raise ConfigError("--params and --trial: give one of them, not both")
    if trial_number is not None:
        from hpsearch.query import reading_study

        with reading_study(cfg.name, storage, workdir) as study:
            return trial_params(_trial(study, trial_number), cfg)
    if params_json is None:
        return {}
    params = params_from_json(params_json)
    hp = cfg.resolve_params(params, given_by="--params")  # the study's rules for names, values
    if hp.batch_size < 2:  # as a study file's: it failed at the first step, a raw torch error
        raise ConfigError(
            f"--params: batch_size: {hp.batch_size}: must be >= 2: batch norm cannot train on "
            "batches of one image"
        )
    unknown = sorted(set(params) - set(cfg.fixed_params()))
    if unknown:
        raise ConfigError(f"--params: {', '.join(unknown)}: unknown hyperparameter")
    unread = unused_hyperparams(hp)
    for name, value in params.items() if warn else ():  # allowed, but said
        if name in unread:  # (a study file refuses it: a searched parameter never read)
            warnings.warn(
                f"--params: {name}: {value!r}: not read: the trainer reads it only with "
                f"{READ_ONLY_WITH[name]}",
                HpsearchWarning,
                stacklevel=2,
            )
        elif (where := outside_space(cfg, name, value)) is not None:  # a probe past its edge
            warnings.warn(
                f"--params: {name}: {value!r}: outside the study's search space ({where})",
                HpsearchWarning,
                stacklevel=2,
            )
    return params


def outside_space(cfg: StudyConfig, name: str, value: Any) -> str | None:
    """Where `value` of a searched `name` falls outside the study's space, else None."""
    from hpsearch.config import CategoricalParam

    spec = cfg.search_space.get(name)
    if spec is None:
        return None
    if isinstance(spec, CategoricalParam):
        return None if value in spec.choices else f"choices {spec.choices}"
    low, high = spec.low, spec.high
    if isinstance(value, int | float) and not low <= value <= high:
        return f"{low} to {high}"
    return None


def trial_seed(cfg: StudyConfig, trial_number: int, storage: str | None, workdir: Path) -> int:
    """The seed trial N trained with (`_seed_of`)."""
    return _seed_of(cfg, _stored_trial(cfg, trial_number, storage, workdir)[0])


def trial_threads(
    cfg: StudyConfig, trial_number: int, storage: str | None, workdir: Path
) -> int | None:
    """The CPU threads trial N trained with (`_threads_of`)."""
    return _threads_of(_stored_trial(cfg, trial_number, storage, workdir)[0])


def _stored_trial(
    cfg: StudyConfig, trial_number: int, storage: str | None, workdir: Path
) -> tuple[FrozenTrial, str | None]:
    """Trial N of the study, and the study's uid (`study.study_uid`; None before it has
    one), in one read."""
    from hpsearch.query import reading_study
    from hpsearch.study import study_uid

    with reading_study(cfg.name, storage, workdir) as study:
        return _trial(study, trial_number), study_uid(study)


def _seed_of(cfg: StudyConfig, trial: FrozenTrial) -> int:
    """`trainer.seed` plus the trial's retry chain's first trial's number, as its worker
    gave it (`train --trial N` with the study's seed was another run: its values differed
    from the trial's from the first epoch on)."""
    from hpsearch.worker import root_trial_number

    return int(cfg.trainer.seed) + root_trial_number(trial)


def _threads_of(trial: FrozenTrial) -> int | None:
    """The CPU threads the trial trained with (its worker's share of the cores, which a
    launch sets), or None where its worker recorded none: on a CPU, `train --trial N` with
    all the cores summed in another order and its values differed from epoch 1 on (QA)."""
    from hpsearch.worker import ATTR_THREADS

    threads = trial.user_attrs.get(ATTR_THREADS)
    return threads if isinstance(threads, int) and threads > 0 else None


def trial_params(trial: FrozenTrial, cfg: StudyConfig) -> dict[str, Any]:
    """The parameters trial N trained with, or will: those it drew, over those fixed for it
    (`study.enqueue_trial`, a retry's: Optuna keeps them in system_attrs until the trial
    runs). A trial with none while the study searches some (failed before it drew them) is
    an error: the study's defaults under its name would be another trial."""
    fixed = trial.system_attrs.get("fixed_params")
    params = {**(fixed if isinstance(fixed, dict) else {}), **trial.params}
    if not params and cfg.search_space:
        raise HpsearchError(
            f"--trial: {trial.number}: trial {trial.number} of study {cfg.name!r} "
            f"({trial.state.name}) has no parameters: it never drew them"
        )
    return params


class TrainServer:
    """The work folder's embedded MLflow server for one `hpsearch train` run: joined when a
    launch or `hpsearch ui` serves its store (one writer per SQLite file), else started for
    it. One it started that dies mid-run is started again on its port (`keep`, at each
    epoch; up to `MAX_RESTARTS`), as a launch does: the run's epochs wait in its tracker
    meanwhile. `close` leaves it; the last of its users stops it."""

    MAX_RESTARTS = 3

    def __init__(self, workdir: Path) -> None:
        from hpsearch.tracking.server import join_server, start_local_server, store_lock

        with store_lock(workdir):
            self.server: Any = join_server(workdir) or start_local_server(workdir)
        self.url: str = self.server.url
        self.restarts = 0

    def keep(self) -> str:
        """Start a dead server of this process's again; what happened, else ''."""
        from hpsearch.errors import TrackingError
        from hpsearch.tracking.server import LocalServer, restart_server

        dead = self.server
        if not isinstance(dead, LocalServer) or dead.is_running():
            return ""
        if self.restarts >= self.MAX_RESTARTS:
            return ""
        self.restarts += 1
        try:
            self.server = restart_server(dead) or dead
        except TrackingError as exc:
            return f"MLflow server at {dead.url} exited and did not start again: {exc}"
        return f"MLflow server at {dead.url} exited; started again ({self.restarts}/3)"

    def close(self) -> bool:
        """Leave it; True when that stopped it (this run was its last user)."""
        return bool(self.server.release() == "stopped")


def run_fixed(
    cfg: StudyConfig, params_json: str | None, trial_number: int | None, storage: str | None,
    workdir: Path, device: str, seed: int | None,
    on_epoch: Callable[[Any], None] | None = None,
    tracking_uri: str | None = None,
    on_run: Callable[[str], None] | None = None,
    should_interrupt: Callable[[], bool] | None = None,
) -> Any:  # fmt: skip
    """Train once with fixed params; the TrainResult. With `tracking_uri`, an MLflow run
    of its own in the study's experiment (`runs.FixedRun`; `on_run` gets its id once made)
    takes its epochs, plots and best model: each run's, where the files below keep the
    last one's. `should_interrupt` (polled between epochs) ends it early, `interrupted`:
    its files are kept as a failed run's, the earlier run's put back."""
    from hpsearch.trainer import TrainOptions, train
    from hpsearch.trainer.trial import ENDED_FOR_GOOD, best_model_path_for

    threads, uid = None, None
    if trial_number is not None and params_json is None:
        # Its params, seed, threads and study uid in one read of the study (was four).
        trial, uid = _stored_trial(cfg, trial_number, storage, workdir)
        params = trial_params(trial, cfg)
        seed = _seed_of(cfg, trial) if seed is None else seed
        threads = _threads_of(trial)
    else:
        params = fixed_params(cfg, params_json, trial_number, storage, workdir)
    label = f"trial-{trial_number}" if trial_number is not None else "fixed"
    run = None
    if tracking_uri is not None:
        from hpsearch.runs import FixedRun

        run = FixedRun.start(cfg, tracking_uri, params, label, trial_number, device, uid)
        if on_run is not None:
            on_run(run.run_id)
    ckpt = workdir / "train" / cfg.name / f"{label}.pt"
    # A fresh run each time (resuming is the search's business), but an earlier run's
    # checkpoint and best model are only set aside: when this run fails (missing data, a
    # bad device, an error before its end) they come back together, and what this run
    # wrote is kept beside them as `<file>.failed`.
    files = [ckpt, best_model_path_for(ckpt)]
    aside = [f.with_name(f.name + ".previous") for f in files]
    earlier = False
    for f, a in zip(files, aside, strict=True):
        if f.exists():
            f.replace(a)
            earlier = True

    def epoch_done(record: Any) -> None:
        if run is not None:
            run.log_epoch(record)
        if on_epoch is not None:
            on_epoch(record)

    options = TrainOptions(
        device=device, workdir=workdir, checkpoint_path=ckpt, seed=seed, on_epoch=epoch_done,
        should_interrupt=should_interrupt,
    )  # fmt: skip

    def put_back() -> None:  # this run's files as `.failed`, the earlier run's in place
        for f, a in zip(files, aside, strict=True):
            if f.exists():
                f.replace(f.with_name(f.name + ".failed"))
            if a.exists():
                a.replace(f)

    import torch
    from hpsearch.trainer.trial import resolve_device

    own_threads = torch.get_num_threads()
    if threads is not None and resolve_device(device).type == "cpu":
        # As many as this host lets it use: a trial of a larger host's (or a GPU worker's,
        # which had all its host's cores) would oversubscribe these cores.
        affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
        cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
        if threads > cores:
            warnings.warn(
                f"trial {trial_number} trained with {threads} CPU threads; this host has "
                f"{cores} cores: its values may differ in the last digits",
                HpsearchWarning,
                stacklevel=2,
            )
        threads = min(threads, cores)
    else:  # on a GPU its values never depended on them
        threads = None
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        result = train(cfg, params, lambda epoch, value: False, options)
    except BaseException as exc:
        if earlier:  # first: the run's end below may wait on MLflow, and a second Ctrl-C
            put_back()
        if run is not None:
            run.fail(exc, traceback.format_exc())
        if isinstance(exc, Exception) and not isinstance(exc, HpsearchError):
            # What a trial records as its error (say, batch_size 1 under BatchNorm: "Expected
            # more than 1 value per channel"): one line, as the worker's trial message.
            raise HpsearchError(f"training failed: {type(exc).__name__}: {exc}") from exc
        raise
    finally:
        torch.set_num_threads(own_threads)
    try:  # a second Ctrl-C (`train` raises it) as the run ends: the run still gets its end
        if getattr(result, "stop_reason", None) in ENDED_FOR_GOOD and result.checkpoint_path:
            # Nothing resumes it (each run starts afresh): it held an epoch before the last,
            # or was not there at all, a write given up at the end (QA: named all the same).
            Path(result.checkpoint_path).unlink(missing_ok=True)
            result = dataclasses.replace(result, checkpoint_path=None)
        if earlier and getattr(result, "stop_reason", None) == "interrupted":
            put_back()

            def moved(path: Any) -> Path | None:
                return None if path is None else Path(path).with_name(Path(path).name + ".failed")

            result = dataclasses.replace(
                result,
                best_model_path=moved(result.best_model_path),
                checkpoint_path=moved(result.checkpoint_path),
            )
        elif earlier and result.best_val_acc is not None and result.best_model_path is None:
            # Its best model's write failed (the result's message says so): the earlier run's
            # files come back, as when a run fails.
            for f, a in zip(files, aside, strict=True):
                if a.exists() and not f.exists():
                    a.replace(f)
        if run is not None:
            run.finish(result)
    except BaseException as exc:
        if run is not None:
            run.fail(exc, None)  # (a no-op once the tracker's end began: that sets it)
        raise
    for a in aside:
        a.unlink(missing_ok=True)
    return result
