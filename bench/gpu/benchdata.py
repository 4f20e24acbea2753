"""A copy of Oxford Flowers-102 small enough to travel to the GPU machine (64 MiB per call,
wheels and the repo included), in the layout `torchvision.datasets.Flowers102` reads.

torchvision checks the md5 of `setid.mat` and `imagelabels.mat`, so the official split files
are copied unchanged and every split keeps all of its images: train and val (2040 images)
byte for byte, and the 6149 test images re-encoded at a lower JPEG quality (same pixel size;
`--test-quality`, default 65). Each split is then loaded back through torchvision, and every
file it lists must exist.

Example (from the repo root; bench/gpu/prepare.sh runs it):
    python bench/gpu/benchdata.py --src ../shared/datasets --dst .benchdata --test-quality 65
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SPLIT_KEYS = {"train": "trnid", "val": "valid", "test": "tstid"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", required=True, help="folder holding flowers-102/")
    p.add_argument("--dst", required=True, help="folder to create flowers-102/ in")
    p.add_argument("--test-quality", type=int, default=65, help="JPEG quality of test images")
    args = p.parse_args(argv)
    if not 1 <= args.test_quality <= 95:
        p.error(f"--test-quality: {args.test_quality}: must be 1..95")
    return args


def reencode(src: Path, dst: Path, quality: int) -> int:
    from PIL import Image

    with Image.open(src) as im:
        buf = io.BytesIO()
        im.convert("RGB").save(buf, "JPEG", quality=quality, optimize=True)
    dst.write_bytes(buf.getvalue())
    return len(buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from scipy.io import loadmat
        from torchvision.datasets import Flowers102
    except ImportError as exc:
        print(f"error: needs scipy, pillow and torchvision: {exc}", file=sys.stderr)
        return 2
    src, dst = Path(args.src) / "flowers-102", Path(args.dst) / "flowers-102"
    if not (src / "jpg").is_dir() or not (src / "setid.mat").is_file():
        print(
            f"error: {src}: expected flowers-102/{{jpg/,imagelabels.mat,setid.mat}}",
            file=sys.stderr,
        )
        return 2
    if dst.exists():
        shutil.rmtree(dst)
    (dst / "jpg").mkdir(parents=True)
    for name in ("imagelabels.mat", "setid.mat"):
        shutil.copyfile(src / name, dst / name)
    ids = {s: loadmat(src / "setid.mat", squeeze_me=True)[k] for s, k in SPLIT_KEYS.items()}
    sizes = {}
    for split in ("train", "val"):
        files = [f"image_{int(i):05d}.jpg" for i in ids[split]]
        for f in files:
            shutil.copyfile(src / "jpg" / f, dst / "jpg" / f)
        sizes[split] = sum((dst / "jpg" / f).stat().st_size for f in files)
    test = [f"image_{int(i):05d}.jpg" for i in ids["test"]]
    with ThreadPoolExecutor(max_workers=8) as pool:
        written = pool.map(
            lambda f: reencode(src / "jpg" / f, dst / "jpg" / f, args.test_quality), test
        )
        sizes["test"] = sum(written)
    (dst / "SOURCE.txt").write_text(
        f"Made by bench/gpu/benchdata.py from {src.resolve()}: official setid.mat and "
        f"imagelabels.mat; train and val JPEGs unchanged; test JPEGs re-encoded at quality "
        f"{args.test_quality}.\n"
    )
    for split in SPLIT_KEYS:
        ds = Flowers102(str(dst.parent), split=split, download=False)
        missing = [p for p in ds._image_files if not Path(p).is_file()]
        if missing:
            print(
                f"error: {split}: {len(missing)} images missing, e.g. {missing[0]}", file=sys.stderr
            )
            return 1
        print(f"{split:<5} {len(ds):>5} images {sizes[split] / 2**20:6.1f} MiB")
    print(f"total {sum(sizes.values()) / 2**20:.1f} MiB in {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
