"""Datasets: where the images are, how they are decoded once into a uint8 cache, and the
two ways they reach the device.

Every split is first described by a `Source` (items, labels, class names, how to open one
item as a PIL image). Then either

* the fast path: every image is decoded ONCE (shorter side -> cache size, center square crop,
  uint8 HWC) into `workdir/cache/<key>.npz`, built atomically under a file lock; each trial
  puts the whole array on the device and augments batches there (`augment.py`); or
* the streaming path: a DataLoader decodes the same crop per item in worker processes and
  hands uint8 batches to the same device-side augmentation.

Both paths share `decode_image`, so they see the same pixels.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hpsearch.config import StudyConfig
from hpsearch.errors import DataError, DatasetError, HpsearchWarning
from PIL import Image, ImageOps, UnidentifiedImageError

try:  # POSIX only; elsewhere two processes may both decode (still never a half file).
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
# Pillow warns of any image over 89 MP as a possible "decompression bomb" (two lines, from
# each decoding thread): here the user's own scans and panoramas, decoded on purpose. Over
# 179 MP it refuses them, which `open_and_decode` reports as the file's decode error.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

SPLITS = ("train", "val", "test")
CIFAR_VAL_SIZE = 5000  # CIFAR has no val split: the last 5000 of a fixed shuffle of train
SYNTHETIC_SIZES = {"train": 2048, "val": 512, "test": 512}  # images per split without limits
CACHE_VERSION = 1  # bump when the decoded pixels would change


# --- sources: which images belong to a split -------------------------------------------


@dataclass(frozen=True)
class Source:
    """One split of one dataset, before decoding."""

    dataset: str
    split: str
    items: Sequence[Any]  # file paths, or row indices into `array`
    labels: np.ndarray  # int64, one per item
    class_names: list[str]
    array: np.ndarray | None = None  # in-memory images (CIFAR: N x 32 x 32 x 3 uint8)
    ident: str = ""  # distinguishes roots in cache keys
    subset: str = ""  # a part of the split (train_limit): its own family of caches

    def __len__(self) -> int:
        return len(self.items)

    def name_of(self, i: int) -> str:
        return str(self.items[i]) if self.array is None else f"{self.dataset}[{self.items[i]}]"


def _root(config: StudyConfig) -> Path:
    return Path(config.dataset.root or "data").expanduser()


def _limit(labels: np.ndarray, limit: int | None) -> np.ndarray:
    """Indices of a fixed subset of `limit` items, stratified: every class gets `limit / C`
    items, give or take one (all classes when `limit >= C`), kept in file order.

    Official splits are often ordered by class (Flowers-102 train is 10 images of class 0,
    then class 1, ...), so the first N would be a class subset, and a random N leaves out
    classes (102 of Flowers-102's train split kept 72 classes) and weighs the rest unevenly.
    The items come by rounds, the r-th of each class in round r, from a fixed shuffle (seed 0,
    not the trial seed): the same images for every trial.
    """
    n = len(labels)
    if limit is None or limit >= n:
        return np.arange(n)
    order = np.random.default_rng(0).permutation(n)
    shuffled = labels[order]
    # Rank of each shuffled item within its class, in one pass: a stable sort by class keeps
    # the shuffle's order within each class; minus the index where its class starts.
    by_class = np.argsort(shuffled, kind="stable")
    starts = np.searchsorted(shuffled[by_class], shuffled[by_class])
    rank = np.empty(n, dtype=np.int64)
    rank[by_class] = np.arange(n) - starts
    by_round = np.lexsort((np.arange(n), rank))  # round first, then the shuffle's order
    return np.sort(order[by_round[:limit]])


def get_source(config: StudyConfig, split: str) -> Source | None:
    """The split's items, limited by train_limit/eval_limit. None: the dataset has no such
    split (an imagefolder without test/). Raises DatasetError when data is missing."""
    name = config.dataset.name
    src: Source | None
    if name == "flowers102":
        src = _flowers(config, split)
    elif name in ("cifar10", "cifar100"):
        src = _cifar(config, split)
    elif name == "imagefolder":
        src = _imagefolder(config, split)
    elif name == "synthetic":
        src = _synthetic(config, split)
    else:  # pragma: no cover - config validation forbids it
        raise DatasetError(f"dataset {name}: unknown dataset")
    if src is None:
        return None
    limit = config.dataset.train_limit if split == "train" else config.dataset.eval_limit
    keep = _limit(src.labels, limit)
    if len(keep) == len(src):
        return src
    return Source(
        dataset=src.dataset,
        split=src.split,
        items=[src.items[i] for i in keep],
        labels=src.labels[keep],
        class_names=src.class_names,
        array=src.array,
        ident=src.ident,
        # Another subset of the same folder: its caches are another family's, which a
        # study on the whole folder's builds do not replace.
        subset=f"limit={limit}",
    )


def _download_error(name: str, exc: BaseException, where: Path) -> DatasetError:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return DatasetError(
        f"dataset {name}: download to {where} failed ({reason}); "
        "check the network or pass --data-dir with a local copy"
    )


def _flowers(config: StudyConfig, split: str) -> Source:
    from hpsearch.runner import flowers_layout_error, flowers_layout_message
    from torchvision.datasets import Flowers102

    root = _root(config)
    if config.dataset.download:
        try:
            Flowers102(str(root), split="train", download=True)
        except (OSError, RuntimeError, ValueError) as exc:  # URLError is an OSError
            raise _download_error("flowers102", exc, root) from exc
    layout = flowers_layout_error(root)
    if layout is not None:
        raise DatasetError(layout)
    try:
        ds = Flowers102(str(root), split=split, download=False)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted" (md5 check)
        raise DatasetError(flowers_layout_message(root, "failed its checksum")) from exc
    return Source(
        dataset="flowers102",
        split=split,
        items=[str(p) for p in ds._image_files],
        labels=np.asarray(ds._labels, dtype=np.int64),
        class_names=list(getattr(Flowers102, "classes", [str(i) for i in range(102)])),
        ident=str(root.resolve()),
    )


def _cifar(config: StudyConfig, split: str) -> Source:
    from torchvision.datasets import CIFAR10, CIFAR100

    name = config.dataset.name
    cls = CIFAR10 if name == "cifar10" else CIFAR100
    folder = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
    root = _root(config)
    try:
        ds = cls(str(root), train=split != "test", download=config.dataset.download)
    except RuntimeError as exc:  # "Dataset not found or corrupted"
        raise DatasetError(
            f"dataset {name}: {root / folder} not found; expected <root>/{folder}/ "
            "(the python version from the CIFAR site); pass --download or --data-dir"
        ) from exc
    except (OSError, ValueError) as exc:
        raise _download_error(name, exc, root) from exc
    labels = np.asarray(ds.targets, dtype=np.int64)
    rows = np.arange(len(labels))
    if split != "test":
        perm = np.random.default_rng(0).permutation(len(labels))  # fixed train/val split
        rows = np.sort(perm[CIFAR_VAL_SIZE:] if split == "train" else perm[:CIFAR_VAL_SIZE])
    return Source(
        dataset=name,
        split=split,
        items=rows.tolist(),
        labels=labels[rows],
        class_names=list(ds.classes),
        array=ds.data,
        ident=str(root.resolve()),
    )


IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


def class_change(trained: Sequence[str], now: Sequence[str]) -> str | None:
    """What differs between the classes a study's trials trained on and the train split's
    now, as a message; None when they are the same, in the same order."""
    if list(trained) == list(now):
        return None
    added = [n for n in now if n not in trained]
    gone = [n for n in trained if n not in now]
    parts = ([f"added {', '.join(added[:3])}"] if added else []) + (
        [f"without {', '.join(gone[:3])}"] if gone else []
    )
    return (
        f"{len(now)} classes ({'; '.join(parts) or 'reordered'}) where the study's trials "
        f"trained on {len(trained)}: its models and values would not compare; give this "
        "data another study name (--set name=...)"
    )


def _class_folders(split_dir: Path) -> list[str]:
    """A split's class folders, sorted; hidden ones (`.ipynb_checkpoints`, which Jupyter
    makes, was class 0 and shifted every other) are not classes."""
    return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images_under(folder: Path) -> list[str]:
    """A class folder's image files, in its subfolders too (as torchvision's ImageFolder
    reads them), sorted, hidden files and folders left out."""
    found = []
    seen: set[tuple[int, int]] = set()  # (device, inode): a link back up is walked once
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = [n for n in dirnames if not n.startswith(".")]
        found += [
            os.path.join(dirpath, f)
            for f in filenames
            if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTS
        ]
    return sorted(found)


def _imagefolder(config: StudyConfig, split: str) -> Source | None:
    root = _root(config)
    missing = [s for s in ("train", "val") if not (root / s).is_dir()]
    where = f"{root}/{missing[0]}" if len(missing) == 1 else f"{root}/{{train,val}}"
    layout = (
        f"dataset imagefolder: {where}/ not found; expected "
        "<root>/train/<class>/*.jpg, <root>/val/<class>/*.jpg, optional <root>/test/; "
        "pass --data-dir"
    )
    if missing:
        raise DatasetError(layout)
    d = root / split
    if not d.is_dir():
        return None  # only test/ is optional
    classes = _class_folders(root / "train")
    if not classes:
        raise DatasetError(
            layout.replace(f"{where}/ not found", f"{root}/train/ has no class folders")
        )
    if len(classes) < 2:
        raise DatasetError(
            f"dataset imagefolder: {root / 'train'}: one class folder ({classes[0]}); a "
            "classifier needs at least 2"
        )
    index = {c: i for i, c in enumerate(classes)}
    items: list[str] = []
    labels: list[int] = []
    for c in _class_folders(d):
        if c not in index:
            raise DatasetError(f"dataset imagefolder: {d / c}: class not in {root / 'train'}")
        files = _images_under(d / c)
        if not files and split == "train":  # an output no image trains, counted in accuracy
            raise DatasetError(
                f"dataset imagefolder: {d / c}: no images ({', '.join(IMAGE_EXTS)}); every "
                "class folder of train/ needs some"
            )
        items += files
        labels += [index[c]] * len(files)
    if not items:
        raise DatasetError(f"dataset imagefolder: {d}: no images ({', '.join(IMAGE_EXTS)})")
    return Source(
        dataset="imagefolder",
        split=split,
        items=items,
        labels=np.asarray(labels, dtype=np.int64),
        class_names=classes,
        ident=str(root.resolve()),
    )


def _synthetic(config: StudyConfig, split: str) -> Source:
    """Random images with a class-dependent tint, so a model can learn something."""
    n_classes = config.dataset.num_classes or 10
    limit = config.dataset.train_limit if split == "train" else config.dataset.eval_limit
    n = limit or SYNTHETIC_SIZES[split]
    size = 32  # stored px; decode_image resizes to the cache size like any other image
    rng = np.random.default_rng(SPLITS.index(split) + 1)
    labels = rng.integers(0, n_classes, n).astype(np.int64)
    tint = np.random.default_rng(0).integers(40, 216, (n_classes, 1, 1, 3))
    noise = rng.integers(-40, 40, (n, size, size, 3))
    array = np.clip(tint[labels] + noise, 0, 255).astype(np.uint8)
    return Source(
        dataset="synthetic",
        split=split,
        items=list(range(n)),
        labels=labels,
        class_names=[f"class_{i}" for i in range(n_classes)],
        array=array,
        ident=f"synthetic-{n_classes}",
    )


# --- decoding: the one place pixels are made ------------------------------------------


def decode_image(image: Image.Image, size: int) -> np.ndarray:
    """Resize the shorter side to `size` px, center-crop a square: uint8 HWC (size, size, 3).

    PIL's bilinear resize filters over the whole footprint when shrinking (antialiased), so
    a 144 px JPEG becomes a clean 73 px crop.
    """
    if image.mode.startswith("I"):  # 16/32-bit grey: RGB clips it at 255 (white)
        image = Image.fromarray(wide_grey_to_u8(np.asarray(image), image.mode), "L")
    image = image.convert("RGB")
    w, h = image.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    image = image.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    image = image.crop((left, top, left + size, top + size))
    return np.array(image, dtype=np.uint8)  # a writable copy


def wide_grey_to_u8(values: np.ndarray, mode: str) -> np.ndarray:
    """A 16-bit (mode I;16*) or 32-bit (I) grey image as 8 bits: 16-bit full scale is 65535,
    and an I image takes 255, 65535 or its own maximum, the first that holds its values."""
    v = np.clip(values.astype(np.float64), 0, None)
    top = v.max(initial=0.0)
    full = 65535.0 if mode.startswith("I;16") or 255 < top <= 65535 else max(top, 255.0)
    return np.round(v * (255.0 / full)).astype(np.uint8)


def open_and_decode(src: Source, i: int, size: int) -> np.ndarray:
    """Decode item i; corrupt files raise DatasetError naming the file."""
    try:
        if src.array is not None:
            return decode_image(Image.fromarray(src.array[int(src.items[i])]), size)
        with Image.open(src.items[i]) as im:
            if im.format == "JPEG":
                # DCT-domain downscale while decoding (2-8x faster), never below `size`.
                im.draft("RGB", (size, size))
            upright: Image.Image = ImageOps.exif_transpose(im) or im
            return decode_image(upright, size)
    except Image.DecompressionBombError as exc:  # over 2 x PIL's MAX_IMAGE_PIXELS (179 MP)
        raise DatasetError(
            f"dataset {src.dataset}: cannot decode {src.name_of(i)}: {exc.args[0].split(',')[0]} "
            "(Pillow's decompression-bomb guard: scale it down)"
        ) from exc
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise DatasetError(f"dataset {src.dataset}: cannot decode {src.name_of(i)}: {exc}") from exc


# --- the on-disk cache -----------------------------------------------------------------


@dataclass(frozen=True)
class Decoded:
    """A decoded split: images uint8 (N, S, S, 3) and labels int64 (N,)."""

    images: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    built: bool = False  # True when this call decoded it (False: read from the cache)
    skipped: list[str] = field(default_factory=list)  # files left out (on_corrupt: skip)


def decoded_nbytes(n: int, size: int) -> int:
    return n * size * size * 3


def _stamps(src: Source) -> list[tuple[int, int] | None]:
    """Each file's (size in bytes, mtime in ns); None for one gone since it was listed."""
    out: list[tuple[int, int] | None] = []
    for item in src.items:
        try:
            st = os.stat(item)
            out.append((st.st_size, st.st_mtime_ns))
        except OSError:  # its decode says so
            out.append(None)
    return out


