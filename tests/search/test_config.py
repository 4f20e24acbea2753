"""Study files: every class of mistake gets one line naming file, field, value and rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hpsearch.config import (
    available_studies,
    config_from_yaml,
    config_to_yaml,
    direction_note,
    load_config,
    load_yaml,
    parse_overrides,
    pruning_note,
)
from hpsearch.errors import ConfigError
from hpsearch.study import make_sampler
from pydantic import ValidationError

GOOD = {
    "name": "t",
    "dataset": {"name": "flowers102", "image_size": 32},
    "budget": {"n_trials": 3, "max_epochs": 2},
    "search_space": {
        "lr": {"type": "float", "low": 1.0e-3, "high": 0.5, "log": True},
        "loss": {"type": "categorical", "choices": ["ce", "focal"]},
        "focal_gamma": {"type": "float", "low": 0.5, "high": 3, "when": {"loss": "focal"}},
    },
}


def write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "study.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def load_with(tmp_path: Path, *sets: str) -> None:
    load_config(write(tmp_path, GOOD), list(sets))


def test_shipped_studies_load() -> None:
    names = available_studies()
    assert {"flowers102", "cifar10", "tiny"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert cfg.name == name
    flowers = load_config("flowers102")
    space = flowers.search_space
    assert space["lr"].log and space["label_smoothing"].when == {"loss": "label_smoothing"}
    assert set(space["loss"].choices) == {"ce", "label_smoothing"}
    assert {"arch", "image_size", "augment", "mixup_alpha"} <= set(space)  # a real search
    assert all(b & (b - 1) == 0 for b in space["batch_size"].choices)  # powers of two
    assert flowers.sampler.options["constant_liar"]  # packed workers ask concurrently
    assert flowers.trainer.checkpoint_every_s > 0


def test_good_file_and_overrides(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD), ["budget.max_epochs=5", "dataset.image_size=48",
                                              "search_space.lr.high=1e-1"])  # fmt: skip
    assert cfg.budget.max_epochs == 5 and cfg.dataset.image_size == 48
    assert cfg.search_space["lr"].high == pytest.approx(0.1)
    with pytest.raises(ValidationError):  # frozen
        cfg.budget.max_epochs = 3  # type: ignore[misc]


def test_data_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, {**GOOD, "dataset": {**GOOD["dataset"], "root": "/from/file"}})
    assert load_config(p).dataset.root == "/from/file"
    monkeypatch.setenv("HPSEARCH_DATA_DIR", "/from/env")
    assert load_config(p).dataset.root == "/from/env"  # as the README says: over the file
    assert load_config(write(tmp_path, GOOD)).dataset.root == "/from/env"
    assert load_config(p, ["dataset.root=/from/set"]).dataset.root == "/from/set"
    # A file without a dataset section, given one with --set, takes the variable too.
    (tmp_path / "bare").mkdir()
    bare = write(tmp_path / "bare", {k: v for k, v in GOOD.items() if k != "dataset"})
    sets = ["dataset.name=synthetic", "dataset.image_size=16"]
    assert load_config(bare, sets).dataset.root == "/from/env"
    assert load_config(p, data_dir="/from/cli").dataset.root == "/from/cli"
    # Relative: from the folder it was given in, so that the study's stored config holds
    # where the data is for a worker or `train --trial` started elsewhere (QA).
    monkeypatch.chdir(tmp_path)
    assert load_config(p, data_dir="rel").dataset.root == str(tmp_path / "rel")
    monkeypatch.setenv("HPSEARCH_DATA_DIR", "~/d")
    assert load_config(p).dataset.root == str(Path.home() / "d")
    monkeypatch.delenv("HPSEARCH_DATA_DIR")
    assert load_config(p, ["dataset.root=../up"]).dataset.root == str(tmp_path.parent / "up")
    # ... a file taken under the rules of its study's day too (review).
    lenient = load_config(p, ["dataset.root=data"], lenient=True).dataset.root
    assert lenient == str(tmp_path / "data")
    # A stored config's root is its launch's (an older study's relative one, as it was).
    stored = config_to_yaml(load_config(p, ["dataset.root=data"])).replace(
        str(tmp_path / "data"), "data"
    )
    assert config_from_yaml(stored, "stored").dataset.root == "data"
    assert config_from_yaml(stored, "stored", data_dir="here").dataset.root == str(
        tmp_path / "here"
    )


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["budget.bogus=1"], "budget.bogus: 1: unknown key"),
        (["colour=red"], "colour: 'red': unknown key"),
        (["budget.max_epochs=abc"], "budget.max_epochs: 'abc': must be a number, not a string"),
        (["budget.n_trials=0"], "budget.n_trials: 0: Input should be greater than or equal to 1"),
        (["search_space.lr.low=1"], "search_space.lr.low: 1.0: must be <= high (0.5)"),
        # Finite, but past float32: every trial failed at its first step (QA).
        (
            ["search_space.lr.high=1e300"],
            "search_space.lr.high: 1e+300: lr: Input should be less than or equal to 3.4e38 "
            "(float32's largest: a trial's first step fails past it)",
        ),
        (
            ["trainer.defaults.weight_decay=1e39"],
            "trainer.defaults.weight_decay: 1e+39: Input should be less than or equal to 3.4e38",
        ),
        (["search_space.lr.low=-1"], "search_space.lr.low: -1.0: log=True needs low > 0"),
        (["search_space.lr.type=floaty"], "search_space.lr.type: 'floaty'"),
        (
            ["search_space.loss.choices=[]"],
            "search_space.loss.choices: []: List should have at least 1 item",
        ),
        (
            ["search_space.loss.choices=[ce, hinge]"],
            "search_space.loss.choices: 'hinge': unknown loss; must be one of ce, label_smoothing, focal",
        ),
        (
            ["search_space.arch={type: categorical, choices: [resnet9]}"],
            "search_space.arch.choices: 'resnet9': unknown arch",
        ),
        (
            ["search_space.colour={type: float, low: 0, high: 1}"],
            "search_space.colour: 'colour': unknown hyperparameter",
        ),
        (
            ["search_space.focal_gamma.when={optimizer: sgd}"],
            "search_space.focal_gamma.when.optimizer: 'optimizer': a condition must name a categorical parameter declared earlier",
        ),
        (
            ["search_space.focal_gamma.when={loss: hinge}"],
            "search_space.focal_gamma.when.loss: 'hinge': not among the choices of loss",
        ),
        (["dataset.name=mnist"], "dataset.name: 'mnist': must be one of 'flowers102'"),
        (["sampler.name=bayes"], "sampler.name: 'bayes': must be one of 'tpe'"),
        (["pruner.name=magic"], "pruner.name: 'magic': must be one of 'median'"),
        (  # no per-epoch value of train_seconds to prune on
            ["objective.metric=train_seconds", "objective.direction=minimize"],
            "pruner.name: 'median': trials report val_acc or val_loss per epoch",
        ),
        (
            ["sampler.options={n_startup: 3}"],
            "sampler.options: {'n_startup': 3}: unknown option(s) n_startup for TPESampler",
        ),
        (
            ["pruner.options={warmup: 3}"],
            "pruner.options: {'warmup': 3}: unknown option(s) warmup for MedianPruner",
        ),
        # Optuna stores these unchecked and fails on them only when a worker asks.
        (
            ["sampler.options={n_startup_trials: abc}"],
            "sampler.options: {'n_startup_trials': 'abc'}: n_startup_trials: 'abc': must be int (TPESampler)",
        ),
        (
            ["sampler.options={multivariate: 'yes'}"],
            "multivariate: 'yes': must be bool or None (TPESampler)",
        ),
        (["sampler.options={n_startup_trials: true}"], "n_startup_trials: True: must be int"),
        (["sampler.options={n_startup_trials: 2.5}"], "n_startup_trials: 2.5: must be int"),
        (
            ["sampler.options={n_startup_trials: -3}"],
            "sampler.options.n_startup_trials: -3: must be >= 0",
        ),
        (  # the seed is offered as an option, then refused as one (QA)
            ["sampler={name: random, options: {n_startup_trials: 1}}"],
            "unknown option(s) n_startup_trials for RandomSampler; accepted: none (seed is "
            "sampler.seed)",
        ),
        (
            ["pruner.options={n_warmup_steps: 1.5}"],
            "n_warmup_steps: 1.5: must be int (MedianPruner)",
        ),
        (["trainer.defaults.loss=hinge"], "trainer.defaults.loss: 'hinge': must be one of 'ce'"),
        (
            ["search_space.lr.high=2e1", "search_space.lr.low=3e1"],
            "search_space.lr.low: 30.0: must be <= high (20.0)",
        ),
        (
            ["search_space.batch_size={type: int, low: 0, high: 8}"],
            "search_space.batch_size.low: 0: batch_size: Input should be greater than or equal to 1",
        ),
        (
            ["sampler.name=grid"],
            "search_space.lr.type: 'float': the grid sampler needs categorical",
        ),
        # YAML 1.1's `yes` was read as true, and pydantic made it 1.
        (["budget.max_epochs=yes"], "budget.max_epochs: 'yes': must be a number, not a string"),
        (["budget.max_epochs=true"], "budget.max_epochs: True: must be a number, not true/false"),
        (['budget.n_trials="30"'], "budget.n_trials: '30': must be a number, not a string"),
        (["trainer.defaults.batch_size=true"], "batch_size: True: must be a number"),
        (["trainer.defaults.weight_decay=.inf"], "weight_decay: inf: Input should be a finite"),
        (["search_space.lr.high=.nan"], "search_space.lr.high: nan: Input should be a finite"),
        (  # Optuna would draw 37.4, and every trial would fail on it
            ["search_space.batch_size={type: float, low: 16, high: 64}"],
            "search_space.batch_size.type: 'float': batch_size is a whole number",
        ),
        (
            ["search_space.batch_size={type: categorical, choices: [true, 64]}"],
            "search_space.batch_size.choices: True: batch_size must be a number",
        ),
        (["objective.metric=[]"], "objective.metric: []: needs at least one metric"),
        (["objective.metric=[val_acc, val_acc]"], "objective.metric: ['val_acc', 'val_acc']: a"),
        (  # pydantic's union member ("literal['val_acc',...]") is not part of the field
            ["objective.metric=accuracy"],
            "objective.metric: 'accuracy': must be one of 'val_acc', 'val_loss'",
        ),
        (
            # it went to both: train_seconds maximized, slow trials sought (QA)
            [
                "objective={metric: [val_acc, train_seconds], direction: maximize}",
                "pruner.name=none",
                "sampler.name=nsga2",
            ],
            "objective.direction: 'maximize': one direction for 2 metrics, and train_seconds "
            "would maximize too; give one per metric",
        ),
        (
            ["objective.metric=[val_acc, train_seconds]", "objective.direction=[maximize]"],
            "objective.direction: ['maximize']: needs 2 direction(s), one per objective.metric",
        ),
        # Batch norm cannot train on a batch of one image: every trial failed at its first step.
        (["trainer.defaults.batch_size=1"], "trainer.defaults.batch_size: 1: must be >= 2"),
        (["trainer.max_micro_batch=1"], "trainer.max_micro_batch: 1: must be >= 2"),
        (
            ["search_space.batch_size={type: categorical, choices: [1, 32]}"],
            "search_space.batch_size.choices: 1: must be >= 2: batch norm",
        ),
        (["dataset.num_classes=5"], "dataset.num_classes: 5: only the synthetic dataset takes it"),
        # numpy's seeds are < 2**32; torch failed on a larger trainer seed in every trial.
        (["sampler.seed=-1"], "sampler.seed: -1: Input should be greater than or equal to 0"),
        (["trainer.seed=99999999999999999999"], "trainer.seed: 99999999999999999999: Input"),
        # Each worker's sampler draws from its own seed, derived from sampler.seed; a fixed
        # option made them all propose the same parameters.
        (["sampler.options={seed: 7}"], "sampler.options.seed: 7: not an option here: set sampler"),
        # A sampler or pruner option Optuna takes but fails on at a trial: found by the
        # made-up trials at load, not in every worker.
        (
            ["sampler.options={n_ei_candidates: 0}"],
            "sampler.options: {'n_ei_candidates': 0}: Optuna refused them at a trial: ValueError",
        ),
        (
            ["pruner={name: hyperband, options: {reduction_factor: 1}}"],
            "pruner.options.reduction_factor: 1: must be >= 2",
        ),
        (
            ["pruner={name: hyperband, options: {min_resource: 2, max_resource: 1}}"],
            "pruner.options.min_resource: 2: must be <= max_resource (1)",
        ),
        (
            ["search_space.loss.choices=[ce, focal, ce]"],
            "search_space.loss.choices: 'ce': given twice",
        ),
        # ConvNeXt's downsamplings fail on smaller images, in every trial that drew both.
        (
            ["dataset.image_size=16", "trainer.defaults.arch=convnext_tiny"],
            "dataset.image_size: 16: convnext_tiny needs images of at least 32 px",
        ),
        (
            [
                "search_space.arch={type: categorical, choices: [resnet18, convnext_tiny]}",
                "search_space.image_size={type: categorical, choices: [24, 64]}",
            ],
            "search_space.image_size.choices: 24: convnext_tiny needs images of at least 32 px",
        ),
        (
            ["search_space.focal_gamma.when={loss: []}"],
            "search_space.focal_gamma.when.loss: []: needs at least one value",
        ),
        (  # momentum needs loss focal, and optimizer (which it names) exists only with ce
            [
                "search_space.optimizer={type: categorical, choices: [sgd, adamw], when: {loss: ce}}",
                "search_space.momentum={type: float, low: 0.5, high: 0.9, "
                "when: {optimizer: sgd, loss: focal}}",
            ],
            "search_space.momentum.when: {'optimizer': 'sgd', 'loss': 'focal'}: can never hold: "
            "its when needs loss in ['focal'], optimizer (sampled only then) needs it in ['ce']",
        ),
    ],
)
def test_bad_study_files(tmp_path: Path, sets: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_with(tmp_path, *sets)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(str(tmp_path / "study.yaml") + ": "), msg
    assert expected in msg, msg
    if any(expected.startswith(s.partition("=")[0]) for s in sets):  # the field was --set
        assert msg.endswith(tuple(f"(from --set {s})" for s in sets)), msg  # not in the file


def test_a_sibling_set_that_made_a_file_value_wrong_is_named(tmp_path: Path) -> None:
    """`--set search_space.lr.type=int` made the file's `lr.low: 0.001` wrong: the message
    named the file's field alone, and not the --set that did it (QA)."""
    from hpsearch.config import blame_override

    src = str(tmp_path / "study.yaml")
    msg = f"{src}: search_space.lr.low: 0.001: Input should be a valid integer"
    sets = ["budget.n_trials=3", "search_space.lr.type=int"]
    assert blame_override(msg, src, sets) == f"{msg} (after --set search_space.lr.type=int)"
    # a top-level section is no sibling: budget.max_epochs did not make dataset.x wrong
    other = f"{src}: budget.n_trials: 0: must be >= 1"
    assert blame_override(other, src, ["budget.max_epochs=3"]) == other


