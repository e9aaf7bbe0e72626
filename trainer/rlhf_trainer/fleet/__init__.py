"""The elastic rollout fleet of a disaggregated job: who serves (`membership`, and on a cluster
`cluster_membership`, which follows the operator's `status.rollout`), which prompts each member
holds (`queue`, `leasing`), and the composition the controller runs at every step boundary
(`elastic.RolloutFleet`). The weights themselves travel through `rlhf_trainer.sync`, which this
package drives.

See docs/elastic-rollout.md for the protocol the controller and the operator follow.
"""
