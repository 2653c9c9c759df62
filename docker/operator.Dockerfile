# syntax=docker/dockerfile:1
# The inflight operator: `kopf run -m inflight.operator.kopf_main` on slim Python, as a non-root user.
# It imports no torch, so the package goes in without its dependencies and only the
# operator's own are added.
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/inflight-dev/inflight-operator:0.1.0 .
FROM python:3.12-slim
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY inflight ./inflight
RUN pip install --no-deps . \
    && pip install "kopf>=1.37" "kubernetes>=37" "prometheus-client>=0.20" "aiohttp>=3.9" "pyyaml>=6" \
    && rm -rf /src
RUN groupadd --gid 10001 inflight \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp inflight
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080
# The chart passes --standalone, --all-namespaces or --namespace, and --liveness.
ENTRYPOINT ["kopf", "run", "--module=inflight.operator.kopf_main"]
CMD ["--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
