"""Study files: `studies/*.yaml` validated into one frozen `StudyConfig`.

Every error names the file, the field, the value and the rule, for example::

    studies/x.yaml: search_space.lr.low: -1.0: log=True needs low > 0

Nothing here touches storage; loading is pure, so a bad file writes nothing.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from hpsearch.errors import ConfigError, HpsearchWarning
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

ARCHS = (
    "resnet18",
    "resnet34",
    "resnet50",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
)
DATASETS = ("flowers102", "cifar10", "cifar100", "imagefolder", "synthetic")
LOSSES = ("ce", "label_smoothing", "focal")
OPTIMIZERS = ("sgd", "adamw")
LR_SCALINGS = ("none", "linear", "sqrt")
AUGMENTS = ("none", "flip", "crop_flip", "trivial", "randaugment")
SCHEDULES = ("cosine", "onecycle", "plateau", "constant")
SAMPLERS = ("tpe", "gp", "cmaes", "random", "grid", "nsga2")
PRUNERS = ("median", "asha", "successive_halving", "hyperband", "none")
METRICS = ("val_acc", "val_loss", "train_seconds")


class _Frozen(BaseModel):
    # No .inf or .nan: a float field given one trains into a NaN later, far from the file.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _number(value: Any) -> Any:
    """A number field refuses true/false (`max_epochs: yes`, read as 1) and strings
    (`"30"`), which pydantic's lax mode would turn into numbers; a whole float (`1e3`,
    YAML 1.2's way to write a large number) still fits an int field."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    if isinstance(value, str):
        raise ValueError("must be a number, not a string")
    return value


Int = Annotated[int, BeforeValidator(_number)]
Float = Annotated[float, BeforeValidator(_number)]


def _boolean(value: Any) -> Any:
    """A true/false field refuses `1`, `"yes"` and `"true"`, which pydantic's lax mode
    would take: only YAML's true and false are booleans (the README's rule)."""
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


Bool = Annotated[bool, BeforeValidator(_boolean)]


F32_MAX = 3.4028234663852886e38  # float32's largest finite value


class Hyperparams(_Frozen):
    """Every value the trainer reads from a trial. Searched ones come from Optuna; the rest
    from `trainer.defaults`."""

    arch: Literal[ARCHS] = "resnet18"  # type: ignore[valid-type]
    image_size: Int | None = Field(default=None, ge=8, le=1024)  # px; None = dataset.image_size
    optimizer: Literal[OPTIMIZERS] = "sgd"  # type: ignore[valid-type]
    # Past float32's largest (3.4e38) a value fails every trial at its first step (torch:
    # "cannot be converted to type float without overflow"), in every worker (QA).
    lr: Float = Field(default=0.1, gt=0, le=F32_MAX)  # at base_batch_size, before lr_scaling
    momentum: Float = Field(default=0.9, ge=0, lt=1)
    weight_decay: Float = Field(default=5e-4, ge=0, le=F32_MAX)
    batch_size: Int = Field(default=128, ge=1)  # a new study file: >= 2 (_check_new_file)
    lr_scaling: Literal[LR_SCALINGS] = "none"  # type: ignore[valid-type]
    loss: Literal[LOSSES] = "ce"  # type: ignore[valid-type]
    label_smoothing: Float = Field(default=0.1, ge=0, lt=1)
    focal_gamma: Float = Field(default=2.0, ge=0, le=F32_MAX)
    augment: Literal[AUGMENTS] = "crop_flip"  # type: ignore[valid-type]
    augment_strength: Float = Field(default=0.5, ge=0, le=1)  # 0..1 of each op's max magnitude
    mixup_alpha: Float = Field(default=0.0, ge=0, le=F32_MAX)
    cutmix_alpha: Float = Field(default=0.0, ge=0, le=F32_MAX)
    schedule: Literal[SCHEDULES] = "cosine"  # type: ignore[valid-type]
    warmup_epochs: Float = Field(default=1.0, ge=0, le=F32_MAX)


HPARAM_NAMES = tuple(Hyperparams.model_fields)


def reported_metric_of(metrics: Sequence[str] | None) -> str:
    """`StudyConfig.reported_metric` of a study's objective metrics (or its Optuna metric
    names): val_loss where it is sought and val_acc is not, else val_acc."""
    names = list(metrics or [])
    return "val_loss" if "val_loss" in names and "val_acc" not in names else "val_acc"


def unused_hyperparams(hp: Hyperparams) -> frozenset[str]:
    """The values the trainer does not read given the trial's other choices (the smoothing
    of a loss that is not label_smoothing, SGD's momentum under AdamW). A default of these
    logged beside the trial's params read as if it took part in it."""
    unused: set[str] = set()
    if hp.loss != "label_smoothing":
        unused.add("label_smoothing")
    if hp.loss != "focal":
        unused.add("focal_gamma")
    if hp.optimizer != "sgd":
        unused.add("momentum")
    if hp.augment in ("none", "flip"):  # the crop's scale and the policies' magnitude
        unused.add("augment_strength")
    return frozenset(unused)


class DatasetConfig(_Frozen):
    name: Literal[DATASETS]  # type: ignore[valid-type]
    root: str | None = None  # data directory; --data-dir / HPSEARCH_DATA_DIR win
    image_size: Int = Field(default=64, ge=8, le=1024)  # px, train and eval resolution
    # px stored; None = 8/7 x the trial's image size (one cache per size when it is searched)
    cache_size: Int | None = Field(default=None, ge=8, le=2048)
    download: Bool = False
    fast_path: Literal["auto", "on", "off"] = "auto"  # on-device cache vs DataLoader
    max_cache_mb: Int = Field(default=8192, ge=1)  # auto picks the fast path under this
    # Quick checks: a fixed (seed 0) random subset of N images per split, file order kept;
    # the official Flowers-102 splits are sorted by class, so "the first N" would drop classes.
    train_limit: Int | None = Field(default=None, ge=1)
    eval_limit: Int | None = Field(default=None, ge=1)
    on_corrupt: Literal["skip", "fail"] = "skip"
    num_classes: Int | None = Field(default=None, ge=2)  # synthetic only (imagefolder: folders)

    @property
    def effective_cache_size(self) -> int:
        return self.cache_size if self.cache_size is not None else round(self.image_size * 8 / 7)


class ModelConfig(_Frozen):
    pretrained: Bool = False
    weights: str | None = None  # explicit weights file; else torchvision's cache (TORCH_HOME)


# A metric's direction when the study file gives none: accuracy up, loss and time down.
DEFAULT_DIRECTIONS = {"val_acc": "maximize", "val_loss": "minimize", "train_seconds": "minimize"}


