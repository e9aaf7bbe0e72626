"""A real Prometheus (Debian's package) scrapes a real `rlhf run`; every dashboard expression
returns data for it, and the alerts fire exactly for the job that should trigger them.

Targets: `real` is a real local run (GRPO, disaggregated placement, an elastic rollout fleet
under the autoscaling policy) serving the controller's own /metrics. `stalled` is the one part
that is staged: the controller's real exporter classes (`StepMetrics` + `MetricsServer`) fed
step metrics that never advance (`standin_exporter.py`), because a real run that stalls on
purpose is not something to wait for in a test. `operator` is the real `rlhf_operator.metrics`
module with its counters bumped by hand (the operator itself needs a cluster; the cluster tests
scrape the real one). Fails (does not skip) without the prometheus binary.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from promql import ROOT, panel_exprs, rule_exprs

HERE = Path(__file__).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    q = url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(q, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result if body["data"]["resultType"] == "vector" else [{"value": result}]


REAL_JOB = "real"


def _real_run(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    """`rlhf run` of the elastic example, long enough to outlive the test, on a fixed metrics port."""
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "elastic.yaml").read_text())
    doc["metadata"]["name"] = REAL_JOB
    spec = doc["spec"]
    spec["training"]["steps"] = 100_000  # stopped by the fixture
    spec["roles"]["actor"]["replicas"] = 1
    spec["checkpoint"] = {"every": 0}
    spec["output"] = {"metricsPort": port, "report": False, "progress": False}
    # An evaluation every 2 steps on a few of the training prompts (the evaluation panel's series).
    spec["eval"] = {"path": spec["data"]["path"], "every": 2, "maxPrompts": 4}
    manifest = tmp / "real.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    log = (tmp / "real.log").open("wb")
    cmd = [
        sys.executable,
        "-m",
        "rlhf_trainer.cli",
        "run",
        str(manifest),
        "--run-dir",
        str(tmp / "run"),
        "--no-resume",
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT first (the run shuts Ray down cleanly), then the whole process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: install Debian's prometheus package (scripts/test.sh does)"
    tmp = tmp_path_factory.mktemp("prom")
    procs, targets = [], []
    real_port = _port()
    procs.append(_real_run(tmp, real_port))
    targets.append(
        {"targets": [f"127.0.0.1:{real_port}"], "labels": {"rlhf_job": REAL_JOB, "namespace": "team-a"}}
    )
    env = {"PYTHONPATH": f"{ROOT / 'api'}:{ROOT / 'operator'}:{ROOT / 'trainer'}"}
    for mode in ("stalled", "operator"):
        port = _port()
        procs.append(
            subprocess.Popen([sys.executable, str(HERE / "standin_exporter.py"), str(port), mode], env=env)
        )
        labels = {} if mode == "operator" else {"rlhf_job": mode, "namespace": "team-a"}
        targets.append({"targets": [f"127.0.0.1:{port}"], "labels": labels})
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "scrape_configs": [{"job_name": "rlhf", "static_configs": targets}]}  # fmt: skip
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = _port()
    procs.append(subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        # The real run bootstraps its tiny model once (cached), starts Ray and its workers, then
        # steps; wait for every target up and several of its steps scraped.
        ready = f'rlhf_step{{rlhf_job="{REAL_JOB}"}} >= 4 and count_over_time(rlhf_step{{rlhf_job="{REAL_JOB}"}}[1m]) >= 5'
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and procs[0].poll() is None:
            try:
                if len(_query(url, "up == 1")) == 3 and _query(url, ready):
                    break
            except OSError:
                pass
            time.sleep(1)
        else:
            log = (tmp / "real.log").read_text()[-3000:]
            raise AssertionError(
                f"Prometheus did not get 5 steps of the real run and its 2 other targets:\n{log}"
            )
        yield url
    finally:
        _stop(procs[0])
        for p in procs[1:]:
            p.terminate()
        for p in procs[1:]:
            p.wait(timeout=10)


def test_every_panel_expression_returns_data(prometheus: str) -> None:
    """Job-view panels are evaluated for the real run alone (its `$job`), so a series that only the
    staged target exports would show up as empty here."""
    exprs = panel_exprs(job=REAL_JOB)
    # rate() over a series needs two scrapes of it after its first observation: on a loaded
    # machine that can lag the readiness check by a few scrape intervals, so wait for it.
    deadline = time.monotonic() + 60
    while True:
        empty = [(where, e) for where, e in exprs if not _query(prometheus, e)]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not empty, f"panel expressions with no data after 60 s of scrapes: {empty}"


def test_alerts_fire_for_the_stalled_job_only(prometheus: str) -> None:
    exprs = dict(rule_exprs())
    firing = {name: {r["metric"].get("rlhf_job") for r in _query(prometheus, e)} for name, e in exprs.items()}
    assert firing["RLHFJobNoProgress"] == {"stalled"}  # the real run keeps stepping
    assert firing["RLHFRolloutSaturated"] == {"stalled"}
    assert firing["RLHFJobControllerRestarted"] == set()
    assert firing["RLHFJobRestarting"] == {None}  # the operator stand-in counts gang restarts
    assert firing["RLHFJobFailed"] == set()
