"""The operator's Kueue support against Kueue's real controller manager (tests/cluster/kueue.py):
its pod webhook gates the pods, its scheduler admits the job's pod group against a ClusterQueue's
quota, and its pod controller finishes the group's Workload and releases the quota when the job
ends. The pods are kwok's; the operator runs under the chart's RBAC (test_operator_e2e)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import kueue as kueue_harness
import pytest
from harness import Cluster, ClusterError, wait_for
from test_operator_e2e import Api, grpo_job, installed, operator  # noqa: F401 (fixtures)

from rlhf_operator.testing import OperatorProcess

pytestmark = pytest.mark.cluster

GROUP, VERSION = kueue_harness.API, kueue_harness.VERSION
GATE = "kueue.x-k8s.io/admission"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
QUEUE = "team"


@pytest.fixture(scope="module")
def kueue(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[kueue_harness.KueueProcess]:
    why = kueue_harness.missing()
    if why:
        pytest.skip(why)
    proc = kueue_harness.KueueProcess(cluster, tmp_path_factory.mktemp("kueue"))
    try:
        proc.start()
    except ClusterError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield proc
    finally:
        proc.stop()


class Queues:
    """The test's ResourceFlavor, ClusterQueue (only its namespace may use it) and LocalQueue."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        import kubernetes

        self.cluster = cluster
        self.ns = namespace
        self.custom = kubernetes.client.CustomObjectsApi(cluster.admin())
        self.flavor = f"{namespace}-flavor"
        self.cq = f"{namespace}-cq"

    def create(self, quota: dict[str, str], within_queue: str = "Never") -> None:
        """within_queue: the ClusterQueue's preemption.withinClusterQueue."""
        self.custom.create_cluster_custom_object(
            GROUP, VERSION, "resourceflavors", {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor",
                                                "metadata": {"name": self.flavor}},
        )  # fmt: skip
        self.custom.create_cluster_custom_object(
            GROUP,
            VERSION,
            "clusterqueues",
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ClusterQueue",
                "metadata": {"name": self.cq},
                "spec": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.ns}},
                    "resourceGroups": [self._group(quota)],
                    "preemption": {"withinClusterQueue": within_queue},
                },
            },
        )
        self.custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            self.ns,
            "localqueues",
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "LocalQueue",
                "metadata": {"name": QUEUE},
                "spec": {"clusterQueue": self.cq},
            },
        )
        wait_for(
            lambda: _true(self.local_queue(), "Active"),
            timeout=30,
            what=f"LocalQueue {self.ns}/{QUEUE} active",
        )

    def _group(self, quota: dict[str, str]) -> dict[str, Any]:
        return {
            "coveredResources": sorted(quota),
            "flavors": [
                {
                    "name": self.flavor,
                    "resources": [{"name": r, "nominalQuota": q} for r, q in sorted(quota.items())],
                }
            ],
        }

    def set_quota(self, quota: dict[str, str]) -> None:
        self.custom.patch_cluster_custom_object(
            GROUP, VERSION, "clusterqueues", self.cq, {"spec": {"resourceGroups": [self._group(quota)]}}
        )

    def cluster_queue(self) -> dict[str, Any]:
        return self.custom.get_cluster_custom_object(GROUP, VERSION, "clusterqueues", self.cq)  # type: ignore[no-any-return]

    def local_queue(self) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, "localqueues", QUEUE)  # type: ignore[no-any-return]

    def usage(self) -> dict[str, Decimal]:
        """The ClusterQueue's admitted usage by resource (its status.flavorsUsage)."""
        from kubernetes.utils import parse_quantity

        status = self.cluster_queue().get("status") or {}
        return {
            r["name"]: parse_quantity(r.get("total", "0"))
            for f in status.get("flavorsUsage") or []
            for r in f.get("resources") or []
        }

    def workloads(self) -> list[dict[str, Any]]:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, "workloads")["items"]  # type: ignore[no-any-return]

    def delete(self) -> None:
        for plural, name in (("clusterqueues", self.cq), ("resourceflavors", self.flavor)):
            self.cluster.kubectl(
                "delete", f"{plural}.{GROUP}", name, "--ignore-not-found", "--wait=false", check=False
            )