class ObjectiveConfig(_Frozen):
    metric: Literal[METRICS] | list[Literal[METRICS]] = "val_acc"  # type: ignore[valid-type]
    # None: each metric's DEFAULT_DIRECTIONS (a val_loss study maximized its loss before).
    direction: Literal["maximize", "minimize"] | list[Literal["maximize", "minimize"]] | None = None

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric,) if isinstance(self.metric, str) else tuple(self.metric)

    @property
    def directions(self) -> tuple[str, ...]:
        if self.direction is None:
            return tuple(DEFAULT_DIRECTIONS[m] for m in self.metrics)
        if isinstance(self.direction, str):
            return (self.direction,) * len(self.metrics)
        return tuple(self.direction)

    @property
    def multi(self) -> bool:
        return len(self.metrics) > 1

    @field_validator("metric")
    @classmethod
    def _some_metrics_once_each(cls, metric: str | list[str]) -> str | list[str]:
        if isinstance(metric, list) and not metric:
            raise ValueError("needs at least one metric")
        if isinstance(metric, list) and len(set(metric)) != len(metric):
            raise ValueError("a metric given twice")
        return metric

    @field_validator("direction")
    @classmethod
    def _one_per_metric(cls, direction: Any, info: ValidationInfo) -> Any:
        metric = info.data.get("metric")  # absent when the metric itself was refused
        if isinstance(direction, list) and metric is not None:
            n = 1 if isinstance(metric, str) else len(metric)
            if len(direction) != n:
                raise ValueError(f"needs {n} direction(s), one per objective.metric")
        return direction


class BudgetConfig(_Frozen):
    n_trials: Int = Field(default=20, ge=1)  # counts all trials of the study, across relaunches
    timeout_s: Float | None = Field(default=None, gt=0)  # per launch, seconds
    max_epochs: Int = Field(default=10, ge=1)
    # Wall-clock s per trial, set-up and training, a resumed trial's earlier tries included;
    # the best weights' test pass comes after.
    trial_timeout_s: Float | None = Field(default=None, gt=0)


SEED_MAX = 2**32 - 1  # numpy's seeds, which Optuna's samplers use, are < 2**32


class SamplerConfig(_Frozen):
    name: Literal[SAMPLERS] = "tpe"  # type: ignore[valid-type]
    seed: Int | None = Field(default=None, ge=0, le=SEED_MAX)
    options: dict[str, Any] = Field(default_factory=dict)


class PrunerConfig(_Frozen):
    name: Literal[PRUNERS] = "median"  # type: ignore[valid-type]
    options: dict[str, Any] = Field(default_factory=dict)


class TrainerConfig(_Frozen):
    eval_every: Int = Field(default=1, ge=1)  # epochs between validations (and reports)
    patience: Int | None = Field(default=None, ge=1)  # evals without improvement
    # auto: bf16 where the GPU has it natively, else fp16; fp32 on the CPU
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    channels_last: Bool = True
    compile: Bool = False
    cudnn_benchmark: Bool = True
    max_micro_batch: Int | None = Field(default=None, ge=1)  # larger batches accumulate
    base_batch_size: Int = Field(default=256, ge=1)  # reference batch for lr_scaling
    # per-trial seed = seed + trial number; torch takes -2**63 .. 2**64 - 1
    seed: Int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    evaluate_test: Bool = True  # test accuracy of each finished trial
    # Evaluation (val and test alike): the image size is the trial's times eval_scale (a
    # random-resized-crop model sees objects larger than a center crop shows them at the
    # same size: FixRes, Touvron et al. 2019); eval_flip averages the logits of each image
    # and its mirror. Both cost eval time only.
    eval_scale: Float = Field(default=1.0, ge=0.25, le=4.0)
    eval_flip: Bool = False
    num_workers: Int = Field(default=4, ge=0)  # DataLoader workers of the streaming path
    checkpoint: Bool = True
    # seconds between resume checkpoints; 0 = every epoch. A crash redoes at most this much.
    checkpoint_every_s: Float = Field(default=0.0, ge=0)
    defaults: Hyperparams = Field(default_factory=Hyperparams)


class TrackingConfig(_Frozen):
    keep_top_k: Int = Field(default=3, ge=0)  # best models kept on disk; uploaded if top k at tell
    gpu_interval_s: Float = Field(default=5.0, gt=0)  # NVML sampling period, seconds
    input_bound_threshold: Float = Field(default=50.0, ge=0, le=100)  # % GPU utilization
    input_bound_window_s: Float = Field(default=60.0, gt=0)  # seconds averaged
    stop_input_bound: Bool = False  # stop (prune) trials that stay input-bound
    upload_checkpoints: Bool = False  # resume checkpoints to MLflow each epoch (multi-host)
    onnx: Bool = True  # ONNX export of the best model at the end of a launch


class _Param(_Frozen):
    when: dict[str, Any | list[Any]] | None = None  # only sampled when all conditions hold


class FloatParam(_Param):
    type: Literal["float"]
    low: Float
    high: Float
    log: Bool = False
    step: Float | None = Field(default=None, gt=0)


class IntParam(_Param):
    type: Literal["int"]
    low: Int
    high: Int
    log: Bool = False
    step: Int = Field(default=1, ge=1)


class CategoricalParam(_Param):
    type: Literal["categorical"]
    choices: list[str | int | float | bool | None] = Field(min_length=1)


