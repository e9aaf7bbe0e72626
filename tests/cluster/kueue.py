"""Kueue's real controller manager (built from the Go module proxy by tests/cluster/build-kueue) as a
host process against the test cluster, with only its `pod` integration, for the namespaces that
carry NAMESPACE_LABEL.

    kueue = KueueProcess(cluster, workdir)
    kueue.start()          # CRDs, certificates, webhooks, the manager; ready when it returns
    ...
    kueue.stop()           # webhooks, the process, Kueue's CRDs and namespace: nothing is left

The API server reaches Kueue's webhooks on loopback (`clientConfig.url: https://127.0.0.1:<port>`)
with a certificate made here by openssl for 127.0.0.1 and signed by a CA of the test's own (its
`caBundle`); Kueue's internal certificate management is off (it would sign for a Service's DNS
name, which the API server cannot reach here). With it off, Kueue also reads its metrics serving
certificate from a fixed path, /etc/kueue/metrics/certs (no option moves it): the manager runs in a
mount namespace of its own (`unshare`) in which an overlay on /etc adds that directory, so the
host's /etc is never written.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from harness import Cluster, ClusterError, cache_dir, wait_for

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build-kueue"
#: Kueue manages the pods of the namespaces that carry this label (and only those).
NAMESPACE_LABEL = "rlhf.dev/kueue-test"
#: Kueue's own namespace (its events, leases).
KUEUE_NAMESPACE = "kueue-system"
#: The names of the webhook configurations registered for the manager.
WEBHOOK_CONFIG = "rlhf-test-kueue"
METRICS_CERT_DIR = "/etc/kueue/metrics/certs"
API = "kueue.x-k8s.io"
#: The label Kueue's webhook puts on the pods it manages.
MANAGED_LABEL = "kueue.x-k8s.io/managed"
VERSION = "v1beta2"


def pinned_version() -> str:
    found = re.search(r"^KUEUE_VERSION=(\S+)", BUILD_SCRIPT.read_text(), re.MULTILINE)
    if not found:
        raise ClusterError(f"no KUEUE_VERSION= line in {BUILD_SCRIPT}")
    return found.group(1)


def build_dir() -> Path:
    return cache_dir() / "kueue" / pinned_version()


def missing() -> str | None:
    """Why Kueue cannot run here, or None."""
    d = build_dir()
    stamp = d / ".version"
    files = [d / "webhooks.yaml", d / "crd-kustomization.yaml", d / "crds"]
    if not (os.access(d / "manager", os.X_OK) and stamp.exists() and all(f.exists() for f in files)):
        return f"Kueue {pinned_version()} is not built in {d}: run `bash tests/cluster/build-kueue`"
    if shutil.which("openssl") is None:
        return "openssl is not installed (it makes the webhooks' certificates)"
    if not Path(METRICS_CERT_DIR, "tls.crt").exists() and shutil.which("unshare") is None:
        return f"`unshare` (util-linux) is missing: it gives Kueue its {METRICS_CERT_DIR}"
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_certs(directory: Path) -> bytes:
    """A CA and a serving certificate for 127.0.0.1 signed by it (tls.crt, tls.key); returns the
    CA's PEM (the webhooks' caBundle)."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        res = subprocess.run(["openssl", *args], cwd=directory, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise ClusterError(f"openssl {' '.join(args[:2])} failed: {res.stderr.strip()}")

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=rlhf-test-kueue-ca", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    run("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=127.0.0.1")
    (directory / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip
    return (directory / "ca.crt").read_bytes()


def manager_config(*, webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2, apis/config/v1beta2 in its module)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "true"}},
        "integrations": {"frameworks": ["pod"]},
        "featureGates": {"VisibilityOnDemand": False},
    }


