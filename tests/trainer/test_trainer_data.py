"""Data: missing folders, downloads, the decoded cache under concurrency, corrupt files,
and the two data paths agreeing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from disk_util import remount, tmpfs
from hpsearch.errors import DataError
from hpsearch.trainer import data
from hpsearch.trainer.trial import eval_batches, load_split
from PIL import Image
from trainer_helpers import make_config


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("flowers102", "flowers-102/{jpg/,imagelabels.mat,setid.mat}"),
        ("imagefolder", "<root>/train/<class>/"),
    ],
)
def test_missing_data_dir_is_one_line_data_error(tmp_path: Path, name: str, expected: str) -> None:
    cfg = make_config({"name": name, "root": str(tmp_path / "nothing")})
    with pytest.raises(DataError) as info:
        data.get_source(cfg, "train")
    msg = str(info.value)
    assert "\n" not in msg
    assert expected in msg and str(tmp_path / "nothing") in msg
    assert "--data-dir" in msg


def test_missing_cifar_is_data_error(tmp_path: Path) -> None:
    cfg = make_config({"name": "cifar10", "root": str(tmp_path)})
    with pytest.raises(DataError, match=r"cifar-10-batches-py.*--download"):
        data.get_source(cfg, "train")


def test_failed_download_is_one_line_data_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """download=True keeps torchvision's real download code; its network error becomes one
    DataError line."""
    import torchvision.datasets.utils as tvu

    def offline(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(tvu.urllib.request, "urlopen", offline)
    cfg = make_config({"name": "flowers102", "root": str(tmp_path), "download": True})
    with pytest.raises(DataError) as info:
        data.get_source(cfg, "train")
    msg = str(info.value)
    assert "\n" not in msg and "download" in msg and "name resolution" in msg


def test_limit_keeps_every_class(flowers_root: Path) -> None:
    """Flowers-102 splits are sorted by class: a limit must not become a class subset, nor a
    random one (102 random images of the train split held 72 classes)."""
    cfg = make_config(
        {"name": "flowers102", "root": str(flowers_root), "train_limit": 306, "eval_limit": 150}
    )
    train = data.get_source(cfg, "train")
    val = data.get_source(cfg, "val")
    assert train is not None and val is not None
    assert len(train) == 306 and len(val) == 150
    assert sorted(np.bincount(train.labels, minlength=102).tolist()) == [3] * 102
    assert sorted(np.bincount(val.labels, minlength=102).tolist()) == [1] * 54 + [2] * 48
    full = data.get_source(make_config({"name": "flowers102", "root": str(flowers_root)}), "train")
    assert full is not None
    where = [list(full.items).index(item) for item in train.items]
    assert where == sorted(where)  # in the split's own order
    assert len(train.class_names) == 102
    again = data.get_source(cfg, "train")
    assert again is not None and list(again.items) == list(train.items)


CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from hpsearch.config import validate_config
    from hpsearch.trainer import data
    cfg = validate_config({"name": "t", "dataset": {"name": "flowers102", "root": sys.argv[1],
                                                    "train_limit": 200}})
    src = data.get_source(cfg, "train")
    dec = data.load_or_build_cache(src, 40, Path(sys.argv[2]))
    print(f"built={dec.built} n={len(dec.images)} shape={dec.images.shape}")
    """
)


