"""The autoscaler's metric reads against a real local HTTP server that misbehaves: a redirect (to
a second server that must never be reached), a server that never answers, one that streams an
endless body, and one whose answer carries text that must not reach the job's status. Each read
fails fast, with bounded memory, and the job's `status.autoscaling.reason` says why in words of
the operator's own."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from operator_helpers import at
from test_operator_autoscaler import ScaleKube, running

from rlhf_api.autoscale import MetricError, PrometheusSource, ScrapeSource, fetch
from rlhf_operator import autoscaler
from rlhf_operator.executor import Executor

SECRET = "tenant-b-internal-secret"


class Servers:
    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self.streamed = 0
        self.release = threading.Event()


@pytest.fixture
def servers() -> Iterator[tuple[str, str, Servers]]:
    state = Servers()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802
            route = self.path.split("/")[1]
            state.hits[route] = state.hits.get(route, 0) + 1
            if route == "redirect":
                self.send_response(302, f"Found {SECRET}")
                self.send_header("Location", target + "/api/v1/query?query=up")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif route == "hang":
                state.release.wait(30)  # accept, then say nothing
            elif route == "huge":  # chunked, no Content-Length: 1 GB if the client keeps reading
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                block = b"x" * 65536
                try:
                    while state.streamed < (1 << 30):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
                        state.streamed += len(block)
                except OSError:
                    return  # the client hung up: what we want
            elif route == "drip":  # a valid start, then one byte a second
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                try:
                    for _ in range(1000):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.5)
                except OSError:
                    return
            elif route == "leaky":  # an error answer quoting something internal
                body = json.dumps({"status": "error", "error": SECRET, "data": {"result": SECRET}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:  # the redirect's target: a well-formed answer, never to be fetched
                body = json.dumps(
                    {"status": "success", "data": {"resultType": "scalar", "result": [0, "0.9"]}}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    other.daemon_threads = True
    target = f"http://127.0.0.1:{other.server_address[1]}"
    for s in (srv, other):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", target, state
    state.release.set()
    for s in (srv, other):
        s.shutdown()


def timed(fn: Any) -> tuple[float, str]:
    start = time.monotonic()
    with pytest.raises(MetricError) as err:
        fn()
    return time.monotonic() - start, str(err.value)


def test_a_redirect_is_not_followed(servers: tuple[str, str, Servers]) -> None:
    url, target, state = servers
    _, message = timed(lambda: PrometheusSource(url + "/redirect", "up", timeout=2).read())
    assert "HTTP 302" in message and "redirects are not followed" in message
    assert state.hits.get("redirect") == 1
    assert "api" not in state.hits, "the redirect's target was fetched"
    assert SECRET not in message  # the reason phrase is the server's text


def test_a_server_that_never_answers_costs_the_timeout(servers: tuple[str, str, Servers]) -> None:
    url, _, _ = servers
    took, message = timed(lambda: ScrapeSource(url + "/hang", "x", timeout=1.0).read())
    assert took < 3 and "within 1 s" in message


def test_a_slow_drip_body_is_cut_at_the_deadline(servers: tuple[str, str, Servers]) -> None:
    url, _, _ = servers
    took, message = timed(lambda: ScrapeSource(url + "/drip", "x", timeout=1.5).read())
    assert took < 4 and "within 1.5 s" in message


def test_an_endless_body_is_cut_at_the_size_limit_with_bounded_memory(
    servers: tuple[str, str, Servers],
) -> None:
    url, _, state = servers
    limit = 1 << 20
    tracemalloc.start()
    try:
        took, message = timed(lambda: fetch(url + "/huge", timeout=20, max_bytes=limit))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "exceeds the 1048576-byte limit" in message
    assert peak < 8 * limit, f"peak {peak} bytes while reading"
    assert took < 10
    time.sleep(0.2)
    assert state.streamed < 64 * limit, f"the server could send {state.streamed} bytes"


def test_only_http_and_https_are_fetched() -> None:
    with pytest.raises(MetricError, match="scheme 'file' is not allowed"):
        fetch("file:///etc/passwd", timeout=1, max_bytes=100)


def test_a_declared_oversize_answer_is_refused_before_reading() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n")
        time.sleep(2)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    took, message = timed(
        lambda: fetch(f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout=5, max_bytes=1000)
    )
    listener.close()
    assert "1073741824 bytes exceeds the 1000-byte limit" in message and took < 1.5


@pytest.mark.parametrize(
    "route,says", [("redirect", "HTTP 302"), ("hang", "within"), ("huge", "limit"), ("leaky", "status")]
)
def test_the_jobs_status_names_the_failure_and_quotes_nothing_of_the_answer(
    servers: tuple[str, str, Servers], route: str, says: str
) -> None:
    url, _, _ = servers
    body = running(2, prometheus={"url": f"{url}/{route}"})
    fake = ScaleKube(body)
    # The executor reads through the real sources (no injected reader); the operator allows the URL.
    ex = Executor(fake, prometheus_url_prefixes=[url])  # type: ignore[arg-type]
    start = time.monotonic()
    ex.reconcile("ns", "j", now=at(0))
    assert time.monotonic() - start < autoscaler.READ_TIMEOUT_SECONDS + 3
    auto = fake.job["status"]["autoscaling"]
    assert auto.get("signal") is None and auto["desiredReplicas"] == 2  # no data: the fleet holds
    assert says in auto["reason"] and f"{url}/{route}" in auto["reason"]
    assert SECRET not in json.dumps(fake.job["status"]) and SECRET not in " ".join(fake.log)
    assert not any(e.startswith("scale") for e in fake.log)