def cache_path(
    src: Source, size: int, workdir: Path, stamps: Sequence[tuple[int, int] | None] | None = None
) -> Path:
    """`stamps`: an image folder's `_stamps`, when the caller has them (else read here)."""
    # The labels too: they number the classes of train/'s folders, which val/ and test/
    # file lists do not show (a class added to train/ only renumbers the ones after it).
    key = f"{CACHE_VERSION}|{src.ident}|{list(src.items)!r}|{list(src.class_names)!r}".encode()
    ident = hashlib.sha1(key + np.ascontiguousarray(src.labels).tobytes())
    if src.dataset != "imagefolder":
        name = f"{src.dataset}-{src.split}-{size}px-n{len(src)}-{ident.hexdigest()[:12]}.npz"
        return Path(workdir) / "cache" / name
    # A user's own files change under the same names (a corrupt image replaced, a photo
    # re-exported): their sizes and times too, or the cache kept the old ones.
    for stamp in _stamps(src) if stamps is None else stamps:
        ident.update(b"?;" if stamp is None else f"{stamp[0]}:{stamp[1]};".encode())
    prefix = _family_prefix(src, size, workdir)
    return prefix.with_name(f"{prefix.name}n{len(src)}-{ident.hexdigest()[:12]}.npz")


def _family_prefix(src: Source, size: int, workdir: Path) -> Path:
    """The start of the names of an image folder's caches of this split and size: what
    its files held at each build. A build replaces the others (`_prune_replaced`)."""
    family = hashlib.sha1(f"{CACHE_VERSION}|{src.ident}|{src.subset}".encode()).hexdigest()[:8]
    return Path(workdir) / "cache" / f"{src.dataset}-{src.split}-{size}px-r{family}-"


