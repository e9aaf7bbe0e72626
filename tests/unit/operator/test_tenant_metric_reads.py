"""A tenant's `/metrics` cannot starve the operator's threads or wedge its job's pass: the read is
capped at 256 KiB, only the autoscaler's series reaches the parser, the parse raises nothing but
a MetricError, and a signal out of range or an autoscaler failure of any kind leaves the pass
(suspend, TTL, restarts) to run."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from operator_helpers import at
from test_operator_autoscaler import ScaleKube, running

from rlhf_api import autoscale
from rlhf_api.autoscale import MetricError, ScrapeSource, parse_exposition, series_lines
from rlhf_api.loader import parse_job
from rlhf_operator import autoscaler
from rlhf_operator.executor import Executor, read_signal

SERIES = "rlhf_rollout_wait_seconds"


def junk(size: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice('ab{}="\n ,#x0.9_\\') for _ in range(size))


@pytest.mark.parametrize(
    "text",
    [
        junk(4 << 20),
        # 4 MiB of well-formed series of other names (seconds of CPU through the full parser).
        "".join(f'tenant_series_{i % 97}{{pod="p{i}",le="+Inf"}} {i}.5\n' for i in range(110_000)),
        # Junk on lines that start with the series' name: these reach the parser.
        "".join(f'{SERIES}{{a="{i}" junk {junk(20, i)}\n' for i in range(2000)),
        f"{SERIES} 1\n" * (8 << 10) + f"{SERIES}{{le=\n",
    ],
)
def test_junk_costs_bounded_time_and_is_at_most_a_metric_error(text: str) -> None:
    started = time.process_time()
    with contextlib.suppress(MetricError):
        parse_exposition(text, SERIES)
    assert time.process_time() - started < 1.0  # the full parser took 2-5 s on the first two


def test_only_the_series_lines_reach_the_parser() -> None:
    text = f'# HELP {SERIES} x\n{SERIES}_other 9\n{SERIES}{{a="1"}} 2\n{SERIES} 3\nrlhf_x 5\n{SERIES}\t4\n'
    assert series_lines(text, SERIES).splitlines() == [f'{SERIES}{{a="1"}} 2', f"{SERIES} 3", f"{SERIES}\t4"]
    assert parse_exposition(text, SERIES, "sum") == 9.0
    assert parse_exposition(text, SERIES, "max") == 4.0


@pytest.mark.parametrize("error", [KeyError("x"), IndexError("y"), TypeError("z"), OverflowError("w")])
def test_whatever_the_parser_raises_becomes_a_metric_error(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    import prometheus_client.parser as parser

    def broken(_: str) -> Any:
        raise error

    monkeypatch.setattr(parser, "text_string_to_metric_families", broken)
    with pytest.raises(MetricError, match=type(error).__name__):
        parse_exposition(f"{SERIES} 1\n", SERIES)


def test_samples_adding_up_to_infinity_are_a_metric_error() -> None:
    with pytest.raises(MetricError, match="more than a float can hold"):
        parse_exposition(f'{SERIES}{{a="1"}} 1.5e308\n{SERIES}{{a="2"}} 1.5e308\n', SERIES, "sum")


class _Source:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def read(self) -> float | None:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("outcome", "value", "why"),
    [
        (0.5, 0.5, None),
        (None, None, None),
        (MetricError("down"), None, "down"),
        (http.client.BadStatusLine("HTTP/9 x"), None, "the metric read failed (BadStatusLine)"),
        (OverflowError("big"), None, "the metric read failed (OverflowError)"),
        (1.5e308, None, "the signal is not a finite number"),
        (float("nan"), None, "the signal is not a finite number"),
        (float("-inf"), None, "the signal is not a finite number"),
    ],
)
def test_read_signal_answers_a_bounded_number_or_a_reason(
    outcome: Any, value: float | None, why: str | None
) -> None:
    got, reason = read_signal(_Source(outcome))
    assert got == value
    assert (reason is None) if why is None else (reason is not None and reason.startswith(why))


@pytest.fixture
def junk_server() -> Iterator[str]:
    body = junk(4 << 20).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()  # no Content-Length: the cap applies while reading
            with contextlib.suppress(OSError):  # the client hangs up at its cap
                self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def test_the_operator_reads_at_most_256_kib_of_a_jobs_metrics(junk_server: str) -> None:
    job = parse_job(running(2))
    source = autoscaler.metric_source(job, junk_server)
    assert isinstance(source, ScrapeSource) and source.max_bytes == 256 << 10 < autoscale.MAX_SCRAPE_BYTES
    started = time.monotonic()
    with pytest.raises(MetricError, match="exceeds the 262144-byte limit"):
        source.read()
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("error", [OverflowError("ceil(inf)"), KeyError("metrics"), RecursionError()])
def test_an_autoscaler_failure_does_not_stop_the_pass(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise error

    monkeypatch.setattr(autoscaler, "evaluate", broken)
    body = running(2)
    body["spec"]["suspend"] = True
    fake = ScaleKube(body)
    ex = Executor(fake, read=lambda _: (1.0, None))  # type: ignore[arg-type]
    out = ex.reconcile("ns", "j", now=at(0))
    assert fake.job["status"]["phase"] == "Suspended"
    assert out.requeue_after is not None
