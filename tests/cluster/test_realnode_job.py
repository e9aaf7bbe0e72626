"""A job applied with kubectl trains, scales, recovers and finishes for real, on the real node.

The operator runs in the cluster, installed from the chart with the `operator` image built from the
Dockerfile; the job's pods run the `trainer-cpu` image. One disaggregated GRPO job (a tiny model and
prompts made here, on a hostPath volume at /workspace) is followed through the tests of this module,
in order:

1. it trains: the controller pod, two actor pods (FSDP2 over gloo across pods), the reward pod and
   two rollout pods run; `kubectl get rltj` shows Step and Reward advancing; the controller's log
   shows progress;
2. an actor pod deleted mid-run: one gang restart, the new gang resumes from the last checkpoint on
   the volume, at that step;
3. `kubectl scale --replicas=3`: the new pod's replica joins, its weights equal the actor's (by
   hash), syncedGeneration reaches generation; then `--replicas=1`: the leaving pods are deleted
   only after that sync;
4. it ends Succeeded with restarts 1; every prompt taken from the queue was consumed exactly once;
   the exported model loads with from_pretrained and generates.

A second job whose image does not exist is reported (condition, Warning Event naming the pod and
the image) and failed by its failure policy; a third pulls its image from a registry slower than
its start timeout and still succeeds.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import Cluster, ClusterError, assets_dir, helm_capabilities, wait_for
from realnode import NODE_NAME, POOL, POOL_LABEL, TAINT_KEY, TOLERATION
from test_operator_e2e import CHART, ROOT, installed  # noqa: F401  (installed is a fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.realnode, pytest.mark.timeout(1800)]

GROUP, VERSION, PLURAL = "rlhf.dev", "v1alpha1", "rltrainingjobs"
JOB = "rn-grpo"
STEPS = 300
PROMPTS_PER_STEP = 8
CHECKPOINT_EVERY = 5
RELEASE = "rlhf-rn"


# --------------------------------------------------------------------------------------------------
# Fixtures: a namespace, the operator from the chart, the workspace volume


@pytest.fixture(scope="module")
def rn_namespace(cluster: Cluster) -> Iterator[str]:
    name = f"rn-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(
        lambda: cluster.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        timeout=30,
        what=f"ServiceAccount {name}/default",
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _render_operator(images: dict[str, str], namespace: str, operator_ns: str) -> str:
    repository, tag = images["operator"].rsplit(":", 1)
    cmd = [
        str(assets_dir() / "helm"),
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        operator_ns,
        *helm_capabilities(),  # as `helm install` would learn from the API server (status policy on)
        "-f",
        str(CHART / "ci" / "realnode-values.yaml"),
        "--set",
        f"image.repository={repository},watchNamespaces[0]={namespace}",
        # A tag of digits only (a source hash can be one) would be a number under --set, which the
        # chart's schema refuses: the tag is always a string.
        "--set-string",
        f"image.tag={tag}",
        "--set",
        f"tolerations[0].key={TAINT_KEY},tolerations[0].operator=Exists,tolerations[0].effect=NoSchedule",
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def chart_operator(
    cluster: Cluster,
    installed: Any,  # noqa: F811 (the fixture imported above)
    images: dict[str, str],
    rn_namespace: str,
) -> Iterator[str]:
    """The operator Deployment of the chart, Ready on the real node; yields its pod's name."""
    operator_ns = f"{rn_namespace}-system"
    cluster.kubectl("create", "namespace", operator_ns)
    rendered = _render_operator(images, rn_namespace, operator_ns)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered)

    def ready_pod() -> str | None:
        pods = cluster.request("GET", f"/api/v1/namespaces/{operator_ns}/pods")["items"]
        for pod in pods:
            conditions = (pod.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                return str(pod["metadata"]["name"])
        return None

    try:
        pod = wait_for(ready_pod, timeout=180, interval=1, what="the chart's operator pod Ready")
    except ClusterError:
        print(cluster.kubectl("get", "pods", "-n", operator_ns, "-o", "wide", check=False))
        print(
            cluster.kubectl(
                "logs", "-n", operator_ns, "-l", "app.kubernetes.io/name=rlhf-operator", check=False
            )
        )
        raise
    node = cluster.request("GET", f"/api/v1/namespaces/{operator_ns}/pods/{pod}")["spec"]["nodeName"]
    assert node == NODE_NAME
    try:
        yield f"{operator_ns}/{pod}"
    finally:
        logs = cluster.kubectl("logs", "-n", operator_ns, pod, "--tail=40", check=False)
        print(f"--- operator log (last lines)\n{logs}")
        cluster.kubectl("delete", "-f", "-", "--wait=false", input=rendered, check=False)
        cluster.kubectl("delete", "namespace", operator_ns, "--wait=false", check=False)


def bootstrapped_workspace(recipe: str, prompts: int, prefix: str) -> Iterator[Path]:
    """A host directory (the real node's hostPath) with `recipe`'s bootstrapped model and
    `prompts` of its prompts, owned by the pods' user (1000); removed afterwards."""
    from rlhf_api.sections import ModelSpec
    from rlhf_trainer.bootstrap import ensure_model, write_prompts

    root = Path(f"/tmp/{prefix}-{uuid.uuid4().hex[:6]}")
    root.mkdir()
    cached = Path(f"~/.cache/rlhf-operator/models/{recipe}").expanduser()
    ensure_model(ModelSpec(path=str(cached), bootstrap=recipe))
    shutil.copytree(cached, root / "model")
    write_prompts(recipe, root / "prompts.jsonl", prompts)
    subprocess.run(["chown", "-R", "1000:1000", str(root)], check=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def workspace() -> Iterator[Path]:
    """The tiny-arithmetic model and its prompts on a hostPath the job's pods share."""
    yield from bootstrapped_workspace("tiny-arithmetic", 512, "rlhf-rn-workspace")


def job_manifest(name: str, image: str, workspace: Path, **overrides: Any) -> dict[str, Any]:
    small = {"cpu": "100m", "memory": "1500Mi"}
    doc: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RLTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "image": image,
            "model": {"path": "model"},  # relative: against the pods' working directory, /workspace
            "data": {"path": "prompts.jsonl"},
            "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
            "algorithm": {"name": "grpo", "params": {"klCoef": 0.0}},
            "rollout": {"samplesPerPrompt": 4, "maxNewTokens": 4, "temperature": 1.0},
            "training": {
                "steps": STEPS,
                "promptsPerStep": PROMPTS_PER_STEP,
                "microBatchSize": 64,
                "learningRate": 1.0e-3,
                "seed": 0,
            },
            "checkpoint": {"every": CHECKPOINT_EVERY},
            "output": {"dir": "run"},
            "nodePools": [{"name": POOL, "nodeSelector": {POOL_LABEL: POOL}, "tolerations": [TOLERATION]}],
            "pod": {
                "volumes": [
                    {
                        "name": "work",
                        "mountPath": "/workspace",
                        "hostPath": {"path": str(workspace), "type": "Directory"},
                    }
                ],
                # The controller hashes the weights of the actor and every replica after each sync.
                "env": [{"name": "RLHF_VERIFY_WEIGHT_SYNC", "value": "1"}],
            },
            "controller": {"nodePool": POOL, "resources": {"cpu": "100m", "memory": "2Gi"}},
            "failurePolicy": {"maxRestarts": 2},
            "roles": {
                "placement": "disaggregated",
                "actor": {"replicas": 2, "nodePool": POOL, "resources": small},
                "critic": {"replicas": 0},
                "reference": {"replicas": 0},
                "reward": {"replicas": 1, "nodePool": POOL, "resources": {"cpu": "100m", "memory": "1Gi"}},
                "rollout": {
                    "replicas": 2,
                    "minReplicas": 1,
                    "maxReplicas": 3,
                    "nodePool": POOL,
                    "resources": small,
                },
            },
        },
    }
    doc["spec"].update(overrides)
    return doc


