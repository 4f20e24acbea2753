#!/usr/bin/env bash
# Prepares, on THIS machine, what bench/gpu/run.sh needs on the GPU machine, which has no
# network and a 64 MiB limit on what travels (repo + carried folders):
#   .whl/        Python 3.12 manylinux wheels of hpsearch's import-time needs missing there
#                (optuna and its deps, pydantic and its deps); MLflow is NOT carried: the GPU
#                runs use --no-tracking (mlflow 12 MiB + mlflow-skinny 4 MiB + server deps
#                missing there, ~25 MiB together, do not fit beside the data).
#   .benchdata/flowers-102.tar.gz  flowers-102/ in torchvision's layout (official split files,
#                train + val JPEGs as they are, test JPEGs re-encoded at JPEG quality 65:
#                benchdata.py), one .tar.gz: 1 file travels instead of 8189.
# Both are git-ignored through .git/info/exclude. Then, on the GPU machine:
#   run(command="bash bench/gpu/run.sh", carry=[".whl", ".benchdata"], timeout_s=600)
#
# Usage (from anywhere; needs pip, and scipy + pillow + torchvision in $PYTHON):
#   bash bench/gpu/prepare.sh [SRC_DATA_DIR]     # default ../shared/datasets
# Environment: PYTHON (default python3), TEST_QUALITY (default 65), MAX_MIB (default 60).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
SRC=${1:-${HPSEARCH_DATA_DIR:-../shared/datasets}}
QUALITY=${TEST_QUALITY:-65}
MAX_MIB=${MAX_MIB:-60}

if [ ! -d "$SRC/flowers-102/jpg" ]; then
  echo "error: $SRC/flowers-102/jpg: not found (pass the folder that holds flowers-102/)" >&2
  exit 2
fi
exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")"
touch "$exclude"
for pattern in /.whl/ /.benchdata/; do
  grep -qxF "$pattern" "$exclude" || echo "$pattern" >>"$exclude"
done

# Pinned to the versions the test suite ran with here (`pip list`), so the GPU runs the code
# as tested; they satisfy pyproject.toml (optuna>=5,<6; pydantic>=2.6,<3; sqlalchemy>=2,<3)
# and each other. Already on the GPU image, so not carried: click, PyYAML,
# numpy, pandas, scipy, pillow, tqdm, packaging, MarkupSafe, nvidia-ml-py, torch, torchvision.
# typing-extensions is carried because pydantic needs >= 4.16 and the image's may be older.
WHEELS=(
  optuna==5.1.0 alembic==1.20.1 colorlog==6.12.0 sqlalchemy==2.1.9 mako==1.4.3
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  typing-extensions==4.16.0
)
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}" 2> >(grep -v "is ignored" >&2)
count=$(find .whl -maxdepth 1 -type f -name "*.whl" | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "error: expected ${#WHEELS[@]} wheels in .whl/, found $count" >&2
  exit 1
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
"$PY" bench/gpu/benchdata.py --src "$SRC" --dst "$stage" --test-quality "$QUALITY"
rm -rf .benchdata
mkdir -p .benchdata
tar -cf - -C "$stage" flowers-102 | gzip -1 >.benchdata/flowers-102.tar.gz

mib() { du -sb "$@" | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null \
  | awk 'END {printf "%.1f", $1 / 1048576}')
whl=$(mib .whl)
data=$(mib .benchdata)
total=$(awk -v a="$tree" -v b="$whl" -v c="$data" 'BEGIN {printf "%.1f", a + b + c}')
echo "sizes: repo files ${tree} MiB + .whl ${whl} MiB ($count wheels) + .benchdata ${data} MiB" \
  "= ${total} MiB travelling (limit 64, aim <= ${MAX_MIB})"
if awk -v t="$total" -v m="$MAX_MIB" 'BEGIN {exit !(t > m)}'; then
  echo "error: ${total} MiB is over ${MAX_MIB} MiB; lower TEST_QUALITY (now $QUALITY)" >&2
  exit 1
fi
