# syntax=docker/dockerfile:1
# The inflight serving runtime: `inflight serve` as a non-root user, on a plain Ubuntu base.
# No CUDA base image: PyPI's torch 2.13.0 is a CUDA 13.0 build that carries its own CUDA runtime
# and libraries (nvidia-* / cuda-* wheels); the GPU node supplies only the kernel driver
# (>= 580 for CUDA 13, docs/gpu.md), which the NVIDIA container toolkit mounts in. A CUDA base
# image would add a second CUDA that nothing uses (it was 12.8, against torch's 13.0).
# Build from the repository root (docs/images.md):
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/inflight-dev/inflight-runtime:0.1.0 .
ARG BASE_IMAGE=ubuntu:24.04
# The torch the Makefile pins (scripts/install_torch.py), and the CUDA its PyPI build carries
# (torch.version.cuda): the build stops if they disagree, and the container toolkit refuses a
# driver too old for that CUDA (NVIDIA_REQUIRE_CUDA below).
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=13.0

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION
ARG TORCH_CUDA
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/inflight
ENV PATH=/opt/inflight/bin:$PATH
# torch first and pinned, as the Makefile does, so no later range picks another build; then
# check that it is the CUDA build this image declares.
RUN pip install "torch==${TORCH_VERSION}" \
    && python -c "import sys, torch; c = torch.version.cuda; sys.exit(0 if c == '${TORCH_CUDA}' else \
f'torch {torch.__version__} is a CUDA {c} build, not ${TORCH_CUDA}: update TORCH_CUDA here and docs/gpu.md')"
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY inflight ./inflight
RUN pip install . && rm -rf /src

FROM ${BASE_IMAGE}
ARG TORCH_CUDA
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles its small C launchers at run time: it needs a C compiler and Python headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# uid 1000 is what the operator's pods run as (inflight.operator.render.RUN_AS_USER); the
# Ubuntu base ships a user "ubuntu" with that uid, so it makes way.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 inflight \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/inflight inflight
COPY --from=build /opt/inflight /opt/inflight
# What the NVIDIA container toolkit reads (a CUDA base image would have set them): mount the
# driver's compute and nvidia-smi libraries, and refuse a driver older than torch's CUDA needs.
# The GPUs themselves come from the pod's nvidia.com/gpu limit (or docker run --gpus).
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=${TORCH_CUDA}"
ENV PATH=/opt/inflight/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/inflight \
    HF_HUB_OFFLINE=1 \
    TRITON_CACHE_DIR=/tmp/triton
USER 1000:1000
WORKDIR /home/inflight
EXPOSE 8000
# Arguments replace CMD, so pass the address too, e.g.
#   docker run --gpus all -v /srv/models:/models IMAGE --model /models/NAME --host 0.0.0.0
# (the operator sets command and args itself).
ENTRYPOINT ["inflight", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
