#!/usr/bin/env bash
# The GPU benchmarks in one device call, from the repo root, after bench/gpu/prepare.sh here:
#   run(command="bash bench/gpu/run.sh", carry=[".whl", ".benchdata"], timeout_s=600)
#
# Steps in the order they run (STEPS="..." picks and orders them); each is capped with
# `timeout` inside one budget (BUDGET_S, default 540 s, so the call ends inside its 10
# minutes), and a step that no longer fits is skipped. The study runs before packing so that
# its 200 s always fit. One summary line per step, repeated at the end:
#   nvml             hpsearch.tracking.gpu against the real GPU      bench/gpu/nvml_check.py
#   trainer          img/s, eager: resnet18 128px b256 and b32,      bench/trainer.py
#                    resnet50 224px b256
#   study            flowers102 for 200 s, 4 workers (STUDY_WORKERS) bench/study.py
#   study-b          the same with STUDY_B_SET's --set overrides     bench/study.py
#                    ('field=value;field=value'; not in the default STEPS)
#   packing          trials/h, img/s, GPU util with 1, 2, 4 workers  bench/packing.py
#                    (ResNet-18 at 112 px, batch 64: the issue's packing reference batch)
#   paths            fp16, a real CUDA OOM and recovery, compile reuse bench/gpu/paths_check.py
#   trainer-compile  resnet18 128px b256 and resnet50 224px b256     bench/trainer.py --compile
#   packing-auto     --workers auto, as many trials as W=4 had       bench/packing.py
#   recipes          fixed flowers102 configurations side by side    bench/gpu/recipes.py
#                    (RECIPES_S s each), eval variants of each best
#                    (not in the default STEPS)
# With the default budget the last steps run only as far as time is left (BUDGET_S=570 gives
# them 30 s more). Results: $OUT/{nvml,trainer,packing,study,paths,packing-auto}.json and
# $OUT/run.log (8 files at most come back from the machine).
# Exit status 1 when a step failed or timed out (its summary line says which).
#
# Rehearsal on a CPU (no wheels, the project's venv, tiny settings, ~2 minutes on 2 cores):
#   PYTHON=.venv/bin/python SKIP_WHEELS=1 DEVICE=cpu QUICK=1 OUT=/tmp/gpu-out bash bench/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/bench-gpu-out}
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET_S:-540}
DATA=${DATA_DIR:-/tmp/benchdata}  # .benchdata/flowers-102.tar.gz is unpacked here
WORK=${WORK_DIR:-/tmp/bench-gpu-work}
mkdir -p "$OUT" "$WORK"
T0=$SECONDS
SUMMARY=()
FAILED=0

main() {
echo "== $(date -u +%FT%TZ) $(hostname) budget ${BUDGET}s device $DEVICE"
if [ -z "${SKIP_WHEELS:-}" ]; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "FATAL: no .whl/*.whl here: run bench/gpu/prepare.sh first and carry .whl" >&2
    return 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "FATAL: wheel install failed" >&2; return 2; }
  # hpsearch from this tree, laid out as pyproject's package-dir maps it (no build needed).
  rm -rf /tmp/hps && mkdir -p /tmp/hps/hpsearch && cp -r search/. /tmp/hps/hpsearch/
  for d in trainer tracking studies; do cp -r "$d" "/tmp/hps/hpsearch/$d"; done
  export PYTHONPATH=/tmp/hps:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ ! -d "$DATA/flowers-102/jpg" ]; then
  if [ ! -f .benchdata/flowers-102.tar.gz ]; then
    echo "FATAL: .benchdata/flowers-102.tar.gz missing: run bench/gpu/prepare.sh, carry .benchdata" >&2
    return 2
  fi
  mkdir -p "$DATA"
  if ! tar -xzf .benchdata/flowers-102.tar.gz -C "$DATA"; then
    echo "FATAL: cannot unpack .benchdata/flowers-102.tar.gz" >&2
    return 2
  fi
fi
"$PY" -c "import hpsearch, optuna, torch, torchvision; print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'torchvision', torchvision.__version__, 'optuna', optuna.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" \
  || { echo "FATAL: imports failed" >&2; return 2; }
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
fi
run_steps
}

left() { echo $((BUDGET - (SECONDS - T0))); }

