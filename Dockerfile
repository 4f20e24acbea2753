# hpsearch worker image: `hpsearch worker` on one GPU (docker-compose.yml, deploy/k8s/).
# The dashboard and the one-shot schema service of docker-compose.yml reuse it without a GPU.
#
#   docker build -t hpsearch:latest .
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:<tag> -t hpsearch:latest .
#
# The base image brings CUDA, cuDNN and torch/torchvision; pip keeps those (constraints below)
# and adds hpsearch and the rest of its dependencies. Pick a tag whose CUDA runtime the hosts'
# NVIDIA driver supports (CUDA 12.8 needs driver >= 570 on Linux).
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}
# The MLflow server's and the gRPC proxy's versions (docker-compose.yml passes them): the
# client and the server, and the proxy's and the workers' Optuna schema, must match.
ARG MLFLOW_VERSION=3.17.2
ARG OPTUNA_VERSION=5.1.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDA_DEVICE_ORDER=PCI_BUS_ID \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HPSEARCH_WORKDIR=/work \
    HPSEARCH_DATA_DIR=/data \
    HPSEARCH_GPU_SLOTS_DIR=/gpu-slots \
    TORCH_HOME=/work/torch \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=true

WORKDIR /opt/hpsearch
COPY pyproject.toml README.md ./
COPY search/ search/
COPY trainer/ trainer/
COPY tracking/ tracking/
COPY studies/ studies/
# Keep the base image's torch/torchvision (else pip may fetch other multi-GB CUDA wheels).
RUN python -c "import torch, torchvision as tv; \
print('torch==' + torch.__version__.split('+')[0]); \
print('torchvision==' + tv.__version__.split('+')[0])" > /tmp/keep-torch.txt \
 && printf 'mlflow==%s\noptuna==%s\n' "${MLFLOW_VERSION}" "${OPTUNA_VERSION}" >> /tmp/keep-torch.txt \
 && python -m pip install --constraint /tmp/keep-torch.txt . \
 && python -c "import hpsearch.cli, optuna_dashboard, psycopg2" \
 && rm -rf /tmp/keep-torch.txt

COPY deploy/worker/gpu-slot.sh /usr/local/bin/gpu-slot
RUN chmod 0755 /usr/local/bin/gpu-slot \
 && useradd --create-home --uid 1000 hpsearch \
 && mkdir -p /work /data /gpu-slots /studies \
 && chown hpsearch:hpsearch /work /data /gpu-slots /studies

# Study files: the shipped ones by name (--study flowers102), or mount your own on /studies
# and use --study /studies/mine.yaml.
WORKDIR /work
USER hpsearch
CMD ["hpsearch", "--help"]
