"""The run report: PNG plots and `report.html` from `<run_dir>/metrics.jsonl`.

`write_report(run_dir)` draws, from the step records the controller logged:

* `reward.png`: mean reward per step with a ±std band (`reward/mean`, `reward/std`);
* `kl.png`: KL to the reference (`actor/kl`, or the other KL keys of `metrics.SERIES`);
* `loss.png`: actor and critic losses;
* `reward_hist.png`: the reward distribution of the last step that logged its scores
  (`reward/scores`, a list) or a histogram (`reward/hist`: `{"counts": [...], "edges": [...]}`);
* `timing.png`: seconds per phase per step, stacked (`timing/<phase>`; `timing/step` is the total
  and is not stacked);
* `eval.png`: the evaluation's mean rewards at the steps it ran (`eval/greedy/reward_mean`,
  `eval/sampled/reward_mean`, `eval/sampled/best_of_n`; `spec.eval`);

and `report.html`, a self-contained page (images inlined) with a summary table: steps, first
and last mean reward, the first and last evaluation, mean tokens/s and samples/s; then the
samples of the last step and of the last evaluation from `samples.jsonl` (prompt, response,
reward). Plots whose metrics were never logged are left out. `rlhf report RUN_DIR` calls this.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_trainer.metrics import SERIES, read_jsonl, step_records

TOTAL_PHASE = "step"
#: The evaluation's curves: metric key -> label.
EVAL_CURVES = {
    "eval/greedy/reward_mean": "greedy",
    "eval/sampled/reward_mean": "sampled (mean)",
    "eval/sampled/best_of_n": "sampled (best of n)",
}
#: Characters of a prompt or response shown in the report's sample table.
SAMPLE_CHARS = 400


def _series(
    records: list[dict[str, Any]], keys: tuple[str, ...]
) -> tuple[list[float], list[float], str | None]:
    """(steps, values, key used) for the first of `keys` present in any record."""
    for key in keys:
        xs, ys = [], []
        for i, r in enumerate(records):
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(float(r.get("step", i)))
                ys.append(float(v))
        if xs:
            return xs, ys, key
    return [], [], None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.4g}"


def write_report(run_dir: str | Path) -> Path:
    """Write the plots and `report.html` into `run_dir`; returns the path of `report.html`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    records = load_records(run)
    plots: list[tuple[str, str]] = []
    for name, title, draw in PLOTS:
        fig = draw(plt, records)
        if fig is None:  # its metrics were never logged
            continue
        fig.tight_layout()
        fig.savefig(run / name, dpi=100)
        plt.close(fig)
        plots.append((name, title))
    summary = _summary(records)
    samples = _last_samples(run / "samples.jsonl")
    out = run / "report.html"
    out.write_text(_html(run, summary, plots, samples), encoding="utf-8")
    return out


def load_records(run: Path) -> list[dict[str, Any]]:
    """The step records of `run`'s metrics log; an error naming the path when there are none."""
    log_path = run / "metrics.jsonl"
    if not log_path.exists():
        raise FileNotFoundError(f"no metrics log at {str(log_path)!r}; is {str(run)!r} a run directory?")
    records = read_jsonl(log_path)
    if not records:
        raise ValueError(f"{str(log_path)!r} holds no step records")
    return records