def test_a_missing_section_is_named_without_the_dict_around_it(tmp_path: Path) -> None:
    p = tmp_path / "nodata.yaml"
    p.write_text("name: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert str(info.value) == f"{p}: dataset: missing: a required key"
    p.write_text("# nothing yet\n")  # said as such, not as a missing section (QA)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert str(info.value) == f"{p}: empty: a study file needs at least `dataset`"


@pytest.mark.parametrize(
    "sets",
    [
        [],  # TPE, median
        ["sampler={name: tpe, options: {multivariate: true, group: true, constant_liar: true}}"],
        ["sampler.name=random", "pruner={name: hyperband, options: {reduction_factor: 2}}"],
        ["sampler.name=gp", "pruner.name=asha"],
        ["sampler.name=cmaes", "pruner.name=successive_halving"],
        ["sampler.name=nsga2", "objective.metric=[val_acc, train_seconds]", "pruner.name=none"],
        [
            "sampler.name=grid",
            "search_space.lr={type: float, low: 0.1, high: 0.3, step: 0.1}",
            # no `when` (refused with a grid): every point is its own configuration
            "search_space.focal_gamma={type: float, low: 0.5, high: 3, step: 0.5}",
        ],
        [  # nested conditions that can hold: momentum with loss focal, optimizer sgd
            "search_space.optimizer={type: categorical, choices: [sgd, adamw], "
            "when: {loss: [ce, focal]}}",
            "search_space.momentum={type: float, low: 0.5, high: 0.9, "
            "when: {optimizer: sgd, loss: focal}}",
        ],
        [  # conditions compare as `suggest` does (==): 0 and 0.0 are one value
            "search_space.mixup_alpha={type: categorical, choices: [0, 0.2]}",
            "search_space.cutmix_alpha={type: categorical, choices: [0.0, 1.0], "
            "when: {mixup_alpha: 0}}",
            "search_space.warmup_epochs={type: float, low: 0.1, high: 1.0, "
            "when: {mixup_alpha: 0.0, cutmix_alpha: 1.0}}",
        ],
        ["pruner.options={n_warmup_steps: 2}"],  # decides at the last epoch: none pruned
        ["pruner={name: hyperband, options: {min_resource: 10}}"],  # prunes none: a note
    ],
)
def test_every_sampler_and_pruner_passes_its_made_up_trials_quietly(
    tmp_path: Path, sets: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    """The load's made-up trials pass every sampler and pruner with good options, fast and
    without a line of output (no "A new study created", no independent-sampling notice)."""
    import time

    t0 = time.process_time()  # this process's CPU: another test process's load not counted
    load_with(tmp_path, *sets)
    spent = time.process_time() - t0
    assert spent < 5.0, spent  # s; GP's model is not fitted (seconds of torch)
    out, err = capfd.readouterr()
    assert "study created" not in out + err and "independent" not in out + err, out + err


@pytest.mark.parametrize(
    ("sets", "note"),
    [
        (["budget.n_trials=10"], None),  # median, n_warmup_steps 1: decides from epoch 1
        (  # QA: its 3 start-up trials are the whole budget
            [],
            "pruner.options.n_startup_trials: 3: at or past budget.n_trials (3): the pruner "
            "judges no trial before the budget is spent",
        ),
        (  # at the last epoch, where no trial is pruned (it has trained to its end)
            ["pruner.options={n_warmup_steps: 2}"],
            "pruner.options.n_warmup_steps: 2: the pruner's first decision comes at epoch 2, "
            "at budget.max_epochs (2), whose trials have trained to their end: no trial will "
            "be pruned",
        ),
        (["pruner.options={n_warmup_steps: 2}", "budget.max_epochs=3", "budget.n_trials=10"], None),
        (  # review: reports come at evaluations only
            ["trainer.eval_every=2"],
            "trainer.eval_every: 2: a trial's only report comes at budget.max_epochs (2)",
        ),
        (
            ["pruner.options={n_warmup_steps: 3}"],
            "pruner.options.n_warmup_steps: 3: the pruner's first decision comes at epoch 3, "
            "after budget.max_epochs (2), whose trials have trained to their end: no trial "
            "will be pruned",
        ),
        (
            ["pruner={name: asha, options: {min_resource: 1, min_early_stopping_rate: 1}}"],
            "pruner.options.min_resource: 1: the pruner's first decision comes at epoch 3",
        ),
        (  # flowers102's Hyperband on a quick run
            ["pruner={name: hyperband, options: {min_resource: 10}}"],
            "pruner.options.min_resource: 10: the pruner's first decision comes at epoch 10",
        ),
        (
            ["pruner={name: hyperband, options: {max_resource: 5}}"],
            "pruner.options.max_resource: 5: above budget.max_epochs (2): Hyperband's brackets",
        ),
        (["pruner={name: hyperband, options: {max_resource: 2}}"], None),
        (["pruner.name=none"], None),
    ],
)
def test_a_pruner_that_prunes_nothing_in_the_budget_gets_a_note(
    tmp_path: Path, sets: list[str], note: str | None
) -> None:
    """Not an error: a quick run of a long study (--set budget.max_epochs=2) is fine
    unpruned; `launch` prints the note."""
    got = pruning_note(load_config(write(tmp_path, GOOD), sets))
    assert got == note if note is None else (got is not None and got.startswith(note)), got


def test_a_parameter_read_where_its_governing_choice_is_not_drawn_is_accepted(
    tmp_path: Path,
) -> None:
    """Review: a searched loss under a `when` of its own leaves the trials it is not drawn
    in at the default loss, which may read the parameter: that was refused as never read."""
    space = {
        "batch_size": {"type": "categorical", "choices": [32, 64]},
        "loss": {"type": "categorical", "choices": ["ce", "focal"], "when": {"batch_size": 64}},
        "label_smoothing": {"type": "float", "low": 0.05, "high": 0.2},
    }
    data = {**GOOD, "search_space": space,
            "trainer": {"defaults": {"loss": "label_smoothing"}}}  # fmt: skip
    load_config(write(tmp_path, data))
    with pytest.raises(ConfigError, match="label_smoothing: searched but never read"):
        load_config(write(tmp_path, {**data, "trainer": {"defaults": {"loss": "ce"}}}))


def test_a_set_that_made_the_files_pruner_options_wrong_is_named_with_the_way_out() -> None:
    """QA: no word of the --set that made the file's options wrong, nor of the way out."""
    with pytest.raises(ConfigError) as info:
        load_config("tiny", ["pruner.name=none"])
    assert str(info.value).endswith(
        "pruner 'none' takes no options: make pruner.options {} (after --set pruner.name=none)"
    ), info.value


def test_a_warm_up_as_long_as_the_budget_gets_a_note(tmp_path: Path) -> None:
    """QA: `warmup_epochs: 10` with `max_epochs: 3` trained without a word; the learning
    rate only ever ramps up."""
    from hpsearch.config import warmup_note

    note = warmup_note(load_config(write(tmp_path, GOOD), ["trainer.defaults.warmup_epochs=2"]))
    assert note == (
        "trainer.defaults.warmup_epochs: 2: at or past budget.max_epochs (2): the learning "
        "rate only ramps up"
    )
    assert warmup_note(load_config(write(tmp_path, GOOD))) is None  # 1 of 2 epochs
    searched = ["search_space.warmup_epochs={type: float, low: 3, high: 5}"]
    assert "search_space.warmup_epochs.low: 3.0: at or past" in str(
        warmup_note(load_config(write(tmp_path, GOOD), searched))
    )


def test_a_bad_value_from_the_file_itself_names_no_override(tmp_path: Path) -> None:
    bad = {**GOOD, "budget": {"n_trials": 0, "max_epochs": 2}}
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, bad), ["budget.max_epochs=3", "search_space.lr.high=0.4"])
    assert str(info.value).endswith(
        "budget.n_trials: 0: Input should be greater than or equal to 1"
    )