def _check_range(src: str, field: str, spec: FloatParam | IntParam) -> None:
    step = spec.step if isinstance(spec, FloatParam) else (None if spec.step == 1 else spec.step)
    if spec.low > spec.high:
        raise ConfigError(f"{src}: {field}.low: {spec.low!r}: must be <= high ({spec.high!r})")
    if spec.log and spec.low <= 0:
        raise ConfigError(f"{src}: {field}.low: {spec.low!r}: log=True needs low > 0")
    if spec.log and step is not None:
        raise ConfigError(f"{src}: {field}.step: {step!r}: cannot be combined with log=True")


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class StudyConfig(_Frozen):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    dataset: DatasetConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    pruner: PrunerConfig = Field(default_factory=PrunerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    search_space: dict[str, Param] = Field(default_factory=dict)
    # Trials run before the sampler's own, as Optuna's `study.enqueue_trial`: each maps
    # searched parameters to values (the rest are drawn). Queued once per study: a launch
    # skips one the study already holds, and queues no more than its budget has room for.
    enqueue_trials: list[dict[str, Any]] = Field(default_factory=list)
    source: str = ""  # the file it came from; set by load_config

    @property
    def reported_metric(self) -> str:
        """What an evaluated epoch reports to the pruner, and what picks a trial's best
        epoch (its weights, its told values): val_loss where the objectives have it and not
        val_acc (alone, or beside train_seconds), else val_acc (a multi-objective study
        prunes nothing; a pruner with train_seconds is refused)."""
        return reported_metric_of(self.objective.metrics)

    def fixed_params(self) -> dict[str, Any]:
        """Hyperparameter values used for everything the search space leaves out."""
        return self.trainer.defaults.model_dump()

    def resolve_params(
        self, sampled: Mapping[str, Any], given_by: str | None = None
    ) -> Hyperparams:
        """Defaults overlaid with sampled values, validated. An error names the study file
        (`<file>: params.lr: ...`), or `given_by` when the values came from there
        (`--params: lr: ...`)."""
        merged = {**self.fixed_params(), **dict(sampled)}
        merged = {k: v for k, v in merged.items() if k in HPARAM_NAMES}
        try:
            return Hyperparams(**merged)
        except ValidationError as exc:
            if given_by is not None:
                raise ConfigError(_format_validation(given_by, exc)) from exc
            raise ConfigError(_format_validation(self.source or self.name, exc, "params")) from exc

    def trial_sizes(self, hp: Hyperparams) -> tuple[int, int]:
        """(trained, evaluated) px of a trial: its image size, and that times eval_scale."""
        trained = hp.image_size or self.dataset.image_size
        return trained, max(1, round(trained * self.trainer.eval_scale))


_UNION_MEMBER = re.compile(r"^(function-\w+|tagged-union|literal|list|dict|nullable)\[")


def _format_validation(source: str, exc: ValidationError, prefix: str = "") -> str:
    err = exc.errors()[0]
    # Pydantic inserts the union member tried ("float", "literal['a','b']", "list[...]",
    # "function-before[...]") into the path; drop those, keep field names and list indexes.
    loc = [str(p) for p in err["loc"] if not _UNION_MEMBER.match(str(p))]
    field = ".".join(p for p in loc if p not in ("float", "int", "str", "bool", "categorical"))
    if prefix:
        field = f"{prefix}.{field}" if field else prefix
    value = err.get("input")
    if err["type"] == "missing":  # its input is the section around it, not a value
        return f"{source}: {field}: missing: a required key"
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        tag = value.get("type") if isinstance(value, dict) else None
        return f"{source}: {field}.type: {tag!r}: must be one of 'float', 'int', 'categorical'"
    if isinstance(value, dict | list) and len(repr(value)) > 60:
        value = f"{type(value).__name__}"
    msg = err["msg"].removeprefix("Value error, ")
    if re.search(r"\.choices\.\d+$", field):  # the union's first member ("a valid string")
        msg = "a choice must be a string, a number, true, false or null"
    elif err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "literal_error":
        msg = msg.replace("Input should be", "must be one of")
    return f"{source}: {field or '<root>'}: {value!r}: {_f32_limit(msg, err)}"


def _f32_limit(msg: str, err: Mapping[str, Any]) -> str:
    """`msg` of a value over F32_MAX with the limit as 3.4e38 (pydantic writes 39 digits),
    and why there is one."""
    if (err.get("ctx") or {}).get("le") != F32_MAX:
        return msg
    msg = re.sub(r"\d{30,}(\.\d+)?", "3.4e38", msg)
    return f"{msg} (float32's largest: a trial's first step fails past it)"


# --- search-space rules that need the whole file ---------------------------------------

_CHOICE_SETS: dict[str, tuple[str, ...]] = {
    "arch": ARCHS,
    "optimizer": OPTIMIZERS,
    "loss": LOSSES,
    "lr_scaling": LR_SCALINGS,
    "augment": AUGMENTS,
    "schedule": SCHEDULES,
}


def grid_space(cfg: StudyConfig) -> dict[str, list[Any]]:
    """The grid sampler's values per parameter: the choices, every int step, and every float
    step (to 12 significant digits: `low + i * step` drifts past `high`, e.g. 0.30000000000000004
    for a range ending at 0.3, which Optuna warns is out of range)."""
    space: dict[str, list[Any]] = {}
    for name, spec in cfg.search_space.items():
        if isinstance(spec, CategoricalParam):
            space[name] = list(spec.choices)
        elif isinstance(spec, IntParam):
            space[name] = list(range(spec.low, spec.high + 1, spec.step))
        elif spec.step is not None:
            # Whole steps from low, as Optuna shrinks a stepped range to its last step below
            # high (1e-9: a division such as 0.3 / 0.1 lands just below 3).
            n = math.floor((spec.high - spec.low) / spec.step + 1e-9)
            values = (float(f"{spec.low + i * spec.step:.12g}") for i in range(n + 1))
            space[name] = [min(v, spec.high) for v in values]
    return space


def _check_space(cfg: StudyConfig, src: str, stored: bool = False) -> None:
    seen: dict[str, Any] = {}
    # Per parameter: the values each categorical must take for it to be sampled (its own
    # `when` and, through them, the `when`s of the parameters it names), and why.
    needs: dict[str, dict[str, tuple[list[Any], str]]] = {}
    numeric = {n for n, f in Hyperparams.model_fields.items() if f.annotation in (int, float)}
    integers = {n for n, f in Hyperparams.model_fields.items() if f.annotation is int}
    numeric |= {"image_size"}
    integers |= {"image_size"}
    for name, spec in cfg.search_space.items():
        field = f"search_space.{name}"
        if name not in HPARAM_NAMES:
            raise ConfigError(
                f"{src}: {field}: {name!r}: unknown hyperparameter; "
                f"known: {', '.join(HPARAM_NAMES)}"
            )
        if isinstance(spec, CategoricalParam):
            allowed = _CHOICE_SETS.get(name)
            for i, choice in enumerate(spec.choices):
                if not stored and choice in spec.choices[:i]:
                    # Optuna draws it twice as often (and takes the first for both: 1 and
                    # 1.0, or 1 and true, are one choice to it), and a grid trains it twice.
                    raise ConfigError(f"{src}: {field}.choices: {choice!r}: given twice")
                if allowed is not None and choice not in allowed:
                    raise ConfigError(
                        f"{src}: {field}.choices: {choice!r}: unknown {name}; "
                        f"must be one of {', '.join(allowed)}"
                    )
                if allowed is None and name in numeric and not _is_number(choice):
                    raise ConfigError(
                        f"{src}: {field}.choices: {choice!r}: {name} must be a number"
                    )
                if allowed is None and name in numeric:
                    _check_value(src, f"{field}.choices", name, choice)
        elif name in _CHOICE_SETS:
            raise ConfigError(f"{src}: {field}.type: {spec.type!r}: {name} must be categorical")
        elif isinstance(spec, FloatParam) and name in integers and not stored:
            # Optuna would draw 37.4, and every trial would fail on it, one by one.
            raise ConfigError(
                f"{src}: {field}.type: 'float': {name} is a whole number; use int or categorical"
            )
        else:
            _check_range(src, field, spec)
            _check_value(src, f"{field}.low", name, spec.low)
            _check_value(src, f"{field}.high", name, spec.high)
        for cond_name, cond_value in (spec.when or {}).items():
            cfield = f"{field}.when.{cond_name}"
            if cond_name not in seen:
                raise ConfigError(
                    f"{src}: {cfield}: {cond_name!r}: a condition must name a categorical "
                    "parameter declared earlier in search_space"
                )
            wanted = cond_value if isinstance(cond_value, list) else [cond_value]
            if not wanted and not stored:
                raise ConfigError(f"{src}: {cfield}: []: needs at least one value")
            twice = [w for i, w in enumerate(wanted) if w in wanted[:i]]
            if twice and not stored:  # as a choice given twice: a typo for another value
                raise ConfigError(f"{src}: {cfield}: {twice[0]!r}: given twice")
            for w in wanted:
                if w not in seen[cond_name]:
                    raise ConfigError(
                        f"{src}: {cfield}: {w!r}: not among the choices of {cond_name} "
                        f"{seen[cond_name]}"
                    )
        if not stored:
            needs[name] = _sampling_needs(src, field, spec.when or {}, needs)
        if isinstance(spec, CategoricalParam):
            seen[name] = list(spec.choices)
    if cfg.sampler.name == "grid":
        for name, spec in cfg.search_space.items():
            if isinstance(spec, FloatParam) and spec.step is None:
                raise ConfigError(
                    f"{src}: search_space.{name}.type: 'float': the grid sampler needs "
                    "categorical, int or stepped float parameters"
                )
        points = math.prod(len(v) for v in grid_space(cfg).values())
        if cfg.budget.n_trials > points:
            raise ConfigError(
                f"{src}: budget.n_trials: {cfg.budget.n_trials}: the grid sampler's grid has "
                f"{points} points (search_space's values multiplied); a larger budget would "
                "train points again"
            )
    if cfg.objective.metrics == ("train_seconds",) and cfg.pruner.name != "none":
        raise ConfigError(
            f"{src}: pruner.name: {cfg.pruner.name!r}: trials report val_acc or val_loss per "
            "epoch, not objective.metric 'train_seconds'; use 'none'"
        )
    if cfg.objective.multi and cfg.pruner.name != "none":
        raise ConfigError(
            f"{src}: pruner.name: {cfg.pruner.name!r}: Optuna cannot prune multi-objective "
            "studies; use 'none'"
        )
    if cfg.objective.multi and cfg.sampler.name == "cmaes":
        raise ConfigError(
            f"{src}: sampler.name: {cfg.sampler.name!r}: does not support multi-objective studies"
        )


def np_bool() -> type:
    """numpy's bool type where numpy is loaded (it is no `numbers` type), else bool."""
    np = sys.modules.get("numpy")
    return np.bool_ if np is not None else bool


def enqueued_value(spec: FloatParam | IntParam | CategoricalParam, value: Any) -> Any:
    """`value` as a trial of `spec` draws it (a float parameter's 1 is 1.0; a choice is the
    choice itself), or raises ValueError with the rule it breaks."""
    if isinstance(spec, CategoricalParam):
        for choice in spec.choices:
            # 1 and True are equal in Python, not as choices (the space refuses both at once)
            is_bool = isinstance(value, bool | np_bool())
            if choice == value and isinstance(choice, bool) == is_bool:
                return choice
        raise ValueError(f"not among its choices {spec.choices}")
    # numbers.Real: numpy's scalars too (params read back from `best_trials`' DataFrame)
    if not isinstance(value, numbers.Real) or isinstance(value, bool | np_bool()):
        raise ValueError("must be a number")
    if isinstance(spec, IntParam) and not isinstance(value, numbers.Integral):
        raise ValueError("must be a whole number")
    raw: Any = value  # a numpy scalar converts like the builtin it stands for
    number: float | int
    try:
        number = float(raw) if isinstance(spec, FloatParam) else int(raw)
        finite = math.isfinite(number)
    except OverflowError:  # an integer past a float's range
        raise ValueError(f"outside its range {spec.low}..{spec.high}") from None
    if not finite:
        raise ValueError("must be finite")
    if not spec.low <= number <= spec.high:
        raise ValueError(f"outside its range {spec.low}..{spec.high}")
    step = spec.step
    if step is not None and not (isinstance(spec, IntParam) and step == 1):
        k = (number - spec.low) / step
        if abs(k - round(k)) > 1e-8:  # Optuna's own tolerance for a stepped float
            raise ValueError(f"not on its steps: {spec.low} + k * {step}")
    return number


def enqueued_trials(cfg: StudyConfig) -> list[dict[str, Any]]:
    """`enqueue_trials` as Optuna is given them: each value as its parameter draws it."""
    return [
        {name: enqueued_value(cfg.search_space[name], value) for name, value in entry.items()}
        for entry in cfg.enqueue_trials
    ]


# A search space narrowed with --set may leave a shipped study's enqueued trial outside it.
DROP_ENQUEUED = " (to run without the file's enqueued trials: --set 'enqueue_trials=[]')"


def check_enqueued(
    cfg: StudyConfig, entry: Mapping[str, Any], where: str, sep: str = ".", hint: str = ""
) -> dict[str, Any]:
    """`entry` as Optuna is given it (`enqueued_value` of each), or ConfigError: it gives
    searched parameters only, values their trial could draw, and only parameters it draws
    (a `when` that does not hold would leave a value unused, silently); Optuna itself takes
    a value outside the space with a warning in one worker's log. An error names
    `<where><sep><name>`, and ends with `hint`."""
    if not entry:
        raise ConfigError(f"{where}: {{}}: gives no parameter")
    out: dict[str, Any] = {}
    for name, value in entry.items():
        field = f"{where}{sep}{name}"
        spec = cfg.search_space.get(name)
        if spec is None:
            why = (
                f"not searched here: set it in trainer.defaults.{name}"
                if name in HPARAM_NAMES
                else f"unknown hyperparameter; searched: {', '.join(cfg.search_space)}"
            )
            raise ConfigError(f"{field}: {value!r}: {why}{hint}")
        try:
            out[name] = enqueued_value(spec, value)
        except ValueError as exc:
            raise ConfigError(f"{field}: {value!r}: {exc}{hint}") from None
        for cond, wanted in (spec.when or {}).items():
            values = wanted if isinstance(wanted, list) else [wanted]
            if cond not in entry:
                raise ConfigError(
                    f"{field}: {value!r}: drawn only when {cond} is one of {values}, and "
                    f"this trial gives no {cond}{hint}"
                )
            if entry[cond] not in values:
                raise ConfigError(
                    f"{field}: {value!r}: drawn only when {cond} is one of {values}, and "
                    f"this trial gives {cond}: {entry[cond]!r}{hint}"
                )
    if cfg.sampler.name == "grid":
        # Optuna's GridSampler marks no point visited for an enqueued trial, and hands trial
        # n the n-th point: that point trains twice and another never.
        raise ConfigError(
            f"{where}: {dict(entry)!r}: the grid sampler trains every point of its grid once "
            f"already; an enqueued trial would train one twice and leave another out{hint}"
        )
    return out


def _check_enqueue(cfg: StudyConfig, src: str) -> None:
    seen: list[dict[str, Any]] = []
    for i, entry in enumerate(cfg.enqueue_trials):
        where = f"{src}: enqueue_trials[{i}]"
        normal = check_enqueued(cfg, entry, where, hint=DROP_ENQUEUED)
        if normal in seen:
            raise ConfigError(
                f"{where}: {entry!r}: the same trial as enqueue_trials[{seen.index(normal)}]"
            )
        seen.append(normal)


def _sampling_needs(
    src: str,
    field: str,
    when: Mapping[str, Any],
    needs: Mapping[str, dict[str, tuple[list[Any], str]]],
) -> dict[str, tuple[list[Any], str]]:
    """What a parameter with `when` needs of the categoricals to be sampled: its own
    conditions, and those of each parameter it names (which is sampled only when they
    hold). ConfigError when two of them leave a categorical no value: the parameter would
    never be sampled."""
    out: dict[str, tuple[list[Any], str]] = {}

    def narrow(key: str, values: list[Any], why: str) -> None:
        if key not in out:
            out[key] = (values, why)
            return
        have, have_why = out[key]
        both = [v for v in have if v in values]  # ==, as `suggest` tests a condition
        if not both:
            raise ConfigError(
                f"{src}: {field}.when: {dict(when)!r}: can never hold: {have_why} needs "
                f"{key} in {have}, {why} needs it in {values}"
            )
        out[key] = (both, have_why)

    for cond_name, cond_value in when.items():
        narrow(cond_name, cond_value if isinstance(cond_value, list) else [cond_value], "its when")
    for cond_name in when:
        for key, (values, _) in needs.get(cond_name, {}).items():
            narrow(key, values, f"{cond_name} (sampled only then)")
    return out


def direction_note(cfg: StudyConfig) -> str | None:
    """An objective metric sought the other way than its own (`val_loss` maximized): the
    worst trials rank best. Not an error (a study begun before val_loss minimized by
    default goes on with `direction: maximize`), but a launch says so. None when none is."""
    against = [
        f"{metric} {direction}d"
        for metric, direction in zip(cfg.objective.metrics, cfg.objective.directions, strict=True)
        if DEFAULT_DIRECTIONS[metric] != direction
    ]
    if not against:
        return None
    return (
        f"objective.direction: {', '.join(against)}: the worst trials rank best (each "
        "metric's own direction is taken when none is given)"
    )


def warmup_note(cfg: StudyConfig) -> str | None:
    """A warm-up as long as the budget's epochs (`warmup_epochs: 10` with `max_epochs: 3`):
    the learning rate only ever ramps up; not an error (a quick run of a long study), but
    a launch says so. None when none is."""
    epochs = cfg.budget.max_epochs
    spec = cfg.search_space.get("warmup_epochs")
    if isinstance(spec, FloatParam | IntParam):
        if spec.low >= epochs:
            return (
                f"search_space.warmup_epochs.low: {spec.low}: at or past budget.max_epochs "
                f"({epochs}): every trial's learning rate only ramps up"
            )
        return None
    if spec is not None:  # categorical: each choice
        return None
    warm = cfg.trainer.defaults.warmup_epochs
    if warm >= epochs:
        given = "warmup_epochs" in cfg.trainer.defaults.model_fields_set
        return (
            f"trainer.defaults.warmup_epochs: {warm:g}{'' if given else ' (the default)'}: at "
            f"or past budget.max_epochs ({epochs}): the learning rate only ramps up"
        )
    return None


def pruning_note(cfg: StudyConfig) -> str | None:
    """Why the study's pruner will prune no trial with this epoch budget, or None. Not an
    error: a quick run of a long study (`--set budget.max_epochs=2`) is fine unpruned, but
    a launch says so. Trials report at epochs 1..budget.max_epochs."""
    opts, epochs = cfg.pruner.options, cfg.budget.max_epochs
    name = cfg.pruner.name

    def whole(key: str, default: int) -> int | None:
        value = opts.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    first: tuple[str, int] | None = None  # (option, the first epoch it can prune at)
    if name == "median" and (warm := whole("n_warmup_steps", 1)) is not None:
        first = ("n_warmup_steps", warm)
    elif name in ("asha", "successive_halving"):
        low, factor = whole("min_resource", 1), whole("reduction_factor", 3)
        rate = whole("min_early_stopping_rate", 0)
        if low is not None and factor is not None and rate is not None:
            first = ("min_resource", low * factor**rate)
    elif name == "hyperband" and (low := whole("min_resource", 1)) is not None:
        first = ("min_resource", low)
        high = whole("max_resource", epochs)
        if low <= epochs and high is not None and high > epochs:
            return (
                f"pruner.options.max_resource: {high}: above budget.max_epochs ({epochs}): "
                "Hyperband's brackets are sized for trials longer than any trains"
            )
    every = cfg.trainer.eval_every  # trials report at their evaluations only
    if name != "none" and 1 < every >= epochs:  # (one epoch in all: nothing to prune anyway)
        return (
            f"trainer.eval_every: {every}: a trial's only report comes at budget.max_epochs "
            f"({epochs}), where it has trained to its end: no trial will be pruned"
        )
    # No trial is pruned at its last epoch (reporting.TrialReports: it trained to its end).
    if first is not None and first[1] >= epochs:
        when = "after" if first[1] > epochs else "at"
        return (
            f"pruner.options.{first[0]}: {opts.get(first[0], first[1])!r}: the pruner's first "
            f"decision comes at epoch {first[1]}, {when} budget.max_epochs ({epochs}), whose "
            "trials have trained to their end: no trial will be pruned"
        )
    startup = whole("n_startup_trials", 3)  # median: trials finished before it judges one
    if name == "median" and startup is not None and startup >= cfg.budget.n_trials:
        return (
            f"pruner.options.n_startup_trials: {startup}: at or past budget.n_trials "
            f"({cfg.budget.n_trials}): the pruner judges no trial before the budget is spent"
        )
    return None


# What makes the trainer read a hyperparameter it may ignore (`unused_hyperparams`).
READ_ONLY_WITH = {
    "label_smoothing": "loss label_smoothing",
    "focal_gamma": "loss focal",
    "momentum": "optimizer sgd",
    "augment_strength": "an augment other than none and flip",
}


def _check_read(cfg: StudyConfig, src: str) -> None:
    """A searched parameter the trainer never reads, under its `when` and what the study
    draws or fixes of loss, optimizer and augment (label_smoothing searched with
    `when: {loss: focal}`): its values took no part in any trial, and the sampler modelled
    them as if they did."""
    import itertools

    governing = ("loss", "optimizer", "augment")
    for name, spec in cfg.search_space.items():
        if name not in READ_ONLY_WITH:
            continue
        options: list[list[Any]] = []
        for g in governing:
            gspec = cfg.search_space.get(g)
            if g in (spec.when or {}):
                value = (spec.when or {})[g]
                options.append(value if isinstance(value, list) else [value])
            elif isinstance(gspec, CategoricalParam):
                # Drawn under a `when` of its own: the trials it is not drawn in train with
                # the default.
                default = [getattr(cfg.trainer.defaults, g)] if gspec.when else []
                options.append(list(gspec.choices) + default)
            else:
                options.append([getattr(cfg.trainer.defaults, g)])
        combos = [dict(zip(governing, c, strict=True)) for c in itertools.product(*options)]
        if all(
            name in unused_hyperparams(cfg.trainer.defaults.model_copy(update=combo))
            for combo in combos
        ):
            raise ConfigError(
                f"{src}: search_space.{name}: searched but never read: the trainer reads it "
                f"only with {READ_ONLY_WITH[name]}, which no trial of this study has"
                + (f" under its when {spec.when!r}" if spec.when else "")
            )


def _check_new_file(cfg: StudyConfig, src: str) -> None:
    """Rules of a study file that a study's stored config (`config_from_yaml`) is spared:
    its trials ran under the rules of their day, and it must keep loading."""
    _check_read(cfg, src)
    reserved = {"seed": "set sampler.seed; each worker draws from a seed derived from it",
                "search_space": "the grid is the search_space's values"}  # fmt: skip
    for key, why in reserved.items():
        if key in cfg.sampler.options:
            raise ConfigError(
                f"{src}: sampler.options.{key}: {cfg.sampler.options[key]!r}: not an option "
                f"here: {why}"
            )
    objective = cfg.objective
    direction = objective.direction
    if isinstance(direction, str) and objective.multi:
        # It goes to every metric: [val_acc, train_seconds] with maximize sought slow trials.
        against = [m for m in objective.metrics if DEFAULT_DIRECTIONS[m] != direction]
        if against:
            raise ConfigError(
                f"{src}: objective.direction: {direction!r}: one direction for "
                f"{len(objective.metrics)} metrics, and {against[0]} would "
                f"{direction[:-1]}e too; give one per metric (a list in their order) or none "
                "(each metric's own)"
            )
    # A count (n_startup_trials, n_ei_candidates, ...): Optuna's samplers store a negative
    # one unchecked, and TPE then ran with no start-up trials at all. None of Optuna's
    # counts takes -1 for "all".
    for section, options in (("sampler", cfg.sampler.options), ("pruner", cfg.pruner.options)):
        for key, value in options.items():
            if key.startswith("n_") and _is_number(value) and value < 0:
                raise ConfigError(f"{src}: {section}.options.{key}: {value!r}: must be >= 0")
    if cfg.dataset.num_classes is not None and cfg.dataset.name != "synthetic":
        raise ConfigError(
            f"{src}: dataset.num_classes: {cfg.dataset.num_classes}: only the synthetic "
            f"dataset takes it; {cfg.dataset.name} has its own classes"
        )
    # Batch norm cannot train on one image: every trial drawing it failed at its first step.
    one = "must be >= 2: batch norm cannot train on batches of one image"
    if cfg.trainer.defaults.batch_size < 2:
        raise ConfigError(
            f"{src}: trainer.defaults.batch_size: {cfg.trainer.defaults.batch_size}: {one}"
        )
    if cfg.trainer.max_micro_batch is not None and cfg.trainer.max_micro_batch < 2:
        raise ConfigError(f"{src}: trainer.max_micro_batch: {cfg.trainer.max_micro_batch}: {one}")
    spec = cfg.search_space.get("batch_size")
    if isinstance(spec, IntParam) and spec.low < 2:
        raise ConfigError(f"{src}: search_space.batch_size.low: {spec.low}: {one}")
    if isinstance(spec, CategoricalParam):
        for choice in spec.choices:
            if _is_number(choice) and choice < 2:  # type: ignore[operator]
                raise ConfigError(f"{src}: search_space.batch_size.choices: {choice!r}: {one}")
    _check_arch_sizes(cfg, src)
    _check_cache_size(cfg, src)
    if len(cfg.name) > MAX_NAME_LENGTH:
        raise ConfigError(
            f"{src}: name: {cfg.name[:20]}... ({len(cfg.name)} characters): must be at most "
            f"{MAX_NAME_LENGTH}: it names files (the study's lock, its checkpoints)"
        )
    for name, spec in cfg.search_space.items():
        ranged = spec if isinstance(spec, FloatParam | IntParam) else None
        step = ranged.step if ranged is not None else None
        if ranged is not None and step is not None and 0 < ranged.high - ranged.low < step:
            # Optuna draws low every time: a parameter searched in name only.
            raise ConfigError(
                f"{src}: search_space.{name}.step: {step!r}: must be <= high - low "
                f"({ranged.high - ranged.low:g}), or every trial draws low"
            )
        if cfg.sampler.name == "grid" and spec.when:
            raise ConfigError(
                f"{src}: search_space.{name}.when: {spec.when!r}: the grid sampler's grid is "
                "every parameter's values multiplied, so a point that differs only in a "
                "parameter not sampled trains the same configuration again; list it without "
                "`when`, or use another sampler"
            )
    for section in ("sampler", "pruner"):
        for key, value in getattr(cfg, section).options.items():
            if _is_number(value) and not math.isfinite(value):
                raise ConfigError(f"{src}: {section}.options.{key}: {value!r}: must be finite")
    sigma0 = cfg.sampler.options.get("sigma0")
    if cfg.sampler.name == "cmaes" and isinstance(sigma0, int | float) and sigma0 <= 0:
        # Optuna clamps it to 1e-8: every trial after the first proposes one point.
        raise ConfigError(f"{src}: sampler.options.sigma0: {sigma0!r}: must be > 0")
    if cfg.pruner.name == "hyperband":
        opts = cfg.pruner.options
        low, high = opts.get("min_resource"), opts.get("max_resource")
        factor = opts.get("reduction_factor")
        # Optuna checks these only when its first bracket is made, at a trial's report.
        if isinstance(factor, int | float) and factor < 2:
            raise ConfigError(f"{src}: pruner.options.reduction_factor: {factor!r}: must be >= 2")
        if isinstance(low, int | float) and low < 1:
            raise ConfigError(f"{src}: pruner.options.min_resource: {low!r}: must be >= 1")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            # Optuna then makes no bracket, and prunes nothing.
            raise ConfigError(
                f"{src}: pruner.options.min_resource: {low}: must be <= max_resource ({high})"
            )


MAX_NAME_LENGTH = 200  # characters: file names (255 bytes) also hold a prefix and suffix


def _check_cache_size(cfg: StudyConfig, src: str) -> None:
    """A stored size below a trained (or evaluated) one scales every image up: the trials
    train on blur."""
    stored = cfg.dataset.cache_size
    largest, field = _image_size_bound(cfg, largest=True)
    scale = cfg.trainer.eval_scale
    if stored is None:  # each trial stores 8/7 of its own size
        if scale > 8 / 7:
            raise ConfigError(
                f"{src}: trainer.eval_scale: {scale:g}: must be <= 8/7 without a "
                "dataset.cache_size (trials store 8/7 of their image size): larger scales up"
            )
        return
    if stored < largest:
        raise ConfigError(
            f"{src}: dataset.cache_size: {stored}: must be >= the largest image size trained "
            f"({largest:g}, {field}): smaller stored images are scaled up"
        )
    if stored < round(largest * scale):
        raise ConfigError(
            f"{src}: trainer.eval_scale: {scale:g}: evaluates the largest image size trained "
            f"({largest:g}, {field}) at {round(largest * scale)} px, above dataset.cache_size "
            f"({stored}): stored images would be scaled up"
        )


def _image_size_bound(cfg: StudyConfig, largest: bool) -> tuple[float, str]:
    """The largest (or smallest) image size the study trains at, px, and the field that
    gives it: the searched one, else trainer.defaults, else the dataset's."""
    size = cfg.search_space.get("image_size")
    pick = max if largest else min
    if isinstance(size, CategoricalParam):
        sizes = [float(c) for c in size.choices if _is_number(c)]  # type: ignore[arg-type]
        return pick(sizes), "search_space.image_size.choices"
    if isinstance(size, IntParam | FloatParam):
        bound = "high" if largest else "low"
        return float(getattr(size, bound)), f"search_space.image_size.{bound}"
    if cfg.trainer.defaults.image_size is not None:
        return cfg.trainer.defaults.image_size, "trainer.defaults.image_size"
    return cfg.dataset.image_size, "dataset.image_size"


# px an architecture needs at least: ConvNeXt's stem (stride 4) and three 2x2 downsamplings
# without padding fail on a smaller input ("Kernel size can't be greater than actual input
# size"), in every trial that draws both.
MIN_IMAGE_SIZE = {"convnext_tiny": 32}


def _check_arch_sizes(cfg: StudyConfig, src: str) -> None:
    space = cfg.search_space
    arch = space.get("arch")
    archs = arch.choices if isinstance(arch, CategoricalParam) else [cfg.trainer.defaults.arch]
    smallest, field = _image_size_bound(cfg, largest=False)
    for name in archs:
        need = MIN_IMAGE_SIZE.get(str(name))
        if need is not None and smallest < need:
            raise ConfigError(
                f"{src}: {field}: {smallest:g}: {name} needs images of at least {need} px"
            )
        evaluated = round(smallest * cfg.trainer.eval_scale)  # as StudyConfig.trial_sizes
        if need is not None and evaluated < need:
            raise ConfigError(
                f"{src}: trainer.eval_scale: {cfg.trainer.eval_scale:g}: evaluates {field} "
                f"{smallest:g} at {evaluated} px; {name} needs images of at least {need} px"
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_value(src: str, field: str, name: str, value: Any) -> None:
    try:
        Hyperparams(**{name: value})
    except ValidationError as exc:
        msg = _f32_limit(str(exc.errors()[0]["msg"]), exc.errors()[0])
        raise ConfigError(f"{src}: {field}: {value!r}: {name}: {msg}") from exc


def _check_components(cfg: StudyConfig, src: str, stored: bool = False) -> None:
    """Build sampler and pruner once, then (a new study's file) run a few made-up trials
    through them, so that bad options fail at load time: Optuna checks many only when a
    trial asks or the pruner decides, which would fail every trial in every worker."""
    from hpsearch.study import RehearsalError, make_pruner, make_sampler, rehearse

    for section, make in (("sampler", make_sampler), ("pruner", make_pruner)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FutureWarning)
            try:
                make(cfg, quiet=False)
            except (TypeError, ValueError) as exc:
                opts = getattr(cfg, section).options
                raise ConfigError(f"{src}: {section}.options: {opts!r}: {exc}") from exc
        for w in caught:  # Optuna's deprecations: once, a file's (not a stored config's)
            if issubclass(w.category, FutureWarning):
                if stored:
                    continue
                said = " ".join(str(w.message).split()).split(" See https://")[0]
                warnings.warn(f"{src}: {section}.options: {said}", HpsearchWarning, stacklevel=2)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if stored:
        return
    _check_new_file(cfg, src)
    try:
        rehearse(cfg)
    except RehearsalError as exc:
        part = getattr(cfg, exc.section)
        cause = exc.__cause__
        if isinstance(cause, ImportError):
            raise ConfigError(
                f"{src}: {exc.section}.name: {part.name!r}: needs the Python package "
                f"{cause.name or cause}; pip install it"
            ) from exc
        raise ConfigError(
            f"{src}: {exc.section}.options: {part.options!r}: Optuna refused them at a "
            f"trial: {type(cause).__name__}: {' '.join(str(cause).split())}"
        ) from exc


# --- loading ---------------------------------------------------------------------------


def studies_dirs() -> list[Path]:
    """Where `--study NAME` looks: ./studies, then the studies shipped with the package."""
    dirs = [Path.cwd() / "studies"]
    try:
        shipped = resources.files("hpsearch.studies")
        dirs.append(Path(str(shipped)))
    except (ModuleNotFoundError, TypeError):
        pass
    return dirs


def is_shipped(path: Path) -> bool:
    """Whether a study file is one shipped with the package (not the user's own)."""
    shipped = studies_dirs()[1:]
    return any(path.resolve().parent == d.resolve() for d in shipped)


def available_studies() -> list[str]:
    names: set[str] = set()
    for d in studies_dirs():
        if d.is_dir():
            names |= {p.stem for p in d.glob("*.yaml")}
    return sorted(names)


def find_study_file(study: str) -> Path:
    p = Path(study)
    if p.suffix.lower() in (".yaml", ".yml") or os.sep in study or p.is_file():
        if p.is_dir():
            raise ConfigError(f"{study}: a folder, not a study file")
        if not p.is_file():
            # /dev/null, a FIFO: there, but no file to read (QA: "not found")
            raise ConfigError(
                f"{study}: not a regular file" if p.exists() else f"{study}: study file not found"
            )
        return p
    for d in studies_dirs():
        cand = d / f"{study}.yaml"
        if cand.is_file():
            return cand
    known = ", ".join(available_studies()) or "none"
    raise ConfigError(f"--study: {study!r}: no such study file; known studies: {known}")


def study_name(study: str) -> str:
    """The stored study a `--study` value names: a study file's `name` (a `.yaml`/`.yml`
    path, or a file that is there), as `launch` named the study it made from the file
    without a `--set name=`, else the value itself. Raises ConfigError for such a file that
    is missing or not valid."""
    p = Path(study)
    if not (p.suffix.lower() in (".yaml", ".yml") or p.is_file()):
        return study
    # Its name only: a file a launch took keeps being read so when a later version's rules
    # for new files would refuse it (the stored config is the study's).
    path = find_study_file(study)
    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:  # where, as a load says it (QA: the class's name alone)
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from exc
    except (UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"{path}: not a readable study file: {type(exc).__name__}") from exc
    name = raw.get("name", path.stem) if isinstance(raw, dict) else None
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}: name: {name!r}: not a study file's name")
    return name


class StudyLoader(yaml.SafeLoader):
    """PyYAML's safe loader with two habits of YAML 1.2 that study files rely on: a plain
    (unquoted) `1e-3` or `5e4` is a float, as YAML 1.2 reads it (YAML 1.1 needs a dot and a
    signed exponent; a quoted "1e3" stays a string), and a key given twice in one mapping
    is an error rather than the last one silently winning."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: its keys may be overridden here, as YAML allows
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


class StudyDumper(yaml.SafeDumper):
    """Writes what `StudyLoader` reads back the same: a string such as "1e3" is quoted."""


# YAML 1.2's exponent floats without a dot (`1e-3`, `.5e3`, `-2E+3`); YAML 1.1 needs the
# dot and a signed exponent (`1.0e-3`), which PyYAML's own resolver already reads.
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")
for _cls in (StudyLoader, StudyDumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+.0123456789"))


# YAML 1.2's booleans only: YAML 1.1 (PyYAML's default) also reads yes/no/on/off as true and
# false, so `fast_path: off` was False, and a choice `no` became a boolean. The dumper keeps
# YAML 1.1's, so it quotes "off": other readers of the stored config (yaml.safe_load, the
# study.yaml logged to MLflow) read it back as the string too.
_BOOL_TAG = "tag:yaml.org,2002:bool"
StudyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in StudyLoader.yaml_implicit_resolvers.items()
}
StudyLoader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    """A study file's or a --set value's YAML, read with `StudyLoader`."""
    return yaml.load(text, Loader=StudyLoader)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line, placed by line and column: PyYAML's own text names the
    stream `"<unicode string>"`, not the file, and runs over several lines."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem is None or mark is None:
        return " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" + (
        f" ({context})" if context else ""
    )


def params_from_json(text: str, option: str = "--params") -> dict[str, Any]:
    """Hyperparameters given on the command line as a JSON object, or one-line ConfigError."""
    shown = repr(text) if len(text) <= 200 else repr(text[:200]) + "..."

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # A key given twice: the last won without a word (as a study file's is refused).
        seen = [k for i, (k, _) in enumerate(pairs) if k in (p[0] for p in pairs[:i])]
        if seen:
            raise ConfigError(f"{option}: {shown}: key {seen[0]!r} given twice")
        return dict(pairs)

    try:
        params = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option}: {shown}: not valid JSON: {exc.msg}") from exc
    except (ValueError, RecursionError) as exc:  # a number of 4300+ digits, deep nesting
        first = str(exc).split(";")[0]
        raise ConfigError(f"{option}: {shown}: not valid JSON: {first}") from exc
    if not isinstance(params, dict):
        raise ConfigError(f"{option}: {shown}: must be a JSON object")
    return params


def parse_overrides(items: Iterable[str]) -> list[tuple[str, Any]]:
    """`key.sub=value` pairs; values are parsed as YAML (`2`, `1e-3`, `[a, b]`, `null`)."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set: {item!r}: expected key=value, e.g. budget.max_epochs=2")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"--set: {item!r}: value is not valid YAML: {yaml_problem(exc)}"
            ) from exc
        out.append((key.strip(), value))
    return out


