"""One tenant cannot take the shared operator down, on the real control plane: a job asking for
a million pods is refused by the API server, a job nested 1000 deep (accepted by the API server:
no schema bounds a free-form field's depth) Fails with a condition while the operator process
stays up and a second tenant's job, created at the same time, reaches Running; a forged
`status.restarts` of 10^12 costs the operator nothing; a hostPath is refused unless the
operator's allow-list names it. The operator's peak RSS is measured in each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_for
from kubernetes.client import ApiException
from test_operator_e2e import GROUP, PLURAL, VERSION, Api, grpo_job, installed, operator, unique  # noqa: F401

from rlhf_operator import safe_json
from rlhf_operator.testing import OperatorProcess

pytestmark = pytest.mark.cluster

#: What the operator may grow by while it serves a hostile job (it is about 100 MiB at rest).
RSS_GROWTH_LIMIT = 100 << 20


def _jobs_path(namespace: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"


def _failed(api: Api, cluster: Cluster, name: str, timeout: float = 90) -> dict[str, Any]:
    """The Failed condition of job `name`, read as raw text (the object may be nested too deep for
    the test's own JSON decoder) and decoded with the operator's bounded decoder."""

    def read() -> dict[str, Any] | None:
        text = cluster.request("GET", f"{_jobs_path(api.ns)}/{name}", raw=True)
        status = safe_json.loads(text).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c.get("type") == "Failed"), None)

    return wait_for(read, timeout=timeout, what=f"job {api.ns}/{name} to fail")  # type: ignore[no-any-return]


def test_a_million_replicas_is_refused_by_the_api_server(
    cluster: Cluster,
    namespace: str,
    installed: Any,  # noqa: F811  (the chart's CRD: run alone, the test met a 404, not the CRD's 422)
) -> None:
    api = Api(cluster, namespace)
    doc = grpo_job("huge")
    doc["spec"]["roles"]["rollout"].update(replicas=1_000_000, maxReplicas=1_000_000)
    with pytest.raises(ApiException) as err:
        api.apply(doc)
    assert err.value.status == 422
    assert "spec.roles.rollout.replicas" in err.value.body and "1024" in err.value.body
    doc = grpo_job("wide")
    doc["spec"]["roles"]["actor"]["replicas"] = 1000
    doc["spec"]["roles"]["rollout"].update(replicas=30, maxReplicas=30)
    with pytest.raises(ApiException) as err:
        api.apply(doc)
    assert err.value.status == 422 and "a job has at most 1024 pods" in err.value.body


def test_a_job_nested_1000_deep_fails_and_the_other_tenant_runs(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    rss_before = operator.peak_rss_bytes()
    deep, other = unique("deep"), unique("other")
    doc = grpo_job(deep)
    doc["spec"]["reward"]["functions"][0]["kwargs"] = "KWARGS"
    depth = 1000
    text = json.dumps(doc).replace('"KWARGS"', '{"a": ' * depth + "1" + "}" * depth)
    # The API server stores it. Sent as YAML (JSON is YAML): the client re-encodes a str body
    # given as application/json into one JSON string, which the server refuses (400).
    cluster.request("POST", _jobs_path(namespace), body=text, content_type="application/yaml", raw=True)
    api.apply(grpo_job(other))
    cond = _failed(api, cluster, deep)
    assert cond["reason"] == "InvalidSpec"
    assert "spec.reward.functions[0].kwargs" in cond["message"] or "nested deeper than" in cond["message"]
    api.wait_phase(other, "Running", timeout=120)
    assert operator.proc is not None and operator.proc.poll() is None, operator.log_tail()
    assert not [p for p in api.pods(deep)], "no pod of the refused job"
    growth = operator.peak_rss_bytes() - rss_before
    print(f"operator peak RSS grew by {growth / 2**20:.1f} MiB (deep job + second tenant)")
    assert growth < RSS_GROWTH_LIMIT


def _half_job(name: str) -> dict[str, Any]:
    """A GRPO job on half of each GPU pool (16 of the 32 H100s, 4 of the 8 L4s), so that two
    tenants' jobs fit the test cluster side by side: the full example takes 24 H100s and every L4,
    and a second one would wait for the scheduler whatever the operator did."""
    doc = grpo_job(name)
    roles = doc["spec"]["roles"]
    roles["actor"]["replicas"] = 1
    roles["rollout"].update(replicas=1, minReplicas=1, maxReplicas=1)
    return doc


def test_a_forged_restart_count_costs_the_operator_nothing(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    forged, other = unique("forged"), unique("other")
    api.apply(_half_job(forged))
    api.wait_phase(forged, "Running")
    rss_before = operator.peak_rss_bytes()
    # What a controller pod could write where the status policy is absent (admin here).
    api.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, forged, {"status": {"restarts": 10**12, "phase": "Restarting"}}
    )
    api.apply(_half_job(other))
    api.wait_phase(other, "Running", timeout=120)
    assert operator.proc is not None and operator.proc.poll() is None, operator.log_tail()
    # The operator counts restarts from its own record (annotations on the job), not the status:
    # the forged number is written back to its count, and the gang is not restarted for it.
    wait_for(lambda: api.status(forged).get("restarts") == 0, timeout=60, what="the operator's count back")
    assert {p.metadata.labels["rlhf.dev/restart-attempt"] for p in api.pods(forged)} == {"0"}
    assert "rlhf.dev/restarts" not in (api.job(forged)["metadata"].get("annotations") or {})
    growth = operator.peak_rss_bytes() - rss_before
    print(f"operator peak RSS grew by {growth / 2**20:.1f} MiB (restarts 10^12 + second tenant)")
    assert growth < RSS_GROWTH_LIMIT


def _host_path_job(name: str, path: str) -> dict[str, Any]:
    doc = grpo_job(name)
    doc["spec"]["pod"]["volumes"].append({"name": "host", "mountPath": "/host", "hostPath": {"path": path}})
    return doc


def test_a_host_path_is_refused_by_default(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    name = unique("hostpath")
    api.apply(_host_path_job(name, "/proc"))
    cond = _failed(api, cluster, name)
    assert cond["reason"] == "HostPathNotAllowed"
    assert "spec.pod.volumes[3].hostPath.path: hostPath '/proc' is not allowed" in cond["message"]
    assert not api.pods(name)


def test_a_host_path_the_operator_allows_runs(
    cluster: Cluster,
    namespace: str,
    installed: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    proc = OperatorProcess(
        installed.kubeconfig,
        [namespace],
        log_path=tmp_path / "operator.log",
        env={"RLHF_OPERATOR_ALLOWED_HOST_PATHS": "/data,/srv/models"},
    )
    with proc:
        api = Api(cluster, namespace)
        ok, refused = unique("allowed"), unique("refused")
        api.apply(_host_path_job(ok, "/srv/models/qwen"))
        api.apply(_host_path_job(refused, "/srv/modelsx"))
        api.wait_phase(ok, "Running", timeout=120)
        volumes = [v for p in api.pods(ok) for v in p.spec.volumes or [] if v.name == "host"]
        assert volumes and all(v.host_path.path == "/srv/models/qwen" for v in volumes)
        cond = _failed(api, cluster, refused)
        assert (
            cond["reason"] == "HostPathNotAllowed"
            and "allowed host paths: /data, /srv/models" in cond["message"]
        )
