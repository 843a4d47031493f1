"""A step's time as the slope between calls that run different numbers of steps.

A call also costs something once: the host's dispatch and sync and, on a GPU, XLA's update of
the call's CUDA graphs for its buffers, which move between calls (they are donated). For the
1.38B step that was ~1.7 ms a call, 0.1 ms a step of a 16-step call (results/decode/decode_h200.md,
2026-11-30). The slope between two calls' medians, timed interleaved, drops it: what a step costs
inside a loop that runs on, as a decode does. Every benchmark times its steps through this module,
so their figures mean the same thing.
"""

from __future__ import annotations

from typing import Callable, Hashable

import numpy as np

Call = Callable[[], float]  # runs once, returns its wall seconds


def interleaved_slopes(calls: dict[Hashable, dict[int, Call]], reps: int,
                       warmup: int = 1) -> dict[Hashable, tuple[float, float]]:
    """``{variant: (ms a step, ms a step of the shorter call whole)}`` from ``{variant: {steps:
    call}}``, two calls a variant. Each call first runs ``warmup`` times untimed (its compile among
    them); then every call of every variant runs once a rep, so the variants share the machine's
    drift and their ratio is side by side. A variant whose longer call ran no slower than its
    shorter is an error: the timing noise exceeded the steps' own time."""
    for per in calls.values():
        for call in per.values():
            for _ in range(warmup):
                call()
    times = {v: {n: [] for n in per} for v, per in calls.items()}
    for _ in range(reps):
        for v, per in calls.items():
            for n, call in per.items():
                times[v][n].append(call())
    out = {}
    for v, per in times.items():
        if len(per) != 2:
            raise ValueError(f"{v!r}: a slope needs calls of two lengths, got {sorted(per)}")
        (n1, t1), (n2, t2) = sorted((n, float(np.median(ts))) for n, ts in per.items())
        if t2 <= t1:
            raise RuntimeError(f"{f'{v}: ' if v else ''}a call of {n2} steps ran no slower than one of {n1} "
                               f"({1e3 * t2:.3f} vs {1e3 * t1:.3f} ms): the timing noise exceeds the steps' "
                               "own time; raise --reps or --steps_per_call")
        out[v] = (1e3 * (t2 - t1) / (n2 - n1), 1e3 * t1 / n1)
    return out


def per_step_slope(calls: dict[int, Call], reps: int, warmup: int = 1) -> tuple[float, float]:
    """`interleaved_slopes` of one variant: ``(ms a step, ms a step of the shorter call whole)``."""
    return interleaved_slopes({"": calls}, reps, warmup)[""]