@pytest.fixture
def queues(cluster: Cluster, kueue: kueue_harness.KueueProcess, namespace: str) -> Iterator[Queues]:
    """The test's namespace under Kueue (labelled for its webhook and its namespace selector)."""
    cluster.kubectl("label", "namespace", namespace, f"{kueue_harness.NAMESPACE_LABEL}=true")
    _wait_webhook_gates(cluster, namespace)
    q = Queues(cluster, namespace)
    offset = kueue.log_size()
    try:
        yield q
    finally:
        # Jobs first (the operator releases their groups), then what Kueue's finalizers still hold.
        cluster.kubectl("delete", "rltj", "--all", "-n", namespace, "--wait=false", check=False)
        q.delete()
        print(f"--- Kueue's log during the test ({kueue.log_path}):\n{kueue.log_since(offset)}")


def _wait_webhook_gates(cluster: Cluster, namespace: str) -> None:
    """Until Kueue's webhook gates a pod of the namespace (a server-side dry run: Kueue reads the
    namespace's label from its cache, which follows the label a moment later)."""
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "kueue-probe",
            "namespace": namespace,
            "labels": {"kueue.x-k8s.io/queue-name": QUEUE},
        },
        "spec": {"containers": [{"name": "c", "image": "registry.invalid/probe:1"}]},
    }

    def gated() -> bool:
        out = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(probe))
        gates = json.loads(out)["spec"].get("schedulingGates") or []
        return any(g["name"] == GATE for g in gates)

    wait_for(gated, timeout=30, interval=0.5, what=f"Kueue's webhook to gate pods in {namespace}")