# An image folder's cache named before families (`_family_prefix`): never read again.
_UNFAMILIED = re.compile(r"imagefolder-[a-z]+-\d+px-n\d+-[0-9a-f]{12}\.npz")


def _prune_replaced(path: Path, src: Source, size: int, workdir: Path) -> None:
    """Delete this image folder's caches of the split and size that `path` replaces: built
    before its newest file changed (each as large as the new one, and read again by no
    run), and those of names before families. Only while `path` holds the files as they
    are now (a build that took minutes may be stale itself: a newer one is kept), and
    not one a process is building. A host of another copy of the files, older, in a
    shared work folder keeps the cache it builds after this one."""
    stamps = _stamps(src)  # one pass over the files, for both checks
    if cache_path(src, size, workdir, stamps) != path:
        return  # the files changed during this build: a later build prunes
    newest = max((stamp[1] for stamp in stamps if stamp is not None), default=0)
    prefix = _family_prefix(src, size, workdir)
    olds = [p for p in prefix.parent.glob(f"{prefix.name}*.npz") if p != path]
    olds += [p for p in prefix.parent.glob("imagefolder-*.npz") if _UNFAMILIED.fullmatch(p.name)]
    for old in olds:
        lock = old.with_suffix(".lock")
        try:
            if old.stat().st_mtime_ns >= newest and old.name.startswith(prefix.name):
                continue  # built from files as new as these: another host's copy, say
            with open(lock, "a+b") as fh:
                if fcntl is not None:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                old.unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
        except OSError:  # held (being built), gone, or not ours to delete: left
            continue
        log.info("deleted %s: its image folder changed since (%s replaces it)", old, path.name)


