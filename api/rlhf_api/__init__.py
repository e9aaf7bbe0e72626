"""The RLTrainingJob API: what the operator and the trainer share, and nothing else.

`rlhf_api` imports neither torch, Ray, kopf nor a Kubernetes client, and neither of the two
packages that use it (`rlhf_operator`, `rlhf_trainer`); its only third-party imports are PyYAML
and cel-python (and prometheus_client's text parser, lazily, for a scraped `/metrics`). It holds:

* the job's spec, one kind of thing a file, its CEL rules beside the fields they check (as
  kubebuilder's markers sit beside its `api/v1` types):
  `fields` (the documented field `_f`, shared patterns and bounds, CEL text and type helpers),
  `pods` (the Kubernetes pod types a job may set), `sections` (model, data, reward, algorithm,
  rollout, training, checkpoint, eval, output), `roles` (roles, node pools, scheduling, failure
  policy, autoscaling), `job` (`JobSpec`, `RLTrainingJob` and what is derived from a whole spec),
  `storage` (are the trainer's directories on shared volumes), `schema` (the CRD's OpenAPI
  schema), `admission` (that schema and its rules evaluated as the API server does), `loader`
  (`parse_job`: admit, then convert into typed sections) and `reference` (the manifest reference);
* `status`: the schema of the job's status (what the operator and the controller pod write);
* `contract`: every name a pod and the operator share (labels, env vars, ports, paths, status keys);
* `algorithm_params`: the typed parameters of the built-in algorithms (and the verl spellings they
  accept), `algorithm_schema`: their CRD schema, keyed rules and reference section;
* `cel`: CEL evaluated in Python, as the API server does (for admission and the params' rules);
* `autoscale`: the rollout autoscaling policy and its metric sources.
"""