def test_yaml_reads_plain_exponents_as_floats_keeps_quoted_strings_and_refuses_duplicates(
    tmp_path: Path,
) -> None:
    assert load_yaml("a: 1e-3\nb: '1e3'\nc: 5e4\nd: [1.0e5, e5]\n") == {
        "a": 0.001,
        "b": "1e3",
        "c": 50000.0,
        "d": [100000.0, "e5"],
    }
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump(GOOD, sort_keys=False) + 'description: "1e3"\n')
    assert load_config(study).description == "1e3"  # quoted: a string, as written
    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump(GOOD, sort_keys=False) + "budget: {max_epochs: 3}\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: not valid YAML: duplicate key 'budget'"):
        load_config(twice)
    with pytest.raises(ConfigError, match=r"--set: .*duplicate key 'a'"):
        load_with(tmp_path, "search_space.lr={a: 1, a: 2}")
    assert load_yaml(".5e3: x\ny: [-.5e-3, +.5e3, '.5e3', 1_000]\n") == {
        500.0: "x",
        "y": [-0.0005, 500.0, ".5e3", 1000],
    }
    # A merge key's entries may be overridden after it, as YAML allows.
    assert load_yaml("b: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n")["c"] == {"x": 1, "y": 3}
    # What the launcher writes for its workers reads back the same: "1e3" stays a string.
    assert load_yaml(config_to_yaml(load_config(study)))["description"] == "1e3"
    # An int option written as a whole float is that int.
    cfg = load_config(write(tmp_path, GOOD), ["sampler.options={n_startup_trials: 1e1}"])
    assert make_sampler(cfg)._n_startup_trials == 10  # type: ignore[attr-defined]


