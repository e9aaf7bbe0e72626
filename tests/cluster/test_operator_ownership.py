"""Ownership and end of life on the real control plane: a recreated job starts fresh, a job named
like a user's ServiceAccount never runs with that account, and jobs (and their namespace) are
deleted while the operator is stopped, because jobs carry no finalizer.

Fixtures (the chart's RBAC, an operator process per test) come from test_operator_e2e.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, bind_example_claims, wait_for
from test_operator_e2e import Api, grpo_job, installed, metric, operator  # noqa: F401 (fixtures)

from rlhf_api.contract import FINALIZER
from rlhf_operator.testing import OperatorProcess

pytestmark = pytest.mark.cluster

KINDS = ("serviceaccounts", "roles", "rolebindings", "secrets", "configmaps", "services")


def _children(cluster: Cluster, namespace: str, name: str) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for kind in KINDS:
        out[kind] = json.loads(
            cluster.kubectl("get", kind, "-n", namespace, "-l", f"rlhf.dev/job-name={name}", "-o", "json")
        )["items"]
    return out


def _gone(fn: Any) -> bool:
    import kubernetes

    try:
        fn()
    except kubernetes.client.ApiException as err:
        return err.status == 404
    return False


def test_job_recreated_under_the_same_name_starts_fresh(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    name = "again"
    api.apply(grpo_job(name))
    api.wait_phase(name, "Running")
    old_uid = api.job(name)["metadata"]["uid"]
    old_token = cluster.kubectl(
        "get", "secret", f"{name}-ray-token-{old_uid}", "-n", namespace, "-o", "jsonpath={.data.token}"
    )
    assert metric(operator, 'rlhf_operator_jobs{phase="Running"}') == 1

    # Deleted (at once: no finalizer) and recreated before the garbage collector is done.
    cluster.kubectl("delete", "rltj", name, "-n", namespace, "--wait=false")
    wait_for(lambda: _gone(lambda: api.job(name)), timeout=10, what="the job deleted without the operator")
    api.apply(grpo_job(name))
    new_uid = api.job(name)["metadata"]["uid"]
    assert new_uid != old_uid

    status = api.wait_phase(name, "Running", timeout=120)
    assert status["restarts"] == 0
    pods = api.pods(name)
    assert len(pods) == 7
    assert {p.metadata.owner_references[0].uid for p in pods} == {new_uid}
    assert {p.metadata.labels["rlhf.dev/restart-attempt"] for p in pods} == {"0"}

    def owners() -> dict[str, list[str]]:
        return {
            kind: [i["metadata"]["ownerReferences"][0]["uid"] for i in items]
            for kind, items in _children(cluster, namespace, name).items()
        }

    # The predecessor's children may linger until the garbage collector is done, never adopted.
    wait_for(
        lambda: owners() == {kind: [new_uid] for kind in KINDS},
        timeout=30,
        what="one child of each kind, owned by the new job",
    )
    new_token = cluster.kubectl(
        "get", "secret", f"{name}-ray-token-{new_uid}", "-n", namespace, "-o", "jsonpath={.data.token}"
    )
    assert new_token and new_token != old_token
    assert not api.job(name)["metadata"].get("finalizers")
    # The operator's gauge counts the new job once, not the deleted one too.
    wait_for(
        lambda: metric(operator, 'rlhf_operator_jobs{phase="Running"}') == 1,
        timeout=30,
        what="one Running job in rlhf_operator_jobs",
    )
    cluster.kubectl("delete", "rltj", name, "-n", namespace, "--wait=false")
    wait_for(
        lambda: metric(operator, 'rlhf_operator_jobs{phase="Running"}') == 0,
        timeout=30,
        what="the deleted job forgotten by rlhf_operator_jobs",
    )


def test_job_named_like_a_users_service_account_never_uses_it(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    """A tenant mints a ServiceAccount named like a job it is about to create and a RoleBinding
    names that account (dangling, or written for it): the job's pods never run as it, because the
    job's own account is `<job>-<12 characters of its UID>`, a name nobody can choose in advance."""
    api = Api(cluster, namespace)
    name = "borrowed"
    api.core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    cluster.kubectl(
        "create",
        "rolebinding",
        f"{name}-view",
        "--clusterrole=view",
        f"--serviceaccount={namespace}:{name}",
        "-n",
        namespace,
    )
    api.apply(grpo_job(name))
    api.wait_phase(name, "Running", timeout=120)
    uid = api.job(name)["metadata"]["uid"]
    account = f"{name}-{uid[:12]}"
    assert {p.spec.service_account_name for p in api.pods(name)} == {account}
    own = api.core.read_namespaced_service_account(account, namespace)
    assert own.metadata.owner_references[0].uid == uid
    theirs = api.core.read_namespaced_service_account(name, namespace)
    assert not theirs.metadata.owner_references  # not adopted, not used
    conds = {c["type"]: c for c in api.status(name).get("conditions") or []}
    assert conds.get("ChildFailure", {}).get("status") != "True", conds.get("ChildFailure")


def test_namespace_with_jobs_is_deleted_while_the_operator_is_stopped(
    cluster: Cluster,
    installed: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    import kubernetes

    ns = f"t-{uuid.uuid4().hex[:8]}"
    core = kubernetes.client.CoreV1Api(cluster.admin())
    core.create_namespace({"metadata": {"name": ns}})
    wait_for(lambda: core.read_namespaced_service_account("default", ns), timeout=30, what="default SA")
    volumes = bind_example_claims(core, ns)  # what the example's pods mount
    api = Api(cluster, ns)
    try:
        # One job as an earlier release left it (with its finalizer; suspended, so that the two
        # gangs do not compete for the pools), one new.
        legacy = grpo_job("legacy", suspend=True)
        legacy["metadata"]["finalizers"] = [FINALIZER]
        api.apply(legacy)
        api.apply(grpo_job("fresh"))
        with OperatorProcess(installed.kubeconfig, [ns], log_path=tmp_path / "operator.log") as op:
            try:
                api.wait_phase("fresh", "Running", timeout=120)
                api.wait_phase("legacy", "Suspended", timeout=30)
                wait_for(
                    lambda: not api.job("legacy")["metadata"].get("finalizers"),
                    timeout=60,
                    what="the old finalizer removed from job legacy",
                )
                assert not api.job("fresh")["metadata"].get("finalizers")
            finally:
                print(op.log_tail(3000))
        # The operator is stopped: the namespace, its jobs and their pods still go.
        core.delete_namespace(ns)
        wait_for(lambda: _gone(lambda: core.read_namespace(ns)), timeout=120, what=f"namespace {ns} deleted")
    finally:
        if not _gone(lambda: core.read_namespace(ns)):
            for job in ("legacy", "fresh"):  # unblock a namespace a failed check left behind
                cluster.kubectl(
                    "patch",
                    "rltj",
                    job,
                    "-n",
                    ns,
                    "--type=merge",
                    "-p",
                    '{"metadata":{"finalizers":null}}',
                    check=False,
                )
            core.delete_namespace(ns)
        for pv in volumes:
            core.delete_persistent_volume(pv)
