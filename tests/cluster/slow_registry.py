"""A registry on 127.0.0.1 that serves one image slowly: the real node's pull, made to take longer
than a job's start timeout.

`SlowRegistry` speaks the read side of the OCI distribution API (`GET /v2/`, manifests by tag or
digest, blobs by digest; `HEAD` of each) from memory and from the node's own content store. The
image it serves is one the node already has (the trainer image, imported from its archive) plus
one small layer of random bytes made here: containerd finds every base layer in its content store
and fetches only the manifest, the config and the new layer, and the new layer's blob is sent at
`rate` bytes per second. A new layer per instance, so a layer pulled by an earlier run (the node's
content store is cached between runs) is never found already there.

The node's containerd reads registry hosts from `realnode.REGISTRY_HOSTS_DIR` (its
`config_path`); `SlowRegistry.configure(node)` writes the `hosts.toml` that sends this registry's
pulls over plain HTTP. Nothing leaves the machine.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
#: An uncompressed layer (what containerd's import of a docker-archive records).
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def random_layer(size: int, path: str = "opt/slow-pull/random.bin") -> bytes:
    """An uncompressed layer tar holding one file of `size` random bytes."""
    payload = os.urandom(size)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parts = path.split("/")
        for i in range(1, len(parts)):
            d = tarfile.TarInfo("/".join(parts[:i]))
            d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(d)
        info = tarfile.TarInfo(path)
        info.size, info.mode, info.mtime = len(payload), 0o644, 0
        tar.addfile(info, io.BytesIO(payload))
    return out.getvalue()


class SlowRegistry:
    """One repository, one tag: `base_ref`'s image (read from `node`'s containerd) plus a layer of
    `layer_bytes` random bytes sent at `rate` bytes/s. `ref` is what a pod names."""

    REPOSITORY = "slow/trainer"

    def __init__(self, node: Any, base_ref: str, *, layer_bytes: int, rate: float, tag: str = "1") -> None:
        self.node, self.rate, self.tag = node, rate, tag
        manifest = self._resolve_manifest(base_ref)
        config = json.loads(self._content(manifest["config"]["digest"]))
        layer = random_layer(layer_bytes)
        self.slow_digest = digest_of(layer)
        layer_type = OCI_LAYER if manifest.get("mediaType") == OCI_MANIFEST else DOCKER_LAYER
        manifest["layers"].append({"mediaType": layer_type, "size": len(layer), "digest": self.slow_digest})
        config["rootfs"]["diff_ids"].append(self.slow_digest)  # uncompressed: its digest is its diff id
        config.setdefault("history", []).append({"created_by": "slow_registry.py: one random layer"})
        config_blob = json.dumps(config).encode()
        manifest["config"] = {
            **manifest["config"],
            "digest": digest_of(config_blob),
            "size": len(config_blob),
        }
        self.manifest = json.dumps(manifest).encode()
        self.manifest_type = str(manifest.get("mediaType") or DOCKER_MANIFEST)
        self.blobs: dict[str, bytes] = {digest_of(config_blob): config_blob, self.slow_digest: layer}
        self.base_blobs = {layer["digest"] for layer in manifest["layers"][:-1]}
        #: (path, bytes sent, seconds) of every blob this registry sent.
        self.sent: list[tuple[str, int, float]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ref(self) -> str:
        return f"{self.host}/{self.REPOSITORY}:{self.tag}"

    # ---- the node's content ------------------------------------------------------------------

    def _content(self, digest: str) -> bytes:
        import subprocess

        from harness import assets_dir

        cmd = [
            str(assets_dir() / "ctr"),
            f"--address={self.node.socket}",
            "-n",
            "k8s.io",
            "content",
            "get",
            digest,
        ]
        return subprocess.run(cmd, capture_output=True, check=True, timeout=120).stdout

    def _resolve_manifest(self, ref: str) -> dict[str, Any]:
        """The single-platform manifest of `ref` in the node's image store (an index resolved to
        its linux/amd64 entry)."""
        listed = self.node.ctr("images", "ls").stdout.splitlines()
        row = next((line.split() for line in listed[1:] if line.split()[:1] == [ref]), None)
        if row is None:
            raise RuntimeError(f"the node has no image {ref}")
        digest = next(f for f in row if re.fullmatch(r"sha256:[0-9a-f]{64}", f))
        doc: dict[str, Any] = json.loads(self._content(digest))
        while "manifests" in doc:  # an index: its amd64 manifest
            entry = next(
                (
                    m
                    for m in doc["manifests"]
                    if (m.get("platform") or {}).get("architecture") in (None, "amd64")
                ),
                doc["manifests"][0],
            )
            doc = json.loads(self._content(entry["digest"]))
        return doc

    # ---- serving -----------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        registry = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                if path in ("/v2", "/v2/"):
                    return self._send(200, b"{}", "application/json", body)
                m = re.fullmatch(rf"/v2/{re.escape(registry.REPOSITORY)}/(manifests|blobs)/(.+)", path)
                if not m:
                    return self._send(404, b'{"errors":[{"code":"NAME_UNKNOWN"}]}', "application/json", body)
                kind, ref = m.groups()
                if kind == "manifests":
                    if ref not in (registry.tag, digest_of(registry.manifest)):
                        return self._send(
                            404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', "application/json", body
                        )
                    return self._send(
                        200, registry.manifest, registry.manifest_type, body, ref=registry.manifest
                    )
                data = registry.blobs.get(ref)
                if data is None and ref in registry.base_blobs:
                    data = registry._content(ref)  # a base layer the node lacks after all: served as is
                if data is None:
                    return self._send(404, b'{"errors":[{"code":"BLOB_UNKNOWN"}]}', "application/json", body)
                slow = ref == registry.slow_digest
                self._send(
                    200,
                    data,
                    "application/octet-stream",
                    body,
                    ref=data,
                    rate=registry.rate if slow else None,
                )

            def _send(
                self,
                code: int,
                data: bytes,
                content_type: str,
                body: bool,
                ref: bytes | None = None,
                rate: float | None = None,
            ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                if ref is not None:
                    self.send_header("Docker-Content-Digest", digest_of(ref))
                self.end_headers()
                if not body:
                    return
                t0 = time.monotonic()
                chunk = 64 * 1024 if rate is None else max(1024, int(rate / 10))
                try:
                    for i in range(0, len(data), chunk):
                        self.wfile.write(data[i : i + chunk])
                        if rate is not None:
                            time.sleep(len(data[i : i + chunk]) / rate)
                except (BrokenPipeError, ConnectionResetError):
                    return
                if code == 200 and ref is not None:
                    registry.sent.append((self.path, len(data), time.monotonic() - t0))

        return Handler

    def configure(self, node: Any) -> None:
        """The node's containerd pulls from this registry over plain HTTP (its hosts.toml)."""
        hosts = node.registry_hosts_dir / self.host
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(
            f'server = "http://{self.host}"\n\n[host."http://{self.host}"]\n  capabilities = ["pull", "resolve"]\n'
        )

    def __enter__(self) -> SlowRegistry:
        self._thread.start()
        self.configure(self.node)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        hosts = self.node.registry_hosts_dir / self.host
        for f in hosts.glob("*"):
            f.unlink()
        hosts.rmdir()
