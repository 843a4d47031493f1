"""`experiments.timing`: a step's time is the slope between two calls, the calls' own cost cancelled."""

import itertools

import pytest

from experiments import timing


def _calls(ms_per_step, ms_per_call, lengths=(64, 16), jitter=(0.0, 2e-5, -1e-5)):
    noise = itertools.cycle(jitter)
    return {n: (lambda n=n: n * ms_per_step * 1e-3 + ms_per_call * 1e-3 + next(noise)) for n in lengths}


def test_a_step_is_the_slope_between_two_calls():
    """Calls of 16 and 64 steps at 1 ms a step plus 1.7 ms a call, with jitter: the slope drops the
    call's cost, the shorter call's per-step time keeps it."""
    ms, whole = timing.per_step_slope(_calls(1.0, 1.7), reps=9)
    assert abs(ms - 1.0) < 1e-3, ms
    assert abs(whole - (1.0 + 1.7 / 16)) < 2e-3, whole


def test_variants_are_timed_interleaved_and_each_gets_its_own_slope():
    order = []

    def logged(name, calls):
        return {n: (lambda n=n, c=c: (order.append(name), c())[1]) for n, c in calls.items()}

    calls = {"a": logged("a", _calls(1.0, 1.7)), "b": logged("b", _calls(0.25, 3.0))}
    slopes = timing.interleaved_slopes(calls, reps=5, warmup=0)
    assert abs(slopes["a"][0] - 1.0) < 1e-3 and abs(slopes["b"][0] - 0.25) < 1e-3, slopes
    assert order[:8] == ["a", "a", "b", "b"] * 2  # every rep runs each variant's two calls, then the next rep


def test_noise_as_large_as_the_steps_is_an_error_naming_the_variant():
    flat = {16: lambda: 0.02, 64: lambda: 0.02}
    with pytest.raises(RuntimeError, match="no slower"):
        timing.per_step_slope(flat, reps=3)
    with pytest.raises(RuntimeError, match="^moe_ref: a call of 64 steps"):
        timing.interleaved_slopes({"base": _calls(1.0, 1.7), "moe_ref": flat}, reps=3)
    with pytest.raises(ValueError, match="two lengths"):
        timing.per_step_slope({16: lambda: 0.02}, reps=3)
