"""`rlhf validate` imports the user's code a manifest names by path (reward functions, a custom
algorithm, a multi-turn environment, a pipeline) in a subprocess cut at a timeout, as the trainer
would import it (from the current directory, then PYTHONPATH): a bad path is an error naming the
field, the value and the cause, before anything starts. `--no-import` skips it; the project's own
paths are checked in-process; `-` reads the manifest from standard input, named `<stdin>`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

MODULES = {
    "my_rewards.py": "def good(prompts, responses, **kw):\n    return [0.0] * len(responses)\n\nSCALE = 3\n",
    "raises_at_import.py": "raise RuntimeError('no GPU here, says the module')\n",
    "hangs_at_import.py": "import time\ntime.sleep(600)\n",
    "my_algos.py": "def not_an_algorithm():\n    pass\n",
    "my_envs.py": "def make_env():\n    pass\n",
}


def _job(rewards: list[str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "imports"},
        "spec": {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": p} for p in rewards]},
            **spec,
        },
    }


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The user's project: their modules in the current directory, the manifest beside them."""
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _validate(cwd: Path, doc: dict[str, Any], *extra: str, stdin: bool = False) -> tuple[int, str, float]:
    manifest = cwd / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    args = ["-"] if stdin else [str(manifest)]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.cli", "validate", *args, *extra],
        input=manifest.read_text() if stdin else None,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ),
        timeout=300,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


@pytest.mark.parametrize(
    ("path", "cause"),
    [
        ("no_such_module:score", "cannot import module 'no_such_module': No module named 'no_such_module'"),
        ("my_rewards:scroe", "module 'my_rewards' has no attribute 'scroe'"),
        ("my_rewards:SCALE", "TypeError: reward 'my_rewards:SCALE' is a int, neither a function nor"),
        ("raises_at_import:score", "RuntimeError: no GPU here, says the module"),
    ],
    ids=["module-missing", "attribute-missing", "not-callable", "import-raises"],
)
def test_a_bad_reward_path_names_the_field_the_value_and_the_cause(
    workdir: Path, path: str, cause: str
) -> None:
    rc, out, _ = _validate(workdir, _job(["my_rewards:good", path]))
    assert rc == 1, out
    assert "its code cannot be imported" in out
    # The first line names functions[1]: functions[0], a module of the current directory, imported.
    line = next(x for x in out.splitlines() if "spec.reward.functions[" in x)
    assert line.startswith(f"  - spec.reward.functions[1].path: {path!r} cannot be used: "), out
    assert cause in line, out


def test_a_hanging_import_is_cut_at_the_timeout(workdir: Path) -> None:
    rc, out, took = _validate(
        workdir, _job(["hangs_at_import:score", "my_rewards:good"]), "--import-timeout", "1"
    )
    assert rc == 1, out
    assert (
        "spec.reward.functions[0].path: 'hangs_at_import:score' cannot be used: importing it did not finish in 1 s"
    ) in out
    assert "spec.reward.functions[1].path: 'my_rewards:good' not checked" in out
    print(f"validate with a hanging import, --import-timeout 1: returned in {took:.1f} s")
    assert took < 120  # a guard only: the module sleeps 600 s


def test_a_custom_algorithm_and_an_environment_are_checked(workdir: Path) -> None:
    doc = _job(
        ["my_rewards:good"],
        algorithm={"name": "my_algos:not_an_algorithm"},
        rollout={"multiTurn": {"environment": "my_envs:make_env"}},
    )
    rc, out, _ = _validate(workdir, doc)
    assert rc == 1, out
    assert (
        "spec.algorithm.name: 'my_algos:not_an_algorithm' cannot be used: TypeError: "
        "'my_algos:not_an_algorithm' is <function not_an_algorithm"
    ) in out
    assert "not a subclass of rlhf_trainer.algorithms.Algorithm" in out
    assert "spec.rollout.multiTurn.environment: 'my_envs:make_env' cannot be used: TypeError: " in out
    assert "is a function, not a class with step(episode)" in out