def decode_all(src: Source, size: int, on_corrupt: str, workers: int | None = None) -> Decoded:
    """Decode every image of the split with a thread pool (PIL releases the GIL)."""
    out = np.empty((len(src), size, size, 3), dtype=np.uint8)
    ok = np.ones(len(src), dtype=bool)

    def one(i: int) -> None:
        try:
            out[i] = open_and_decode(src, i, size)
        except DataError as exc:
            if on_corrupt == "fail":
                raise
            warnings.warn(f"{exc}; skipped", HpsearchWarning, stacklevel=2)
            ok[i] = False

    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        for _ in pool.map(one, range(len(src))):
            pass
    skipped = [src.name_of(int(i)) for i in np.flatnonzero(~ok)]
    if skipped:
        dec = Decoded(out[ok], src.labels[ok], src.class_names, built=True, skipped=skipped)
    else:
        dec = Decoded(out, src.labels.copy(), src.class_names, built=True)
    check_decodable(dec.labels, src, skipped)
    return dec


def check_decodable(labels: np.ndarray, src: Source, skipped: Sequence[str]) -> None:
    """Raises DatasetError for a split of which no image decoded (its metrics were 0 over
    0 images: a val_loss study ranked it best), or a train class none of whose images did
    (the model had an output nothing trained). `labels`: the decoded images' labels."""
    if not len(src) or not skipped:
        return
    if not len(labels):
        raise DatasetError(
            f"dataset {src.dataset}: none of the {len(src)} images of its {src.split} split "
            "could be decoded" + (f" (e.g. {skipped[0]})" if skipped[0] else "")
        )
    if src.split == "train":
        lost = sorted(set(np.unique(src.labels).tolist()) - set(np.unique(labels).tolist()))
        if lost:
            names = ", ".join(src.class_names[c] for c in lost[:3])
            more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
            raise DatasetError(
                f"dataset {src.dataset}: class {names}{more}: none of its train images could "
                "be decoded; a class the model cannot learn"
            )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        fh = open(path, "a+b")  # noqa: SIM115 - closed below
    except OSError as exc:
        if exc.errno not in _DISK_ERRNOS:
            raise
        fh = None
    if fh is None:
        # A full disk (no inode left): the write will fail and say so; the decode goes on
        # unlocked (two processes may both decode: no harm).
        yield
        return
    with fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # blocks until the other builder is done
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _read_cache(path: Path) -> Decoded:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        skipped = meta.get("skipped", [])  # (none recorded by caches of older versions)
        return Decoded(z["images"], z["labels"], meta["class_names"], skipped=skipped)


