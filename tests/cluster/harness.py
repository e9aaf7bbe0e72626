"""A real Kubernetes control plane on loopback for the tests: etcd, kube-apiserver (RBAC and admission
on), kube-controller-manager, kube-scheduler and kwok, started by `kwokctl --runtime binary` from
the binaries `tests/cluster/build` put in the cache, plus fake GPU node pools and kwok Stages.

Nothing runs on the fake nodes: kwok plays the kubelet, so pod specs, scheduling, status, owner
references, endpoints and RBAC are real while containers are not.

    cluster = Cluster.start()            # or Cluster.existing() with RLHF_USE_EXISTING_CLUSTER=1
    cluster.kubectl("get", "nodes")
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    cluster.stop()

Teardown leaves no process, port or directory behind, also when the test run is interrupted: a
watchdog process in its own session cleans up when the owner dies (even by SIGKILL), and the next
start reaps whatever an earlier run could not. See docs/cluster-harness.md.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build"
STAGES_DIR = HERE / "stages"
POOLS_FILE = HERE / "pools.yaml"

#: Label every fake node carries with the name of its pool.
POOL_LABEL = "rlhf.dev/pool"
#: Extended resource of NVIDIA's device plugin, faked on the pools' nodes.
GPU_RESOURCE = "nvidia.com/gpu"
#: Marks a Node as one kwok plays the kubelet for.
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
#: Set to "true" on a node to make kwok report it NotReady (stages/node-not-ready.yaml).
NOT_READY_ANNOTATION = "kwok.rlhf.dev/not-ready"
#: Set to "succeeded" or "failed" on a running pod to make it finish (stages/pod-complete.yaml).
COMPLETE_ANNOTATION = "kwok.rlhf.dev/complete"
#: Exit code of a pod finished with COMPLETE_ANNOTATION "failed" (default 1).
EXIT_CODE_ANNOTATION = "kwok.rlhf.dev/exit-code"

BINARIES = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "etcd",
    "kwok",
    "kwokctl",
    "helm",
)
WORKDIR_PREFIX = "rlhf-cluster-"
_OWNER_FILE = "owner.json"


class ClusterError(RuntimeError):
    """The control plane could not be built, started, reached or stopped."""


# --------------------------------------------------------------------------------------------------
# Binaries


def pinned_versions() -> dict[str, str]:
    """Versions pinned in tests/cluster/build, the one place they are written: {"kubernetes": "v1.36.3", ...}."""
    text = BUILD_SCRIPT.read_text()
    found = dict(re.findall(r"^(KUBE|ETCD|KWOK|HELM)_VERSION=(\S+)", text, re.MULTILINE))
    names = {"KUBE": "kubernetes", "ETCD": "etcd", "KWOK": "kwok", "HELM": "helm"}
    return {names[k]: v for k, v in found.items()}


def helm_capabilities() -> list[str]:
    """What `helm install` would learn from this harness's API server, for `helm template` (which
    asks no cluster): its Kubernetes version and the ValidatingAdmissionPolicy API that v1.30+
    serves (the chart renders the status-writers policy only where both say so)."""
    return [
        "--kube-version",
        pinned_versions()["kubernetes"],
        "--api-versions",
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
    ]


def cache_dir() -> Path:
    return Path(os.environ.get("RLHF_CACHE_DIR") or Path.home() / ".cache" / "rlhf-operator")


def assets_dir() -> Path:
    """Directory holding the control-plane binaries: $RLHF_KUBE_ASSETS, else the build's cache."""
    given = os.environ.get("RLHF_KUBE_ASSETS")
    if given:
        return Path(given)
    return cache_dir() / "bin" / pinned_versions()["kubernetes"]


def missing_binaries(directory: Path | None = None) -> list[str]:
    directory = directory or assets_dir()
    return [b for b in BINARIES if not os.access(directory / b, os.X_OK)]


def require_binaries() -> Path:
    directory = assets_dir()
    missing = missing_binaries(directory)
    if missing:
        raise ClusterError(
            f"control-plane binaries missing from {directory}: {', '.join(missing)}. "
            "Run `bash tests/cluster/build` (builds them once from the Go module proxy), point "
            "RLHF_KUBE_ASSETS at a directory that holds them, or use an existing cluster with "
            "RLHF_USE_EXISTING_CLUSTER=1 and KUBECONFIG."
        )
    return directory


def use_existing_cluster() -> bool:
    return os.environ.get("RLHF_USE_EXISTING_CLUSTER", "0") in ("1", "true", "yes")


# --------------------------------------------------------------------------------------------------
# Node pools