# Processes of ours still on the GPU after a step (a bench killed by its cap): end them by id,
# only those whose command line is an hpsearch or bench one.
reap() {
  [ "$DEVICE" = cuda ] || return 0
  local pid cmd
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || continue
    case "$cmd" in
      *hpsearch*|*bench/*) echo "reap: killing leftover pid $pid: ${cmd:0:120}"; kill -9 "$pid" ;;
    esac
  done
}

# step NAME MIN_S CAP_S KIND JSON -- CMD...: run CMD under `timeout` if MIN_S seconds are left.
step() {
  local name=$1 min=$2 cap=$3 kind=$4 json=$5
  shift 6
  local l
  l=$(left)
  if ((l < min)); then
    SUMMARY+=("$name: skipped (${l}s left, needs ${min}s)")
    echo "== ${SUMMARY[-1]}"
    return 0
  fi
  ((cap > l - 5)) && cap=$((l - 5))
  echo "== $name (cap ${cap}s, ${l}s left): $*"
  local start=$SECONDS rc status line
  PYTHONUNBUFFERED=1 timeout -k 20 "$cap" "$@"
  rc=$?
  reap
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMEOUT after ${cap}s" ;;
    *) status="exit $rc" ;;
  esac
  [ "$status" = ok ] || FAILED=1
  line=$("$PY" bench/gpu/summarize.py "$kind" "$json" 2>&1)
  SUMMARY+=("$name: $status in $((SECONDS - start))s; $line")
  echo "== ${SUMMARY[-1]}"
}

# trainer LABEL ARCH RES BATCH MIN_S CAP_S [--compile]: bench/trainer.py, its JSON merged
# into $OUT/trainer.json under LABEL (one file for all configs: few files come back).
trainer() {
  local label=$1 arch=$2 res=$3 batch=$4 min=$5 cap=$6
  shift 6
  rm -f "$WORK/trainer-$label.json"
  step "trainer-$label" "$min" "$cap" trainer "$WORK/trainer-$label.json" -- \
    "$PY" bench/trainer.py --arch "$arch" --resolution "$res" --batch "$batch" "$@" \
    "${TRAIN[@]}" --device "$DEVICE" --data-dir "$DATA" --workdir "$WORK/trainer" \
    --json "$WORK/trainer-$label.json"
  [ -f "$WORK/trainer-$label.json" ] && "$PY" -c '
import json, pathlib, sys
out, label, src = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
merged = json.loads(out.read_text()) if out.is_file() else {}
merged[label] = json.loads(src.read_text())
out.write_text(json.dumps(merged, indent=2))' "$OUT/trainer.json" "$label" "$WORK/trainer-$label.json"
  return 0
}

run_steps() {
if [ -n "${QUICK:-}" ]; then  # the CPU rehearsal: tiny images, one epoch, short study
  SMALL=(--set dataset.image_size=32 --set dataset.cache_size=36 --set dataset.eval_limit=255)
  # a cache_size under the study's searched sizes is refused at load: shrink those too
  SMALL+=(--set 'search_space.image_size={type: categorical, choices: [32]}')
  PACK=(--trials-per-worker 1 --epochs 1 "${SMALL[@]}" --set trainer.evaluate_test=false)
  PACK_W=(1 2)
  TRAIN=(--steps 3 --warmup 1)
  EAGER=("r18-32-b16 resnet18 32 16")
  COMPILED=()
  STUDY=(--workers 2 --grace 20 "${SMALL[@]}" --set budget.max_epochs=2
    --set pruner.options.min_resource=1 --set 'search_space.arch={type: categorical, choices: [resnet18]}'
    --set 'enqueue_trials=[{arch: resnet18, image_size: 32, batch_size: 256, lr: 0.1}]')  # at 32 px
  STUDY_S=30
  RECIPE=(--epochs-scale 0.02 --size 32 --only e150 e300-cutmix "${SMALL[@]}")
  RECIPE_S=60
else
  PACK=(--trials-per-worker 2 --epochs 10 --launch-timeout 90 --params '{"batch_size": 64}')
  PACK_W=(1 2 4)
  TRAIN=(--steps 15 --warmup 3 --workers 16)  # 16 DataLoader workers, as the issue's 1,900 img/s
  EAGER=("r18-128-b256 resnet18 128 256" "r18-128-b32 resnet18 128 32" "r50-224-b256 resnet50 224 256")
  COMPILED=("r18-128-b256-compile resnet18 128 256" "r50-224-b256-compile resnet50 224 256")
  STUDY=(--workers "${STUDY_WORKERS:-4}" --grace 30 --target 0.4 0.5 0.6 0.65 0.7)
  STUDY_S=200
  RECIPE=()
  RECIPE_S=${RECIPES_S:-200}
fi
COMMON=(--device "$DEVICE" --data-dir "$DATA" --workdir "$WORK")
local name config label arch res batch study_s item
local -a sets items
for name in ${STEPS:-nvml trainer study packing paths trainer-compile packing-auto}; do
  case $name in
    nvml)
      [ "$DEVICE" = cuda ] && step nvml 20 45 nvml "$OUT/nvml.json" -- \
        "$PY" bench/gpu/nvml_check.py --json "$OUT/nvml.json" ;;
    trainer)
      for config in "${EAGER[@]}"; do
        read -r label arch res batch <<<"$config"
        trainer "$label" "$arch" "$res" "$batch" 25 60
      done ;;
    trainer-compile)  # compiling in the warm-up steps takes most of the cap
      for config in "${COMPILED[@]}"; do
        read -r label arch res batch <<<"$config"
        trainer "$label" "$arch" "$res" "$batch" 60 150 --compile
      done ;;
    packing)
      step packing 60 200 packing "$OUT/packing.json" -- \
        "$PY" bench/packing.py "${COMMON[@]}" --workers "${PACK_W[@]}" "${PACK[@]}" \
        --json "$OUT/packing.json" ;;
    paths)
      [ "$DEVICE" = cuda ] && step paths 40 150 paths "$OUT/paths.json" -- \
        "$PY" bench/gpu/paths_check.py --data-dir "$DATA" --workdir "$WORK/paths" \
        --json "$OUT/paths.json" ;;
    packing-auto)  # the launcher's own choice, with as many trials as the largest W above
      [ "$DEVICE" = cuda ] && step packing-auto 90 150 packing "$OUT/packing-auto.json" -- \
        "$PY" bench/packing.py "${COMMON[@]}" --workers auto "${PACK[@]}" \
        --json "$OUT/packing-auto.json" ;;
    study | study-b)
      # What is left, up to STUDY_S seconds of search; the cap adds the grace (30 s), the
      # bench's stop escalation (up to 40 s), the cache build and reading back.
      # --workers auto's GPU probe counts inside --timeout (from the launch command's start)
      # study-b: the same with STUDY_B_SET's overrides ('field=value' items split at ';'),
      # a variant of the study file measured beside it in one lease. One that narrows the
      # search space past the study's enqueued trial needs 'enqueue_trials=[]' too.
      sets=()
      if [ "$name" = study-b ]; then
        IFS=';' read -ra items <<<"${STUDY_B_SET:-}"
        for item in "${items[@]}"; do [ -n "$item" ] && sets+=(--set "$item"); done
      fi
      study_s=$(($(left) - 100))
      ((study_s > STUDY_S)) && study_s=$STUDY_S
      step "$name" 130 $((study_s + 90)) study "$OUT/$name.json" -- \
        "$PY" bench/study.py "${COMMON[@]}" --timeout "$study_s" "${STUDY[@]}" "${sets[@]}" \
        --json "$OUT/$name.json" ;;
    recipes)  # fixed configurations side by side, then each best model's eval variants
      step recipes 120 $((RECIPE_S + 60)) recipes "$OUT/recipes.json" -- \
        "$PY" bench/gpu/recipes.py --device "$DEVICE" --data-dir "$DATA" \
        --workdir "$WORK/recipes" --trial-timeout "$RECIPE_S" "${RECIPE[@]}" \
        --json "$OUT/recipes.json" ;;
    *) echo "== unknown step $name (steps: nvml trainer study study-b packing paths trainer-compile packing-auto recipes)" ;;
  esac
done

echo "== summary ($((SECONDS - T0))s of ${BUDGET}s)"
printf '%s\n' "${SUMMARY[@]}"
return "$FAILED"
}

main 2>&1 | tee -a "$OUT/run.log"
exit "${PIPESTATUS[0]}"
