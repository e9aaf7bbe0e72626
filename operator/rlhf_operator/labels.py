"""Label, annotation and resource-name constants shared by the operator, the trainer and the tests.

Every key the project puts on a Kubernetes object is defined here, once.
"""

GROUP = "rlhf.dev"
VERSION = "v1alpha1"
KIND = "RLTrainingJob"
PLURAL = "rltrainingjobs"
SINGULAR = "rltrainingjob"
SHORT_NAMES = ["rltj"]
API_VERSION = f"{GROUP}/{VERSION}"

#: Name of the RLTrainingJob that owns the object.
JOB_NAME = "rlhf.dev/job-name"
#: Role of the pod: controller, actor, critic, reference, reward or rollout.
ROLE = "rlhf.dev/role"
#: Ordinal of the pod within its role (0-based, stable across restarts).
REPLICA_INDEX = "rlhf.dev/replica-index"
#: Gang restart attempt the pod belongs to (bumped on every gang restart).
RESTART_ATTEMPT = "rlhf.dev/restart-attempt"

ROLES = ("actor", "critic", "reference", "reward", "rollout")
CONTROLLER_ROLE = "controller"

#: Roles whose pods form the training gang: one of them failing restarts every pod of the job
#: from the last checkpoint. A failed `rollout` pod is replaced alone.
GANG_ROLES = (CONTROLLER_ROLE, "actor", "critic", "reference", "reward")

#: Finalizer the operator puts on every job so that its per-job worker stops before deletion.
FINALIZER = "rlhf.dev/operator"

#: Kueue's plain-pod integration: queue, pod group and the group's size.
KUEUE_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
KUEUE_POD_GROUP_NAME = "kueue.x-k8s.io/pod-group-name"
KUEUE_POD_GROUP_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
#: scheduler-plugins' coscheduling label and Volcano's group annotation.
SCHEDULER_PLUGINS_POD_GROUP = "scheduling.x-k8s.io/pod-group"
VOLCANO_POD_GROUP = "scheduling.k8s.io/group-name"

#: Ray custom resource a role pod advertises (`rlhf.dev/role-actor: 1`) so the driver's actors land on it.
RAY_ROLE_RESOURCE_PREFIX = "rlhf.dev/role-"

#: Field manager of every write the operator makes.
FIELD_MANAGER = "rlhf-operator"
