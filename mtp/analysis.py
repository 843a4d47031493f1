"""Summaries of per-turn statistics (split by cold/warm turns, paired bootstrap intervals), and
where two greedy runs part."""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from mtp.metrics import AcceptanceStats
from mtp.model import target


def summarize(turns: Sequence) -> dict:
    """Aggregate `serving.TurnStats` of one policy (one split).

    Rates are pooled: the acceptance figures over all the turns' verify steps (DESIGN §2's
    definitions), decode tokens/s as the tokens the decode loops produced (a turn's first
    token comes from its prefill, inside TTFT) over the time they took, each turn charged its
    share of its wave's loop, so that a wave of two turns counts its time once.
    """
    if not turns:
        return {"turns": 0}
    acc = sum((t.acceptance for t in turns), AcceptanceStats())
    decoded = sum(max(t.output_len - 1, 0) for t in turns)
    decode_s = sum(t.decode_s / t.wave_turns for t in turns)
    return {
        "turns": len(turns),
        "ttft_ms_mean": 1e3 * float(np.mean([t.ttft_s for t in turns])),
        "ttft_ms_p50": 1e3 * float(np.median([t.ttft_s for t in turns])),
        "ttft_wait_ms_p50": 1e3 * float(np.median([t.ttft_wait_s for t in turns])),
        "start_calls_mean": float(np.mean([t.start_calls for t in turns])),
        "decode_tokens_per_s": decoded / decode_s if decode_s > 0 else float("nan"),
        "decode_ms_per_turn": 1e3 * decode_s / len(turns),
        "decode_ms_per_verify_step": 1e3 * decode_s / acc.steps if acc.steps else float("nan"),
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


MIN_BOOTSTRAP_SESSIONS = 10
"""The fewest sessions whose paired bootstrap interval is reported without a warning. The
bootstrap resamples whole sessions, so over ``n`` sessions it has only ``n`` values to draw from
(2 sessions give 3 distinct resamples): below about 10 its percentile interval is too narrow for
the spread new sessions would show, and one session more or less moves its ends, its sign
included. Results over fewer sessions say so beside each interval (`interval_caveat`)."""


def interval_caveat(result: dict) -> str:
    """What to write beside a `paired_bootstrap` interval: '' over enough sessions, else a warning
    naming how few there were."""
    if not result.get("too_few_sessions"):
        return ""
    return f"only {result['sessions']} sessions (< {MIN_BOOTSTRAP_SESSIONS}): the interval means little"


def paired_bootstrap(a: Sequence[float], b: Sequence[float], sessions: Sequence, samples: int, seed: int,
                     a_den: Sequence[float] | None = None, b_den: Sequence[float] | None = None) -> dict:
    """Difference between two policies' statistic over the same turns, with its 95% interval.

    Turn ``i`` is ``a[i]`` under one policy and ``b[i]`` under the other. Each side's
    statistic is the ratio ``sum(num) / sum(den)`` over the turns (``den`` 1 each when not
    given: the mean), so that a rate pooled over verify steps, the acceptance length as the
    tables report it, is compared as pooled and not as a mean of per-turn rates (which
    weighs a one-step turn like a hundred-step one). Both sides pool the same turns: one
    without a verify step on either side adds to neither sum. The turns of one session are
    one conversation with one carried drafter, not independent draws, so the interval resamples whole ``sessions`` with
    replacement, each with all its turns (a cluster bootstrap). ``too_few_sessions`` marks an
    interval over fewer than `MIN_BOOTSTRAP_SESSIONS` sessions.
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    a_den = np.ones_like(a) if a_den is None else np.asarray(a_den, float)
    b_den = np.ones_like(b) if b_den is None else np.asarray(b_den, float)
    if not (a.shape == b.shape == a_den.shape == b_den.shape == (len(sessions),)):
        raise ValueError(f"paired bootstrap needs equal-length samples, one session label per turn; got "
                         f"{a.shape}, {b.shape}, denominators {a_den.shape}, {b_den.shape}, {len(sessions)} labels")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("paired bootstrap: a value is not finite (give counts and denominators, not rates)")
    defined = (a_den > 0) & (b_den > 0)
    if not defined.any():
        raise ValueError("paired bootstrap: no turn has both statistics defined")
    labels, cluster = np.unique(np.asarray(sessions, dtype=object).astype(str), return_inverse=True)
    sums = np.stack([np.bincount(cluster, weights=np.where(defined, x, 0.0), minlength=len(labels))
                     for x in (a, a_den, b, b_den)])
    # How often each session is drawn when len(labels) are drawn with replacement, per resample.
    draws = np.random.default_rng(seed).multinomial(len(labels), np.full(len(labels), 1 / len(labels)), samples)
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = sums @ draws.T  # [4, samples]
        diffs = boot[0] / boot[1] - boot[2] / boot[3]
    diffs = diffs[np.isfinite(diffs)]  # a resample of sessions with no verify step at all
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    total = sums.sum(axis=1)
    return {"mean_diff": float(total[0] / total[1] - total[2] / total[3]), "ci95": [float(lo), float(hi)],
            "pairs": int(defined.sum()), "sessions": len(labels), "undefined_resamples": int(samples - diffs.size),
            "too_few_sessions": len(labels) < MIN_BOOTSTRAP_SESSIONS}


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