def test_a_metric_without_a_direction_goes_its_own_way_and_only_true_false_are_booleans(
    tmp_path: Path,
) -> None:
    """A val_loss study with no direction maximized its loss: Optuna kept the worst trials
    and the pruner stopped the best. YAML 1.1 read `off` as false, which fast_path refused."""
    assert load_config(write(tmp_path, GOOD)).objective.directions == ("maximize",)
    loss = load_config(write(tmp_path, GOOD), ["objective={metric: val_loss}"])
    assert loss.objective.directions == ("minimize",)
    both = load_config(
        write(tmp_path, GOOD),
        ["objective={metric: [val_acc, train_seconds]}", "sampler.name=nsga2", "pruner.name=none"],
    )
    assert both.objective.directions == ("maximize", "minimize")
    given = load_config(
        write(tmp_path, GOOD), ["objective={metric: val_loss, direction: maximize}"]
    )
    assert given.objective.directions == ("maximize",)  # as written
    # ... and a launch says so (QA: `best 63.99` without a word).
    assert direction_note(given) == (
        "objective.direction: val_loss maximized: the worst trials rank best (each metric's "
        "own direction is taken when none is given)"
    )
    assert direction_note(loss) is None and direction_note(both) is None
    assert load_config(write(tmp_path, GOOD), ["budget.n_trials=1e2"]).budget.n_trials == 100
    assert load_config(write(tmp_path, GOOD), ["dataset.fast_path=off"]).dataset.fast_path == "off"
    assert load_yaml("a: [yes, no, on, off, true, False, TRUE]") == {
        "a": ["yes", "no", "on", "off", True, False, True]
    }
    assert load_yaml(config_to_yaml(loss))["objective"]["direction"] is None  # reads back
    # The stored config reads back the same with any YAML reader: "off" is quoted.
    off = load_config(write(tmp_path, GOOD), ["dataset.fast_path=off"])
    assert yaml.safe_load(config_to_yaml(off))["dataset"]["fast_path"] == "off"
    assert config_from_yaml(config_to_yaml(off), "stored").dataset.fast_path == "off"


