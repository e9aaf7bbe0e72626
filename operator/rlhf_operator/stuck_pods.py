"""Pods stuck `Terminating` on a node that no longer answers: force-deleted, so a restart proceeds.

A pod's deletion completes only when its node's kubelet confirms that the containers stopped. On
a node that is NotReady or unreachable (a stopped kubelet, a partition, a dead machine) nobody
confirms, and the pod stays `Terminating` forever. The gang's pods have stable names
(`contract.pod_name`), so a gang restart cannot create the next attempt's pods while the old ones
hold their names: the job would wait in `Restarting` until the node came back.

Kubernetes' pod garbage collector force-deletes such pods only on nodes marked out of service
(the `node.kubernetes.io/out-of-service` taint, set by an administrator). The operator does it
for its own pods, past a grace period: a pod being deleted, `GRACE_SECONDS` after its own
deletion deadline (`metadata.deletionTimestamp`, which already includes the pod's termination
grace period), whose node's `Ready` condition is not True (False or Unknown). A pod on a Ready
node is left to its kubelet, however long it takes; so is a pod whose node cannot be read (no
RBAC for nodes: then the old behaviour, the restart waits for the node).

A force-deleted pod's containers may still run on a partitioned node until its kubelet returns
and kills them; the new attempt resumes from the last complete checkpoint, which the staging /
rename / COMPLETE protocol keeps whole (`rlhf_trainer.checkpoint`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_api.status import parse_time

#: Seconds past a pod's deletion deadline before it counts as stuck (its kubelet would have
#: removed it by then: the kubelet SIGKILLs at the deadline and reports within seconds).
GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class StuckPod:
    pod: dict[str, Any]
    node: str
    #: Seconds since the pod's deletion deadline.
    overdue: float
    #: The node's Ready condition: "False", "Unknown" or "missing".
    node_ready: str

    @property
    def message(self) -> str:
        name = self.pod["metadata"]["name"]
        return (
            f"pod {name} was still Terminating {self.overdue:.0f} s past its deletion deadline on node "
            f"{self.node} (Ready: {self.node_ready}); force-deleted so the job's next pods can take its name"
        )


def deadline(pod: dict[str, Any]) -> dt.datetime | None:
    """When the pod's deletion is due (`deletionTimestamp`), None when it is not being deleted."""
    stamp = (pod.get("metadata") or {}).get("deletionTimestamp")
    try:
        return parse_time(stamp) if isinstance(stamp, str) else None
    except ValueError:
        return None


def node_ready(node: dict[str, Any] | None) -> str:
    """The status of a Node's `Ready` condition ("True", "False", "Unknown"); "missing" for no node."""
    if node is None:
        return "missing"
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("status") or "Unknown")
    return "Unknown"


def find(
    pods: list[dict[str, Any]],
    now: dt.datetime,
    read_node: Callable[[str], dict[str, Any] | None],
    grace: float = GRACE_SECONDS,
) -> tuple[list[StuckPod], float | None]:
    """The stuck pods among `pods`, and the seconds until the next one may be (None: no candidate).
    `read_node(name)` returns the Node (None when there is none); it raises when the node cannot
    be read, and then that pod is left alone. Nodes are read only for pods already overdue."""
    stuck: list[StuckPod] = []
    wake: float | None = None
    nodes: dict[str, str] = {}
    for pod in pods:
        due = deadline(pod)
        node = (pod.get("spec") or {}).get("nodeName")
        if due is None or not node:
            continue  # an unbound pod is removed by the API server at once
        overdue = (now - due).total_seconds()
        if overdue < grace:
            wake = min(wake, grace - overdue) if wake is not None else grace - overdue
            continue
        if node not in nodes:
            try:
                nodes[node] = node_ready(read_node(node))
            except Exception:  # no RBAC for nodes, API away: the restart waits, as without this
                nodes[node] = "True"
        if nodes[node] != "True":
            stuck.append(StuckPod(pod, node, overdue, nodes[node]))
    return stuck, wake
