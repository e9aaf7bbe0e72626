"""`rlhf run` starts no worker for a role the algorithm never uses (`rlhf_api.job.unused_roles`, the rule
the operator follows for pods): GRPO with klCoef 0 and a critic and a reference given replicas
trains with an actor, a reward and no critic or reference worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import make_job


@pytest.mark.slow
def test_grpo_without_kl_starts_no_critic_or_reference_worker(
    tiny_model: Path, ray_session: None, tmp_path: Path
):
    from rlhf_api.job import unused_roles
    from rlhf_trainer import startup

    job = make_job("no-idle", roles={"critic": {"replicas": 1}, "reference": {"replicas": 1}})
    assert job.spec.roles.critic.replicas == 1 and {"critic", "reference"} <= set(unused_roles(job.spec))
    spec = startup.resolve_spec(job.spec, tmp_path, None)
    r = startup.setup(job.metadata_name, spec, tmp_path / "run", False, None, None)
    try:
        assert r.ctx.critic is None and r.ctx.reference is None
        assert r.ctx.actor is not None and r.ctx.reward is not None
        metrics = r.stream.step()  # one real step: rollout, reward, advantage, update
        assert any(k.startswith("actor/") for k in metrics), sorted(metrics)
    finally:
        startup.teardown(r)
