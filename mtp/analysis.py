"""Summaries of per-turn statistics (split by cold/warm turns, paired bootstrap intervals), and
where two greedy runs part."""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from mtp.metrics import AcceptanceStats
from mtp.model import target


def summarize(turns: Sequence) -> dict:
    """Aggregate `engine.TurnStats` of one policy (one split)."""
    if not turns:
        return {"turns": 0}
    acc = sum((t.acceptance for t in turns), AcceptanceStats())
    out_tokens = sum(t.output_len for t in turns)
    return {
        "turns": len(turns),
        "ttft_ms_mean": 1e3 * float(np.mean([t.ttft_s for t in turns])),
        "ttft_ms_p50": 1e3 * float(np.median([t.ttft_s for t in turns])),
        "ttft_wait_ms_p50": 1e3 * float(np.median([t.ttft_wait_s for t in turns])),
        "start_calls_mean": float(np.mean([t.start_calls for t in turns])),
        "decode_tokens_per_s": out_tokens / max(sum(t.decode_s for t in turns), 1e-9),
        "verify_steps": acc.steps,
        "accepted_per_step": acc.accepted / acc.steps if acc.steps else float("nan"),
        "mean_acceptance_length": acc.mean_acceptance_length,
        "draft_acceptance_rate": acc.draft_acceptance_rate,
        "acceptance_per_position": acc.per_position,
        "drafter_rows_prefilled": sum(t.drafter_prefilled for t in turns),
        "drafter_rows_adopted": sum(t.drafter_adopted for t in turns),
        "drafter_rows_appended": sum(t.drafter_appended for t in turns),
        "target_tokens_prefilled": sum(t.prefilled_tokens for t in turns),
        "paths": {p: sum(t.path == p for t in turns) for p in sorted({t.path for t in turns})},
        "carry_outcomes": {o: sum(t.carry_outcome == o for t in turns) for o in sorted({t.carry_outcome for t in turns})},
    }


def paired_bootstrap(a: Sequence[float], b: Sequence[float], samples: int, seed: int,
                     stat: Callable[[np.ndarray], float] = np.mean) -> dict:
    """95% interval of ``stat(a - b)`` over pairs (turns) resampled with replacement.

    Pairs where either side is undefined (a turn that ended at its first token has
    no verify step, so no acceptance length) are left out, and ``pairs`` says how
    many remained.
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape:
        raise ValueError(f"paired bootstrap needs two equal-length samples; got {a.shape} and {b.shape}")
    d = (a - b)[np.isfinite(a) & np.isfinite(b)]
    if not d.size:
        raise ValueError("paired bootstrap: no pair has both values defined")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, (samples, d.size))
    boots = np.array([stat(d[i]) for i in idx])
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return {"mean_diff": float(stat(d)), "ci95": [float(lo), float(hi)], "pairs": int(d.size)}


def acceptance_length(t) -> float:
    return t.acceptance.mean_acceptance_length


def first_divergence(cfg, params, prompts, got, want):
    """Where two greedy runs first part, and how close the target's call was there.

    A bf16 GEMM of another shape (or another algorithm) rounds differently; a flip is
    expected only where the top two logits nearly tie. Returns None when the runs agree,
    else the sequence, the token index, both tokens, and the gap between the target's
    top two logits there (an uncached forward of prompt + the agreed tokens, in the
    model's dtype) beside the logits' spread.
    """
    for i, (x, y) in enumerate(zip(got, want)):
        t = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        if t == len(x) == len(y):
            continue
        seq = jnp.asarray([list(prompts[i]) + list(y[:t])], jnp.int32)
        logits = np.asarray(target.forward(cfg, params, seq)[0, -1], np.float32)
        top2 = np.sort(logits)[-2:]
        token = lambda z: int(z[t]) if t < len(z) else None  # None: that run had ended
        return dict(sequence=i, token=t, got=token(x), want=token(y),
                    top2_gap=float(top2[1] - top2[0]), logit_std=float(logits.std()))
    return None