def test_a_stored_config_keeps_loading_under_rules_newer_than_its_study(tmp_path: Path) -> None:
    """A study stored with a float range of batch_size (whole steps: its trials ran) still
    loads for `train --trial N` and load_best_model; a file with it is refused."""
    stepped = ["search_space.batch_size={type: float, low: 32, high: 64, step: 32}"]
    with pytest.raises(ConfigError, match="batch_size is a whole number"):
        load_with(tmp_path, *stepped)
    raw = yaml.safe_load(config_to_yaml(load_config(write(tmp_path, GOOD))))
    raw["search_space"]["batch_size"] = {"type": "float", "low": 32, "high": 64, "step": 32}
    cfg = config_from_yaml(yaml.safe_dump(raw, sort_keys=False), "study t")
    assert cfg.resolve_params({"batch_size": 64.0}).batch_size == 64
    # Nor do the later rules of the file alone (its trials ran under those of their day):
    # a choice given twice, a `when` that never holds, a sampler seed option, a batch of 1.
    raw["search_space"]["loss"]["choices"] = ["ce", "focal", "ce"]
    raw["search_space"]["focal_gamma"]["when"] = {"loss": []}
    raw["sampler"]["options"] = {"seed": 3}
    raw["search_space"]["batch_size"] = {"type": "int", "low": 1, "high": 64}
    raw["dataset"]["num_classes"] = 5
    cfg = config_from_yaml(yaml.safe_dump(raw, sort_keys=False), "study t")
    assert cfg.search_space["loss"].choices == ["ce", "focal", "ce"]  # type: ignore[union-attr]


def test_option_types_leave_richer_annotations_and_fitting_values_alone() -> None:
    from hpsearch.study import check_option

    assert check_option("int", 3) == 3
    assert check_option("int", 1e1) == 10 and isinstance(check_option("int", 1e1), int)
    assert check_option("float | None", 2) == 2  # an int is a float
    assert check_option("float | None", None) is None
    assert check_option("str | int", "auto") == "auto"
    assert check_option(int, 3) == 3
    assert check_option("Callable[[int], int] | None", "x") == "x"  # left to the class
    assert check_option("dict[str, Any] | None", 3) == 3
    for annotation, value, rule in (
        (int, "3", "must be int"),
        ("bool", 1, "must be bool"),
        ("int", 2.5, "must be int"),
        ("bool | None", "yes", "must be bool or None"),
    ):
        with pytest.raises(TypeError, match=rf": {rule}$"):
            check_option(annotation, value)