def test_an_estimator_named_by_path_in_a_builtins_params_is_checked(workdir: Path) -> None:
    doc = _job(
        ["my_rewards:good"], algorithm={"name": "grpo", "params": {"advantageEstimator": "my_rewards:SCALE"}}
    )
    rc, out, _ = _validate(workdir, doc)
    assert rc == 1, out
    assert (
        "spec.algorithm.params.advantageEstimator: 'my_rewards:SCALE' cannot be used: "
        "TypeError: 'my_rewards:SCALE' is a int, not a function or class"
    ) in out


def test_no_import_skips_the_check(workdir: Path) -> None:
    rc, out, _ = _validate(workdir, _job(["no_such_module:score"]), "--no-import")
    assert rc == 0, out
    assert "valid (imports" in out


def test_stdin_is_named_and_imports_from_the_current_directory(workdir: Path) -> None:
    rc, out, _ = _validate(workdir, _job(["my_rewards:good", "my_rewards:scroe"]), stdin=True)
    assert rc == 1, out
    assert "<stdin>: its code cannot be imported" in out
    assert "spec.reward.functions[1].path: 'my_rewards:scroe'" in out
    assert "functions[0]" not in out  # the module in the current directory imported
    rc, out, _ = _validate(workdir, _job(["my_rewards:good"]), stdin=True)
    assert rc == 0 and out.startswith("<stdin>: valid (imports"), out


def test_stdin_is_read_once(capsys: pytest.CaptureFixture[str]) -> None:
    from rlhf_trainer.cli import main

    assert main(["validate", "-", "--nodes", "-"]) == 2
    assert "only one of MANIFEST, --nodes and --old can be - (standard input)" in capsys.readouterr().err


def test_the_projects_own_paths_are_checked_without_a_subprocess(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlhf_trainer import user_code
    from rlhf_trainer.cli import main

    def no_subprocess(*_: Any, **__: Any) -> None:
        raise AssertionError("a subprocess for the project's own paths")

    monkeypatch.setattr(user_code.subprocess, "Popen", no_subprocess)
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_job(["rlhf_trainer.rewards.builtin:arithmetic_exact"])))
    assert main(["validate", str(manifest)]) == 0, capsys.readouterr().err
    manifest.write_text(yaml.safe_dump(_job(["rlhf_trainer.rewards.builtin:arithmetic_exactt"])))
    assert main(["validate", str(manifest)]) == 1
    err = capsys.readouterr().err
    assert (
        "spec.reward.functions[0].path: 'rlhf_trainer.rewards.builtin:arithmetic_exactt' cannot be used: "
        "ValueError: reward path 'rlhf_trainer.rewards.builtin:arithmetic_exactt': module "
        "'rlhf_trainer.rewards.builtin' has no attribute 'arithmetic_exactt'"
    ) in err


def test_relative_paths_resolve_against_the_manifests_folder_or_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlhf_api.loader import manifest_dir, manifest_name, resolve_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobs").mkdir()
    assert manifest_dir("-") == tmp_path and manifest_name("-") == "<stdin>"
    assert manifest_dir("jobs/job.yaml") == tmp_path / "jobs"
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    assert resolve_path("models/tiny", manifest_dir("-")) == str(tmp_path / "models" / "tiny")
    assert resolve_path("tiny.jsonl", manifest_dir("jobs/job.yaml")) == str(tmp_path / "jobs" / "tiny.jsonl")
    assert resolve_path("Qwen/Qwen3-0.6B", manifest_dir("-")) == "Qwen/Qwen3-0.6B"  # a hub id


def test_help_says_the_rules() -> None:
    from rlhf_trainer.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = " ".join(sub.choices["validate"].format_help().split())  # type: ignore[attr-defined]
    assert "--no-import" in text and "--import-timeout" in text
    assert "against the current directory" in text and "<stdin>" in text
