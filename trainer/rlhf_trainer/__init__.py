"""rlhf_trainer: the trainer runtime of rlhf-operator.

Importing this package is cheap and does not import torch; the heavy parts
(algorithms, workers, rollout engines) are imported by the modules that need them.
"""

__version__ = "0.1.0"
