# syntax=docker/dockerfile:1
# The inflight serving runtime: `inflight serve` on a CUDA base image, as a non-root user.
# Build from the repository root:
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/inflight-dev/inflight-runtime:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/inflight
ENV PATH=/opt/inflight/bin:$PATH
# torch first and pinned, as the Makefile does, so no later range picks another build.
RUN pip install torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY inflight ./inflight
RUN pip install . && rm -rf /src

FROM ${CUDA_IMAGE}
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
