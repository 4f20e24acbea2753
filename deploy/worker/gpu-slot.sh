#!/usr/bin/env bash
# gpu-slot COMMAND...: pin this container to ONE free GPU of the host, then exec COMMAND.
#
# Why: Docker gives a container that reserves `count: 1` GPU always the host's first GPU, so
# `docker compose up --scale worker=4` would put all four workers on GPU 0
# (docker/compose#11863, NVIDIA/nvidia-container-toolkit#521). The worker service therefore
# sees every GPU (`count: all`) and each replica claims one with an exclusive flock on
# $HPSEARCH_GPU_SLOTS_DIR/gpu-<index>.lock, a named volume that the replicas of one host share.
# The lock lives as long as COMMAND (the open descriptor survives exec), so a restarted or
# replacement container takes over a GPU that was freed.
#
# HPSEARCH_GPUS: "auto" (default: every GPU the container sees), a list such as "0,2,3",
# or "none" (do not pin). A CUDA_VISIBLE_DEVICES set by the user wins (with "auto").
# No free GPU: exit 75 with one line saying so (more replicas than GPUs).
set -euo pipefail

slots_dir=${HPSEARCH_GPU_SLOTS_DIR:-/gpu-slots}
gpus=${HPSEARCH_GPUS:-auto}

if [[ $# -eq 0 ]]; then
  echo "usage: gpu-slot COMMAND [ARGS...]" >&2
  exit 2
fi
if [[ "$gpus" == none || ( "$gpus" == auto && -n "${CUDA_VISIBLE_DEVICES:-}" ) ]]; then
  exec "$@"
fi
if [[ "$gpus" == auto ]]; then
  n=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  gpus=$(seq -s, 0 $((n - 1)))
fi
if [[ -z "$gpus" ]]; then
  echo "gpu-slot: no GPU visible in this container; running unpinned" >&2
  exec "$@"
fi

mkdir -p "$slots_dir"
IFS=, read -ra candidates <<<"$gpus"
for g in "${candidates[@]}"; do
  exec {fd}>>"$slots_dir/gpu-$g.lock"
  if flock --nonblock "$fd"; then
    export CUDA_VISIBLE_DEVICES=$g
    echo "gpu-slot: $(hostname) runs on GPU $g" >&2
    exec "$@"
  fi
  exec {fd}>&-
done
echo "gpu-slot: every GPU ($gpus) already has a worker on this host;" \
  "run at most ${#candidates[@]} worker replicas here" >&2
exit 75
