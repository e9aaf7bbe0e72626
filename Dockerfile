# syntax=docker/dockerfile:1.7
# Three images from one source tree:
#
#   docker build --target operator    -t ghcr.io/rlhf-operator/operator:0.1.0    .  # kopf operator: slim, non-root, no torch
#   docker build --target trainer     -t ghcr.io/rlhf-operator/trainer:0.1.0     .  # controller + role pods on GPUs: CUDA, torch, vLLM, Ray
#   docker build --target trainer-cpu -t ghcr.io/rlhf-operator/trainer-cpu:0.1.0 .  # the same on CPU nodes: no CUDA base, no vLLM
#
# BASE_IMAGE is the Python base of the operator and trainer-cpu images. Where Docker Hub cannot be
# reached, any Debian/Ubuntu image with python3 (>= 3.10, with venv) does: scripts/images.sh makes
# one from Debian's packages with mmdebstrap and builds these targets with buildah.
#
# Each image installs its dependencies in a layer keyed on pyproject.toml alone, then the project
# as one small wheel: a change of the source rebuilds only that last layer. PIP_CACHE_DIR lets a
# builder without BuildKit cache mounts point pip at a mounted cache (scripts/images.sh does).

ARG BASE_IMAGE=python:3.11-slim
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------------------------------------
# The project as a wheel (no dependencies), built once.
FROM ${BASE_IMAGE} AS wheels
ARG PIP_CACHE_DIR=/root/.cache/pip
ENV PIP_CACHE_DIR=${PIP_CACHE_DIR} PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/build \
 && /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
# Operator: the `rlhf` command with kopf and the Kubernetes client; no torch, no Ray.
FROM ${BASE_IMAGE} AS operator
ARG PIP_CACHE_DIR=/root/.cache/pip
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_CACHE_DIR=${PIP_CACHE_DIR} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
COPY pyproject.toml scripts/image_requirements.py /opt/requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv $VIRTUAL_ENV \
 && pip install --upgrade pip \
 && python3 /opt/requirements/image_requirements.py /opt/requirements/pyproject.toml operator >/opt/requirements/operator.txt \
 && pip install -r /opt/requirements/operator.txt
COPY --from=wheels /wheels /opt/wheels
RUN pip install --no-deps --no-index /opt/wheels/*.whl \
 && useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin rlhf
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["rlhf"]
CMD ["operator", "--all-namespaces", "--liveness=http://0.0.0.0:8081/healthz", "--metrics-port=8080"]
HEALTHCHECK NONE

# ---------------------------------------------------------------------------------------------
# Trainer for CPU nodes: Ray head + controller (`rlhf controller`) and role pods (`rlhf worker`),
# torch, transformers and the Kubernetes client (status.progress); no vLLM, no CUDA base.
FROM ${BASE_IMAGE} AS trainer-cpu
ARG PIP_CACHE_DIR=/root/.cache/pip
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_CACHE_DIR=${PIP_CACHE_DIR} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
COPY pyproject.toml scripts/image_requirements.py /opt/requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv $VIRTUAL_ENV \
 && pip install --upgrade pip \
 && python3 /opt/requirements/image_requirements.py /opt/requirements/pyproject.toml trainer operator >/opt/requirements/trainer.txt \
 && pip install -r /opt/requirements/trainer.txt
COPY --from=wheels /wheels /opt/wheels
# The pods run with runAsUser 1000 and a read-only root filesystem; /tmp and /dev/shm are volumes.
RUN pip install --no-deps --no-index /opt/wheels/*.whl \
 && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin rlhf
USER 1000:1000
WORKDIR /home/rlhf
EXPOSE 6379 8080
ENTRYPOINT []
CMD ["rlhf", "--help"]

# ---------------------------------------------------------------------------------------------
# Trainer for GPU nodes: the same on a CUDA base, with vLLM. The default (last) target.
FROM ${CUDA_IMAGE} AS trainer
ARG PYTHON_VERSION
ARG PIP_CACHE_DIR=/root/.cache/pip
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_CACHE_DIR=${PIP_CACHE_DIR} PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python${PYTHON_VERSION} python${PYTHON_VERSION}-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python${PYTHON_VERSION} -m venv $VIRTUAL_ENV
COPY pyproject.toml scripts/image_requirements.py /opt/requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --upgrade pip \
 && python /opt/requirements/image_requirements.py /opt/requirements/pyproject.toml trainer operator gpu >/opt/requirements/trainer.txt \
 && pip install -r /opt/requirements/trainer.txt
COPY --from=wheels /wheels /opt/wheels
RUN pip install --no-deps --no-index /opt/wheels/*.whl \
 && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin rlhf
USER 1000:1000
WORKDIR /home/rlhf
EXPOSE 6379 8080
ENTRYPOINT []
CMD ["rlhf", "--help"]
