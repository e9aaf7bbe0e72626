# syntax=docker/dockerfile:1.7
# Three images from one source tree:
#
#   docker build --target operator    -t ghcr.io/rlhf-operator/operator:0.1.0    .  # kopf operator: slim, non-root, no torch
#   docker build --target trainer     -t ghcr.io/rlhf-operator/trainer:0.1.0     .  # controller + role pods on GPUs: torch + vLLM (CUDA 13 wheels), Ray; driver >= 580
#   docker build --target trainer-cpu -t ghcr.io/rlhf-operator/trainer-cpu:0.1.0 .  # the same on CPU nodes: no vLLM
#
# BASE_IMAGE is the Python base of every image (the GPU trainer's CUDA comes with its wheels). Where Docker Hub cannot be
# reached, any Debian/Ubuntu image with python3 (>= 3.10, with venv) does: scripts/images.sh makes
# one from Debian's packages with mmdebstrap and builds these targets with buildah.
#
# Each image installs its dependencies in a layer keyed on its own requirements list alone (made by
# the `requirements` stage from pyproject.toml and constraints/<operator|trainer-cpu|trainer-gpu>.txt,
# `name==version` per line, applied with pip's `-c` when present), then the project as one small
# wheel: a change of the source rebuilds only that last layer. PIP_CACHE_DIR lets a
# builder without BuildKit cache mounts point pip at a mounted cache (scripts/images.sh does).

ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
# The project as a wheel (no dependencies), built once.
FROM ${BASE_IMAGE} AS wheels
ARG PIP_CACHE_DIR=/root/.cache/pip
ENV PIP_CACHE_DIR=${PIP_CACHE_DIR} PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api/ api/
COPY operator/ operator/
COPY trainer/ trainer/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/build \
 && /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
# Each image's requirements, from pyproject.toml and its pin file. An image copies only its own
# list, so its dependency layer is rebuilt when that list changes, not when another part of
# pyproject.toml does (the pytest settings, the dev extra).
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml scripts/image_requirements.py /opt/requirements/
COPY constraints/ /opt/requirements/constraints/
WORKDIR /opt/requirements
RUN python3 image_requirements.py pyproject.toml \
      --constraints /opt/requirements/constraints/operator.txt operator >operator.txt \
 && python3 image_requirements.py pyproject.toml \
      --constraints /opt/requirements/constraints/trainer-cpu.txt trainer operator >trainer-cpu.txt \
 && python3 image_requirements.py pyproject.toml \
      --constraints /opt/requirements/constraints/trainer-gpu.txt trainer operator gpu >trainer-gpu.txt

# ---------------------------------------------------------------------------------------------
# Operator: `rlhf_api` and `rlhf_operator` with kopf and the Kubernetes client; no trainer, no torch, no Ray.
FROM ${BASE_IMAGE} AS operator
ARG PIP_CACHE_DIR=/root/.cache/pip
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_CACHE_DIR=${PIP_CACHE_DIR} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# Its list, and the pin file the list names with `-c`.
COPY --from=requirements /opt/requirements/operator.txt /opt/requirements/operator.txt
COPY --from=requirements /opt/requirements/constraints/operator.txt /opt/requirements/constraints/operator.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv $VIRTUAL_ENV \
 && pip install --upgrade pip \
 && pip install -r /opt/requirements/operator.txt
# The API and the operator only (no trainer): their sources on the venv's path, run as
# `python -m rlhf_operator` (the chart's command).
COPY api/rlhf_api/ /opt/app/rlhf_api/
COPY operator/rlhf_operator/ /opt/app/rlhf_operator/
ENV PYTHONPATH=/opt/app
RUN python3 -m compileall -q /opt/app \
 && useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin rlhf
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["python3", "-m", "rlhf_operator"]
CMD ["operator", "--all-namespaces", "--liveness=http://0.0.0.0:8081/healthz", "--metrics-port=8080"]
HEALTHCHECK NONE