@dataclass(frozen=True)
class NodePool:
    """A pool of identical fake nodes, named <name>-<i> and labelled rlhf.dev/pool=<name>."""

    name: str
    #: How many nodes.
    nodes: int
    #: nvidia.com/gpu per node (0: none advertised).
    gpus: int = 0
    #: CPU capacity per node (a Kubernetes quantity).
    cpu: str = "32"
    #: Memory capacity per node (a Kubernetes quantity).
    memory: str = "256Gi"
    #: Pod capacity per node.
    pods: int = 110
    #: Extra node labels.
    labels: dict[str, str] = field(default_factory=dict)
    #: Node taints, each {key, value, effect}.
    taints: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.name):
            raise ValueError(f"pool name {self.name!r} is not a DNS label (lowercase, digits, '-')")
        if self.nodes < 0 or self.gpus < 0 or self.pods < 1:
            raise ValueError(
                f"pool {self.name}: nodes={self.nodes}, gpus={self.gpus}, pods={self.pods}: "
                "need nodes >= 0, gpus >= 0, pods >= 1"
            )
        for taint in self.taints:
            if set(taint) - {"key", "value", "effect"} or "key" not in taint or "effect" not in taint:
                raise ValueError(f"pool {self.name}: taint {taint} needs key, effect and optional value")

    def node_names(self, first_index: int = 0) -> list[str]:
        return [f"{self.name}-{i}" for i in range(first_index, first_index + self.nodes)]


def load_pools(path: Path | str = POOLS_FILE) -> list[NodePool]:
    """Reads pools.yaml: `pools: {<name>: {nodes, gpus, cpu, memory, pods, labels, taints}}`."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    if set(doc) - {"pools"}:
        raise ValueError(f"{path}: unknown top-level keys {sorted(set(doc) - {'pools'})}; valid: ['pools']")
    valid = {f.name for f in fields(NodePool)} - {"name"}
    pools = []
    for name, spec in (doc.get("pools") or {}).items():
        unknown = set(spec) - valid
        if unknown:
            raise ValueError(f"{path}: pool {name}: unknown keys {sorted(unknown)}; valid: {sorted(valid)}")
        pools.append(NodePool(name=name, **spec))
    return pools


def node_manifest(pool: NodePool, node_name: str) -> dict[str, Any]:
    """The Node object of one fake node of `pool`; kwok makes it Ready with this capacity."""
    resources = {"cpu": pool.cpu, "memory": pool.memory, "pods": str(pool.pods)}
    if pool.gpus:
        resources[GPU_RESOURCE] = str(pool.gpus)
    labels = {
        "kubernetes.io/hostname": node_name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        POOL_LABEL: pool.name,
        **pool.labels,
    }
    if pool.gpus:
        labels.setdefault("nvidia.com/gpu.count", str(pool.gpus))
        labels.setdefault("nvidia.com/gpu.present", "true")
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node_name,
            "labels": labels,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [dict(t) for t in pool.taints]},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


# --------------------------------------------------------------------------------------------------
# Clients


def wait_for(
    predicate: Callable[[], Any], *, timeout: float = 60, interval: float = 0.2, what: str = "condition"
) -> Any:
    """Polls `predicate` until it returns something truthy (returned); ClusterError after `timeout` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # reported if it never succeeds
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(interval)


class Identity:
    """Someone the API server knows: a kubeconfig, and clients that use it."""

    def __init__(self, kubeconfig: Path | str, kubectl_cache: Path | None = None) -> None:
        self.kubeconfig = Path(kubeconfig)
        #: kubectl's discovery cache (--cache-dir); None: kubectl's default, ~/.kube/cache.
        self.kubectl_cache = kubectl_cache
        self._shared_client: Any = None

    def api_client(self, pool_size: int = 32):
        """A kubernetes.client.ApiClient authenticated by this kubeconfig."""
        import kubernetes

        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(
            config_file=str(self.kubeconfig), client_configuration=configuration
        )
        configuration.connection_pool_maxsize = pool_size
        return kubernetes.client.ApiClient(configuration)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        raw: bool = False,
    ) -> Any:
        """A raw API call (`"GET", "/api/v1/nodes"`) returning the decoded JSON (the text if raw): fast
        for thousands of objects (no model classes) and the same across kubernetes client versions.
        Raises kubernetes.client.ApiException with .status and .body for an error status."""
        import kubernetes

        client = self._client()
        cfg = client.configuration
        url = cfg.host + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json", "Content-Type": content_type}
        # The kubeconfig loader stores "Bearer <token>" under one of these keys, by client version.
        token = cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization")
        if token:
            headers["Authorization"] = token
        resp = client.rest_client.request(method, url, headers=headers, body=body)
        data = resp.data if getattr(resp, "data", None) is not None else resp.read()
        text = data.decode(errors="replace") if isinstance(data, bytes) else data
        if resp.status >= 400:
            exc = kubernetes.client.ApiException(status=resp.status, reason=resp.reason)
            exc.body = text
            raise exc
        if raw:
            return text
        return json.loads(text) if text else None

    def _client(self):
        if self._shared_client is None:
            self._shared_client = self.api_client()
        return self._shared_client

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        """Runs kubectl with this kubeconfig; returns stdout, raises ClusterError when it fails and check."""
        cmd = [kubectl_binary(), f"--kubeconfig={self.kubeconfig}"]
        if self.kubectl_cache is not None:
            cmd.append(f"--cache-dir={self.kubectl_cache}")
        cmd += args
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout


