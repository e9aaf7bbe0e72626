"""Plain-Python reference implementations of every formula, for the numerical tests.

Explicit loops over Python floats, no tensors and no vectorisation: each function is the
formula as written in the papers, so the vectorised library is checked against something
independent of it. Inputs are nested lists (`to_lists`), outputs likewise.
"""

from __future__ import annotations

import math
from typing import Any

import torch

Matrix = list[list[float]]

SHAPES = [(1, 1), (3, 4), (5, 7)]
SEEDS = [0, 1, 2]
LAYOUTS = ["right", "left", "holes", "empty"]
ATOL = 1e-6


def close(actual: Any, expected: Any) -> None:
    """Assert agreement to 1e-6 (float64) between a tensor/float and nested lists/float."""
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    actual_t = torch.as_tensor(actual, dtype=torch.float64).detach()
    assert actual_t.shape == expected_t.shape, (actual_t.shape, expected_t.shape)
    assert torch.allclose(actual_t, expected_t, atol=ATOL, rtol=1e-6), (actual_t, expected_t)


def case(shape: tuple[int, int], layout: str, seed: int) -> tuple[torch.Generator, torch.Tensor]:
    """A seeded generator and a mask for one parametrised case."""
    gen = torch.Generator().manual_seed(seed * 1000 + shape[0] * 10 + shape[1])
    return gen, make_mask(shape[0], shape[1], layout, gen)