# ---------------------------------------------------------------------------------------------
# Trainer for CPU nodes: Ray head + controller (`rlhf controller`) and role pods (`rlhf worker`),
# torch, transformers and the Kubernetes client (status.progress); no vLLM, no CUDA base.
FROM ${BASE_IMAGE} AS trainer-cpu
ARG PIP_CACHE_DIR=/root/.cache/pip
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_CACHE_DIR=${PIP_CACHE_DIR} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# Its list, and the pin file the list names with `-c`.
COPY --from=requirements /opt/requirements/trainer-cpu.txt /opt/requirements/trainer-cpu.txt
COPY --from=requirements /opt/requirements/constraints/trainer-cpu.txt /opt/requirements/constraints/trainer-cpu.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv $VIRTUAL_ENV \
 && pip install --upgrade pip \
 && pip install -r /opt/requirements/trainer-cpu.txt
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
# Trainer for GPU nodes: the same with vLLM, on the same plain base. The torch and vLLM wheels from
# PyPI carry their CUDA user-space libraries (torch 2.13+: CUDA 13, the nvidia-* and cuda-toolkit
# wheels), so the base needs no CUDA of its own; what it needs from the node is the NVIDIA driver,
# R580 or newer for CUDA 13 (NVIDIA's minor-version compatibility table; the labels below, the
# pods' start-up check `rlhf_trainer.gpu_preflight`, and the container toolkit's
# NVIDIA_REQUIRE_CUDA all say so). Also in this image: a C compiler and the Python headers
# (Triton compiles its launchers at run time: without them vLLM's kernels fail inside `LLM()`),
# and the InfiniBand verbs libraries NCCL loads for RDMA (rdma-core's runtime packages:
# libibverbs1, its providers such as mlx5, librdmacm1; without them NCCL silently uses TCP).
# The default (last) target. Package versions: constraints/trainer-gpu.txt when present.
FROM ${BASE_IMAGE} AS trainer
ARG PIP_CACHE_DIR=/root/.cache/pip
# The CUDA major version the wheels carry and its driver floor (checked against torch below).
ARG CUDA_VERSION=13
ARG CUDA_DRIVER_MIN=580
LABEL org.opencontainers.image.title="rlhf-operator trainer (GPU)" \
      org.opencontainers.image.description="Controller and role pods on NVIDIA GPUs: torch, vLLM, Ray; CUDA ${CUDA_VERSION} from the wheels, needs NVIDIA driver >= ${CUDA_DRIVER_MIN}" \
      dev.rlhf.cuda.version="${CUDA_VERSION}" \
      dev.rlhf.cuda.driver-min="${CUDA_DRIVER_MIN}"
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_CACHE_DIR=${PIP_CACHE_DIR} PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    RLHF_CUDA_DRIVER_MIN=${CUDA_DRIVER_MIN} \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=${CUDA_VERSION}.0"
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
      libibverbs1 ibverbs-providers librdmacm1 \
 && { python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
      || apt-get install -y --no-install-recommends python3-dev; } \
 && rm -rf /var/lib/apt/lists/*
# Its list, and the pin file the list names with `-c`.
COPY --from=requirements /opt/requirements/trainer-gpu.txt /opt/requirements/trainer-gpu.txt
COPY --from=requirements /opt/requirements/constraints/trainer-gpu.txt /opt/requirements/constraints/trainer-gpu.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv $VIRTUAL_ENV \
 && pip install --upgrade pip \
 && pip install -r /opt/requirements/trainer-gpu.txt
COPY --from=wheels /wheels /opt/wheels
# The labels must say what torch carries: the build stops here otherwise.
RUN pip install --no-deps --no-index /opt/wheels/*.whl \
 && python -m rlhf_trainer.gpu_preflight --labels "${CUDA_VERSION}" "${CUDA_DRIVER_MIN}" \
 && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin rlhf
USER 1000:1000
WORKDIR /home/rlhf
EXPOSE 6379 8080
ENTRYPOINT []
CMD ["rlhf", "--help"]