class Job:
    """The job under test, through kubectl and the API (as a user would see it)."""

    def __init__(self, cluster: Cluster, namespace: str, name: str) -> None:
        self.cluster, self.ns, self.name = cluster, namespace, name

    def get(self) -> dict[str, Any]:
        return self.cluster.request(  # type: ignore[no-any-return]
            "GET", f"/apis/{GROUP}/{VERSION}/namespaces/{self.ns}/{PLURAL}/{self.name}"
        )

    def status(self) -> dict[str, Any]:
        return self.get().get("status") or {}

    def step(self) -> int:
        return int((self.status().get("progress") or {}).get("step") or 0)

    def pods(self) -> dict[str, dict[str, Any]]:
        items = self.cluster.request(
            "GET",
            f"/api/v1/namespaces/{self.ns}/pods",
            query={"labelSelector": f"rlhf.dev/job-name={self.name}"},
        )["items"]
        return {p["metadata"]["name"]: p for p in items}

    def kubectl(self, *args: str, check: bool = True) -> str:
        return self.cluster.kubectl(*args, "-n", self.ns, check=check)

    def row(self) -> dict[str, str]:
        """`kubectl get rltj NAME`: the printer columns by header."""
        header, line = self.kubectl("get", "rltj", self.name).strip().splitlines()[:2]
        return dict(zip(header.split(), line.split()))

    def controller_log(self, *args: str) -> str:
        return self.kubectl("logs", f"{self.name}-controller", *args, check=False)

    def wait(self, predicate: Any, what: str, timeout: float = 300) -> Any:
        try:
            return wait_for(predicate, timeout=timeout, interval=0.5, what=f"{self.name}: {what}")
        except ClusterError as err:
            raise ClusterError(f"{err}\n{self.diagnostics()}") from err

    def diagnostics(self) -> str:
        """What a failed wait prints: status, pods, the namespace's events, the controller's log."""
        pods = self.kubectl("get", "pods", "-o", "wide", check=False)
        events = self.kubectl("get", "events", "--sort-by=.lastTimestamp", check=False)
        tail = self.controller_log("--tail=40")
        return (
            f"status: {json.dumps(self.status())[:1500]}\n{pods}\nevents:\n{events[-4000:]}\n"
            f"{node_state(self.cluster)}\ncontroller log:\n{tail}"
        )


