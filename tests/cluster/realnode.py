"""A real node in the test cluster: a kubelet with containerd, runc and CNI that runs pods for real
(CPU only), beside kwok's fake GPU nodes, on this machine.

    node = RealNode.start(cluster)          # Ready, labelled rlhf.dev/pool=real
    node.load_image(archive)                # a docker-archive made by scripts/images.sh
    node.stop()

The network stays on this machine: a bridge `rlhf0` holding the node's address (10.244.0.1) and
the `kubernetes` Service's ClusterIP (10.96.0.1); pods get addresses on the bridge, a route to the
Service range through the node and no default route; nothing is forwarded (ip_forward is left as it
is, no firewall rule is written: there is no kube-proxy, and the one ClusterIP a pod needs, the
API server's, is a local address of the node where a forwarder relays to the API server on
loopback). CoreDNS on the node's address serves cluster.local (headless Services, pod names).

Teardown removes every process, mount, cgroup, network namespace, address and the bridge, also
after the test run was interrupted or killed: a watchdog in its own session tears down when the
owner dies, and the next start reaps what a dead run left. Images stay in containerd's content
store under the cache (~/.cache/rlhf-operator/node/), so a later run need not import them again.
One real node per machine at a time (the kubelet's cgroups are global).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import (  # noqa: E402
    Cluster,
    ClusterError,
    _pid_alive,
    assets_dir,
    cache_dir,
    terminate,
    wait_for,
)

from rlhf_operator.testing import free_port  # noqa: E402

#: The node's name and the pool label value its pods select.
NODE_NAME = "rlhf-real-0"
POOL = "real"
POOL_LABEL = "rlhf.dev/pool"
#: The real node's taint: only pods that tolerate it run there, so the kwok tests' pods (whose
#: images exist nowhere) never land on a node that would try to pull them.
TAINT_KEY = "rlhf.dev/real-node"
TAINT = {"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
#: The bridge and its addresses (also the API server's advertised address and Service range:
#: tests/cluster/harness.py kwokctl_config uses these).
BRIDGE = "rlhf0"
POD_SUBNET = "10.244.0.0/24"
NODE_IP = "10.244.0.1"
SERVICE_CIDR = "10.96.0.0/16"
#: The `kubernetes` Service's ClusterIP: the first address of SERVICE_CIDR.
KUBERNETES_SERVICE_IP = "10.96.0.1"
CLUSTER_DOMAIN = "cluster.local"
#: The sandbox image, built here from a few lines of C (no registry can be reached).
PAUSE_IMAGE = "localhost/rlhf-operator/pause:1"

NODE_BINARIES = ("kubelet", "containerd", "containerd-shim-runc-v2", "ctr", "crictl", "coredns")
CNI_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
WORKDIR_PREFIX = "rlhf-node-"
_OWNER_FILE = "owner.json"

PAUSE_C = r"""
/* The pod sandbox's process: holds the namespaces, reaps zombies, exits on SIGTERM/SIGINT. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
  signal(SIGINT, quit); signal(SIGTERM, quit); signal(SIGCHLD, reap);
  for (;;) pause();
  return 0;
}
"""


class NodeUnavailable(RuntimeError):
    """This machine cannot run a real node (the reason says what is missing)."""


# --------------------------------------------------------------------------------------------------
# What the machine must have


def cni_dir() -> Path | None:
    for d in CNI_DIRS:
        if all(os.access(Path(d) / p, os.X_OK) for p in CNI_PLUGINS):
            return Path(d)
    return None


def preflight() -> list[str]:
    """Why a real node cannot run here (empty when it can)."""
    missing: list[str] = []
    if os.geteuid() != 0:
        missing.append("root (a kubelet and containerd manage mounts, cgroups and network namespaces)")
    assets = assets_dir()
    absent = [b for b in NODE_BINARIES if not os.access(assets / b, os.X_OK)]
    if absent:
        missing.append(f"{', '.join(absent)} in {assets} (run `bash tests/cluster/build`)")
    if not shutil.which("runc"):
        missing.append("runc (Debian: apt-get install runc)")
    if cni_dir() is None:
        missing.append(
            f"CNI plugins {', '.join(CNI_PLUGINS)} in {' or '.join(CNI_DIRS)} "
            "(Debian: apt-get install containernetworking-plugins)"
        )
    if not shutil.which("ip"):
        missing.append("iproute2's `ip`")
    try:
        if "overlay" not in Path("/proc/filesystems").read_text():
            missing.append("the overlay filesystem (modprobe overlay)")
    except OSError:
        missing.append("/proc/filesystems")
    if not missing and subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        missing.append("network namespaces (unshare --net failed)")
    if not Path("/sys/fs/cgroup").is_dir():
        missing.append("cgroups at /sys/fs/cgroup")
    return missing


# --------------------------------------------------------------------------------------------------
# Small helpers


def _run(*cmd: str, check: bool = True, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise ClusterError(
            f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}"
        )
    return res


def _pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains `text` (shims and containers of our containerd)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            out.append(int(proc.name))
    return out


def _mounts_under(prefixes: list[str]) -> list[str]:
    """Mount points under any of `prefixes`, deepest first."""
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
                points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def _cgroup_roots() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    roots = [d for d in base.iterdir() if d.is_dir() and not d.is_symlink()] if base.is_dir() else []
    return roots + ([base] if (base / "cgroup.controllers").exists() else [])


def _rmdir_tree(path: Path) -> None:
    """Removes a cgroup directory tree bottom-up (cgroups are removed with rmdir, never rm)."""
    if not path.is_dir():
        return
    for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


# --------------------------------------------------------------------------------------------------
# Configuration files


def registry_hosts_dir(workdir: Path) -> Path:
    """containerd's registry `config_path`: `<host:port>/hosts.toml` files read at each pull (none by
    default: no registry can be reached; `slow_registry.SlowRegistry` adds one on loopback)."""
    return workdir / "certs.d"


def containerd_config(workdir: Path, root: Path, cni_bin: Path) -> str:
    """containerd 2.x (config version 3): its own root/state/socket, runc with cgroupfs, the local
    pause image, registry hosts from workdir, CNI from workdir, and restrict_oom_score_adj (root here lacks CAP_SYS_RESOURCE)."""
    cri_runtime = "plugins.'io.containerd.cri.v1.runtime'"
    cri_images = "plugins.'io.containerd.cri.v1.images'"
    return f"""version = 3
root = "{root}"
state = "{workdir / "cs"}"
[grpc]
  address = "{workdir / "containerd.sock"}"
[ttrpc]
  address = "{workdir / "containerd.sock.ttrpc"}"
[debug]
  level = "info"
[{cri_images}]
  snapshotter = "overlayfs"
  [{cri_images}.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
  [{cri_images}.registry]
    config_path = "{registry_hosts_dir(workdir)}"
[{cri_runtime}]
  enable_selinux = false
  restrict_oom_score_adj = true
  [{cri_runtime}.containerd]
    default_runtime_name = "runc"
    [{cri_runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri_runtime}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{shutil.which("runc") or "runc"}"
  [{cri_runtime}.cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{workdir / "cni" / "net.d"}"
    max_conf_num = 1
"""


def cni_config(workdir: Path) -> dict[str, Any]:
    """A bridge the tests own: no gateway in pods (isGateway false), no masquerade, a route to the
    Service range only."""
    return {
        "cniVersion": "1.0.0",
        "name": "rlhf-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": False,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                    "routes": [{"dst": SERVICE_CIDR, "gw": NODE_IP}],
                    "dataDir": str(workdir / "cni" / "ipam"),
                },
            },
            {"type": "loopback"},
        ],
    }


def kubelet_config(workdir: Path, ca_file: Path, port: int, healthz_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "containerRuntimeEndpoint": f"unix://{workdir / 'containerd.sock'}",
        # No systemd here, and the machine's cgroups are hybrid v1/v2 (notes/real-node.md).
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "clusterDNS": [NODE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(workdir / "resolv.conf"),
        "podLogsDir": str(workdir / "pod-logs"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "serializeImagePulls": False,
        # Images are GBs; the machine's disk is shared: never evict or collect during a test run.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "maxPods": 40,
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
        "runtimeRequestTimeout": "10m",
    }


def corefile(kubeconfig: Path, health_port: int, ready_port: int) -> str:
    return f""".:53 {{
    bind {NODE_IP}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        ttl 1
        fallthrough in-addr.arpa ip6.arpa
    }}
}}
"""


# --------------------------------------------------------------------------------------------------
# The node


@dataclass
class RealNode:
    cluster: Cluster
    workdir: Path
    name: str = NODE_NAME
    start_seconds: float | None = None
    _watchdog: subprocess.Popen[bytes] | None = None
    _stopped: bool = False

    @staticmethod
    def containerd_root() -> Path:
        """containerd's content store, kept between runs so images are imported once."""
        return cache_dir() / "node" / "containerd"

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd.sock"

    @property
    def registry_hosts_dir(self) -> Path:
        return registry_hosts_dir(self.workdir)

    @classmethod
    def start(cls, cluster: Cluster, *, timeout: float = 120) -> RealNode:
        missing = preflight()
        if missing:
            raise NodeUnavailable("a real node needs " + "; ".join(missing))
        if cluster.workdir is None:
            raise NodeUnavailable(
                "a real node joins a cluster the harness started (not RLHF_USE_EXISTING_CLUSTER)"
            )
        reap_stale_nodes()
        if any(Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*")):
            raise ClusterError(
                "another real node runs on this machine (one at a time: the kubelet's cgroups are global)"
            )
        # Short: containerd's socket paths must fit in 108 bytes.
        workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir="/tmp"))
        node = cls(cluster=cluster, workdir=workdir)
        (workdir / _OWNER_FILE).write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "started": time.time(),
                    "node": node.name,
                    "kubeconfig": str(cluster.kubeconfig),
                }
            )
        )
        t0 = time.monotonic()
        try:
            node._start_watchdog()
            node._start(timeout)
        except BaseException as exc:
            logs = node.tail_logs()
            node.stop()
            if isinstance(exc, ClusterError):
                raise ClusterError(f"{exc}\nreal node logs (last lines):\n{logs}") from exc
            raise
        node.start_seconds = time.monotonic() - t0
        return node

    # ---- start ---------------------------------------------------------------------------------

    def _owner(self, **update: Any) -> None:
        path = self.workdir / _OWNER_FILE
        owner = json.loads(path.read_text())
        owner.update(update)
        path.write_text(json.dumps(owner))

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the test run reaches the teardown, not these
            env={**os.environ, **(env or {})},
        )
        log.close()
        (self.workdir / f"{name}.pid").write_text(str(proc.pid))
        return proc

    def _start(self, timeout: float) -> None:
        assets = assets_dir()
        w = self.workdir
        cluster_dir = self.cluster.cluster_dir()
        ca_file = cluster_dir / "pki" / "ca.crt"
        for sub in ("cni/net.d", "cni/ipam", "pod-logs", "kubelet", "cs"):
            (w / sub).mkdir(parents=True, exist_ok=True)
        (w / "resolv.conf").write_text("")  # no host search domains or servers leak into pods

        # Network: the bridge with the node's address and the kubernetes Service's ClusterIP.
        self._owner(bridge=BRIDGE)
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{NODE_IP}/{POD_SUBNET.split('/')[1]}", "dev", BRIDGE)
        _run("ip", "addr", "add", f"{KUBERNETES_SERVICE_IP}/32", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")

        # The API server listens on loopback only: relay the node's address and the ClusterIP to it.
        api_port = int(self.cluster.ports()["kubeApiserverPort"])
        self._spawn(
            "forwarder",
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "forward",
                f"{NODE_IP}:{api_port}=127.0.0.1:{api_port}",
                f"{KUBERNETES_SERVICE_IP}:443=127.0.0.1:{api_port}",
            ],
        )

        # DNS for cluster.local on the node's address.
        health_port, ready_port = free_port(), free_port()
        (w / "Corefile").write_text(corefile(self.cluster.kubeconfig, health_port, ready_port))
        self._spawn("coredns", [str(assets / "coredns"), "-conf", str(w / "Corefile")])

        # containerd.
        cni_bin = cni_dir()
        assert cni_bin is not None
        root = self.containerd_root()
        root.mkdir(parents=True, exist_ok=True)
        (w / "containerd.toml").write_text(containerd_config(w, root, cni_bin))
        (w / "cni" / "net.d" / "10-rlhf.conflist").write_text(json.dumps(cni_config(w), indent=2))
        self._spawn(
            "containerd",
            [str(assets / "containerd"), "--config", str(w / "containerd.toml")],
            env={"PATH": f"{assets}:{os.environ.get('PATH', '')}"},
        )
        wait_for(
            lambda: self.ctr("version", check=False).returncode == 0,
            timeout=60,
            what=f"containerd on {self.socket}",
        )
        self.ensure_pause_image()

        # The kubelet.
        kport, hport = free_port(), free_port()
        (w / "kubelet.yaml").write_text(json.dumps(kubelet_config(w, ca_file, kport, hport), indent=2))
        self._spawn(
            "kubelet",
            [
                str(assets / "kubelet"),
                f"--config={w / 'kubelet.yaml'}",
                f"--kubeconfig={self.cluster.kubeconfig}",
                f"--root-dir={w / 'kubelet'}",
                f"--cert-dir={w / 'kubelet' / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={NODE_IP}",
                f"--node-labels={POOL_LABEL}={POOL},type=real",
                f"--register-with-taints={TAINT_KEY}={TAINT['value']}:{TAINT['effect']}",
                "--v=1",
            ],
            env={"PATH": f"{assets}:{os.environ.get('PATH', '')}"},
        )
        wait_for(self._ready, timeout=timeout, interval=0.5, what=f"real node {self.name} Ready")
        wait_for(lambda: _http_ok(f"http://127.0.0.1:{ready_port}/ready"), timeout=30, what="CoreDNS ready")

    def _ready(self) -> bool:
        try:
            node = self.cluster.request("GET", f"/api/v1/nodes/{self.name}")
        except Exception:
            return False
        conditions = (node.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _start_watchdog(self) -> None:
        self._watchdog = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "watchdog", str(self.workdir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        self._owner(watchdog=self._watchdog.pid)

    # ---- images ----------------------------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return _run(
            str(assets_dir() / "ctr"),
            f"--address={self.socket}",
            "-n",
            "k8s.io",
            *args,
            check=check,
            timeout=timeout,
        )

    def has_image(self, ref: str) -> bool:
        res = self.ctr("images", "ls", "-q", check=False)
        return ref in res.stdout.split()

    def load_image(self, archive: Path | str, ref: str) -> float:
        """Imports a docker-archive into the node's containerd unless `ref` is there; returns seconds."""
        if self.has_image(ref):
            return 0.0
        # Other versions of the same image go first: a trainer image unpacks to about 13 GB, and
        # every source change makes a new one (containerd collects the unreferenced content).
        repository = ref.rsplit(":", 1)[0]
        listed = self.ctr("images", "ls", "-q", check=False).stdout.split()
        stale = [r for r in listed if r.rsplit(":", 1)[0] == repository and r != ref]
        if stale:
            self.ctr("images", "rm", *stale, check=False)
        t0 = time.monotonic()
        self.ctr("images", "import", "--digests", str(archive), timeout=1800)
        if not self.has_image(ref):
            raise ClusterError(f"{archive} imported, but containerd has no image {ref}")
        self.prune_image_refs()
        return time.monotonic() - t0

    def prune_image_refs(self) -> list[str]:
        """Removes the refs that only keep old content alive (returned): `import-<date>@sha256:...`
        (each `ctr images import --digests` adds one) and CRI's `sha256:<id>` refs of images no named
        ref holds any more. The content store is cached between runs, so without this every
        source change left another 6 GB trainer image on the disk."""
        rows = [line.split() for line in self.ctr("images", "ls").stdout.splitlines()[1:] if line.strip()]
        named = {row[2] for row in rows if not row[0].startswith(("import-", "sha256:"))}
        drop = [
            row[0]
            for row in rows
            if row[0].startswith("import-") or (row[0].startswith("sha256:") and row[2] not in named)
        ]
        if drop:
            self.ctr("images", "rm", "--sync", *drop, check=False)
        return drop

    def ensure_pause_image(self) -> None:
        if self.has_image(PAUSE_IMAGE):
            return
        archive = cache_dir() / "images" / "pause-1.tar"
        if not archive.exists():
            build_pause_image(archive)
        self.load_image(archive, PAUSE_IMAGE)

    # ---- diagnostics -----------------------------------------------------------------------------

    def tail_logs(self, lines: int = 15) -> str:
        out = []
        for log in sorted(self.workdir.glob("*.log")):
            with contextlib.suppress(OSError):
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # ---- stop --------------------------------------------------------------------------------------

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        destroy_node(self.workdir)
        with contextlib.suppress(Exception):
            self.cluster.request("DELETE", f"/api/v1/nodes/{self.name}")
        if self._watchdog is not None:
            with contextlib.suppress(Exception):
                assert self._watchdog.stdin is not None
                self._watchdog.stdin.close()
                self._watchdog.wait(timeout=60)


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def build_pause_image(archive: Path) -> None:
    """The sandbox image: a static binary of PAUSE_C, packed by buildah into a docker-archive."""
    if not shutil.which("gcc") or not shutil.which("buildah"):
        raise NodeUnavailable("building the pause image needs gcc (static libc) and buildah")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "pause.c"
        src.write_text(PAUSE_C)
        _run("gcc", "-static", "-O2", "-s", "-o", str(Path(tmp) / "pause"), str(src))
        ctr = _run("buildah", "from", "scratch").stdout.strip()
        try:
            _run("buildah", "copy", ctr, str(Path(tmp) / "pause"), "/pause")
            _run("buildah", "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr)
            _run("buildah", "commit", "--quiet", ctr, PAUSE_IMAGE)
        finally:
            _run("buildah", "rm", ctr, check=False)
        part = archive.with_suffix(".part")
        _run("buildah", "push", "--quiet", PAUSE_IMAGE, f"docker-archive:{part}:{PAUSE_IMAGE}", timeout=300)
        part.rename(archive)


# --------------------------------------------------------------------------------------------------
# Teardown, also of what a killed run left behind


def destroy_node(workdir: Path) -> None:
    """Stops pods, kubelet, containerd, CoreDNS and the forwarder of the node in `workdir`; removes
    its mounts, network namespaces, cgroups, bridge and directory. Idempotent."""
    if not workdir.exists():
        return
    try:
        owner = json.loads((workdir / _OWNER_FILE).read_text())
    except (OSError, ValueError):
        owner = {}
    assets = assets_dir()
    sock = workdir / "containerd.sock"

    def pid_of(name: str) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((workdir / f"{name}.pid").read_text())
        return None

    # 1. The kubelet first, so it restarts nothing; then every pod sandbox through CRI (CNI DEL
    #    frees addresses and network namespaces) while containerd still runs.
    kubelet = pid_of("kubelet")
    if kubelet:
        terminate([kubelet], grace=10)
    containerd = pid_of("containerd")
    if containerd and _pid_alive(containerd) and sock.exists():
        crictl = [str(assets / "crictl"), f"--runtime-endpoint=unix://{sock}", "--timeout=30s"]
        with contextlib.suppress(Exception):
            subprocess.run([*crictl, "rmp", "--force", "--all"], capture_output=True, timeout=120)
    # 2. The daemons, then shims and container processes of this containerd.
    terminate([p for p in (containerd, pid_of("coredns"), pid_of("forwarder")) if p], grace=10)
    terminate(_pids_mentioning(str(sock)))
    state = workdir / "cs"
    runc = shutil.which("runc")
    if runc:
        for runc_root in state.glob("**/runc/k8s.io"):
            listed = subprocess.run(
                [runc, "--root", str(runc_root), "list", "-q"], capture_output=True, text=True
            )
            for cid in listed.stdout.split():
                subprocess.run(
                    [runc, "--root", str(runc_root), "delete", "--force", cid], capture_output=True
                )
    # 3. Mounts: rootfs overlays, emptyDirs, projected volumes, shm, netns bind mounts.
    started = float(owner.get("started", time.time()))
    netns = [
        str(p)
        for d in ("/run/netns", "/var/run/netns")
        for p in (Path(d).glob("cni-*") if Path(d).is_dir() else [])
        if p.stat().st_mtime >= started - 1
    ]
    root = RealNode.containerd_root()
    for point in _mounts_under([str(workdir), str(root), *netns]):
        subprocess.run(["umount", "-l", point], capture_output=True)
    for ns in netns:
        with contextlib.suppress(OSError):
            os.unlink(ns)
    # Shim sockets live in containerd's default state dir whatever the config says.
    shim_dir = Path("/run/containerd/s")
    for sock_file in shim_dir.glob("*") if shim_dir.is_dir() else []:
        with contextlib.suppress(OSError):
            if sock_file.stat().st_mtime >= started - 1:
                sock_file.unlink()
    # 4. Interfaces: veths on the bridge, then the bridge with its addresses.
    if owner.get("bridge") and Path(f"/sys/class/net/{BRIDGE}").exists():
        for iface in Path(f"/sys/class/net/{BRIDGE}/brif").glob("*"):
            subprocess.run(["ip", "link", "del", iface.name], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
    # 5. The kubelet's cgroups (kubepods, under every hierarchy).
    for cg in _cgroup_roots():
        _rmdir_tree(cg / "kubepods")
    # 6. Working files (containerd's content store in the cache stays, with its images).
    shutil.rmtree(workdir, ignore_errors=True)
    if workdir.exists():  # a mount we could not release: say so rather than hide it
        print(f"warning: could not remove {workdir}: {os.listdir(workdir)}", file=sys.stderr)


def reap_stale_nodes(root: Path | None = None) -> list[Path]:
    """Destroys real nodes whose owner and watchdog are both gone; returns their directories."""
    root = root or Path("/tmp")
    reaped = []
    for workdir in root.glob(WORKDIR_PREFIX + "*"):
        try:
            owner = json.loads((workdir / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            owner = {}
        if any(_pid_alive(owner[k]) for k in ("pid", "watchdog") if k in owner):
            continue
        destroy_node(workdir)
        reaped.append(workdir)
    return reaped


def leftovers() -> list[str]:
    """What a real node could leave behind, if any is there now: for the tests of the teardown."""
    found = []
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        found.append(f"bridge {BRIDGE}")
    found += [f"directory {p}" for p in Path("/tmp").glob(WORKDIR_PREFIX + "*")]
    found += [f"mount {m}" for m in _mounts_under([str(RealNode.containerd_root())])]
    found += [f"cgroup {cg / 'kubepods'}" for cg in _cgroup_roots() if (cg / "kubepods").exists()]
    for name in ("kubelet", "containerd", "coredns", "containerd-shim-runc-v2"):
        assets = str(assets_dir() / name)
        found += [f"process {p} ({name})" for p in _pids_mentioning(assets)]
    return found


# --------------------------------------------------------------------------------------------------
# Processes this file runs: the API server relay and the watchdog


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _forward(pairs: list[tuple[str, int, str, int]]) -> None:
    async def serve(target_host: str, target_port: int):
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(target_host, target_port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(_relay(reader, up_writer), _relay(up_reader, writer))

        return handle

    servers = [await asyncio.start_server(await serve(th, tp), lh, lp) for lh, lp, th, tp in pairs]
    await asyncio.gather(*(s.serve_forever() for s in servers))


def _forward_main(specs: list[str]) -> None:
    pairs = []
    for spec in specs:
        listen, target = spec.split("=")
        lh, lp = listen.rsplit(":", 1)
        th, tp = target.rsplit(":", 1)
        pairs.append((lh, int(lp), th, int(tp)))
    asyncio.run(_forward(pairs))


def _watchdog_main(workdir: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        while sys.stdin.buffer.read(4096):
            pass
    destroy_node(Path(workdir))


def main(argv: list[str]) -> int:
    if argv and argv[0] == "forward":
        _forward_main(argv[1:])
        return 0
    if argv and argv[0] == "watchdog":
        _watchdog_main(argv[1])
        return 0
    if argv and argv[0] == "leftovers":
        found = leftovers()
        print("\n".join(found) or "nothing left behind")
        return 1 if found else 0
    if argv and argv[0] == "reap":
        print("\n".join(str(p) for p in reap_stale_nodes()) or "nothing to reap")
        return 0
    print("usage: realnode.py {leftovers|reap}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