def randn(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def to_lists(t: torch.Tensor) -> Any:
    return t.detach().to(torch.float64).tolist()


def make_mask(batch: int, length: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """(B, T) float64 mask. Layouts: right / left padding, holes in the middle, fully masked rows."""
    mask = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        n = int(torch.randint(1, length + 1, (1,), generator=gen))
        if layout == "right":
            mask[b, :n] = 1
        elif layout == "left":
            mask[b, length - n :] = 1
        elif layout == "holes":
            mask[b] = (torch.rand(length, generator=gen) < 0.6).double()
            mask[b, 0] = 1
        elif layout == "empty":
            if b % 2 == 0:
                continue  # fully masked row
            mask[b, :n] = 1
        else:
            raise ValueError(layout)
    return mask


def valid(mask: Matrix) -> list[tuple[int, int]]:
    return [(b, t) for b in range(len(mask)) for t in range(len(mask[b])) if mask[b][t] == 1.0]


# ----------------------------------------------------------------------------- masked statistics


def whiten(values: Matrix, mask: Matrix, unbiased: bool = True, eps: float = 1e-8) -> Matrix:
    xs = [values[b][t] for b, t in valid(mask)]
    n = len(xs)
    mean = sum(xs) / n if n else 0.0
    sq = sum((x - mean) ** 2 for x in xs)
    var = sq / max(n - 1, 1) if unbiased else sq / max(n, 1)
    out = [[0.0] * len(row) for row in values]
    for b, t in valid(mask):
        out[b][t] = (values[b][t] - mean) / math.sqrt(var + eps)
    return out


# ----------------------------------------------------------------------------- advantages


def gae_carry(
    rewards: Matrix, values: Matrix, mask: Matrix, gamma: float, lam: float
) -> tuple[Matrix, Matrix]:
    adv, ret = [], []
    for b in range(len(rewards)):
        length = len(rewards[b])
        a_row, r_row = [0.0] * length, [0.0] * length
        next_value, running = 0.0, 0.0
        for t in reversed(range(length)):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            candidate = delta + gamma * lam * running
            if mask[b][t] == 1.0:
                next_value = values[b][t]
                running = candidate
            a_row[t] = running
            r_row[t] = running + values[b][t] if mask[b][t] == 1.0 else 0.0
        adv.append(a_row)
        ret.append(r_row)
    return adv, ret


def gae_zero(
    rewards: Matrix, values: Matrix, mask: Matrix, gamma: float, lam: float
) -> tuple[Matrix, Matrix]:
    adv, ret = [], []
    for b in range(len(rewards)):
        length = len(rewards[b])
        v = [values[b][t] if mask[b][t] == 1.0 else 0.0 for t in range(length)]
        r = [rewards[b][t] if mask[b][t] == 1.0 else 0.0 for t in range(length)]
        a_row, r_row = [0.0] * length, [0.0] * length
        running = 0.0
        for t in reversed(range(length)):
            next_value = v[t + 1] if t + 1 < length else 0.0
            running = r[t] + gamma * next_value - v[t] + gamma * lam * running
            a_row[t] = running
            r_row[t] = running + v[t] if mask[b][t] == 1.0 else 0.0
        adv.append(a_row)
        ret.append(r_row)
    return adv, ret


def _groups(index: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    return groups


def _broadcast(per_seq: list[float], mask: Matrix) -> Matrix:
    return [[per_seq[b] if mask[b][t] == 1.0 else 0.0 for t in range(len(mask[b]))] for b in range(len(mask))]


def grpo(scores: list[float], index: list[int], mask: Matrix, epsilon: float, norm_by_std: bool) -> Matrix:
    groups = _groups(index)
    adv = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in groups[index[i]]]
        n = len(members)
        if n == 1:
            adv.append(0.0)
            continue
        mean = sum(members) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
        adv.append((s - mean) / (std + epsilon) if norm_by_std else s - mean)
    return _broadcast(adv, mask)


def rloo(scores: list[float], index: list[int], mask: Matrix) -> Matrix:
    groups = _groups(index)
    adv = []
    for i, s in enumerate(scores):
        others = [scores[j] for j in groups[index[i]] if j != i]
        adv.append(s - sum(others) / len(others) if others else s)
    return _broadcast(adv, mask)


def discounted_returns(rewards: Matrix, mask: Matrix, gamma: float) -> Matrix:
    out = []
    for b in range(len(rewards)):
        length = len(rewards[b])
        row = [0.0] * length
        running = 0.0
        for t in reversed(range(length)):
            running = rewards[b][t] + gamma * running if mask[b][t] == 1.0 else 0.0
            row[t] = running
        out.append(row)
    return out


def reinforce_pp_baseline(scores: list[float], index: list[int], mask: Matrix, unbiased: bool) -> Matrix:
    groups = _groups(index)
    centered = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in groups[index[i]]]
        centered.append(s - sum(members) / len(members) if len(members) > 1 else s)
    return whiten(_broadcast(centered, mask), mask, unbiased=unbiased)


def remax(rewards: Matrix, baselines: list[float], mask: Matrix) -> tuple[Matrix, Matrix]:
    adv, ret = [], []
    for b in range(len(rewards)):
        length = len(rewards[b])
        r_row = [0.0] * length
        a_row = [0.0] * length
        for t in range(length):
            if mask[b][t] == 1.0:
                r_row[t] = sum(rewards[b][s] for s in range(t, length) if mask[b][s] == 1.0)
                a_row[t] = r_row[t] - baselines[b]
        adv.append(a_row)
        ret.append(r_row)
    return adv, ret


def scores_to_token_rewards(scores: list[float], mask: Matrix) -> Matrix:
    out = []
    for b, row in enumerate(mask):
        r = [0.0] * len(row)
        last = max((t for t in range(len(row)) if row[t] == 1.0), default=None)
        if last is not None:
            r[last] = scores[b]
        out.append(r)
    return out


# ----------------------------------------------------------------------------- aggregation


def aggregate(
    loss: Matrix,
    mask: Matrix,
    mode: str,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_length: float | None = None,
) -> float:
    tokens = sum(sum(row) for row in mask)
    seqs = sum(1 for row in mask if sum(row) > 0)
    n_tok = max(global_tokens if global_tokens is not None else tokens, 1.0)
    n_seq = max(global_seqs if global_seqs is not None else seqs, 1.0)
    length = norm_length if norm_length is not None else (len(mask[0]) if mask else 1)
    row_sums = [sum(loss[b][t] for t in range(len(mask[b])) if mask[b][t] == 1.0) for b in range(len(mask))]
    row_counts = [sum(row) for row in mask]
    if mode == "token-mean":
        return sum(row_sums) / n_tok
    if mode == "token-sum":
        return sum(row_sums)
    if mode == "seq-mean-token-sum":
        return sum(row_sums) / n_seq
    if mode == "seq-mean-token-mean":
        return sum(s / c for s, c in zip(row_sums, row_counts) if c > 0) / n_seq
    if mode == "seq-mean-token-sum-norm":
        return sum(row_sums) / length / n_seq
    raise ValueError(mode)


def masked_mean(values: Matrix, mask: Matrix) -> float:
    xs = [values[b][t] for b, t in valid(mask)]
    return sum(xs) / len(xs) if xs else 0.0


# ----------------------------------------------------------------------------- losses


def _clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def ppo(
    lp: Matrix,
    old: Matrix,
    adv: Matrix,
    mask: Matrix,
    low: float,
    high: float,
    c: float | None,
    clamp: float,
    mode: str,
) -> tuple[float, dict[str, float]]:
    loss = [[0.0] * len(row) for row in mask]
    clipped_n = lower_n = 0
    for b in range(len(mask)):
        for t in range(len(mask[b])):
            log_ratio = lp[b][t] - old[b][t]
            ratio = math.exp(_clip(log_ratio, -clamp, clamp))
            a = adv[b][t]
            plain = -a * ratio
            clipped = -a * _clip(ratio, 1 - low, 1 + high)
            surrogate = max(plain, clipped)
            value = surrogate
            if c is not None and a < 0:
                value = min(surrogate, -a * c)
            loss[b][t] = value
            if mask[b][t] == 1.0:
                clipped_n += clipped > plain
                lower_n += c is not None and a < 0 and surrogate > -a * c
    n = len(valid(mask))
    kl = masked_mean([[old[b][t] - lp[b][t] for t in range(len(mask[b]))] for b in range(len(mask))], mask)
    total = aggregate(loss, mask, mode)
    return total, {
        "actor/pg_loss": total,
        "actor/pg_clipfrac": clipped_n / n if n else 0.0,
        "actor/pg_clipfrac_lower": lower_n / n if n else 0.0,
        "actor/ppo_kl": kl,
    }


def gspo(
    lp: Matrix, old: Matrix, adv: Matrix, mask: Matrix, low: float, high: float, clamp: float, mode: str
) -> tuple[float, float]:
    loss = [[0.0] * len(row) for row in mask]
    clipped_n = 0
    for b in range(len(mask)):
        idx = [t for t in range(len(mask[b])) if mask[b][t] == 1.0]
        seq_log_ratio = sum(lp[b][t] - old[b][t] for t in idx) / max(len(idx), 1)
        ratio = math.exp(_clip(seq_log_ratio, -clamp, clamp))
        for t in range(len(mask[b])):
            a = adv[b][t]
            plain = -a * ratio
            clipped = -a * _clip(ratio, 1 - low, 1 + high)
            loss[b][t] = max(plain, clipped)
            if mask[b][t] == 1.0:
                clipped_n += clipped > plain
    n = len(valid(mask))
    return aggregate(loss, mask, mode), clipped_n / n if n else 0.0


def value_loss(
    values: Matrix, old: Matrix, returns: Matrix, mask: Matrix, clip: float | None, mode: str
) -> tuple[float, float]:
    loss = [[0.0] * len(row) for row in mask]
    clipped_n = 0
    for b in range(len(mask)):
        for t in range(len(mask[b])):
            plain = (values[b][t] - returns[b][t]) ** 2
            if clip is None:
                loss[b][t] = plain
                continue
            v_clip = old[b][t] + _clip(values[b][t] - old[b][t], -clip, clip)
            clipped = (v_clip - returns[b][t]) ** 2
            loss[b][t] = max(plain, clipped)
            if mask[b][t] == 1.0:
                clipped_n += clipped > plain
    n = len(valid(mask))
    return 0.5 * aggregate(loss, mask, mode), clipped_n / n if n else 0.0


def kl(lp: float, ref: float, estimator: str, kl_clamp: float | None) -> float:
    x = lp - ref
    if estimator == "k1":
        value = x
    elif estimator == "k2":
        value = x * x / 2
    elif estimator == "k3":
        y = _clip(-x, -20.0, 20.0)
        value = math.exp(y) - y - 1
    elif estimator == "abs":
        value = abs(x)
    else:
        raise ValueError(estimator)
    return value if kl_clamp is None else _clip(value, -kl_clamp, kl_clamp)


def kl_matrix(lp: Matrix, ref: Matrix, mask: Matrix, estimator: str, kl_clamp: float | None) -> Matrix:
    return [
        [
            kl(lp[b][t], ref[b][t], estimator, kl_clamp) if mask[b][t] == 1.0 else 0.0
            for t in range(len(mask[b]))
        ]
        for b in range(len(mask))
    ]


def entropy(logits: list[float]) -> float:
    top = max(logits)
    lse = top + math.log(sum(math.exp(z - top) for z in logits))
    return -sum(math.exp(z - lse) * (z - lse) for z in logits)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def dpo(c: float, r: float, rc: float, rr: float, beta: float, smoothing: float) -> float:
    h = (c - r) - (rc - rr)
    return -(1 - smoothing) * log_sigmoid(beta * h) - smoothing * log_sigmoid(-beta * h)


def ipo(c: float, r: float, rc: float, rr: float, beta: float) -> float:
    h = (c - r) - (rc - rr)
    return (h - 1 / (2 * beta)) ** 2