def webhook_configurations(
    manifests: list[dict[str, Any]], *, port: int, ca_bundle: bytes
) -> list[dict[str, Any]]:
    """Kueue's own webhook manifests (config/components/webhook in its module), kept for pods and
    Kueue's own kinds, pointed at https://127.0.0.1:<port>, pods only in NAMESPACE_LABEL namespaces."""
    import base64

    out = []
    for doc in manifests:
        hooks = []
        for hook in doc.get("webhooks") or []:
            rules = hook.get("rules") or []
            is_pod = any("pods" in r.get("resources", []) and r.get("apiGroups") == [""] for r in rules)
            is_kueue = any(API in r.get("apiGroups", []) for r in rules)
            if not (is_pod or is_kueue):
                continue
            hook = copy.deepcopy(hook)
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
            if is_pod:
                hook["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: "true"}}
            hooks.append(hook)
        if hooks:
            out.append(
                {
                    "apiVersion": doc["apiVersion"],
                    "kind": doc["kind"],
                    "metadata": {"name": WEBHOOK_CONFIG},
                    "webhooks": hooks,
                }
            )
    kinds = sorted(d["kind"] for d in out)
    if kinds != ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]:
        raise ClusterError(f"Kueue's webhook manifests gave {kinds}; expected one mutating, one validating")
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class KueueProcess:
    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = Path(workdir)
        self.log_path = self.workdir / "kueue.log"
        self.webhook_port = _free_port()
        self.health_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.crds: list[str] = []

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> KueueProcess:
        why = missing()
        if why:
            raise ClusterError(why)
        self.workdir.mkdir(parents=True, exist_ok=True)
        build = build_dir()
        cert_dir = self.workdir / "certs"
        ca = make_certs(cert_dir)
        config = self.workdir / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                manager_config(
                    webhook_port=self.webhook_port, health_port=self.health_port, cert_dir=cert_dir
                )
            )
        )
        try:
            self.install_crds(build / "crds", ca_bundle=ca, timeout=timeout)
            self.cluster.kubectl("create", "namespace", KUEUE_NAMESPACE, check=False)
            self._spawn(build / "manager", config, cert_dir)
            self.wait_ready(timeout)
            manifests = [d for d in yaml.safe_load_all((build / "webhooks.yaml").read_text()) if d]
            docs = webhook_configurations(manifests, port=self.webhook_port, ca_bundle=ca)
            self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, manager: Path, config: Path, cert_dir: Path) -> None:
        cmd = [str(manager), f"--config={config}", "--zap-log-level=2"]
        if not Path(METRICS_CERT_DIR, "tls.crt").exists():
            # An overlay on /etc, in a mount namespace only the manager sees, holds its metrics
            # certificate (the webhook's will do).
            upper, work = self.workdir / "etc-upper", self.workdir / "etc-work"
            target = upper / METRICS_CERT_DIR.removeprefix("/etc/")
            target.mkdir(parents=True, exist_ok=True)
            work.mkdir(exist_ok=True)
            for f in ("tls.crt", "tls.key"):
                shutil.copy(cert_dir / f, target / f)
            script = (
                f'mount -t overlay overlay -o "lowerdir=/etc,upperdir={upper},workdir={work}" /etc '
                '&& exec "$@"'
            )
            unshare = ["unshare", "--mount", "--propagation", "private"]
            if os.geteuid() != 0:
                unshare += ["--user", "--map-root-user"]
            cmd = [*unshare, "sh", "-c", script, "kueue", *cmd]
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (only prctl, before exec)
            )

    def wait_ready(self, timeout: float) -> None:
        """Until the manager's /readyz answers ok (its webhook server listens with its certificate);
        ClusterError, with the log's tail, when it exits or after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ClusterError(f"Kueue's manager exited with {self.proc.returncode}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"Kueue's manager not ready after {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.5)

    def install_crds(self, directory: Path, *, ca_bundle: bytes, timeout: float) -> None:
        """Kueue's CRDs as its module ships them, with its conversion webhook (`/convert`) on those
        its kustomization (config/components/crd) patches with one."""
        import base64

        # The CRDs Kueue's kustomization patches with `webhook_in_<plural>.yaml` (not all that
        # serve two versions: ResourceFlavor has no conversion).
        kustomization = yaml.safe_load((directory.parent / "crd-kustomization.yaml").read_text())
        converted = {
            m.group(1) + "." + API
            for patch in kustomization.get("patches") or []
            if (m := re.fullmatch(r"patches/webhook_in_(\w+)\.yaml", patch.get("path", "")))
        }
        if not converted:
            raise ClusterError(f"no conversion patches in {directory.parent / 'crd-kustomization.yaml'}")
        docs = []
        for f in sorted(directory.glob("*.yaml")):
            doc = yaml.safe_load(f.read_text())
            if doc["metadata"]["name"] in converted:
                doc["spec"]["conversion"] = {
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {
                            "url": f"https://127.0.0.1:{self.webhook_port}/convert",
                            "caBundle": base64.b64encode(ca_bundle).decode(),
                        },
                        "conversionReviewVersions": ["v1"],
                    },
                }
            docs.append(doc)
            self.crds.append(doc["metadata"]["name"])
        self.cluster.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(docs)
        )
        jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
        for name in self.crds:
            wait_for(
                lambda n=name: self.cluster.kubectl("get", "crd", n, "-o", f"jsonpath={jsonpath}") == "True",
                timeout=timeout,
                what=f"CRD {name} established",
            )

    def stop(self) -> None:
        """Webhooks first (no pod create may fail on a webhook that is gone), then the manager, then
        Kueue's CRDs (their objects go with them) and its namespace. Idempotent."""
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            self.cluster.kubectl("delete", kind, WEBHOOK_CONFIG, "--ignore-not-found", check=False)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # Without the manager nothing removes the finalizers Kueue put on pods and on its objects.
        self._drop_finalizers("pods", f"{MANAGED_LABEL}=true")
        for crd in self.crds:
            self._drop_finalizers(crd)
        if self.crds:
            self.cluster.kubectl(
                "delete", "crd", *self.crds, "--ignore-not-found", "--wait=false", check=False
            )
            self.crds = []
        self.cluster.kubectl(
            "delete", "namespace", KUEUE_NAMESPACE, "--ignore-not-found", "--wait=false", check=False
        )

    def _drop_finalizers(self, resource: str, selector: str = "") -> None:
        args = ["get", resource, "-A", "-o", "json"] + (["-l", selector] if selector else [])
        out = self.cluster.kubectl(*args, check=False)
        for obj in json.loads(out)["items"] if out.strip() else []:
            meta = obj["metadata"]
            if not meta.get("finalizers"):
                continue
            kept = [f for f in meta["finalizers"] if not f.startswith(API + "/")]
            ns = ["-n", meta["namespace"]] if meta.get("namespace") else []
            patch = json.dumps({"metadata": {"finalizers": kept or None}})
            self.cluster.kubectl(
                "patch", resource, meta["name"], *ns, "--type=merge", "-p", patch, check=False
            )

    # ---- diagnostics -----------------------------------------------------------------------------

    def log_tail(self, chars: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no Kueue log)"
        return f"--- Kueue's log ({self.log_path}), last {chars} characters:\n" + text[-chars:]

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int, chars: int = 12000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no Kueue log)"
        return text[-chars:]