def node_state(cluster: Cluster) -> str:
    """The real node's taints and conditions: a pod that stays Pending while the node has room is
    behind a NoSchedule taint the kubelet's pressure signals or a missed heartbeat put there."""
    try:
        node = cluster.request("GET", f"/api/v1/nodes/{NODE_NAME}")
    except Exception as err:  # a diagnostic must not hide the failure it explains
        return f"node {NODE_NAME}: cannot read ({err})"
    taints = [f"{t['key']}:{t['effect']}" for t in (node.get("spec") or {}).get("taints") or []]
    conditions = [
        f"{c['type']}={c['status']} ({c.get('reason', '')}, since {c.get('lastTransitionTime')})"
        for c in (node.get("status") or {}).get("conditions") or []
    ]
    return f"node {NODE_NAME}: taints {taints}; conditions {'; '.join(conditions)}"


@pytest.fixture(scope="module")
def job(
    cluster: Cluster, chart_operator: str, images: dict[str, str], rn_namespace: str, workspace: Path
) -> Job:
    doc = job_manifest(JOB, images["trainer-cpu"], workspace)
    cluster.kubectl("apply", "-n", rn_namespace, "-f", "-", input=yaml.safe_dump(doc))
    return Job(cluster, rn_namespace, JOB)


def read_metrics(workspace: Path) -> list[dict[str, Any]]:
    path = workspace / "run" / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            rows.append(json.loads(line))
    return rows


# --------------------------------------------------------------------------------------------------
# The job, in order