def test_cache_built_once_under_concurrency(flowers_root: Path, tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(flowers_root), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        outs.append(out.strip().splitlines()[-1])
    assert sorted(o.split()[0] for o in outs) == ["built=False", "built=True"]
    assert all("n=200 shape=(200, 40, 40, 3)" in o for o in outs)
    files = list((tmp_path / "cache").iterdir())
    assert [f.suffix for f in files if f.suffix != ".lock"] == [".npz"]  # no temp left over
    cfg = make_config({"name": "flowers102", "root": str(flowers_root), "train_limit": 200})
    src = data.get_source(cfg, "train")
    assert src is not None
    dec = data.load_or_build_cache(src, 40, tmp_path)
    assert not dec.built and dec.images.dtype == np.uint8
    np.testing.assert_array_equal(dec.images[7], data.open_and_decode(src, 7, 40))


def test_a_cache_the_disk_has_no_room_for_is_kept_in_memory(
    flowers_root: Path, tmp_path: Path
) -> None:
    """QA: a decoded cache larger than the free space (more than the 64 MiB a worker checks
    for) failed each trial with `No space left on device`: twelve trials and three worker
    restarts. The cache only spares the next process its decode: training goes on, with one
    warning, and no temp file is left. The full disk here is a file size limit (EFBIG)."""
    code = CHILD.replace(
        "from hpsearch.trainer import data\n",
        "from hpsearch.trainer import data\nimport resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))\n",
    )
    r = subprocess.run([sys.executable, "-c", code, str(flowers_root), str(tmp_path)],
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "built=True n=200 shape=(200, 40, 40, 3)"
    warned = [ln for ln in r.stderr.splitlines() if "HpsearchWarning" in ln]
    assert len(warned) == 1 and "not cached at" in warned[0], r.stderr
    assert "File too large; kept in memory, each worker process decodes it" in warned[0]
    assert [f.suffix for f in (tmp_path / "cache").iterdir()] == [".lock"]


def test_a_cache_on_a_read_only_disk_is_kept_in_memory(flowers_root: Path, tmp_path: Path) -> None:
    """Review: the cache's lock file was opened before the write, and a read-only disk
    failed the trial there, before the in-memory fallback. A real read-only tmpfs here
    (mounted as root, as CI runs)."""
    with tmpfs(tmp_path / "ro", "8M", read_only=True) as work:
        cfg = make_config({"name": "flowers102", "root": str(flowers_root), "train_limit": 50})
        src = data.get_source(cfg, "train")
        assert src is not None
        with pytest.warns(UserWarning, match=r"not cached at .*Read-only file system; kept in"):
            dec = data.load_or_build_cache(src, 24, work)
        assert dec.built and dec.images.shape == (50, 24, 24, 3)
        # QA: a cache that fit left the disk no room for any trial's checkpoints; with 8 MiB
        # free it is not written, as under the 512 MiB it leaves.
        remount(work, "rw")
        with pytest.warns(UserWarning, match=r"it would leave under 512 MiB free for checkpoi"):
            assert data.load_or_build_cache(src, 24, work).built
        assert not any(work.rglob("*.npz"))


def _imagefolder(root: Path, corrupt: bool) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("daisy", "rose"):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(3):
                arr = rng.integers(0, 255, (20 + i, 30, 3), dtype=np.uint8)
                Image.fromarray(arr).save(d / f"{i}.png")
    if corrupt:
        (root / "train" / "rose" / "broken.jpg").write_bytes(b"not a jpeg at all")


def test_corrupt_image_skip_warns_and_fail_raises(tmp_path: Path) -> None:
    _imagefolder(tmp_path / "data", corrupt=True)
    cfg = make_config({"name": "imagefolder", "root": str(tmp_path / "data")})
    src = data.get_source(cfg, "train")
    assert src is not None and len(src) == 7 and src.class_names == ["daisy", "rose"]
    assert data.get_source(cfg, "test") is None
    with pytest.warns(UserWarning, match=r"broken\.jpg"):
        dec = data.load_or_build_cache(src, 16, tmp_path / "w1", on_corrupt="skip")
    assert dec.images.shape == (6, 16, 16, 3) and dec.labels.tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(DataError, match=r"broken\.jpg"):
        data.load_or_build_cache(src, 16, tmp_path / "w2", on_corrupt="fail")
    # The cache the skip built, read under fail: it silently trained without the file.
    with pytest.raises(DataError, match=r"1 image\(s\) of its train split could not be decoded"):
        data.load_or_build_cache(src, 16, tmp_path / "w1", on_corrupt="fail")
    assert not (tmp_path / "w2" / "cache").exists() or not list(
        (tmp_path / "w2" / "cache").glob("*.npz")
    )


def test_the_files_a_cache_left_out_are_named_at_each_load(tmp_path: Path) -> None:
    """QA: after the first run nothing said which images a skip left out, and under fail
    the message said how many, not which."""
    _imagefolder(tmp_path / "data", corrupt=True)
    cfg = make_config({"name": "imagefolder", "root": str(tmp_path / "data")})
    src = data.get_source(cfg, "train")
    assert src is not None
    with pytest.warns(UserWarning, match=r"broken\.jpg'; skipped"):
        data.load_or_build_cache(src, 16, tmp_path / "w", on_corrupt="skip")
    with pytest.warns(
        UserWarning, match=r"1 image\(s\) of its train split left out, .*broken\.jpg"
    ):
        assert not data.load_or_build_cache(src, 16, tmp_path / "w", on_corrupt="skip").built
    with pytest.raises(DataError, match=r"built \(on_corrupt: skip\): .*broken\.jpg; fix"):
        data.load_or_build_cache(src, 16, tmp_path / "w", on_corrupt="fail")


def test_a_split_or_train_class_of_which_no_image_decodes_is_a_data_error(
    tmp_path: Path,
) -> None:
    """QA: every val image corrupt gave val_loss 0.0 over 0 images (a val_loss study ranked
    it best); every image of one train class, a model with an output nothing trained."""
    from hpsearch.trainer import TrainOptions, train

    _imagefolder(tmp_path / "data", corrupt=False)
    for f in (tmp_path / "data" / "val").glob("*/*.png"):
        f.write_bytes(b"garbage")
    cfg = make_config({"name": "imagefolder", "root": str(tmp_path / "data")})

    def refused(split: str, match: str) -> None:
        src = data.get_source(cfg, split)
        assert src is not None
        with pytest.warns(UserWarning), pytest.raises(DataError, match=match):
            data.load_or_build_cache(src, 16, tmp_path / "w", on_corrupt="skip")

    refused("val", r"none of the 6 images of its val split could be decoded")
    assert not list((tmp_path / "w" / "cache").glob("*.npz"))  # no cache of nothing
    # Streamed: the evaluation finds none.
    streamed = make_config(
        {"name": "imagefolder", "root": str(tmp_path / "data"), "image_size": 16,
         "fast_path": "off"},
        trainer={"num_workers": 0, "evaluate_test": False}, budget={"max_epochs": 1},
    )  # fmt: skip
    with pytest.warns(UserWarning), pytest.raises(DataError, match="none of the 6 images"):
        train(streamed, {"batch_size": 6}, options=TrainOptions(device="cpu", workdir=tmp_path))
    for f in (tmp_path / "data" / "train" / "rose").glob("*.png"):
        f.write_bytes(b"garbage")
    refused("train", r"class rose: none of its train images could be decoded")


def test_a_corrupt_image_in_a_dataloader_worker_is_one_line(tmp_path: Path) -> None:
    """on_corrupt: fail on the streaming path: the DataLoader re-raised the worker's error
    with its traceback in the message, and the file's name came after 500 characters."""
    from hpsearch.trainer import TrainOptions, train

    _imagefolder(tmp_path / "data", corrupt=True)
    cfg = make_config(
        {"name": "imagefolder", "root": str(tmp_path / "data"), "image_size": 16,
         "fast_path": "off", "on_corrupt": "fail"},
        trainer={"num_workers": 1, "evaluate_test": False},
        budget={"max_epochs": 1},
    )  # fmt: skip
    with pytest.raises(DataError) as info:
        # One batch of all 7 images: a shuffled smaller one might leave the file out.
        train(cfg, {"batch_size": 7}, options=TrainOptions(device="cpu", workdir=tmp_path))
    msg = str(info.value)
    assert "\n" not in msg and "broken.jpg" in msg and "Traceback" not in msg, msg


def test_fast_and_streaming_paths_compute_the_same_eval_batches(
    flowers_root: Path, cache_workdir: Path
) -> None:
    cfg = make_config(
        {"name": "flowers102", "root": str(flowers_root), "eval_limit": 20},
        trainer={"num_workers": 0},
    )
    src = data.get_source(cfg, "val")
    assert src is not None
    cpu = torch.device("cpu")
    kw = {"train": False, "batch_size": 8, "seed": 0}
    fast = load_split(cfg, src, 37, 32, cpu, True, cache_workdir, None, **kw)  # type: ignore[arg-type]
    stream = load_split(cfg, src, 37, 32, cpu, False, cache_workdir, None, **kw)  # type: ignore[arg-type]
    assert fast.loader is None and stream.loader is not None
    ((xf, yf),) = list(eval_batches(fast, 32, cpu))
    ((xs, ys),) = list(eval_batches(stream, 32, cpu))
    assert xf.shape == (20, 3, 32, 32)
    assert torch.equal(yf, ys)
    assert torch.equal(xf, xs)


def test_fast_path_auto_respects_max_cache_mb(flowers_root: Path) -> None:
    cfg = make_config({"name": "flowers102", "root": str(flowers_root), "max_cache_mb": 1})
    src = data.get_source(cfg, "train")
    assert src is not None
    assert not data.use_fast_path(cfg, [src], 73)  # 1020 x 73 x 73 x 3 = 16 MB > 1 MB
    assert data.use_fast_path(cfg, [src], 16)  # 0.8 MB
    on = make_config({"name": "flowers102", "fast_path": "on", "max_cache_mb": 1})
    assert data.use_fast_path(on, [src], 512)


def test_the_cache_key_follows_the_class_numbering(tmp_path: Path) -> None:
    """A class folder added to train/ only renumbers the classes after it: val/'s file list
    is the same, and its cache of the old labels scored val against the wrong classes."""
    files = [tmp_path / "val" / "b" / "1.jpg", tmp_path / "val" / "c" / "2.jpg"]
    before = data.Source("folder", "val", files, np.array([0, 1]), ["b", "c"], ident="r")
    after = data.Source("folder", "val", files, np.array([1, 2]), ["a", "b", "c"], ident="r")
    assert data.cache_path(before, 32, tmp_path) != data.cache_path(after, 32, tmp_path)
    again = data.Source("folder", "val", list(files), np.array([0, 1]), ["b", "c"], ident="r")
    assert data.cache_path(before, 32, tmp_path) == data.cache_path(again, 32, tmp_path)


def test_a_stop_signal_to_the_whole_job_leaves_the_loaders_workers_to_their_trial(
    flowers_root: Path, cache_workdir: Path
) -> None:
    """systemd and Slurm stop a job by signalling every process in it: the loader's worker
    processes died of the SIGTERM, and the trial failed ("DataLoader worker exited
    unexpectedly") instead of being handed back at its epoch's end. From another process
    (the worker's own SIGTERM is the loader's to end them with), as a group kill sends it."""
    import signal
    import subprocess

    cfg = make_config(
        {"name": "flowers102", "root": str(flowers_root), "eval_limit": 40},
        trainer={"num_workers": 1},
    )
    src = data.get_source(cfg, "val")
    assert src is not None
    kw = {"train": True, "batch_size": 4, "seed": 0}  # 10 batches: 2 in flight at a time
    split = load_split(cfg, src, 37, 32, torch.device("cpu"), False, cache_workdir, None, **kw)  # type: ignore[arg-type]
    assert split.loader is not None
    batches = iter(split.loader)
    next(batches)
    (worker,) = batches._workers  # type: ignore[attr-defined]
    for sig in (signal.SIGTERM, signal.SIGINT):
        subprocess.run(["kill", f"-{sig.name[3:]}", str(worker.pid)], check=True)
    assert sum(1 for _ in batches) == 9 and worker.is_alive()  # the epoch's other batches
    del batches


_EXIT_HOLDING_A_LOADER = """
import sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from hpsearch.trainer import data
from hpsearch.trainer.trial import load_split
from trainer_helpers import make_config
cfg = make_config({"name": "flowers102", "root": sys.argv[1], "eval_limit": 40},
                  trainer={"num_workers": 1})
src = data.get_source(cfg, "val")
split = load_split(cfg, src, 37, 32, torch.device("cpu"), False, Path(sys.argv[2]), None,
                   train=True, batch_size=4, seed=0)
batches = iter(split.loader)
next(batches)
raise RuntimeError("a trial's error, whose traceback holds the loader")
"""


def test_a_process_that_exits_holding_a_loader_exits(
    flowers_root: Path, cache_workdir: Path, subprocess_env: dict[str, str]
) -> None:
    """The loader's workers ignore SIGTERM, which multiprocessing's exit handler sends them
    before it waits for them without a limit: a process ending on an error that kept its
    loader alive hung there for good."""
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_HOLDING_A_LOADER, str(flowers_root), str(cache_workdir),
         str(Path(__file__).parent)],
        capture_output=True, text=True, env=subprocess_env, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "a trial's error" in out.stderr
    assert "killed by signal" not in out.stderr, out.stderr  # ended by the loader's shutdown


def test_an_image_replaced_under_its_name_is_decoded_again(tmp_path: Path) -> None:
    """The cache was keyed by file names: a corrupt image replaced by a good one (or a photo
    re-exported) kept the cache built without it, or with the old pixels (QA)."""
    _imagefolder(tmp_path / "data", corrupt=True)
    cfg = make_config({"name": "imagefolder", "root": str(tmp_path / "data")})
    src = data.get_source(cfg, "train")
    assert src is not None
    with pytest.warns(UserWarning, match=r"broken\.jpg"):
        first = data.load_or_build_cache(src, 16, tmp_path / "w", on_corrupt="skip")
    assert len(first.labels) == 6
    good = np.full((20, 30, 3), 200, dtype=np.uint8)
    Image.fromarray(good).save(tmp_path / "data" / "train" / "rose" / "broken.jpg", "JPEG")
    src = data.get_source(cfg, "train")
    assert src is not None
    again = data.load_or_build_cache(src, 16, tmp_path / "w", on_corrupt="fail")
    assert again.built and len(again.labels) == 7
    assert data.load_or_build_cache(src, 16, tmp_path / "w", on_corrupt="fail").built is False
    # The cache it replaces is deleted (each edit left one as large behind), not a subset's
    # of the same folder (train_limit) nor another size's.
    part = make_config({"name": "imagefolder", "root": str(tmp_path / "data"), "train_limit": 2})
    sub = data.get_source(part, "train")
    assert sub is not None and len(sub) == 2
    data.load_or_build_cache(sub, 16, tmp_path / "w", on_corrupt="fail")
    data.load_or_build_cache(src, 24, tmp_path / "w", on_corrupt="fail")
    assert len(list((tmp_path / "w" / "cache").glob("*.npz"))) == 3
    before = data.cache_path(src, 16, tmp_path / "w")
    older = tmp_path / "w" / "cache" / "imagefolder-val-16px-n6-0123456789ab.npz"
    older.write_bytes(b"a cache named before families: never read again")
    Image.fromarray(good // 2).save(tmp_path / "data" / "train" / "rose" / "broken.jpg", "JPEG")
    src = data.get_source(cfg, "train")
    assert src is not None
    assert data.load_or_build_cache(src, 16, tmp_path / "w", on_corrupt="fail").built
    caches = sorted(p.name for p in (tmp_path / "w" / "cache").iterdir())
    assert len([n for n in caches if n.endswith(".npz")]) == 3, caches
    assert data.cache_path(src, 16, tmp_path / "w").name in caches and older.name not in caches
    assert len([n for n in caches if n.endswith(".lock")]) == 3, caches  # its lock went too
    # Review: a build of the files as they were (it began before the change) prunes
    # nothing, not the cache of the files as they are.
    before.write_bytes(b"a stale build, written last")
    data._prune_replaced(before, src, 16, tmp_path / "w")
    assert data.cache_path(src, 16, tmp_path / "w").is_file()


def test_an_image_folders_classes_are_its_visible_folders_with_images(tmp_path: Path) -> None:
    """Jupyter's `.ipynb_checkpoints` became class 0 (every other class's index shifted), a
    class's images in a subfolder were left out (torchvision's ImageFolder reads them), and
    an empty class folder or a single class trained without a word (QA)."""
    root = tmp_path / "data"
    _imagefolder(root, corrupt=False)
    (root / "train" / ".ipynb_checkpoints").mkdir()
    nested = root / "train" / "rose" / "batch2"
    nested.mkdir()
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(nested / "9.png")
    (root / "train" / "rose" / ".hidden.png").write_bytes(b"not an image")
    cfg = make_config({"name": "imagefolder", "root": str(root)})
    src = data.get_source(cfg, "train")
    assert src is not None and src.class_names == ["daisy", "rose"]
    assert len(src) == 7 and str(nested / "9.png") in src.items
    (root / "val" / "tulip").mkdir()  # in val/ only: refused as before
    (root / "train" / "tulip").mkdir()  # in train/, empty
    with pytest.raises(DataError, match=r"train/tulip: no images .*every class folder of"):
        data.get_source(cfg, "train")
    import shutil

    for split in ("train", "val"):
        shutil.rmtree(root / split / "tulip")
        shutil.rmtree(root / split / "rose")
    with pytest.raises(DataError, match=r"one class folder \(daisy\); a classifier needs at"):
        data.get_source(cfg, "train")


def test_an_image_folder_without_val_names_what_is_missing(tmp_path: Path) -> None:
    """`<root>/{train,val}/ not found` when only val/ was missing (QA)."""
    root = tmp_path / "data"
    _imagefolder(root, corrupt=False)
    cfg = make_config({"name": "imagefolder", "root": str(root)})
    import shutil

    shutil.rmtree(root / "val")
    with pytest.raises(DataError, match=rf"imagefolder: {root}/val/ not found; expected"):
        data.get_source(cfg, "train")
    shutil.rmtree(root / "train")
    with pytest.raises(DataError, match=r"/\{train,val\}/ not found"):
        data.get_source(cfg, "train")
    (root / "train").mkdir()
    (root / "val").mkdir()
    with pytest.raises(DataError, match=rf"imagefolder: {root}/train/ has no class folders"):
        data.get_source(cfg, "train")


def test_a_trial_on_classes_other_than_the_studys_is_a_dataset_error(tmp_path: Path) -> None:
    """A class added while a worker runs: its next trial trained a model of another shape
    in the same study (review). The trainer checks the study's classes (TrainOptions)."""
    from hpsearch.errors import DatasetError
    from hpsearch.trainer import TrainOptions, train

    root = tmp_path / "data"
    _imagefolder(root, corrupt=False)
    extra = root / "train" / "aaa"
    extra.mkdir()
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(extra / "0.png")
    cfg = make_config(
        {"name": "imagefolder", "root": str(root), "image_size": 16},
        trainer={"evaluate_test": False}, budget={"max_epochs": 1},
    )  # fmt: skip
    opts = TrainOptions(device="cpu", workdir=tmp_path, class_names=["daisy", "rose"])
    with pytest.raises(DatasetError, match=r"3 classes \(added aaa\) where the study's trials"):
        train(cfg, {"batch_size": 4}, options=opts)


def test_a_link_back_up_a_class_folder_is_walked_once(tmp_path: Path) -> None:
    """`self -> .` listed each image 41 times (to the OS's link depth); two such links ran
    on without end, at launch and in every trial (review)."""
    root = tmp_path / "data"
    _imagefolder(root, corrupt=False)
    for name in ("self", "again"):
        (root / "train" / "rose" / name).symlink_to(".")
    cfg = make_config({"name": "imagefolder", "root": str(root)})
    src = data.get_source(cfg, "train")
    assert src is not None and len(src) == 6


def test_a_16_bit_grey_image_keeps_its_tones(tmp_path: Path) -> None:
    """QA: a 16-bit grey PNG (PIL mode I;16) decoded as solid white: RGB clips at 255."""
    ramp = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)  # 0 .. 65472
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    with Image.open(tmp_path / "g16.png") as im:
        assert im.mode.startswith("I")
        out = data.decode_image(im, 32)
    expected = np.round(ramp / 257.0)
    assert np.abs(out[..., 0].astype(int) - expected).max() <= 1
    assert (out[..., 0] == out[..., 2]).all() and out.min() == 0 and out.max() >= 254
    # A 32-bit one whose values are 8-bit ones: as they are.
    small = Image.fromarray(np.full((8, 8), 100, dtype=np.int32), "I")
    assert (data.decode_image(small, 8) == 100).all()
    assert data.wide_grey_to_u8(np.array([0, 70000, -5]), "I").tolist() == [0, 255, 0]


def test_an_image_over_pillows_size_guard_is_a_decode_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA: a 180 MP image failed every trial with a raw DecompressionBombError naming no
    file, and the launch restarted its worker three times."""
    _imagefolder(tmp_path / "data", corrupt=False)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 20 x 30 px: over twice that
    cfg = make_config({"name": "imagefolder", "root": str(tmp_path / "data")})
    src = data.get_source(cfg, "train")
    assert src is not None
    with pytest.raises(DataError, match=r"cannot decode .*0\.png: Image size \(600 pixels\)"):
        data.open_and_decode(src, 0, 16)
