#!/usr/bin/env bash
# Checks the GPU trainer image without a GPU: what it must carry to run what it ships.
#
#   bash scripts/check_gpu_image.sh [IMAGE]     # default: the `trainer` image scripts/images.sh built
#
# In a container of IMAGE (buildah, as the image's own user): a C compiler that compiles against
# the Python headers (Triton builds its launchers so at run time), the InfiniBand verbs library
# NCCL loads, `import vllm`, the project's vLLM engine module defining its weight source, torch's
# CUDA and the image's labels agreeing (`dev.rlhf.cuda.version`, `dev.rlhf.cuda.driver-min`, by
# `rlhf_trainer.gpu_preflight`), NCCL from the wheel of that CUDA, and the pods' start-up check.
# Prints one "ok"/"FAILED" line per check; exits 1 when one failed.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v buildah >/dev/null || { echo "error: buildah is not installed" >&2; exit 2; }
image=${1:-}
if [ -z "$image" ]; then
  image=$(buildah images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/rlhf-operator/trainer:' | head -n1 || true)
  [ -n "$image" ] || { echo "error: no localhost/rlhf-operator/trainer image: run bash scripts/images.sh trainer" >&2; exit 2; }
fi
label() { buildah inspect --type image --format "{{index .OCIv1.Config.Labels \"$1\"}}" "$image"; }
cuda=$(label dev.rlhf.cuda.version)
driver_min=$(label dev.rlhf.cuda.driver-min)
size=$(buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | awk -v i="$image" '$1 == i {print $2, $3}')
echo "image $image ($size): labels CUDA $cuda, driver >= $driver_min"

ctr=$(buildah from --pull=never "$image")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
# The checks, in the image's Python (one process; each prints its own line).
read -r -d '' CHECKS <<'PY' || true
import ctypes, importlib.metadata as md, os, subprocess, sys, sysconfig, tempfile
failed = []
def check(name, ok, detail=""):
    print(f"{'ok' if ok else 'FAILED'}: {name}" + (f" ({detail})" if detail else ""), flush=True)
    if not ok:
        failed.append(name)
def attempt(name, fn):
    try:
        check(name, True, str(fn() or ""))
    except Exception as err:
        check(name, False, f"{type(err).__name__}: {err}")

inc = sysconfig.get_paths()["include"]
check("Python headers", os.path.isfile(os.path.join(inc, "Python.h")), inc)
def compile_ext():
    d = tempfile.mkdtemp()
    src = os.path.join(d, "m.c")
    open(src, "w").write('#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "m"};\nPyMODINIT_FUNC PyInit_m(void) { return PyModule_Create(&m); }\n')
    out = subprocess.run(["cc", "-shared", "-fPIC", "-I", inc, src, "-o", os.path.join(d, "m.so")], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip()[-300:])
    sys.path.insert(0, d)
    import m  # noqa: F401
    return subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
attempt("C compiler builds and loads a Python extension", compile_ext)
attempt("InfiniBand verbs for NCCL (libibverbs.so.1)", lambda: ctypes.CDLL("libibverbs.so.1") and "loaded")
def vllm_import():
    import vllm
    return vllm.__version__
attempt("import vllm", vllm_import)
def weight_source():
    from rlhf_trainer.rollout import vllm as engine
    from vllm.distributed.weight_transfer.base import WeightSource
    src = engine._weight_source()
    assert isinstance(src, WeightSource), type(src).__mro__
    return type(src).__name__
attempt("rlhf_trainer.rollout.vllm defines its WeightSource", weight_source)
import torch
cuda, floor = os.environ["IMAGE_CUDA"], os.environ["IMAGE_DRIVER_MIN"]
from rlhf_trainer import gpu_preflight
problem = gpu_preflight.label_problem(cuda, floor, torch.version.cuda)
check("torch's CUDA matches the labels", problem is None, problem or f"torch {torch.__version__}, CUDA {torch.version.cuda}")
def nccl():
    have = ".".join(str(v) for v in torch.cuda.nccl.version())
    dists = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("nvidia-nccl")]
    want = f"nvidia-nccl-cu{torch.version.cuda.split('.')[0]}"
    assert want in dists, f"NCCL wheels {dists}, expected {want}"
    wheel = md.version(want)
    assert wheel.startswith(have), f"torch links NCCL {have}, wheel {want} {wheel}"
    return f"NCCL {have} from {want} {wheel}"
attempt("NCCL is the wheel of the labelled CUDA", nccl)
out = subprocess.run([sys.executable, "-m", "rlhf_trainer.gpu_preflight"], capture_output=True, text=True)
check("start-up check runs (no GPU here: says it could not read the driver)",
      out.returncode == 0 and "GPU preflight" in out.stderr, out.stderr.strip()[:200])
check("driver floor in the environment", os.environ.get("RLHF_CUDA_DRIVER_MIN") == floor, os.environ.get("RLHF_CUDA_DRIVER_MIN", "unset"))
sys.exit(1 if failed else 0)
PY
buildah run --env IMAGE_CUDA="$cuda" --env IMAGE_DRIVER_MIN="$driver_min" "$ctr" -- python -c "$CHECKS"