def test_job_trains_on_real_pods(job: Job) -> None:
    t0 = time.monotonic()
    job.wait(lambda: job.step() >= 3, "3 steps done", timeout=420)
    print(f"applied -> step 3: {time.monotonic() - t0:.0f} s")
    pods = job.pods()
    want = {f"{JOB}-controller", f"{JOB}-actor-0", f"{JOB}-actor-1", f"{JOB}-reward-0"}
    want |= {f"{JOB}-rollout-0", f"{JOB}-rollout-1"}
    assert set(pods) == want
    for name, pod in pods.items():
        assert pod["status"]["phase"] == "Running", name
        assert pod["spec"]["nodeName"] == NODE_NAME, name
        assert pod["status"]["podIP"].startswith("10.244.0."), name
    # Step and Reward columns of `kubectl get rltj`, advancing. The columns read status.summary,
    # which the operator derives from status.progress on its next reconcile: a moment behind.
    job.wait(lambda: int(job.row()["STEP"].split("/")[0]) >= 3, "Step column at 3")
    first = job.row()
    done, total = (int(x) for x in first["STEP"].split("/"))
    assert total == STEPS and done >= 3
    assert re.fullmatch(r"-?\d+(\.\d+)?(e-?\d+)?", first["REWARD"]), first
    job.wait(lambda: int(job.row()["STEP"].split("/")[0]) >= done + 5, "Step advancing in kubectl get rltj")
    # The actor gang is one gloo group across its two pods.
    actor_ips = {pods[f"{JOB}-actor-{i}"]["status"]["podIP"] for i in (0, 1)}
    assert len(actor_ips) == 2
    log = job.controller_log()
    assert re.search(rf"{JOB}: step \d+/{STEPS}  reward", log), log[-2000:]
    assert "following status.rollout generation 1: 2 rollout replicas" in log