def kubectl_binary() -> str:
    own = assets_dir() / "kubectl"
    if os.access(own, os.X_OK):
        return str(own)
    found = shutil.which("kubectl")
    if not found:
        raise ClusterError(f"no kubectl in {own.parent} nor on PATH; run `bash tests/cluster/build`")
    return found


# --------------------------------------------------------------------------------------------------
# The cluster


class Cluster(Identity):
    """A control plane, as its admin. Start with Cluster.start() (own processes) or Cluster.existing()."""

    def __init__(
        self,
        kubeconfig: Path | str,
        *,
        name: str | None = None,
        workdir: Path | None = None,
        owned: bool = False,
    ) -> None:
        super().__init__(kubeconfig)
        self.name = name
        self.workdir = workdir
        self.owned = owned
        self.start_seconds: float | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self._scratch_dir: Path | None = None
        self._lock = threading.Lock()
        # Per cluster, so that no ~/.kube/cache/discovery/127.0.0.1_<port> outlives it.
        self.kubectl_cache = workdir / "kubectl-cache" if workdir else None

    # ---- lifecycle -------------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        *,
        pools: Iterable[NodePool] | Path | str | None = POOLS_FILE,
        name: str | None = None,
        workdir: Path | str | None = None,
        timeout: float = 120,
        detach: bool = False,
        options: dict[str, Any] | None = None,
    ) -> Cluster:
        """Starts a fresh cluster on loopback and its node pools; ready when it returns.

        workdir: where kwokctl keeps the cluster (certificates, etcd data, logs); a new temporary
        directory by default, removed by stop(). detach: let the cluster outlive this process
        (tests/cluster/up); by default it is torn down at exit, on SIGTERM/SIGHUP, and by a
        watchdog if this process dies some other way. options: see kwokctl_config.
        """
        assets = require_binaries()
        reap_stale_clusters()
        name = name or f"rlhf-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        else:
            workdir = Path(workdir)
            workdir.mkdir(parents=True, exist_ok=False)
        cluster = cls(workdir / "kubeconfig", name=name, workdir=workdir, owned=True)
        (workdir / _OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "name": name}))
        t0 = time.monotonic()
        try:
            if not detach:
                cluster._start_watchdog()
                cluster._register_teardown()
            # kwokctl picks ports by probing for free ones; starting one cluster at a time on this
            # machine, until its components listen, keeps two test runs from picking the same.
            with start_lock():
                cluster._create(assets, timeout, options)
                cluster.wait_ready(timeout)
            if pools is not None:
                cluster.create_pools(load_pools(pools) if isinstance(pools, (str, Path)) else pools)
        except ClusterError as exc:
            logs = cluster.tail_logs()  # before stop() removes them
            cluster.stop()
            raise ClusterError(f"{exc}\ncomponent logs (last lines):\n{logs}") from exc
        except BaseException:
            cluster.stop()
            raise
        cluster.start_seconds = time.monotonic() - t0
        return cluster

    @classmethod
    def existing(cls, kubeconfig: Path | str | None = None) -> Cluster:
        """The cluster of `kubeconfig` ($KUBECONFIG, else ~/.kube/config); stop() leaves it running."""
        path = (
            kubeconfig
            or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
            or Path.home() / ".kube/config"
        )
        if not Path(path).exists():
            raise ClusterError(f"RLHF_USE_EXISTING_CLUSTER=1 but there is no kubeconfig at {path}")
        cluster = cls(path, owned=False)
        cluster.kubectl_cache = cluster._scratch() / "kubectl-cache"
        cluster.wait_ready(30)
        return cluster

    def _env(self) -> dict[str, str]:
        assert self.workdir is not None
        return {**os.environ, "KWOK_WORKDIR": str(self.workdir / "kwok")}

    def _create(self, assets: Path, timeout: float, options: dict[str, Any] | None = None) -> None:
        assert self.workdir is not None and self.name is not None
        config = self.workdir / "kwokctl.yaml"
        config.write_text(kwokctl_config(assets, options, pki_dir=self.cluster_dir() / "pki"))
        cmd = [
            str(assets / "kwokctl"),
            f"--name={self.name}",
            f"--config={config}",
            "create",
            "cluster",
            "--runtime=binary",
            f"--kubeconfig={self.kubeconfig}",
            f"--timeout={int(timeout)}s",
            "--wait=0s",
        ]
        res = subprocess.run(cmd, env=self._env(), capture_output=True, text=True, timeout=timeout + 30)
        if res.returncode != 0:
            raise ClusterError(
                f"kwokctl create cluster failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
            )

    def wait_ready(self, timeout: float = 60) -> None:
        """Waits for /readyz, and for the controller-manager to have made the default ServiceAccount."""
        import kubernetes

        core = kubernetes.client.CoreV1Api(self.admin())

        restarts: dict[str, int] = {}

        def ready() -> bool:
            if self.owned:
                self.restart_exited_components(restarts)
            if self.request("GET", "/readyz", raw=True).strip() != "ok":
                return False
            core.read_namespaced_service_account("default", "default")
            return True

        wait_for(
            ready,
            timeout=timeout,
            interval=0.1,
            what="the API server to be ready with a default ServiceAccount",
        )

    def restart_exited_components(self, restarts: dict[str, int], limit: int = 3) -> list[str]:
        """Starts again, with kwokctl's own command line, a component that exited while the cluster
        came up. kube-controller-manager gives up when the API server is not healthy within its
        first 10 s (its RBAC bootstrap can take longer on a loaded machine); a kubelet would restart
        it as a static pod, and so does this. Returns the restarted names; ClusterError after
        `limit` restarts of one component."""
        if self.workdir is None:
            return []
        restarted = []
        for comp in self.saved_config().get("components") or []:
            name = comp.get("name")
            pid_file = self.cluster_dir() / "pids" / f"{name}.pid"
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            if _pid_alive(pid) or not comp.get("binary"):
                continue
            restarts[name] = restarts.get(name, 0) + 1
            if restarts[name] > limit:
                raise ClusterError(f"{name} exited {limit + 1} times while the cluster started")
            log = open(self.logs_dir() / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
            proc = subprocess.Popen(
                [comp["binary"], *comp.get("args", [])],
                cwd=comp.get("workDir") or None,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            log.close()
            pid_file.write_text(str(proc.pid))
            print(f"cluster {self.name}: {name} had exited; started it again", file=sys.stderr)
            restarted.append(name)
        return restarted

    def stop(self) -> None:
        """Stops every process of the cluster and removes its directory (owned clusters only). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._shared_client is not None:
            with contextlib.suppress(Exception):
                self._shared_client.close()
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)
        if self.owned and self.workdir is not None and self.name is not None:
            destroy(self.workdir, self.name)
        if self._watchdog is not None:
            with contextlib.suppress(Exception):
                assert self._watchdog.stdin is not None
                self._watchdog.stdin.close()
                self._watchdog.wait(timeout=30)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_watchdog(self) -> None:
        assert self.workdir is not None and self.name is not None
        # Its own session: a Ctrl-C to the test run's process group does not reach it. It waits for
        # EOF on stdin, which comes when this process closes the pipe or dies, however it dies.
        self._watchdog = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "watchdog", str(self.workdir), self.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        owner = json.loads((self.workdir / _OWNER_FILE).read_text())
        owner["watchdog"] = self._watchdog.pid
        (self.workdir / _OWNER_FILE).write_text(json.dumps(owner))

    def _register_teardown(self) -> None:
        atexit.register(self.stop)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous = signal.getsignal(sig)

            def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                self.stop()
                if callable(previous):
                    previous(signum, frame)
                else:
                    raise SystemExit(128 + signum)

            signal.signal(sig, handler)

    # ---- paths and diagnostics -------------------------------------------------------------------

    def _scratch(self) -> Path:
        """The cluster's directory, or for an existing cluster a temporary one that stop() removes."""
        if self.workdir is not None:
            return self.workdir
        if self._scratch_dir is None:
            self._scratch_dir = Path(tempfile.mkdtemp(prefix="rlhf-kubeconfigs-"))
        return self._scratch_dir

    def cluster_dir(self) -> Path:
        assert self.workdir is not None and self.name is not None
        return self.workdir / "kwok" / "clusters" / self.name

    def logs_dir(self) -> Path:
        return self.cluster_dir() / "logs"

    def ports(self) -> dict[str, int]:
        """Loopback ports the cluster's components listen on, from kwokctl's saved configuration."""
        options = self.saved_config().get("options") or {}
        return {
            k: v
            for k, v in options.items()
            if k.endswith("Port") and isinstance(v, int) and not isinstance(v, bool) and v
        }

    def saved_config(self) -> dict[str, Any]:
        """The KwokctlConfiguration kwokctl saved for this cluster (options, components), or {}."""
        with contextlib.suppress(OSError, ValueError):
            for doc in yaml.safe_load_all((self.cluster_dir() / "kwok.yaml").read_text()):
                if doc and doc.get("kind") == "KwokctlConfiguration":
                    return dict(doc)
        return {}

    def pids(self) -> list[int]:
        """Process ids of the cluster's components."""
        return _component_pids(self.workdir) if self.workdir else []

    def tail_logs(self, lines: int = 20) -> str:
        out = []
        if self.workdir is None:
            return ""
        for log in sorted(self.logs_dir().glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # ---- clients ---------------------------------------------------------------------------------

    def admin(self):
        """One shared admin ApiClient (api_client() makes a new one each call)."""
        return self._client()

    def as_service_account(
        self, namespace: str, name: str, *, expiration_seconds: int = 3600, create: bool = False
    ) -> Identity:
        """An Identity authenticated as ServiceAccount namespace/name, with a token from TokenRequest.

        create: make the ServiceAccount first when it does not exist.
        """
        import kubernetes

        core = kubernetes.client.CoreV1Api(self.admin())
        if create:
            try:
                core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
            except kubernetes.client.ApiException as exc:
                if exc.status != 409:
                    raise
        request = kubernetes.client.AuthenticationV1TokenRequest(
            spec=kubernetes.client.V1TokenRequestSpec(audiences=[], expiration_seconds=expiration_seconds)
        )
        token = core.create_namespaced_service_account_token(name, namespace, request).status.token
        admin_config = yaml.safe_load(self.kubeconfig.read_text())
        context_name = admin_config.get("current-context")
        context = next(c for c in admin_config["contexts"] if c["name"] == context_name)["context"]
        cluster = next(c for c in admin_config["clusters"] if c["name"] == context["cluster"])
        user = f"system:serviceaccount:{namespace}:{name}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": cluster["name"], "user": user}}],
            "current-context": user,
        }
        path = self._scratch() / f"sa-{namespace}-{name}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return Identity(path, kubectl_cache=self.kubectl_cache)

    # ---- nodes -----------------------------------------------------------------------------------

    def create_pools(
        self, pools: Iterable[NodePool], *, wait: bool = True, timeout: float = 120
    ) -> list[str]:
        names: list[str] = []
        for pool in pools:
            names += self.create_pool(pool, wait=False)
        if wait:
            self.wait_nodes_ready(names, timeout=timeout)
        return names

    def create_pool(
        self,
        pool: NodePool | str,
        nodes: int | None = None,
        gpus: int = 0,
        *,
        first_index: int = 0,
        wait: bool = True,
        timeout: float = 120,
        workers: int = 16,
        **spec: Any,
    ) -> list[str]:
        """Creates `nodes` fake nodes <pool>-<first_index>... (existing ones are kept); returns their names.

        pool: a NodePool, or a pool name with nodes, gpus and NodePool's other fields as keywords.
        wait: until kwok has made them all Ready.
        """
        if isinstance(pool, str):
            if nodes is None:
                raise ValueError(f"create_pool({pool!r}) needs nodes=")
            pool = NodePool(name=pool, nodes=nodes, gpus=gpus, **spec)
        names = pool.node_names(first_index)

        def create(node_name: str) -> None:
            try:
                self.request("POST", "/api/v1/nodes", node_manifest(pool, node_name))
            except Exception as exc:
                if getattr(exc, "status", None) != 409:
                    raise

        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(names)))) as ex:
            list(ex.map(create, names))
        if wait:
            self.wait_nodes_ready(names, timeout=timeout)
        return names

    def nodes(self, label_selector: str = "") -> list[dict[str, Any]]:
        """Nodes as plain dicts (fast for thousands: no model objects)."""
        query = {"labelSelector": label_selector} if label_selector else None
        return self.request("GET", "/api/v1/nodes", query=query)["items"]

    def wait_nodes_ready(self, names: Iterable[str], *, timeout: float = 120, ready: bool = True) -> None:
        """Waits until every named node is Ready (ready=False: NotReady)."""
        pending = set(names)
        total = len(pending)
        status = "True" if ready else "False"

        def done() -> bool:
            if len(pending) == 1:
                items = [self.request("GET", f"/api/v1/nodes/{next(iter(pending))}")]
            else:
                # resourceVersion=0: served from the API server's cache, cheap even for thousands.
                items = self.request("GET", "/api/v1/nodes", query={"resourceVersion": "0"})["items"]
            for node in items:
                conditions = (node.get("status") or {}).get("conditions") or []
                if any(c["type"] == "Ready" and c["status"] == status for c in conditions):
                    pending.discard(node["metadata"]["name"])
            return not pending

        state = "Ready" if ready else "NotReady"
        # Listing a thousand nodes costs the API server and this process real CPU: poll big sets slowly.
        wait_for(
            done, timeout=timeout, interval=0.25 if total <= 20 else 1.0, what=f"{total} node(s) {state}"
        )

    def delete_node(self, name: str) -> None:
        """Node loss: the Node object goes away (its pods are garbage-collected by the real pod GC)."""
        import kubernetes

        kubernetes.client.CoreV1Api(self.admin()).delete_node(name)

    def set_node_not_ready(self, name: str, *, wait: bool = True, timeout: float = 30) -> None:
        """kwok reports the node NotReady (Ready=False) until set_node_ready; the node lifecycle
        controller then taints it node.kubernetes.io/not-ready:NoExecute."""
        self._annotate_node(name, {NOT_READY_ANNOTATION: "true"})
        if wait:
            self.wait_nodes_ready([name], ready=False, timeout=timeout)

    def set_node_ready(self, name: str, *, wait: bool = True, timeout: float = 30) -> None:
        self._annotate_node(name, {NOT_READY_ANNOTATION: None})
        if wait:
            self.wait_nodes_ready([name], timeout=timeout)

    def _annotate_node(self, name: str, annotations: dict[str, str | None]) -> None:
        import kubernetes

        kubernetes.client.CoreV1Api(self.admin()).patch_node(name, {"metadata": {"annotations": annotations}})

    # ---- pods ------------------------------------------------------------------------------------

    def complete_pod(
        self,
        name: str,
        namespace: str = "default",
        *,
        outcome: str = "succeeded",
        exit_code: int | None = None,
    ) -> None:
        """Makes kwok finish a running pod: outcome "succeeded" (exit 0) or "failed" (exit_code, default 1)."""
        import kubernetes

        if outcome not in ("succeeded", "failed"):
            raise ValueError(f"outcome {outcome!r}: valid are 'succeeded', 'failed'")
        annotations = {COMPLETE_ANNOTATION: outcome}
        if exit_code is not None:
            annotations[EXIT_CODE_ANNOTATION] = str(exit_code)
        kubernetes.client.CoreV1Api(self.admin()).patch_namespaced_pod(
            name, namespace, {"metadata": {"annotations": annotations}}
        )

    def wait_pod_phase(
        self, name: str, namespace: str = "default", phase: str = "Running", timeout: float = 60
    ):
        """Waits until the pod is in `phase`; returns it (a V1Pod)."""
        import kubernetes

        core = kubernetes.client.CoreV1Api(self.admin())

        def check():
            pod = core.read_namespaced_pod(name, namespace)
            return pod if pod.status.phase == phase else None

        return wait_for(check, timeout=timeout, what=f"pod {namespace}/{name} to be {phase}")


