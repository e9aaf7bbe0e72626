# syntax=docker/dockerfile:1.7
# Two images from one source tree:
#
#   docker build --target operator -t ghcr.io/rlhf-operator/operator:0.1.0 .   # kopf operator: slim, non-root, no torch
#   docker build --target trainer  -t ghcr.io/rlhf-operator/trainer:0.1.0  .   # controller + role pods: CUDA, torch, vLLM, Ray
#
# Written against Docker's documented practice (multi-stage, pinned bases, BuildKit cache mounts,
# non-root users, no build tools in the final images); not built in this repository's CI, which
# has no container runtime.

ARG PYTHON_VERSION=3.11
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

# ---------------------------------------------------------------------------------------------
# Wheels of the project and of the operator's dependencies, built once.
FROM python:${PYTHON_VERSION}-slim AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --wheel-dir /wheels ".[operator]"

# ---------------------------------------------------------------------------------------------
# Operator: the `rlhf` command with kopf and the Kubernetes client; no torch, no Ray.
FROM python:${PYTHON_VERSION}-slim AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "rlhf-operator[operator]" \
 && useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin rlhf
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["rlhf"]
CMD ["operator", "--all-namespaces", "--liveness=http://0.0.0.0:8081/healthz", "--metrics-port=8080"]
HEALTHCHECK NONE

# ---------------------------------------------------------------------------------------------
# Trainer: Ray head + controller (`rlhf controller`) and Ray workers (`ray start`) on GPU nodes.
FROM ${CUDA_IMAGE} AS trainer
ARG PYTHON_VERSION
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python${PYTHON_VERSION} python${PYTHON_VERSION}-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python${PYTHON_VERSION} -m venv $VIRTUAL_ENV
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ".[trainer,gpu]" \
 && rm -rf /src
# The pods run with runAsUser 1000 and a read-only root filesystem; /tmp and /dev/shm are volumes.
RUN useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin rlhf
USER 1000:1000
WORKDIR /home/rlhf
EXPOSE 6379 8080
ENTRYPOINT []
CMD ["rlhf", "--help"]