def test_the_jobs_pods_admit_only_their_peers(job: Job, chart_operator: str) -> None:
    """The job's NetworkPolicy, as the chart's operator (its settings from the chart) made it. The
    real node's CNI (the bridge plugin) enforces no NetworkPolicy, so this asserts the object and
    whom it selects and admits, not a refused connection."""
    policy = json.loads(job.kubectl("get", "networkpolicy", JOB, "-o", "json"))
    assert policy["metadata"]["ownerReferences"][0]["uid"] == job.get()["metadata"]["uid"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    pods = job.pods()
    assert pods and all(selected.items() <= p["metadata"]["labels"].items() for p in pods.values())
    own, metrics = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": selected}}]}  # the job's own pods, every port
    assert metrics["ports"] == [{"protocol": "TCP", "port": 8080}]  # the others: /metrics only
    peers = metrics["from"]
    operator_ns, operator_pod = chart_operator.split("/")
    (peer,) = [
        p
        for p in peers
        if p.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
        == operator_ns
    ]
    operator_labels = job.cluster.request("GET", f"/api/v1/namespaces/{operator_ns}/pods/{operator_pod}")[
        "metadata"
    ]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= operator_labels.items()  # the operator is let in
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in peers


def test_actor_pod_deleted_mid_run_restarts_the_gang_from_the_checkpoint(job: Job, workspace: Path) -> None:
    job.wait(lambda: job.step() >= CHECKPOINT_EVERY + 2, f"past the checkpoint of step {CHECKPOINT_EVERY}")
    checkpoints = workspace / "run" / "checkpoints"
    job.wait(lambda: any(checkpoints.glob("step-*/COMPLETE")), "a complete checkpoint on the volume")
    before = job.pods()
    job.kubectl("delete", "pod", f"{JOB}-actor-1", "--wait=false")
    latest_at_kill = max(int(p.parent.name.split("-")[1]) for p in checkpoints.glob("step-*/COMPLETE"))
    job.wait(lambda: int(job.status().get("restarts") or 0) == 1, "one gang restart", timeout=120)

    def new_gang_running() -> bool:
        pods = job.pods()
        return len(pods) == len(before) and all(
            p["metadata"]["uid"] != before.get(n, {}).get("metadata", {}).get("uid")
            and p["status"].get("phase") == "Running"
            for n, p in pods.items()
        )

    job.wait(new_gang_running, "a new gang, every pod replaced and Running", timeout=240)
    job.wait(lambda: "resuming from" in job.controller_log(), "the new controller resuming", timeout=300)
    m = re.search(r"resuming from (\S+) \(step (\d+)\)", job.controller_log())
    assert m, job.controller_log()[-2000:]
    resumed = int(m.group(2))
    # The checkpoint it resumed is on the shared volume, and no older than the newest complete
    # one when the pod was deleted (a save may have completed during the teardown).
    assert Path(m.group(1)).name == f"step-{resumed:06d}"
    assert (checkpoints / f"step-{resumed:06d}" / "COMPLETE").exists()
    assert resumed >= latest_at_kill
    assert job.status()["restarts"] == 1
    job.wait(lambda: job.step() > resumed, "steps after the resume")


def test_kubectl_scale_grows_and_shrinks_the_fleet(job: Job) -> None:
    log_before = job.controller_log()
    job.kubectl("scale", f"rltj/{JOB}", "--replicas=3")
    t0 = time.monotonic()

    def synced_at(replicas: int) -> int | None:
        r = job.status().get("rollout") or {}
        gen = int(r.get("generation") or 0)
        ok = r.get("desired") == replicas and gen > 0 and int(r.get("syncedGeneration") or 0) == gen
        return gen if ok else None

    generation = job.wait(lambda: synced_at(3), "syncedGeneration == generation with 3 replicas")
    print(f"scale 2 -> 3: synced in {time.monotonic() - t0:.0f} s")
    assert f"{JOB}-rollout-2" in job.pods()
    # The new replica (slot 2) received weights equal to the actor's, by hash: the first sync
    # after the reshard that the controller verified names all three slots.
    new_lines = job.controller_log()[len(log_before) :]
    verified = re.findall(
        r"weights verified after the sync \(sync group \d+\): actor (\w+), replicas (.*)", new_lines
    )
    with_slot_2 = [(actor, replicas) for actor, replicas in verified if "@2=" in replicas]
    assert with_slot_2, new_lines[-3000:]
    actor_digest, replicas = with_slot_2[0]
    digests = dict(part.split("=") for part in replicas.split(", "))
    assert sorted(k.split("@")[1] for k in digests) == ["0", "1", "2"]
    assert set(digests.values()) == {actor_digest}

    # Down to 1: the leaving pods (slots 1, 2) stay until the controller has synced the new
    # generation, and only then are deleted.
    job.kubectl("scale", f"rltj/{JOB}", "--replicas=1")
    leaving = {f"{JOB}-rollout-1", f"{JOB}-rollout-2"}
    seen_gone_before_sync: list[str] = []
    deadline = time.monotonic() + 300
    synced = None
    while time.monotonic() < deadline:
        # Pods first, then the status: a pod seen gone while the status read after it still shows
        # the generation unsynced was really deleted before the sync (reads are linearizable).
        pods = job.pods()
        r = job.status().get("rollout") or {}
        gen, sync = int(r.get("generation") or 0), int(r.get("syncedGeneration") or 0)
        gone = [p for p in leaving if p not in pods or pods[p]["metadata"].get("deletionTimestamp")]
        if gen > generation and sync < gen:
            seen_gone_before_sync += gone
        if gen > generation and sync == gen:
            synced = gen
            break
        time.sleep(0.2)
    assert synced is not None, f"generation after the scale-down never synced: {job.status().get('rollout')}"
    assert not seen_gone_before_sync, f"deleted before the controller synced: {seen_gone_before_sync}"
    job.wait(lambda: not (leaving & set(job.pods())), "the leaving pods deleted after the sync", timeout=120)
    assert set(p for p in job.pods() if "-rollout-" in p) == {f"{JOB}-rollout-0"}


def test_job_succeeds_with_one_restart_and_every_prompt_once(job: Job, workspace: Path) -> None:
    job.wait(lambda: job.status().get("phase") == "Succeeded", "Succeeded", timeout=900)
    status = job.status()
    assert status["restarts"] == 1
    assert status["progress"]["step"] == STEPS
    rows = read_metrics(workspace)
    steps = [int(r["step"]) for r in rows]
    # The resume dropped the records after its checkpoint: one record per step, in order.
    assert steps == list(range(STEPS)), steps[:5]
    # Exactly once: from the resume on, every prompt the data stream handed out was enqueued once
    # and acknowledged once (requeued prompts, from the drained replicas, included); none stale.
    resumed = next(
        i for i in range(1, len(rows)) if rows[i]["queue/enqueued"] < rows[i - 1]["queue/enqueued"]
    )
    attempt = rows[resumed:]
    last = attempt[-1]
    assert last["queue/enqueued"] == PROMPTS_PER_STEP * len(attempt)
    assert last["queue/acked"] == last["queue/enqueued"]
    assert last["queue/stale_acks"] == 0
    assert last["data/prompts_consumed"] == PROMPTS_PER_STEP * STEPS
    print(
        f"attempt 2: {len(attempt)} steps, {int(last['queue/acked'])} prompts acked, {int(last['queue/requeued'])} requeued"
    )


def test_exported_model_loads_and_generates(job: Job, workspace: Path) -> None:
    job.wait(lambda: job.status().get("phase") == "Succeeded", "Succeeded", timeout=900)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = workspace / "run" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("3+4=", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    print("exported model answers 3+4=", repr(tokenizer.decode(out[0][ids["input_ids"].shape[1] :])))


# --------------------------------------------------------------------------------------------------
# A job whose image does not exist


def test_missing_image_is_reported_and_fails_the_job(
    cluster: Cluster, chart_operator: str, rn_namespace: str, workspace: Path
) -> None:
    name = "rn-noimage"
    image = "localhost/rlhf-operator/does-not-exist:1"
    doc = job_manifest(name, image, workspace, scheduling={"timeoutSeconds": 90})
    doc["spec"]["roles"]["rollout"]["replicas"] = 1
    t0 = time.monotonic()
    cluster.kubectl("apply", "-n", rn_namespace, "-f", "-", input=yaml.safe_dump(doc))
    job = Job(cluster, rn_namespace, name)

    def condition() -> dict[str, Any] | None:
        for c in job.status().get("conditions") or []:
            if c["type"] == "PodFailure" and c["status"] == "True":
                return c  # type: ignore[no-any-return]
        return None

    cond = job.wait(condition, "a PodFailure condition", timeout=90)
    print(
        f"missing image reported in {time.monotonic() - t0:.0f} s: {cond['reason']}: {cond['message'][:200]}"
    )
    assert cond["reason"] == "ImagePullFailed"
    assert image in cond["message"] and f"{name}-" in cond["message"]

    def warning() -> dict[str, Any] | None:
        events = cluster.request(
            "GET",
            f"/api/v1/namespaces/{rn_namespace}/events",
            query={"fieldSelector": f"involvedObject.name={name},type=Warning"},
        )["items"]
        return next((e for e in events if e["reason"] == "ImagePullFailed"), None)

    event = job.wait(warning, "a Warning Event", timeout=60)
    assert image in event["message"] and f"{name}-" in event["message"]
    final = job.wait(lambda: job.status().get("phase") == "Failed" and job.status(), "Failed", timeout=180)
    assert int(final.get("restarts") or 0) == 0  # a missing image fails the same on every restart


SLOW_LAYER_BYTES = 3 * 1024 * 1024
SLOW_RATE = 32 * 1024  # bytes/s: the new layer takes about 96 s
START_TIMEOUT = 20


def test_an_image_pull_slower_than_the_start_timeout_is_no_failure(
    cluster: Cluster,
    chart_operator: str,
    images: dict[str, str],
    rn_namespace: str,
    workspace: Path,
    real_node: Any,
) -> None:
    """The node pulls the job's image from a registry that sends its one new layer for much longer
    than `scheduling.timeoutSeconds`: a pod pulling its image is making progress
    (`imagePullTimeoutSeconds` bounds it, 1800 s by default), so the job reaches Running with no
    failure and no restart, and succeeds."""
    from slow_registry import SlowRegistry

    name = "rn-slowpull"
    with SlowRegistry(
        real_node, images["trainer-cpu"], layer_bytes=SLOW_LAYER_BYTES, rate=SLOW_RATE
    ) as registry:
        doc = job_manifest(
            name,
            registry.ref,
            workspace,
            scheduling={"timeoutSeconds": START_TIMEOUT},
            checkpoint={"every": 3},
            output={"dir": "run-slowpull"},  # not the first job's run directory
        )
        doc["spec"]["training"]["steps"] = 6
        doc["spec"]["roles"]["actor"]["replicas"] = 1
        doc["spec"]["roles"]["rollout"]["replicas"] = 1
        t0 = time.monotonic()
        cluster.kubectl("apply", "-n", rn_namespace, "-f", "-", input=yaml.safe_dump(doc))
        job = Job(cluster, rn_namespace, name)
        try:
            job.wait(lambda: job.status().get("phase") == "Running", "Running", timeout=600)
            t_running = time.monotonic() - t0
            final = job.wait(
                lambda: job.status().get("phase") in ("Succeeded", "Failed") and job.status(),
                "finished",
                timeout=600,
            )
        finally:  # the tag and the digest ref the kubelet's pull recorded
            listed = real_node.ctr("images", "ls", "-q").stdout.split()
            ours = [r for r in listed if r.startswith(f"{registry.host}/")]
            if ours:
                real_node.ctr("images", "rm", "--sync", *ours, check=False)
    slow = [(path, size, secs) for path, size, secs in registry.sent if registry.slow_digest in path]
    print(
        f"slow pull: the new layer ({SLOW_LAYER_BYTES} bytes) sent in {[round(s) for _, _, s in slow]} s; "
        f"Running after {t_running:.0f} s (start timeout {START_TIMEOUT} s); {final.get('phase')}; "
        f"blobs sent: {[(p.rsplit('/', 1)[-1][:19], n) for p, n, _ in registry.sent]}"
    )
    assert slow and slow[0][2] > 2 * START_TIMEOUT, registry.sent  # the pull outlasted the timeout
    assert final["phase"] == "Succeeded", final
    assert int(final.get("restarts") or 0) == 0
    assert not [
        c for c in final.get("conditions") or [] if c["type"] == "PodFailure" and c["status"] == "True"
    ]


# --------------------------------------------------------------------------------------------------
# Multi-turn tool use through the operator

MT_STEPS = 30


@pytest.fixture(scope="module")
def calculator_workspace() -> Iterator[Path]:
    """The multi-turn example's model (tiny-calculator, warmed up to call the tool about a quarter
    of the time) and prompts, on a hostPath the job's pods share."""
    yield from bootstrapped_workspace("tiny-calculator", 1024, "rlhf-rn-calculator")


def test_the_multi_turn_example_learns_through_the_operator(
    cluster: Cluster,
    chart_operator: str,
    images: dict[str, str],
    rn_namespace: str,
    calculator_workspace: Path,
) -> None:
    """manifests/examples/multiturn-calculator.yaml's job (its rollout, reward and algorithm
    sections as they are) on real pods of the operator, colocated: the episodes call the
    calculator through the environment in the actor's pod, the job succeeds, and the tool-call
    rate and the reward rise as they do under `rlhf run`."""
    example = yaml.safe_load((ROOT / "manifests" / "examples" / "multiturn-calculator.yaml").read_text())
    name = "rn-multiturn"
    doc = job_manifest(
        name,
        images["trainer-cpu"],
        calculator_workspace,
        reward=example["spec"]["reward"],
        algorithm=example["spec"]["algorithm"],
        rollout=example["spec"]["rollout"],
        training={**example["spec"]["training"], "steps": MT_STEPS},
        checkpoint={"every": 10},
    )
    roles = doc["spec"]["roles"]
    roles["placement"] = "colocated"
    roles["actor"]["replicas"] = 1
    roles["rollout"] = {"replicas": 0, "minReplicas": 0}
    doc["spec"]["pod"]["env"] = []  # no rollout replicas: no weight sync to verify
    t0 = time.monotonic()
    cluster.kubectl("apply", "-n", rn_namespace, "-f", "-", input=yaml.safe_dump(doc))
    job = Job(cluster, rn_namespace, name)
    job.wait(lambda: job.status().get("phase") == "Succeeded", "Succeeded", timeout=1200)
    rows = [r for r in read_metrics(calculator_workspace) if "multiturn/observed_fraction" in r]
    assert len(rows) == MT_STEPS, len(rows)
    called = [r["multiturn/observed_fraction"] for r in rows]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    calls_first, calls_last = sum(called[:6]) / 6, sum(called[-6:]) / 6
    print(
        f"multi-turn on the real node: {time.monotonic() - t0:.0f} s; reward {first:.3f} -> {last:.3f}, "
        f"tool calls {calls_first:.3f} -> {calls_last:.3f}, turns {rows[-1]['multiturn/turns_mean']:.2f}, "
        f"environment tokens {rows[-1]['multiturn/env_token_fraction']:.3f} of the responses"
    )
    assert all(r["multiturn/env_token_fraction"] > 0 for r in rows[-6:])  # the tool answered in the pod
    assert calls_last > calls_first + 0.2, (calls_first, calls_last)
    assert last > first + 0.2, (first, last)