def apply_overrides(raw: dict[str, Any], overrides: Sequence[tuple[str, Any]], src: str) -> None:
    """Set each dotted `key` to its value; `search_space.NAME=null` leaves NAME out of the
    search (the trainer's default is used), as deleting it from the file would."""
    for key, value in overrides:
        parts = key.split(".")
        if value is None and len(parts) == 2 and parts[0] == "search_space":
            space = raw.get("search_space")
            if not isinstance(space, dict) or parts[1] not in space:
                raise ConfigError(  # (always a --set's: a file has no other way to say it)
                    f"{src}: {key}: not searched here: nothing to leave out (from --set {key}=null)"
                )
            raw["search_space"] = {k: v for k, v in space.items() if k != parts[1]}
            continue
        node: Any = raw
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part) if isinstance(node, dict) else None
            if nxt is None:
                nxt = {}
            if not isinstance(nxt, dict):
                raise ConfigError(
                    f"{src}: {'.'.join(parts[: i + 1])}: {nxt!r}: --set {key} needs a mapping here"
                )
            # A copy on the way down: a YAML alias (`*a`) shares one mapping between fields,
            # and an override of one of them changed them all.
            nxt = dict(nxt)
            node[part] = nxt
            node = nxt
        node[parts[-1]] = value


def load_config(
    study: str | Path,
    overrides: Sequence[str] = (),
    data_dir: str | None = None,
    download: bool | None = None,
    lenient: bool = False,
) -> StudyConfig:
    """Read, override and validate a study file. Raises ConfigError with one line.
    `lenient`: spared the rules for new study files, as a study's stored config is (a file
    a launch already checked, or one a study was launched from before such a rule)."""
    path = find_study_file(str(study))
    src = str(path)
    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{src}: not valid YAML: {yaml_problem(exc)}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{src}: not UTF-8 text (byte {exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{src}: cannot read: {exc.strerror}") from exc
    if raw is None:
        raise ConfigError(f"{src}: empty: a study file needs at least `dataset`")
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: <root>: {type(raw).__name__}: must be a mapping")
    raw.setdefault("name", path.stem)
    return _build_config(raw, src, overrides, data_dir, download, stored=lenient, file=True)


def config_from_yaml(
    text: str,
    src: str,
    overrides: Sequence[str] = (),
    data_dir: str | None = None,
    download: bool | None = None,
) -> StudyConfig:
    """A study's config from YAML text (the resolved config a launch stores on its study),
    overridden and validated as `load_config` does a file, except for rules newer than the
    study may be (a float range of an integer hyperparameter, whose trials ran on whole
    steps). Raises ConfigError."""
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{src}: not valid YAML: {yaml_problem(exc)}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: <root>: {type(raw).__name__}: must be a mapping")
    raw.pop("source", None)  # where it was read from then
    return _build_config(raw, src, overrides, data_dir, download, stored=True)


def _build_config(
    raw: dict[str, Any],
    src: str,
    overrides: Sequence[str],
    data_dir: str | None,
    download: bool | None,
    stored: bool = False,
    file: bool = False,
) -> StudyConfig:
    """`stored`: spared the rules for new study files; `file`: read from a study file (its
    root is taken from the current folder, where a stored config's is its launch's)."""
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"{src}: {key!r}: unknown key")
    pairs = parse_overrides(overrides)
    if "source" in raw or any(k.split(".")[0].strip() == "source" for k, _ in pairs):
        # It is set here, to the file's path: a value given was silently replaced.
        raise ConfigError(f"{src}: source: unknown key (hpsearch sets it to the file's path)")
    apply_overrides(raw, pairs, src)
    # The data folder: --data-dir, then a --set of dataset.root,
    # then HPSEARCH_DATA_DIR, then the file (the README's order).
    env_dir = os.environ.get("HPSEARCH_DATA_DIR")
    set_root = any(
        key.strip() == "dataset.root"
        or (key.strip() == "dataset" and isinstance(value, dict) and "root" in value)
        for key, value in pairs
    )
    if isinstance(raw.get("dataset"), dict):
        given = data_dir or (env_dir if not set_root else None)
        if given:
            raw["dataset"]["root"] = given
        root = raw["dataset"].get("root")
        if isinstance(root, str) and root and (given or file):
            # From the folder it is given in (a stored config's root is its launch's): a
            # relative one stored on the study failed a `train --trial` or a worker started
            # in another folder (QA).
            raw["dataset"]["root"] = os.path.abspath(os.path.expanduser(root))
        if download is not None:
            raw["dataset"]["download"] = download
    raw["source"] = src
    try:
        return validate_config(raw, src, stored=stored)
    except ConfigError as exc:
        raise ConfigError(blame_override(str(exc), src, overrides)) from exc


def blame_override(message: str, src: str, overrides: Sequence[str]) -> str:
    """`message` (`<src>: <field>: ...`) with the --set that gave that field, when one did:
    the value is not in the file the message names."""
    head = f"{src}: "
    if not message.startswith(head):
        return message
    field = message[len(head) :].split(": ", 1)[0]
    for item in reversed(overrides):  # the last that sets the field gave its value
        key = item.partition("=")[0].strip()
        if field == key or field.startswith(key + ".") or key.startswith(field + "."):
            return f"{message} (from --set {item})"
    # A sibling's --set made the file's value wrong (search_space.lr.type=int: lr.low's
    # 0.001 is no whole number): named too, as what came after the file.
    parent = field.rpartition(".")[0]
    # (A top-level section's only where its name gives its options their meaning.)
    coupled = "." in parent or parent in ("sampler", "pruner")
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        if coupled and key.rpartition(".")[0] == parent:
            return f"{message} (after --set {item})"
    return message


def validate_config(
    raw: dict[str, Any], src: str = "<config>", stored: bool = False
) -> StudyConfig:
    """`raw` as a StudyConfig, or one-line ConfigError. `stored`: a config a study stored
    (see `config_from_yaml`)."""
    try:
        cfg = StudyConfig(**raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation(src, exc)) from exc
    _check_space(cfg, src, stored)
    _check_enqueue(cfg, src)
    _check_components(cfg, src, stored)
    return cfg


def config_to_yaml(cfg: StudyConfig, trial_only: bool = False) -> str:
    """The resolved study (defaults filled in), as logged next to each study. `trial_only`:
    without what does not change how a trial trains (where the data is, whether it may be
    downloaded, and the study's budget, given as 1), as each trial's config is recorded,
    so that a relaunch with another --trials or --data-dir records none anew."""
    data = cfg.model_dump(mode="json", exclude={"source"})
    if trial_only:
        data["dataset"].update(root=None, download=False)
        data["budget"]["n_trials"] = 1
    return yaml.dump(data, Dumper=StudyDumper, sort_keys=False)
