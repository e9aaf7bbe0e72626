"""The NetworkPolicy each job gets: its pods accept traffic only from the job's own pods, the
operator, and the monitoring namespaces.

A job's pods run the user's image and serve Ray's GCS (a job's Ray cluster executes whatever code
a client sends it), the trainer's `/metrics`, torch.distributed's store and the weight-sync group on
the pod network; on a shared cluster any pod of any tenant could otherwise connect to them. The
policy selects the job's pods (`rlhf.dev/job-name`) and allows ingress, each peer on the ports it
needs only:

- the job's own pods on every port: Ray's GCS (6379) and, beyond it, the ports Ray, NCCL/gloo,
  torch.distributed's store and the weight sync pick at run time (raylet, object manager, worker
  and rendezvous ports are chosen per process, so no fixed list can name them);
- the operator's pods, in the operator's namespace, on the metrics port only (`METRICS_PORT`:
  its autoscaler reads the controller's `/metrics` when the job names no Prometheus; it talks to
  nothing else of a job's);
- every pod of the monitoring namespaces, on the metrics port only (Prometheus scraping the
  controller pod's `/metrics`, the chart's PodMonitor port `metrics`).

Egress is left open: the pods reach the API server, DNS, and the model and data stores the user
configured, which no operator can enumerate. The operator's settings come from its environment,
which the chart sets (`networkPolicy.*`): `RLHF_OPERATOR_NETWORK_POLICY` (on unless `false`),
`RLHF_OPERATOR_NAMESPACE` (the downward API), `RLHF_OPERATOR_POD_SELECTOR` (its pods' labels, as
`k=v,k=v`) and `RLHF_OPERATOR_MONITORING_NAMESPACES` (comma-separated).

Whether a policy is enforced is up to the cluster's network plugin (Calico, Cilium, ...); the
object is created either way, and a plugin that enforces none ignores it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlhf_api import contract

#: The label every namespace carries with its own name (set by the API server since 1.22).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

ENV_ENABLED = "RLHF_OPERATOR_NETWORK_POLICY"
ENV_NAMESPACE = "RLHF_OPERATOR_NAMESPACE"
ENV_POD_SELECTOR = "RLHF_OPERATOR_POD_SELECTOR"
ENV_MONITORING = "RLHF_OPERATOR_MONITORING_NAMESPACES"


class SettingsError(ValueError):
    pass


def _pairs(text: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SettingsError(
                f"{what}: {item!r} is not key=value (e.g. app.kubernetes.io/name=rlhf-operator)"
            )
        out[key] = value
    return out


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    #: Namespace of the operator's pods; None when it runs outside the cluster (a developer's
    #: process): then no rule names it.
    operator_namespace: str | None = None
    operator_pod_labels: Mapping[str, str] = field(default_factory=dict)
    monitoring_namespaces: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        raw = env.get(ENV_ENABLED, "true").strip().lower()
        if raw not in ("true", "false", "1", "0"):
            raise SettingsError(f"{ENV_ENABLED}={raw!r}: expected true or false")
        return cls(
            enabled=raw in ("true", "1"),
            operator_namespace=env.get(ENV_NAMESPACE) or None,
            operator_pod_labels=_pairs(env.get(ENV_POD_SELECTOR, ""), ENV_POD_SELECTOR),
            monitoring_namespaces=tuple(
                filter(None, (n.strip() for n in env.get(ENV_MONITORING, "").split(",")))
            ),
        )


def policy_name(job_name: str) -> str:
    return job_name


def _namespace(name: str) -> dict[str, Any]:
    return {"matchLabels": {NAMESPACE_NAME_LABEL: name}}


def ingress_peers(job_name: str, settings: Settings) -> list[dict[str, Any]]:
    """Who may connect to the job's pods: the job's own pods, then those allowed the metrics port
    only (`metrics_peers`)."""
    return [_own_pods(job_name), *metrics_peers(settings)]


def _own_pods(job_name: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {contract.JOB_NAME: job_name}}}


def metrics_peers(settings: Settings) -> list[dict[str, Any]]:
    """The operator's pods and the monitoring namespaces: they read `/metrics`, nothing else."""
    peers: list[dict[str, Any]] = []
    if settings.operator_namespace:
        peer: dict[str, Any] = {"namespaceSelector": _namespace(settings.operator_namespace)}
        if settings.operator_pod_labels:
            peer["podSelector"] = {"matchLabels": dict(settings.operator_pod_labels)}
        peers.append(peer)
    peers += [{"namespaceSelector": _namespace(ns)} for ns in settings.monitoring_namespaces]
    return peers


def ingress_rules(job_name: str, settings: Settings) -> list[dict[str, Any]]:
    """The policy's ingress rules: every port from the job's own pods, the metrics port from the
    operator and the monitoring namespaces."""
    rules: list[dict[str, Any]] = [{"from": [_own_pods(job_name)]}]
    peers = metrics_peers(settings)
    if peers:
        rules.append({"from": peers, "ports": [{"protocol": "TCP", "port": contract.METRICS_PORT}]})
    return rules


def build_network_policy(
    job_name: str, metadata: dict[str, Any], settings: Settings
) -> dict[str, Any] | None:
    """The job's NetworkPolicy (`metadata` as the job's other children have it), or None when
    the operator is configured without policies."""
    if not settings.enabled:
        return None
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": {"matchLabels": {contract.JOB_NAME: job_name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress_rules(job_name, settings),
        },
    }
