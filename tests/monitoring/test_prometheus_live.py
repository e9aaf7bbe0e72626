"""A real Prometheus (Debian's package) scrapes live exporters; every dashboard expression
returns data, and the alerts fire exactly for the job that should trigger them.

PARTLY A STAND-IN: the trainer targets run the controller's real exporter classes
(`rlhf_trainer.metrics.StepMetrics` + `MetricsServer`) fed synthetic step metrics by
`standin_exporter.py`, not a real `rlhf run` (the controller's elastic fleet was landing while
this was written); the operator target uses the real `rlhf_operator.metrics` module. The
integration lead switches the trainer targets to a real run. Fails (does not skip) without the
prometheus binary.
"""

from __future__ import annotations

import json
import shutil
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


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: install Debian's prometheus package (scripts/test.sh does)"
    tmp = tmp_path_factory.mktemp("prom")
    procs, targets = [], []
    env = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'trainer'}"}
    for mode in ("healthy", "stalled", "operator"):
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
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every target up and a few samples in
            try:
                up = _query(url, "up == 1")
                if len(up) == 3 and _query(url, "count_over_time(rlhf_step[1m]) >= 5"):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("Prometheus did not scrape the three targets within 60 s")
        yield url
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)


def test_every_panel_expression_returns_data(prometheus: str) -> None:
    empty = [(where, e) for where, e in panel_exprs() if not _query(prometheus, e)]
    assert not empty, f"panel expressions with no data: {empty}"


def test_alerts_fire_for_the_stalled_job_only(prometheus: str) -> None:
    exprs = dict(rule_exprs())
    firing = {name: {r["metric"].get("rlhf_job") for r in _query(prometheus, e)} for name, e in exprs.items()}
    assert firing["RLHFJobNoProgress"] == {"stalled"}
    assert firing["RLHFRolloutSaturated"] == {"stalled"}
    assert firing["RLHFJobControllerRestarted"] == set()
    assert firing["RLHFJobRestarting"] == {None}  # the operator stand-in counts gang restarts
    assert firing["RLHFJobFailed"] == set()
