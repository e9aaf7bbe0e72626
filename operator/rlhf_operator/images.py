"""The trainer image a job's pods run: the job's `spec.image`, else the operator's default.

A platform builds and pushes its own images (docs/install.md), so no image name in the CRD can be
right for every cluster: `spec.image` defaults to empty, and the operator fills it from its own
setting, `RLHF_OPERATOR_TRAINER_IMAGE`, which the chart sets from `trainerImage` (GPU or CPU
variant, tag defaulting to the chart's appVersion). A job that names no image on an operator that
has no default is invalid (`missing_image`): the condition says which field and which chart value.
The setting is read on each call, so an operator restarted with another default builds the new
image into pods it creates from then on (existing pods keep theirs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from rlhf_api.job import JobSpec

#: The operator's default trainer image (the chart's `trainerImage.*`).
ENV_TRAINER_IMAGE = "RLHF_OPERATOR_TRAINER_IMAGE"


def default_image(env: Mapping[str, str] | None = None) -> str:
    """The operator's default trainer image; "" when none is configured."""
    return (os.environ if env is None else env).get(ENV_TRAINER_IMAGE, "").strip()


def trainer_image(spec: JobSpec, env: Mapping[str, str] | None = None) -> str:
    """The image of every container of the job: `spec.image`, else the operator's default ("")."""
    return spec.image or default_image(env)


def missing_image(spec: JobSpec, env: Mapping[str, str] | None = None) -> str | None:
    """Why the job has no image (a spec error), or None when it has one."""
    if trainer_image(spec, env):
        return None
    return (
        "spec.image: empty, and this operator has no default trainer image "
        f"({ENV_TRAINER_IMAGE} is unset); set spec.image, or install the chart with "
        "trainerImage.repository (and trainerImage.tag) naming an image built from the "
        "project's Dockerfile (docs/install.md)"
    )
