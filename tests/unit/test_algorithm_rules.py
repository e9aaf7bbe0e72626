"""The cross-field rules of issue 22 on the valid side: what the new refusals must still admit
(the refusals themselves are rows of tests/admission_cases.py)."""

from __future__ import annotations

import pytest
from admission_cases import A, P, base, both, setp, variant

from rlhf_api import admission
from rlhf_api.loader import parse_job


@pytest.mark.parametrize(
    "case,change",
    [
        (
            "online_dpo best vs worst of 4",
            both(setp(f"{A}.name", "online_dpo"), setp(f"{P}", {}), setp("spec.rollout.samplesPerPrompt", 4)),
        ),
        (
            "gspo with groups of 2",
            both(setp(f"{A}.name", "gspo"), setp(f"{P}", {}), setp("spec.rollout.samplesPerPrompt", 2)),
        ),
        (
            "reinforce_plus_plus (no group baseline) with one sample",
            both(
                setp(f"{A}.name", "reinforce_plus_plus"),
                setp(f"{P}", {}),
                setp("spec.rollout.samplesPerPrompt", 1),
                setp("spec.training.miniBatchSize", 0),
            ),
        ),
        (
            "grpo with a non-group estimator and one sample",
            both(
                setp(f"{P}", {"advantageEstimator": "reinforce_plus_plus"}),
                setp("spec.rollout.samplesPerPrompt", 1),
                setp("spec.training.miniBatchSize", 0),
            ),
        ),
        ("adaptive KL with a coefficient", setp(f"{P}", {"klController": "adaptive", "klCoef": 0.01})),
        (
            "DAPO's recipe and the rollout correction",
            both(
                setp(
                    f"{P}",
                    {"klCoef": 0.0, "overlongBufferLength": 16, "maskTruncated": True, "clipRatioHigh": 0.28},
                ),
                setp(f"{A}.dynamicSampling", {"enabled": True, "maxExtraRounds": 2}),
                setp(
                    f"{A}.rolloutCorrection",
                    {"enabled": True, "level": "sequence", "mode": "mask", "cap": 3.0},
                ),
            ),
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_valid_combinations_are_admitted_in_both_places(case, change):
    doc = variant(change)
    assert admission.admit(doc)[1] == [], case
    spec = parse_job(doc).spec
    assert spec.algorithm.name == doc["spec"]["algorithm"]["name"]


def test_the_new_sections_default_off():
    spec = parse_job(base()).spec
    assert (
        not spec.algorithm.dynamic_sampling.enabled and spec.algorithm.dynamic_sampling.max_extra_rounds == 3
    )
    rc = spec.algorithm.rollout_correction
    assert (rc.enabled, rc.level, rc.mode, rc.cap) == (False, "token", "truncate", 2.0)
