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