def kwokctl_config(assets: Path, options: dict[str, Any] | None = None, pki_dir: Path | None = None) -> str:
    """kwokctl's configuration: every binary local (nothing is downloaded), everything on loopback,
    RBAC and admission on, and the project's kwok Stages instead of kwok's defaults. `options`
    override or add KwokctlConfiguration options (e.g. {"heartbeatFactor": 5}).

    The control plane is also ready for a real node (tests/cluster/realnode.py) to join: kwok
    plays only the nodes annotated as fake, the API server advertises the real node's bridge
    address, its certificate names the `kubernetes` Service's ClusterIP, the Service range does
    not overlap kwok's fake pod addresses, and it reaches kubelets by InternalIP with a client
    certificate (`kubectl logs`/`exec`). `pki_dir`: where kwokctl writes the cluster's certificates."""
    from realnode import KUBERNETES_SERVICE_IP, NODE_IP, SERVICE_CIDR

    versions = pinned_versions()
    options = {
        "runtime": "binary",
        "kubeVersion": versions["kubernetes"],
        "bindAddress": "127.0.0.1",
        "securePort": True,
        "kubeAuthorization": True,
        "kubeAdmission": True,
        "quietPull": True,
        # kwokctl stretches every heartbeat period 5x by default (node leases of 200 s, a node
        # monitor period of 25 s); 1 keeps the kubelet's and controller-manager's own defaults,
        # so a NotReady node is noticed within seconds, as on a real cluster.
        "heartbeatFactor": 1,
        "etcdBinary": str(assets / "etcd"),
        "kubeApiserverBinary": str(assets / "kube-apiserver"),
        "kubeControllerManagerBinary": str(assets / "kube-controller-manager"),
        "kubeSchedulerBinary": str(assets / "kube-scheduler"),
        "kwokControllerBinary": str(assets / "kwok"),
        "kubectlBinary": str(assets / "kubectl"),
        "kubeApiserverCertSANs": [KUBERNETES_SERVICE_IP, NODE_IP],
        **(options or {}),
    }
    apiserver_args = [
        {"key": "advertise-address", "value": NODE_IP},
        {"key": "service-cluster-ip-range", "value": SERVICE_CIDR},
        {"key": "kubelet-preferred-address-types", "value": "InternalIP"},
    ]
    if pki_dir is not None:
        apiserver_args += [
            {"key": "kubelet-client-certificate", "value": str(pki_dir / "admin.crt")},
            {"key": "kubelet-client-key", "value": str(pki_dir / "admin.key")},
        ]
    kwokctl = {
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
        "kind": "KwokctlConfiguration",
        "options": options,
        # kwok hands out pod IPs from --cidr; its default, a /24, runs out at 254 pods.
        "componentsPatches": [
            {
                "name": "kwok-controller",
                "extraArgs": [
                    {"key": "cidr", "value": "10.0.0.1/16"},
                    # A real kubelet owns the real node; kwok must leave it alone.
                    {"key": "manage-all-nodes", "value": "false"},
                    {"key": "manage-nodes-with-annotation-selector", "value": f"{KWOK_NODE_ANNOTATION}=fake"},
                ],
            },
            {"name": "kube-apiserver", "extraArgs": apiserver_args},
            # One instance of each, so no leader election: with it, a lease renewal that misses its
            # 10 s deadline (etcd or the API server starved on a loaded machine) makes the scheduler
            # and the controller-manager exit for good, and from then on no new pod is scheduled
            # while the running ones go on (seen on the real node: a scaled-up rollout pod Pending
            # for good, then the next job's pods too).
            {"name": "kube-scheduler", "extraArgs": [{"key": "leader-elect", "value": "false"}]},
            {
                "name": "kube-controller-manager",
                "extraArgs": [
                    {"key": "service-cluster-ip-range", "value": SERVICE_CIDR},
                    {"key": "leader-elect", "value": "false"},
                ],
            },
        ],
    }
    docs: list[Any] = [kwokctl]
    for stage_file in sorted(STAGES_DIR.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(stage_file.read_text()) if d]
    return yaml.safe_dump_all(docs, sort_keys=False)