def load_or_build_cache(src: Source, size: int, workdir: Path, on_corrupt: str = "skip") -> Decoded:
    """The decoded split from workdir/cache, decoding it first if needed.

    Concurrent callers (trials in other processes) wait on a lock file; exactly one decodes.
    The file appears complete or not at all (temp file + os.replace).
    """
    if src.dataset == "synthetic":  # generated in memory already; nothing to cache
        return Decoded(
            np.stack([open_and_decode(src, i, size) for i in range(len(src))]),
            src.labels.copy(),
            src.class_names,
            built=True,
        )
    path = cache_path(src, size, workdir)
    with contextlib.suppress(FileNotFoundError):  # none, or pruned just now: built
        return _checked(_read_cache(path), src, path, on_corrupt)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if exc.errno not in _DISK_ERRNOS:
            raise
        return _kept_in_memory(src, decode_all(src, size, on_corrupt), path, exc)
    with _file_lock(path.with_suffix(".lock")):
        with contextlib.suppress(FileNotFoundError):  # another process built it meanwhile
            return _checked(_read_cache(path), src, path, on_corrupt)
        log.info(
            "decoding %d images of %s/%s at %d px into %s",
            len(src),
            src.dataset,
            src.split,
            size,
            path,
        )
        dec = decode_all(src, size, on_corrupt)
        meta = json.dumps(
            {"class_names": dec.class_names, "items": len(src), "skipped": dec.skipped}
        )
        try:
            st = os.statvfs(path.parent)
            free: int | None = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        if free is not None and free - dec.images.nbytes < CACHE_SPARES_BYTES:
            # QA: a 192 MiB cache left 9 MiB of a 200 MiB disk, and no trial could write its
            # checkpoints there again: every launch exited 74, the cache written anew.
            why = f"it would leave under {CACHE_SPARES_BYTES >> 20} MiB free for checkpoints"
            return _kept_in_memory(src, dec, path, OSError(errno.ENOSPC, why))
        try:
            _write_cache(path, dec, meta)
        except OSError as exc:
            if exc.errno not in _DISK_ERRNOS:
                raise
            return _kept_in_memory(src, dec, path, exc)
    if src.dataset == "imagefolder":
        _prune_replaced(path, src, size, workdir)
    return dec