def _axes(plt: Any, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return fig, ax


def plot_reward(plt: Any, records: list[dict[str, Any]]) -> Any:
    """Mean reward per step, with a ±std band when every step logged its std."""
    xs, mean, _ = _series(records, ("reward/mean",))
    if not xs:
        return None
    fig, ax = _axes(plt, "step", "reward")
    ax.plot(xs, mean, color="tab:blue", label="mean reward")
    sx, std, _ = _series(records, ("reward/std",))
    if sx == xs:
        ax.fill_between(
            xs,
            [m - s for m, s in zip(mean, std)],
            [m + s for m, s in zip(mean, std)],
            alpha=0.2,
            color="tab:blue",
            label="± std",
        )
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    return fig


def plot_kl(plt: Any, records: list[dict[str, Any]]) -> Any:
    """KL to the reference, under the first KL key of `metrics.SERIES` that was logged."""
    kx, kl, kkey = _series(records, SERIES["kl"][1])
    if not kx:
        return None
    fig, ax = _axes(plt, "step", kkey or "kl")
    ax.plot(kx, kl, color="tab:red")
    ax.grid(alpha=0.3)
    return fig


def plot_losses(plt: Any, records: list[dict[str, Any]]) -> Any:
    """Actor and critic losses, each under the key it was logged with."""
    losses = [
        (label, *_series(records, SERIES[name][1]))
        for name, label in (("actor_loss", "actor"), ("critic_loss", "critic"))
    ]
    if not any(lx for _, lx, _, _ in losses):
        return None
    fig, ax = _axes(plt, "step", "loss")
    for label, lx, ly, key in losses:
        if lx:
            ax.plot(lx, ly, label=f"{label} ({key})")
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    return fig


def plot_reward_histogram(plt: Any, records: list[dict[str, Any]]) -> Any:
    """The reward distribution of the last step that logged its scores or a histogram."""
    hist_step, hist = _last_histogram(records)
    if hist is None:
        return None
    fig, ax = _axes(plt, "reward", "samples")
    if "scores" in hist:
        ax.hist(hist["scores"], bins=min(30, max(5, len(set(hist["scores"])))), color="tab:green")
    else:
        edges, counts = hist["edges"], hist["counts"]
        widths = [b - a for a, b in zip(edges[:-1], edges[1:])]
        ax.bar(edges[:-1], counts, width=widths, align="edge", color="tab:green")
    ax.set_title(f"step {hist_step}")
    return fig


def timed_phases(records: list[dict[str, Any]]) -> list[str]:
    """The phases with a `timing/<phase>` key, in the order the controller logged them (the
    order they run in), without the step's total."""
    return list(
        dict.fromkeys(
            k[len("timing/") :]
            for r in records
            for k in r
            if k.startswith("timing/") and k != f"timing/{TOTAL_PHASE}"
        )
    )


def plot_timing(plt: Any, records: list[dict[str, Any]]) -> Any:
    """Seconds per phase per step, stacked (a phase a step did not time counts 0)."""
    records = step_records(records)  # the before-training evaluation is no step
    phases = timed_phases(records)
    if not phases:
        return None
    steps = [float(r.get("step", i)) for i, r in enumerate(records)]
    stacks = [[_num(r.get(f"timing/{p}")) for r in records] for p in phases]
    fig, ax = _axes(plt, "step", "seconds")
    ax.stackplot(steps, stacks, labels=phases, alpha=0.85)
    ax.legend(loc="upper left", fontsize="small", ncol=min(4, len(phases)))
    ax.grid(alpha=0.3)
    return fig


def plot_eval(plt: Any, records: list[dict[str, Any]]) -> Any:
    """The evaluation's mean rewards at the steps it ran (`EVAL_CURVES`)."""
    curves = [(label, *_series(records, (key,))[:2]) for key, label in EVAL_CURVES.items()]
    if not any(ex for _, ex, _ in curves):
        return None
    fig, ax = _axes(plt, "step", "eval reward")
    for label, ex, ey in curves:
        if ex:
            ax.plot(ex, ey, marker="o", label=label)
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    return fig


#: The report's plots, in page order: file name, title, and the function that draws the figure
#: from the step records (None when none of its metrics were logged).
PLOTS: tuple[tuple[str, str, Callable[[Any, list[dict[str, Any]]], Any]], ...] = (
    ("reward.png", "Reward", plot_reward),
    ("kl.png", "KL divergence", plot_kl),
    ("loss.png", "Losses", plot_losses),
    ("reward_hist.png", "Reward distribution (last step)", plot_reward_histogram),
    ("timing.png", "Time per phase", plot_timing),
    ("eval.png", "Evaluation reward", plot_eval),
)


def _last_samples(path: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """(title, rows) of the last step's training samples and of the last evaluation's samples
    of each mode, from the sample log (none when there is no log)."""
    if not path.is_file():
        return []
    last: dict[str, tuple[Any, list[dict[str, Any]]]] = {}
    for row in read_jsonl(path):
        split, step = str(row.get("split", "train")), row.get("step")
        if split not in last or last[split][0] != step:
            last[split] = (step, [])
        last[split][1].append(row)
    return [(f"{split} samples, step {step}", rows) for split, (step, rows) in last.items()]


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def _last_histogram(records: list[dict[str, Any]]) -> tuple[Any, dict[str, Any] | None]:
    for i in range(len(records) - 1, -1, -1):
        r = records[i]
        scores = r.get("reward/scores")
        if isinstance(scores, list) and scores:
            vals = [float(s) for s in scores if isinstance(s, (int, float)) and math.isfinite(s)]
            if vals:
                return r.get("step", i), {"scores": vals}
        hist = r.get("reward/hist")
        if (
            isinstance(hist, dict)
            and hist.get("counts")
            and hist.get("edges")
            and len(hist["edges"]) == len(hist["counts"]) + 1
        ):
            return r.get("step", i), {"counts": hist["counts"], "edges": hist["edges"]}
    return None, None


def _summary(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    _, mean, _ = _series(records, ("reward/mean",))
    _, tps, _ = _series(records, SERIES["tokens_per_second"][1])
    _, sps, _ = _series(records, SERIES["samples_per_second"][1])
    _, step_s, _ = _series(records, (f"timing/{TOTAL_PHASE}",))
    ex, ev, _ = _series(records, ("eval/reward_mean",))  # the before-training evaluation's too
    records = step_records(records) or records
    last_step = records[-1].get("step", len(records) - 1)
    rows = [
        ("steps logged", str(len(records))),
        ("last step", str(last_step)),
        ("first mean reward", _fmt(mean[0] if mean else None)),
        ("last mean reward", _fmt(mean[-1] if mean else None)),
        ("best mean reward", _fmt(max(mean) if mean else None)),
    ]
    if ev:
        rows += [
            (f"first eval reward (step {ex[0]:g})", _fmt(ev[0])),
            (f"last eval reward (step {ex[-1]:g})", _fmt(ev[-1])),
        ]
    rows += [
        ("mean tokens/s", _fmt(_mean(tps))),
        ("mean samples/s", _fmt(_mean(sps))),
        ("mean seconds/step", _fmt(_mean(step_s))),
    ]
    return rows


def _clip(text: Any) -> str:
    text = str(text)
    return text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + " …"


def _sample_tables(samples: list[tuple[str, list[dict[str, Any]]]]) -> str:
    out = []
    for title, rows in samples:
        body = "\n".join(
            f"<tr><td><pre>{html.escape(_clip(r.get('prompt', '')))}</pre></td>"
            f"<td><pre>{html.escape(_clip(r.get('response', '')))}</pre></td>"
            f"<td>{html.escape(_fmt(r.get('reward')) if r.get('reward') is not None else 'failed')}</td></tr>"
            for r in rows
        )
        out.append(
            f"<h2>{html.escape(title)}</h2>\n<table class=samples><tr><th>prompt</th><th>response</th>"
            f"<th>reward</th></tr>\n{body}</table>"
        )
    return "\n".join(out)


def _html(
    run: Path,
    summary: list[tuple[str, str]],
    plots: list[tuple[str, str]],
    samples: list[tuple[str, list[dict[str, Any]]]] | None = None,
) -> str:
    rows = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary)
    figures = []
    for name, title in plots:
        data = base64.b64encode((run / name).read_bytes()).decode("ascii")
        figures.append(
            f'<figure><figcaption>{html.escape(title)} (<a href="{name}">{name}</a>)</figcaption>'
            f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>'
        )
    body = "\n".join(figures) or "<p>No plottable metrics were logged.</p>"
    tables = _sample_tables(samples or [])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>rlhf run report: {html.escape(run.name)}</title>
<style>body{{font-family:sans-serif;max-width:780px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin-bottom:1.5em}}th,td{{border:1px solid #ccc;padding:4px 10px;text-align:left}}
figure{{margin:1.5em 0}}img{{max-width:100%}}figcaption{{font-weight:bold;margin-bottom:.3em}}
pre{{white-space:pre-wrap;margin:0;font-size:90%}}table.samples td{{vertical-align:top}}</style></head>
<body><h1>Run report: {html.escape(run.name)}</h1>
<table>{rows}</table>
{body}
{tables}
</body></html>
"""
