"""Whether the status-writers ValidatingAdmissionPolicy protects the operator's status keys.

The chart ships a ValidatingAdmissionPolicy (`admissionregistration.k8s.io/v1`, Kubernetes 1.30
and later) that lets a job's controller pod write only the status keys it owns
(templates/rbac/status-writers-policy.yaml). On an older API server, or with
`rbac.statusWritersPolicy=false`, the chart renders no policy, and the controller pod's Role alone
(patch of its own job's status) guards the status. The operator says which at start: one log line,
the gauge `rlhf_operator_status_policy_installed` (1 or 0) and, when it is missing, a warning that
names the chart value and the Kubernetes version that have it.

The chart passes the policy's name in `RLHF_OPERATOR_STATUS_POLICY` ("" when it rendered none);
`check` reads the policy and its binding through `read` (a GET that returns None for a missing
object or API), so it is a pure function of what the API server has, tested without a cluster.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("rlhf_operator")

ENV_POLICY = "RLHF_OPERATOR_STATUS_POLICY"
API = "/apis/admissionregistration.k8s.io/v1"
#: Where the chart's policy is rendered (Helm capabilities) and what the operator reports.
MIN_KUBERNETES = "1.30"
HOW_TO_INSTALL = (
    f"Kubernetes >= {MIN_KUBERNETES} with the chart's rbac.statusWritersPolicy=true installs it; without it, "
    "a job's controller pod may patch any key of its own job's status (its Role names only that job)"
)


@dataclass(frozen=True)
class PolicyState:
    installed: bool
    #: One sentence for the log: what was found, and what protects status without it.
    message: str


def policy_name(env: Mapping[str, str] | None = None) -> str:
    return (os.environ if env is None else env).get(ENV_POLICY, "").strip()


def check(name: str, read: Callable[[str], dict[str, Any] | None]) -> PolicyState:
    """The state of policy `name` ("" : the chart rendered none) and of its binding (same name).
    `read(path)` GETs an API path, None when the object or its API is absent."""
    if not name:
        return PolicyState(False, f"no status-writers ValidatingAdmissionPolicy configured; {HOW_TO_INSTALL}")
    for kind, plural in (
        ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
        ("ValidatingAdmissionPolicyBinding", "validatingadmissionpolicybindings"),
    ):
        if read(f"{API}/{plural}/{name}") is None:
            return PolicyState(
                False,
                f"the {kind} {name!r} is not installed (or {API} is not served); {HOW_TO_INSTALL}",
            )
    return PolicyState(
        True,
        f"the ValidatingAdmissionPolicy {name!r} is installed: a job's controller pod may write only "
        "status.progress and status.rollout.syncedGeneration",
    )


def report(state: PolicyState, gauge: Any) -> None:
    """The log line and the gauge of `state`."""
    gauge.set(1 if state.installed else 0)
    if state.installed:
        log.info("status policy: %s", state.message)
    else:
        log.warning("status policy: %s", state.message)