# Bytes a cache leaves free on its disk, or it is not written (a trial's checkpoints and best
# model: 130 MiB for a ResNet-18 with momentum, 300 MiB for a ResNet-50).
CACHE_SPARES_BYTES = 512 << 20
# A cache write that fails on these leaves training as it was: no room, or none allowed.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def _kept_in_memory(src: Source, dec: Decoded, path: Path, exc: OSError) -> Decoded:
    """The cache only spares the next process its decode: training goes on without it (QA:
    a cache larger than the free space failed every trial, a dozen of them), said once."""
    warnings.warn(
        f"dataset {src.dataset}: its decoded {src.split} split ({dec.images.nbytes / 2**20:.1f}"
        f" MiB) not cached at {path}: {exc.strerror or exc}; kept in memory, each worker "
        "process decodes it",
        HpsearchWarning,
        stacklevel=3,
    )
    return dec


def _write_cache(path: Path, dec: Decoded, meta: str) -> None:
    """Whole or not at all: a temp file beside `path`, replaced onto it once synced."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, images=dec.images, labels=dec.labels, meta=np.asarray(meta))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _checked(dec: Decoded, src: Source, path: Path, on_corrupt: str) -> Decoded:
    """A cache built under on_corrupt: skip left out the files it could not decode; read
    under fail, it silently trained without them."""
    missing = len(src) - len(dec.labels)
    named = f": {', '.join(dec.skipped[:3])}{' ...' if len(dec.skipped) > 3 else ''}"
    if on_corrupt == "fail" and missing > 0:
        raise DatasetError(
            f"dataset {src.dataset}: {missing} image(s) of its {src.split} split could not be "
            f"decoded when {path} was built (on_corrupt: skip){named if dec.skipped else ''}; "
            "fix or remove them and delete that file, or set dataset.on_corrupt: skip"
        )
    if missing > 0:  # said again at each load: the first build's warnings are long gone
        check_decodable(dec.labels, src, dec.skipped or [""])  # (older caches: unnamed)
        warnings.warn(
            f"dataset {src.dataset}: {missing} image(s) of its {src.split} split left out, as "
            f"they could not be decoded when its cache was built{named if dec.skipped else ''}",
            HpsearchWarning,
            stacklevel=2,
        )
    return dec


# --- choosing the path -----------------------------------------------------------------


def use_fast_path(config: StudyConfig, sources: Sequence[Source], size: int) -> bool:
    """fast_path=auto: the on-device cache when all splits fit under max_cache_mb."""
    mode = config.dataset.fast_path
    if mode != "auto":
        return mode == "on"
    total = sum(decoded_nbytes(len(s), size) for s in sources)
    return total <= config.dataset.max_cache_mb * 2**20


# --- streaming path --------------------------------------------------------------------


class StreamDataset(torch.utils.data.Dataset[tuple[torch.Tensor, int] | None]):
    """Per-item decoding for the streaming path: the same uint8 crop as the cache."""

    def __init__(self, src: Source, size: int, on_corrupt: str) -> None:
        self.src = src
        self.size = size
        self.on_corrupt = on_corrupt

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int] | None:
        try:
            arr = open_and_decode(self.src, i, self.size)
        except DataError as exc:
            if self.on_corrupt == "fail":
                raise
            warnings.warn(f"{exc}; skipped", HpsearchWarning, stacklevel=2)
            return None
        return torch.from_numpy(arr).permute(2, 0, 1), int(self.src.labels[i])  # CHW uint8


def collate_skip(batch: list[tuple[torch.Tensor, int] | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a batch, dropping items that failed to decode (on_corrupt=skip)."""
    good = [b for b in batch if b is not None]
    if not good:
        return torch.empty(0, 3, 1, 1, dtype=torch.uint8), torch.empty(0, dtype=torch.long)
    x = torch.stack([b[0] for b in good])
    return x.contiguous(memory_format=torch.channels_last), torch.tensor([b[1] for b in good])


class EpochSampler(torch.utils.data.Sampler[int]):
    """A shuffle decided by (seed, epoch), so a resumed run sees the same order."""

    def __init__(self, n: int, seed: int, shuffle: bool) -> None:
        self.n = n
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.n))
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch, 1))
        return iter(torch.randperm(self.n, generator=g).tolist())


def epoch_seed(seed: int, epoch: int, stream: int) -> int:
    """A distinct 63-bit seed per (trial seed, epoch, random stream)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
