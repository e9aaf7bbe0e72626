"""rlhf_operator: the Kubernetes operator of rlhf-operator (kopf handlers, pure builders, policies)."""

__version__ = "0.1.0"