# --------------------------------------------------------------------------------------------------
# Teardown, also of what an interrupted run left behind


@contextlib.contextmanager
def start_lock() -> Iterator[None]:
    """Held while a cluster starts (by every process using this harness on this machine)."""
    import fcntl

    path = Path(tempfile.gettempdir()) / "rlhf-cluster.start-lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def _component_pids(workdir: Path) -> list[int]:
    pids = []
    for pid_file in workdir.glob("kwok/clusters/*/pids/*.pid"):
        with contextlib.suppress(ValueError, OSError):
            pids.append(int(pid_file.read_text().strip()))
    return pids


def destroy(workdir: Path, name: str) -> None:
    """Stops the cluster's processes (kwokctl delete cluster, then signals for any survivor) and
    removes `workdir`. Safe to call twice and from several processes."""
    if not workdir.exists():
        return
    pids = _component_pids(workdir)
    binary = str(assets_dir() / "kwokctl")
    if os.access(binary, os.X_OK) and (workdir / "kwok" / "clusters" / name).exists():
        with contextlib.suppress(Exception):
            subprocess.run(
                # --kubeconfig: kwokctl would otherwise edit ~/.kube/config.
                [binary, f"--name={name}", "delete", "cluster", f"--kubeconfig={workdir / 'kubeconfig'}"],
                env={**os.environ, "KWOK_WORKDIR": str(workdir / "kwok")},
                capture_output=True,
                timeout=60,
            )
    terminate(pids, grace=5)
    shutil.rmtree(workdir, ignore_errors=True)