def _true(obj: dict[str, Any], type_: str) -> bool:
    return any(
        c["type"] == type_ and c["status"] == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def _condition(status: dict[str, Any], type_: str) -> tuple[str, str] | None:
    c = next((c for c in status.get("conditions") or [] if c["type"] == type_), None)
    return (c["status"], c["reason"]) if c else None


def _counts(cq: dict[str, Any]) -> tuple[int, int]:
    st = cq.get("status") or {}
    return int(st.get("admittedWorkloads") or 0), int(st.get("pendingWorkloads") or 0)


def queued_job(name: str) -> dict[str, Any]:
    """A small GRPO job in the LocalQueue: a gang of 4 pods (controller, 1 actor and 1 reference
    with 8 GPUs each, a reward pod) and 1 rollout pod (4 GPUs). Two such jobs fit the pools; only
    the ClusterQueue's quota keeps the second waiting."""
    doc = grpo_job(
        name,
        scheduling={"queueName": QUEUE, "timeoutSeconds": 300, "onTimeout": "wait"},
        autoscaling={"enabled": False},
    )
    roles = doc["spec"]["roles"]
    roles["actor"]["replicas"] = 1
    roles["rollout"].update(replicas=1, minReplicas=1, maxReplicas=2)
    return doc


def gang_and_fleet(api: Api, name: str) -> tuple[list[Any], list[Any]]:
    pods = api.pods(name)
    gang = [p for p in pods if p.metadata.labels.get("rlhf.dev/role") != "rollout"]
    return gang, [p for p in pods if p.metadata.labels.get("rlhf.dev/role") == "rollout"]


#: Kueue's Warning while a group's pods are still being created (it reconciles the group on each
#: pod's creation, before the last one exists); after that it would mean pods went missing.
COMPOSING = "group has fewer runnable pods than expected"


def _kueue_events(api: Api) -> list[Any]:
    return [
        e
        for e in api.core.list_namespaced_event(api.ns).items
        if e.type == "Warning"
        and "kueue" in ((e.source and e.source.component) or e.reporting_component or "")
    ]


def kueue_warnings(api: Api) -> list[tuple[str, str, str]]:
    """Warning Events Kueue posted in the namespace (what it found wrong with the pods it manages:
    a group it cannot compose, excess pods, ...): (object, reason, message). Not "Pending" (a
    Workload waits for quota, as the tests intend) nor `COMPOSING` (see `composing_notices`)."""
    return sorted(
        (e.involved_object.name, e.reason, e.message)
        for e in _kueue_events(api)
        if e.reason != "Pending" and not (e.reason == "ErrWorkloadCompose" and COMPOSING in e.message)
    )


def composing_notices(api: Api, group: str) -> int:
    """How many times Kueue said the group `group` had fewer pods than its count."""
    return sum(e.count or 1 for e in _kueue_events(api) if f"'{group}' {COMPOSING}" in (e.message or ""))


def is_gated(pod: Any) -> bool:
    return any(g.name == GATE for g in pod.spec.scheduling_gates or [])


def requests_of(pods: list[Any]) -> dict[str, Decimal]:
    """What Kueue counts against the quota for these pods: each pod's effective request (the sum
    of its containers', or its largest init container's when larger), summed."""
    from kubernetes.utils import parse_quantity

    total: dict[str, Decimal] = {}
    for pod in pods:
        main: dict[str, Decimal] = {}
        for c in pod.spec.containers:
            for r, q in ((c.resources and c.resources.requests) or {}).items():
                main[r] = main.get(r, Decimal(0)) + parse_quantity(q)
        for c in pod.spec.init_containers or []:
            for r, q in ((c.resources and c.resources.requests) or {}).items():
                main[r] = max(main.get(r, Decimal(0)), parse_quantity(q))
        for r, q in main.items():
            total[r] = total.get(r, Decimal(0)) + q
    return total


def quantity(resource: str, value: Decimal) -> str:
    if resource == "cpu":
        return f"{int(value * 1000)}m"
    return str(int(value))


def run_first_job_on_quota_for_it(api: Api, queues: Queues) -> dict[str, Decimal]:
    """Queues with no quota; job "a" applied, its pods gated; the quota set to what they request
    (room for exactly one such job); "a" Running. Returns the quota."""
    queues.create({r: "0" for r in ("cpu", "memory", "nvidia.com/gpu")})
    api.apply(queued_job("a"))
    need = requests_of(wait_pods(api, "a", 5, "created, gated", is_gated))
    queues.set_quota({r: quantity(r, q) for r, q in need.items()})
    api.wait_phase("a", "Running", timeout=120)
    return need


def wait_pods(api: Api, name: str, count: int, what: str, check: Any, timeout: float = 90) -> list[Any]:
    def ready() -> list[Any] | None:
        pods = api.pods(name)
        return pods if len(pods) == count and all(check(p) for p in pods) else None

    return wait_for(ready, timeout=timeout, what=f"{count} pods of {name} {what}")  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------


def test_a_job_queued_behind_a_full_cluster_queue_runs_when_quota_frees(
    cluster: Cluster,
    namespace: str,
    queues: Queues,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    resources = ["cpu", "memory", "nvidia.com/gpu"]
    queues.create({r: "0" for r in resources})

    # No quota: job A's pods exist, every one gated by Kueue's webhook; A reports Queued.
    api.apply(queued_job("a"))
    pods_a = wait_pods(api, "a", 5, "created, gated", is_gated)
    status = wait_for(
        lambda: _condition(s := api.status("a"), "Queued") == ("True", "WaitingForKueue") and s,
        timeout=30,
        what="job a Queued",
    )
    assert status["phase"] == "Scheduling", status
    gang_a, fleet_a = gang_and_fleet(api, "a")
    assert all(p.metadata.labels["kueue.x-k8s.io/managed"] == "true" for p in pods_a)
    assert "kueue.x-k8s.io/managed" in pods_a[0].metadata.finalizers

    # Kueue made one Workload of the gang (its pod group, counted whole) and one per rollout pod.
    group = {p.metadata.labels[GROUP_LABEL] for p in gang_a}
    assert len(group) == 1, group
    workloads = wait_for(lambda: len(w := queues.workloads()) == 2 and w, timeout=30, what="2 Workloads of a")
    by_name = {w["metadata"]["name"]: w for w in workloads}
    gang_wl = by_name[next(iter(group))]
    assert sum(ps["count"] for ps in gang_wl["spec"]["podSets"]) == len(gang_a) == 4
    (rollout_wl,) = (w for n, w in by_name.items() if n not in group)
    composing = composing_notices(api, next(iter(group)))  # while its pods were being created
    assert [o["name"] for o in rollout_wl["metadata"]["ownerReferences"]] == [fleet_a[0].metadata.name]

    # Quota for exactly one job (all of A's pods); then A is admitted and runs.
    need = requests_of(pods_a)
    assert set(need) == set(resources), need
    queues.set_quota({r: quantity(r, need[r]) for r in resources})
    api.wait_phase("a", "Running", timeout=120)
    assert not any(is_gated(p) for p in api.pods("a"))
    assert _condition(api.status("a"), "Queued") == ("False", "Admitted")
    wait_for(lambda: queues.usage() == need, timeout=30, what=f"ClusterQueue usage {need}")

    # Job B waits behind the full ClusterQueue: Kueue keeps its Workloads pending, its pods gated.
    api.apply(queued_job("b"))
    wait_pods(api, "b", 5, "created, gated", is_gated)

    def b_pending() -> bool:
        wls = [w for w in queues.workloads() if w["metadata"]["name"] not in by_name]
        return len(wls) == 2 and all(
            _condition(w.get("status") or {}, "QuotaReserved") == ("False", "Pending") for w in wls
        )

    wait_for(b_pending, timeout=60, what="Kueue to find no quota for b's 2 Workloads")
    wait_for(
        lambda: _counts(queues.cluster_queue()) == (2, 2),
        timeout=30,
        what="ClusterQueue: 2 admitted Workloads (a's), 2 pending (b's)",
    )
    status_b = api.status("b")
    assert status_b["phase"] == "Scheduling" and _condition(status_b, "Queued") == ("True", "WaitingForKueue")
    assert all(is_gated(p) for p in api.pods("b")) and api.status("a")["phase"] == "Running"

    # A succeeds: the operator releases its group, Kueue finishes A's Workloads and admits B.
    cluster.complete_pod("a-controller", namespace, outcome="succeeded")
    api.wait_phase("a", "Succeeded")
    api.wait_phase("b", "Running", timeout=120)
    assert not any(is_gated(p) for p in api.pods("b"))
    # A's group Workload is Finished (kept while its succeeded controller pod is); the rollout
    # pod's is Finished too, or already gone with its pod (the pod owns it).
    left = {w["metadata"]["name"]: w for w in queues.workloads() if w["metadata"]["name"] in by_name}
    assert gang_wl["metadata"]["name"] in left
    assert all(_true(w, "Finished") for w in left.values()), {n: w.get("status") for n, w in left.items()}
    # Kueue let A's pods go (its finalizers removed): only the succeeded controller pod is left.
    wait_for(
        lambda: [p.metadata.name for p in api.pods("a")] == ["a-controller"],
        timeout=60,
        what="a's workers gone",
    )
    assert not api.pods("a")[0].metadata.finalizers
    wait_for(lambda: queues.usage() == need, timeout=30, what="ClusterQueue usage = b's")

    # B succeeds: the ClusterQueue's usage returns to zero.
    cluster.complete_pod("b-controller", namespace, outcome="succeeded")
    api.wait_phase("b", "Succeeded")

    def drained() -> bool:
        st = queues.cluster_queue().get("status") or {}
        return (
            all(v == 0 for v in queues.usage().values())
            and st.get("admittedWorkloads") == 0
            and st.get("reservingWorkloads") == 0
        )

    wait_for(drained, timeout=60, what="ClusterQueue usage back to zero")
    assert all(_true(w, "Finished") for w in queues.workloads())
    # Not once more since its Workload existed: releasing it lost no pod from Kueue's view.
    assert composing_notices(api, next(iter(group))) == composing
    warnings = kueue_warnings(api)
    assert warnings == [], "\n".join(map(str, warnings))


def test_suspending_a_queued_job_frees_its_quota_and_resume_queues_it_again(
    cluster: Cluster,
    namespace: str,
    queues: Queues,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    # Quota for one job, measured on a first job's pods (as in the test above, without its checks).
    need = run_first_job_on_quota_for_it(api, queues)
    old_group = {p.metadata.labels.get(GROUP_LABEL) for p in gang_and_fleet(api, "a")[0]}
    api.apply(queued_job("b"))
    wait_pods(api, "b", 5, "created, gated", is_gated)

    # Suspending A releases its pod group: Kueue finishes its Workloads and admits B.
    cluster.kubectl("patch", "rltj", "a", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    api.wait_phase("a", "Suspended")
    api.wait_phase("b", "Running", timeout=120)
    wait_for(lambda: not api.pods("a"), timeout=60, what="a's pods gone (Kueue's finalizers removed)")

    # Resumed, A is a new pod group that Kueue queues behind B; no restart is counted.
    cluster.kubectl("patch", "rltj", "a", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    pods = wait_pods(api, "a", 5, "re-created, gated", is_gated)
    new_group = {
        p.metadata.labels.get(GROUP_LABEL) for p in pods if p.metadata.labels["rlhf.dev/role"] != "rollout"
    }
    assert len(new_group) == 1 and not new_group & old_group, (old_group, new_group)
    status = wait_for(
        lambda: _condition(s := api.status("a"), "Queued") == ("True", "WaitingForKueue") and s,
        timeout=30,
        what="job a Queued again",
    )
    assert status["restarts"] == 0 and status["phase"] == "Scheduling", status

    # B succeeds: A's new group is admitted and runs.
    cluster.complete_pod("b-controller", namespace, outcome="succeeded")
    api.wait_phase("b", "Succeeded")
    api.wait_phase("a", "Running", timeout=120)
    assert api.status("a")["restarts"] == 0
    wait_for(lambda: queues.usage() == need, timeout=30, what="ClusterQueue usage = a's")
    warnings = kueue_warnings(api)
    assert warnings == [], "\n".join(map(str, warnings))


def test_a_rollout_scale_up_past_the_quota_waits_gated_while_the_job_runs(
    cluster: Cluster,
    namespace: str,
    queues: Queues,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    need = run_first_job_on_quota_for_it(api, queues)
    gang_wl = {p.metadata.labels[GROUP_LABEL] for p in gang_and_fleet(api, "a")[0]}

    # One more rollout pod: Kueue admits it on its own, so it waits (gated) for quota; the gang's
    # group and its count do not change, and the job keeps running.
    cluster.kubectl("scale", "rltj", "a", "-n", namespace, "--replicas=2")
    new = wait_for(
        lambda: next((p for p in api.pods("a") if p.metadata.name == "a-rollout-1"), None),
        timeout=30,
        what="a-rollout-1 created",
    )
    assert is_gated(new) and GROUP_LABEL not in new.metadata.labels
    wait_for(
        lambda: (
            len(queues.workloads()) == 3 and queues.cluster_queue()["status"].get("pendingWorkloads") == 1
        ),
        timeout=60,
        what="a-rollout-1's Workload pending",
    )
    gang, fleet = gang_and_fleet(api, "a")
    assert {p.metadata.labels[GROUP_LABEL] for p in gang} == gang_wl
    assert {p.metadata.annotations["kueue.x-k8s.io/pod-group-total-count"] for p in gang} == {"4"}
    assert api.status("a")["phase"] == "Running" and is_gated(
        next(p for p in fleet if p.metadata.name == "a-rollout-1")
    )

    # Quota for one more rollout pod: it is admitted and runs.
    more = requests_of([new])
    queues.set_quota({r: quantity(r, q + more.get(r, 0)) for r, q in need.items()})
    cluster.wait_pod_phase("a-rollout-1", namespace, "Running", timeout=60)
    wait_for(lambda: api.status("a")["rollout"]["ready"] == 2, timeout=60, what="2 rollout replicas ready")
    assert api.status("a")["phase"] == "Running"


@pytest.fixture
def priorities(cluster: Cluster, namespace: str) -> Iterator[dict[str, str]]:
    """Two PriorityClasses (Kueue takes a pod's as its Workload's priority), deleted afterwards."""
    names = {"low": f"{namespace}-low", "high": f"{namespace}-high"}
    for level, value in (("low", 100), ("high", 1000)):
        doc = {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": names[level]},
            "value": value,
            "preemptionPolicy": "Never",  # the scheduler preempts nothing; only Kueue does
        }
        cluster.kubectl("create", "-f", "-", input=json.dumps(doc))
    try:
        yield names
    finally:
        cluster.kubectl("delete", "priorityclass", *names.values(), "--ignore-not-found", check=False)


def test_kueue_preemption_suspends_the_job_and_it_queues_again_as_a_new_group(
    cluster: Cluster,
    namespace: str,
    queues: Queues,
    priorities: dict[str, str],
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    queues.create({r: "0" for r in ("cpu", "memory", "nvidia.com/gpu")}, within_queue="LowerPriority")

    def job(name: str, level: str) -> dict[str, Any]:
        doc = queued_job(name)
        doc["spec"]["scheduling"]["priorityClassName"] = priorities[level]
        return doc

    api.apply(job("low", "low"))
    need = requests_of(wait_pods(api, "low", 5, "created, gated", is_gated))
    queues.set_quota({r: quantity(r, q) for r, q in need.items()})
    api.wait_phase("low", "Running", timeout=120)
    old_group = {p.metadata.labels.get(GROUP_LABEL) for p in gang_and_fleet(api, "low")[0]}

    # A job of higher priority: Kueue evicts the low one (TerminationTarget, then deletes its
    # pods); the operator counts no restart and re-creates the gang as a new group, queued.
    api.apply(job("high", "high"))
    api.wait_phase("high", "Running", timeout=180)
    pods = wait_pods(
        api,
        "low",
        5,
        "re-created, gated",
        lambda p: is_gated(p) and not p.metadata.deletion_timestamp,
        timeout=120,
    )
    new_group = {
        p.metadata.labels.get(GROUP_LABEL) for p in pods if p.metadata.labels["rlhf.dev/role"] != "rollout"
    }
    assert len(new_group) == 1 and not new_group & old_group, (old_group, new_group)
    status = wait_for(
        lambda: _condition(s := api.status("low"), "Queued") == ("True", "WaitingForKueue") and s,
        timeout=30,
        what="job low Queued again",
    )
    assert status["restarts"] == 0 and status["phase"] == "Scheduling", status
    reasons = {
        e.reason
        for e in api.core.list_namespaced_event(namespace, field_selector="involvedObject.name=low").items
    }
    assert "StoppedByKueue" in reasons and "GangRestart" not in reasons, reasons

    # The high job done, the low one is admitted again and runs.
    cluster.complete_pod("high-controller", namespace, outcome="succeeded")
    api.wait_phase("high", "Succeeded")
    api.wait_phase("low", "Running", timeout=120)
    assert api.status("low")["restarts"] == 0


def test_deleting_a_job_under_kueue_releases_its_quota_and_leaves_no_pod(
    cluster: Cluster,
    namespace: str,
    queues: Queues,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    need = run_first_job_on_quota_for_it(api, queues)
    api.apply(queued_job("b"))
    wait_pods(api, "b", 5, "created, gated", is_gated)

    # `kubectl delete rltj a`: the garbage collector deletes its pods; Kueue must let them go
    # (its finalizers) and free A's quota, so that B is admitted.
    cluster.kubectl("delete", "rltj", "a", "-n", namespace, "--wait=false")
    wait_for(lambda: not api.pods("a"), timeout=90, what="a's pods gone")
    api.wait_phase("b", "Running", timeout=120)
    wait_for(lambda: queues.usage() == need, timeout=30, what="ClusterQueue usage = b's")
