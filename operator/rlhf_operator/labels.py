"""Label, annotation and resource-name constants, re-exported from the pod contract.

They are defined once, in `rlhf_trainer.contract`, which the trainer imports too (it never imports
the operator); this module keeps the operator's `labels.X` spelling.
"""

from rlhf_trainer.contract import (
    API_VERSION,
    CONTROLLER_ROLE,
    FIELD_MANAGER,
    FINALIZER,
    GANG_ROLES,
    GROUP,
    JOB_NAME,
    KIND,
    KUEUE_POD_GROUP_NAME,
    KUEUE_POD_GROUP_TOTAL_COUNT,
    KUEUE_QUEUE_NAME,
    PLURAL,
    RAY_ROLE_RESOURCE_PREFIX,
    REPLICA_INDEX,
    RESTART_ATTEMPT,
    ROLE,
    ROLES,
    SCHEDULER_PLUGINS_POD_GROUP,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    VOLCANO_POD_GROUP,
)

__all__ = [
    "API_VERSION",
    "CONTROLLER_ROLE",
    "FIELD_MANAGER",
    "FINALIZER",
    "GANG_ROLES",
    "GROUP",
    "JOB_NAME",
    "KIND",
    "KUEUE_POD_GROUP_NAME",
    "KUEUE_POD_GROUP_TOTAL_COUNT",
    "KUEUE_QUEUE_NAME",
    "PLURAL",
    "RAY_ROLE_RESOURCE_PREFIX",
    "REPLICA_INDEX",
    "RESTART_ATTEMPT",
    "ROLE",
    "ROLES",
    "SCHEDULER_PLUGINS_POD_GROUP",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "VOLCANO_POD_GROUP",
]