def terminate(pids: Iterable[int], grace: float = 5) -> None:
    """SIGTERM, then after `grace` seconds SIGKILL, to those of `pids` still alive; returns when
    they are gone (or after the second grace)."""
    alive = list(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in alive if _pid_alive(p)]
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in alive if _pid_alive(p)]
        if not alive:
            return


def reap_stale_clusters(root: Path | None = None) -> list[Path]:
    """Destroys clusters under the temp dir whose owner and watchdog are both gone; returns them."""
    root = root or Path(tempfile.gettempdir())
    reaped = []
    for workdir in root.glob(WORKDIR_PREFIX + "*"):
        owner_file = workdir / _OWNER_FILE
        try:
            owner = json.loads(owner_file.read_text())
        except (OSError, ValueError):
            continue
        if any(_pid_alive(owner[k]) for k in ("pid", "watchdog") if k in owner):
            continue
        destroy(workdir, owner["name"])
        reaped.append(workdir)
    return reaped


def _watchdog_main(workdir: str, name: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        while sys.stdin.buffer.read(4096):
            pass
    destroy(Path(workdir), name)


def dev_cluster_dir(name: str) -> Path:
    return cache_dir() / "clusters" / name


def main(argv: list[str]) -> int:
    """tests/cluster/up and down: a long-lived cluster for development, reused by the tests with
    RLHF_USE_EXISTING_CLUSTER=1 KUBECONFIG=<printed path>."""
    import argparse

    parser = argparse.ArgumentParser(prog="tests/cluster/{up,down}")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a cluster that outlives this command")
    up.add_argument("--name", default="rlhf-dev")
    up.add_argument("--pools", default=str(POOLS_FILE), help="pools YAML, or '' for no nodes")
    down = sub.add_parser("down", help="stop a cluster started by up")
    down.add_argument("--name", default="rlhf-dev")
    watchdog = sub.add_parser("watchdog", help=argparse.SUPPRESS)
    watchdog.add_argument("workdir")
    watchdog.add_argument("name")
    args = parser.parse_args(argv)

    if args.command == "watchdog":
        _watchdog_main(args.workdir, args.name)
        return 0
    workdir = dev_cluster_dir(args.name)
    if args.command == "down":
        if not workdir.exists():
            print(f"no cluster {args.name} ({workdir} does not exist)", file=sys.stderr)
            return 0
        destroy(workdir, args.name)
        print(f"cluster {args.name} stopped; {workdir} removed", file=sys.stderr)
        return 0
    if workdir.exists():
        print(
            f"cluster {args.name} exists ({workdir}); `tests/cluster/down --name {args.name}` first",
            file=sys.stderr,
        )
        return 1
    workdir.parent.mkdir(parents=True, exist_ok=True)
    try:
        cluster = Cluster.start(pools=args.pools or None, name=args.name, workdir=workdir, detach=True)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"cluster {args.name} ready in {cluster.start_seconds:.1f} s; ports {cluster.ports()}",
        file=sys.stderr,
    )
    print(f"export KUBECONFIG={cluster.kubeconfig} RLHF_USE_EXISTING_CLUSTER=1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# --------------------------------------------------------------------------------------------------
# The claims the example manifests mount

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


def example_claims() -> list[str]:
    """The PersistentVolumeClaims that the shipped example manifests mount and do not define
    themselves (the cluster tests apply those examples as they are; the scheduler keeps a pod
    whose claim is missing Pending)."""

    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            claim = node.get("persistentVolumeClaim")
            if isinstance(claim, dict) and claim.get("claimName"):
                yield str(claim["claimName"])
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    names: set[str] = set()
    shipped: set[str] = set()  # claims an example file defines itself (applied with it)
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            names.update(walk(doc))
            if isinstance(doc, dict) and doc.get("kind") == "PersistentVolumeClaim":
                shipped.add(str(doc["metadata"]["name"]))
    return sorted(names - shipped)


def bind_example_claims(core: Any, namespace: str) -> list[str]:
    """Each example claim in `namespace`, pre-bound to a PersistentVolume of its own (kwok's pods
    never mount it); returns the volumes' names (cluster-scoped, deleted after the test)."""
    volumes = []
    for claim in example_claims():
        pv = f"{namespace}-{claim}"
        access = {"accessModes": ["ReadWriteMany"], "storageClassName": ""}
        core.create_persistent_volume(
            {
                "metadata": {"name": pv},
                "spec": {
                    **access,
                    "capacity": {"storage": "1Gi"},
                    "hostPath": {"path": f"/tmp/rlhf-kwok-volumes/{pv}"},
                    "persistentVolumeReclaimPolicy": "Retain",
                    "claimRef": {"namespace": namespace, "name": claim},
                },
            }
        )
        volumes.append(pv)
        core.create_namespaced_persistent_volume_claim(
            namespace,
            {
                "metadata": {"name": claim},
                "spec": {**access, "volumeName": pv, "resources": {"requests": {"storage": "1Gi"}}},
            },
        )
    for claim in example_claims():
        wait_for(
            lambda c=claim: (
                core.read_namespaced_persistent_volume_claim(c, namespace).status.phase == "Bound"
            ),
            timeout=60,
            what=f"PersistentVolumeClaim {namespace}/{claim} Bound",
        )
    return volumes