def test_unreadable_and_unknown_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML") as info:
        load_config(bad)
    # Placed in the file, not in PyYAML's "<unicode string>".
    assert str(info.value).endswith(
        "but got '<stream end>' at line 2, column 1 (while parsing a flow sequence)"
    ), info.value
    with pytest.raises(
        ConfigError, match=r"--study: 'nosuch': no such study file; known studies: .*flowers102"
    ):
        load_config("nosuch")
    with pytest.raises(ConfigError, match=r"missing.yaml: study file not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "folder.yaml").mkdir()
    for folder in (tmp_path, tmp_path / "folder.yaml"):
        with pytest.raises(ConfigError, match=r": a folder, not a study file$"):
            load_config(folder)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("description: Blüten\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin.yaml: not UTF-8 text \(byte 15\)$"):
        load_config(latin)
    numbered = tmp_path / "numbered.yaml"
    numbered.write_text("1: foo\nname: x\n")
    with pytest.raises(ConfigError, match=r"numbered.yaml: 1: unknown key$"):
        load_config(numbered)


def test_parse_overrides_types() -> None:
    assert parse_overrides(["a.b=2", "c=1e-3", "d=[x, y]", "e=null", "f=true"]) == [
        ("a.b", 2), ("c", 0.001), ("d", ["x", "y"]), ("e", None), ("f", True)
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["novalue"])


def test_shipped_studies_found_outside_the_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert {"flowers102", "cifar10", "tiny"} <= set(available_studies())
    assert load_config("tiny").name == "tiny"


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        # Optuna draws low every time: a parameter searched in name only.
        (
            ["search_space.lr={type: float, low: 0.1, high: 0.2, step: 0.5}"],
            r"search_space.lr.step: 0.5: must be <= high - low \(0.1\)",
        ),
        (
            ["search_space.batch_size={type: int, low: 16, high: 20, step: 32}"],
            r"search_space.batch_size.step: 32: must be <= high - low \(4\)",
        ),
        # Grid points that differ only in a parameter not sampled train one configuration.
        (
            [
                "sampler.name=grid",
                "search_space.lr={type: float, low: 0.1, high: 0.2, step: 0.1}",
                "search_space.focal_gamma={type: float, low: 1, high: 2, step: 1, when: {loss: focal}}",
                "budget.n_trials=2",
            ],
            r"search_space.focal_gamma.when: .*the grid sampler",
        ),
        # Smaller stored images are scaled up: the trials train on blur.
        (
            ["dataset.cache_size=16"],
            r"dataset.cache_size: 16: must be >= the largest image size trained \(32, dataset",
        ),
        (
            [
                "dataset.cache_size=40",
                "search_space.image_size={type: categorical, choices: [32, 64]}",
            ],
            r"\(64, search_space.image_size.choices\)",
        ),
        # Evaluated above the stored size: val and test scaled up, unlike training.
        (
            ["dataset.cache_size=40", "trainer.eval_scale=1.5"],
            r"trainer.eval_scale: 1.5: evaluates the largest image size trained \(32, "
            r"dataset.image_size\) at 48 px, above dataset.cache_size \(40\)",
        ),
        (
            ["trainer.eval_scale=1.2"],
            r"trainer.eval_scale: 1.2: must be <= 8/7 without a dataset.cache_size",
        ),
        # ConvNeXt fails at its first validation below 32 px, after a whole epoch of training.
        (
            ["trainer.defaults.arch=convnext_tiny", "trainer.eval_scale=0.5"],
            r"trainer.eval_scale: 0.5: evaluates dataset.image_size 32 at 16 px; convnext_tiny "
            r"needs images of at least 32 px",
        ),
        # CMA-ES proposed NaN from its second generation on; sigma0 <= 0 froze it.
        (
            [
                "sampler={name: cmaes, options: {sigma0: .inf}}",
                "search_space.focal_gamma=null",
                "search_space.loss={type: categorical, choices: [ce]}",
            ],
            r"sampler.options.sigma0: inf: must be finite",
        ),
        (
            ["sampler={name: cmaes, options: {sigma0: 0}}"],
            r"sampler.options.sigma0: 0: must be > 0",
        ),
        # Optuna checks these at a trial's first report ("float division by zero").
        (
            ["pruner={name: hyperband, options: {reduction_factor: 1}}"],
            r"pruner.options.reduction_factor: 1: must be >= 2",
        ),
        (
            ["pruner={name: hyperband, options: {min_resource: 0}}"],
            r"pruner.options.min_resource: 0: must be >= 1",
        ),
        # It said "Input should be a valid string": numbers are choices too.
        (
            ["search_space.batch_size={type: categorical, choices: [[32], 64]}"],
            r"choices.0: \[32\]: a choice must be a string, a number, true, false or null",
        ),
        # Lax booleans: 1, "yes" and "true" were true; only true and false are booleans.
        (["trainer.compile=1"], r"trainer.compile: 1: must be true or false"),
        (["tracking.onnx=yes"], r"tracking.onnx: 'yes': must be true or false"),
        # Set by hpsearch to the file's path: a value given was silently replaced.
        (["source=/x.yaml"], r"source: unknown key \(hpsearch sets it"),
        # It names files: the error blamed --workdir ("File name too long").
        ([f"name={'a' * 201}"], r"name: a{20}\.\.\. \(201 characters\): must be at most 200"),
        # QA: accepted; a value given twice in a `when` is a typo for another, as a choice.
        (["search_space.focal_gamma.when={loss: [focal, focal]}"], r"when.loss: 'focal': given"),
        # QA: searched dimensions the trainer never reads under their `when` or the study.
        (
            [
                "search_space.label_smoothing={type: float, low: 0.05, high: 0.2, "
                "when: {loss: focal}}"
            ],
            r"search_space.label_smoothing: searched but never read: the trainer reads it only "
            r"with loss label_smoothing, which no trial of this study has under its when",
        ),
        (
            [
                "trainer.defaults.optimizer=adamw",
                "search_space.momentum={type: float, low: 0.8, high: 0.99}",
            ],
            r"search_space.momentum: searched but never read: .* only with optimizer sgd",
        ),
        (
            [
                "trainer.defaults.augment=flip",
                "search_space.augment_strength={type: float, low: 0.1, high: 1.0}",
            ],
            r"augment_strength: searched but never read: .* other than none and flip",
        ),
    ],
)
def test_a_search_that_would_waste_or_fail_its_trials_is_refused_at_load(
    tmp_path: Path, sets: list[str], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_with(tmp_path, *sets)


def test_an_override_through_a_yaml_alias_changes_that_field_only(tmp_path: Path) -> None:
    """`--set` wrote into the mapping an alias shares, and so changed every field using it."""
    study = tmp_path / "alias.yaml"
    study.write_text(
        "name: alias\ndataset: {name: flowers102, image_size: 32}\nsearch_space:\n"
        "  mixup_alpha: &a {type: float, low: 0.0, high: 0.4}\n  cutmix_alpha: *a\n"
    )
    cfg = load_config(study, ["search_space.mixup_alpha.high=1.0"])
    assert cfg.search_space["mixup_alpha"].high == 1.0  # type: ignore[union-attr]
    assert cfg.search_space["cutmix_alpha"].high == 0.4  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["enqueue_trials=[{lr: 0.01, bogus: 1}]"],
         "enqueue_trials[0].bogus: 1: unknown hyperparameter; searched: lr, loss, focal_gamma"),
        (["enqueue_trials=[{momentum: 0.8}]"],
         "enqueue_trials[0].momentum: 0.8: not searched here: set it in trainer.defaults.momentum"),
        (["enqueue_trials=[{lr: 0.9}]"], "enqueue_trials[0].lr: 0.9: outside its range 0.001..0.5"),
        (["enqueue_trials=[{lr: fast}]"], "enqueue_trials[0].lr: 'fast': must be a number"),
        (["enqueue_trials=[{lr: true}]"], "enqueue_trials[0].lr: True: must be a number"),
        (["enqueue_trials=[{loss: label_smoothing}]"],
         "enqueue_trials[0].loss: 'label_smoothing': not among its choices ['ce', 'focal']"),
        # A value its trial would never use (focal_gamma is drawn only under loss focal)
        (["enqueue_trials=[{focal_gamma: 2.0}]"],
         "enqueue_trials[0].focal_gamma: 2.0: drawn only when loss is one of ['focal'], and "
         "this trial gives no loss"),
        (["enqueue_trials=[{loss: ce, focal_gamma: 2.0}]"],
         "enqueue_trials[0].focal_gamma: 2.0: drawn only when loss is one of ['focal'], and "
         "this trial gives loss: 'ce'"),
        (["enqueue_trials=[{lr: 0.1}, {}]"], "enqueue_trials[1]: {}: gives no parameter"),
        (["enqueue_trials=[{lr: 0.1}, {lr: 0.1}]"],
         "enqueue_trials[1]: {'lr': 0.1}: the same trial as enqueue_trials[0]"),
        (["enqueue_trials={lr: 0.1}"], "enqueue_trials: {'lr': 0.1}: Input should be a valid list"),
        (["search_space.batch_size={type: int, low: 16, high: 64, step: 16}",
          "enqueue_trials=[{batch_size: 40}]"],
         "enqueue_trials[0].batch_size: 40: not on its steps: 16 + k * 16"),
        (["search_space.batch_size={type: int, low: 16, high: 64}",
          "enqueue_trials=[{batch_size: 32.5}]"],
         "enqueue_trials[0].batch_size: 32.5: must be a whole number"),
        # Optuna's GridSampler marks no point visited for it, and hands trial n point n: a
        # point trained twice, another never.
        (["sampler.name=grid", "sampler.options={}", "budget.n_trials=2",
          "search_space={lr: {type: categorical, choices: [0.1, 0.2]}}",
          "enqueue_trials=[{lr: 0.1}]"],
         "enqueue_trials[0]: {'lr': 0.1}: the grid sampler trains every point of its grid once"),
        (["enqueue_trials=[{lr: .nan}]"], "enqueue_trials[0].lr: nan: must be finite"),
        ([f"enqueue_trials=[{{lr: 1{'0' * 400}}}]"], "outside its range 0.001..0.5"),
        (["search_space.warmup_epochs={type: int, low: 0, high: 3}",
          f"enqueue_trials=[{{warmup_epochs: 1{'0' * 400}}}]"], "outside its range 0..3"),
    ],
)  # fmt: skip
def test_an_enqueued_trial_its_study_could_not_run_as_given_is_refused(
    tmp_path: Path, sets: list[str], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_with(tmp_path, *sets)
    assert expected in str(info.value), str(info.value)
    assert str(info.value).startswith(str(tmp_path / "study.yaml") + ": ")


def test_enqueued_trials_are_given_to_optuna_as_their_trials_draw_them(tmp_path: Path) -> None:
    from hpsearch.config import enqueued_trials

    cfg = load_config(
        write(tmp_path, GOOD),
        ["search_space.lr.high=2", "search_space.batch_size={type: categorical, choices: [2, 4]}",
         "enqueue_trials=[{lr: 1, loss: focal, focal_gamma: 3}, {batch_size: 2}, {lr: 0.5}]"],
    )  # fmt: skip
    seeds = enqueued_trials(cfg)
    assert seeds == [{"lr": 1.0, "loss": "focal", "focal_gamma": 3.0}, {"batch_size": 2},
                     {"lr": 0.5}]  # fmt: skip
    # a float parameter's value is a float (Optuna's skip_if_exists compares types)
    assert type(seeds[0]["lr"]) is float and type(seeds[0]["focal_gamma"]) is float
    # and the config keeps them as written, to store on the study
    assert config_from_yaml(config_to_yaml(cfg), "s").enqueue_trials == cfg.enqueue_trials
    # a bool is not the choice 1
    with pytest.raises(ConfigError, match=r"mixup_alpha: True: not among its choices \[0, 1\]"):
        load_config(
            write(tmp_path, GOOD),
            ["search_space.mixup_alpha={type: categorical, choices: [0, 1]}",
             "enqueue_trials=[{mixup_alpha: true}]"],
        )  # fmt: skip


def test_enqueued_values_may_be_numpy_scalars_as_best_trials_gives_them_back() -> None:
    import numpy as np
    from hpsearch.config import check_enqueued

    cfg = load_config("tiny", ["search_space.batch_size={type: int, low: 16, high: 64}"])
    got = check_enqueued(cfg, {"batch_size": np.int64(64), "lr": np.float64(0.1)}, "params")
    assert got == {"batch_size": 64, "lr": 0.1}
    assert type(got["batch_size"]) is int and type(got["lr"]) is float
    with pytest.raises(ConfigError, match=r"params.batch_size: np.float64\(64.0\): must be a "
                                          "whole number"):  # fmt: skip
        check_enqueued(cfg, {"batch_size": np.float64(64.0)}, "params")
    with pytest.raises(ConfigError, match=r"params.lr: np.True_: must be a number"):
        check_enqueued(cfg, {"lr": np.bool_(True)}, "params")


def test_params_on_the_command_line_are_a_json_object_or_one_short_line() -> None:
    from hpsearch.config import params_from_json

    assert params_from_json('{"lr": 0.1}') == {"lr": 0.1}
    for text, shown in (
        ("{bad", "not valid JSON: Expecting property name"),
        ("[1]", "must be a JSON object"),
        ('{"lr": 1' + "0" * 5000 + "}", "not valid JSON: Exceeds the limit"),  # a number
        ("[" * 100_000, "not valid JSON: maximum recursion depth"),
        ('{"lr": 0.01, "lr": 0.02}', "key 'lr' given twice"),  # the last won (QA)
    ):
        with pytest.raises(ConfigError) as info:
            params_from_json(text)
        msg = str(info.value)
        assert msg.startswith("--params: ") and shown in msg and "\n" not in msg, msg
        assert len(msg) < 400, len(msg)  # the argument cut short


def test_a_searched_parameter_is_left_out_with_a_null_set() -> None:
    """`--set search_space.momentum=null` was a "valid dictionary" error: no --set could
    take a parameter out of a shipped study's search (QA)."""
    cfg = load_config("tiny", ["search_space.focal_gamma=null"])
    assert "focal_gamma" not in cfg.search_space and "loss" in cfg.search_space
    assert load_config("tiny").search_space.keys() > cfg.search_space.keys()  # the file's
    with pytest.raises(ConfigError, match=r"search_space.nope: not searched here: nothing to"):
        load_config("tiny", ["search_space.nope=null"])
    # a parameter another's `when` names stays needed: the rule says so
    with pytest.raises(ConfigError, match=r"label_smoothing.when.loss: 'loss': a condition"):
        load_config("tiny", ["search_space.loss=null"])
    # null is still a value elsewhere: a data folder left to --data-dir
    assert load_config("tiny", ["dataset.root=null"]).dataset.root is None


def test_a_stored_config_with_a_negative_count_still_loads() -> None:
    """A negative count is refused in a new study file only: a study's stored config that an
    earlier version ran with must keep loading (best model, enqueue, train --trial)."""
    from hpsearch.config import config_from_yaml, config_to_yaml

    text = config_to_yaml(load_config("tiny"))
    text = text.replace("    n_startup_trials: 2\n", "    n_startup_trials: -1\n", 1)
    assert "n_startup_trials: -1" in text
    assert config_from_yaml(text, "stored").sampler.options == {"n_startup_trials": -1}
    with pytest.raises(ConfigError, match="n_startup_trials: -1: must be >= 0"):
        load_config("tiny", ["sampler.options.n_startup_trials=-1"])


def test_one_direction_for_several_metrics_that_all_go_that_way_is_taken() -> None:
    """The rule refuses a direction some metric would go against, not one they all share."""
    cfg = load_config("tiny", ["objective={metric: [val_loss, train_seconds], direction: minimize}",
                               "pruner={name: none}", "sampler={name: nsga2}"])  # fmt: skip
    assert cfg.objective.directions == ("minimize", "minimize")


def test_an_option_optuna_deprecated_is_one_warning_at_load_naming_the_field(
    tmp_path: Path,
) -> None:
    """`sampler.options.sigma0` (deprecated by Optuna 4.9) printed Optuna's raw two-line
    FutureWarning at every load and in every worker's log. Now the load warns once, as
    the study file's field; building the sampler (each worker) is quiet."""
    import subprocess
    import sys
    import warnings

    from hpsearch.config import find_study_file
    from hpsearch.errors import HpsearchWarning

    sets = ["sampler={name: cmaes, seed: 0, options: {sigma0: 0.2}}"]
    with pytest.warns(HpsearchWarning) as caught:
        cfg = load_config("tiny", sets)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].endswith(
        ": sampler.options: `sigma0` has been deprecated in v4.9.0. This feature will be "
        "removed in v6.0.0."
    ), said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_sampler(cfg)
        # The config a launch stored, as each worker reads it again: no second warning.
        from hpsearch.config import config_from_yaml, config_to_yaml

        config_from_yaml(config_to_yaml(cfg), "study tiny")
    # On the command line: one line, `warning: ...`, then the command's own error.
    code = "import sys; from hpsearch.cli import main; sys.argv[0] = 'hpsearch'; main()"
    args = ["launch", "--study", "tiny", "--workdir", str(tmp_path), "--no-tracking",
            "--train-fn", "no_such_module:train", *[a for s in sets for a in ("--set", s)]]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and lines[0] == f"warning: {said[0]}", out.stderr
    assert said[0].startswith(str(find_study_file("tiny"))), said  # the file it was read from
    assert lines[1] == (
        "Error: --train-fn: 'no_such_module:train': no module named 'no_such_module' on the "
        "Python path (PYTHONPATH, the current folder)"
    )


def test_leaving_out_a_parameter_the_study_does_not_search_names_the_set() -> None:
    """QA: the README's example left out `momentum`, which neither shipped study searches;
    its error alone of the --set errors did not say it came from a --set."""
    from hpsearch.config import load_config

    cfg = load_config("tiny", ["search_space.focal_gamma=null"])  # the README's
    assert "focal_gamma" not in cfg.search_space
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["search_space.momentum=null"])
    assert str(err.value).endswith(
        "tiny.yaml: search_space.momentum: not searched here: nothing to leave out "
        "(from --set search_space.momentum=null)"
    )
