"""`mtp.analysis`: the pooled summaries and the session-clustered paired bootstrap the ablation reports."""

import dataclasses

import numpy as np
import pytest

from mtp.analysis import MIN_BOOTSTRAP_SESSIONS, interval_caveat, paired_bootstrap, summarize
from mtp.serving import TurnStats
from mtp.metrics import AcceptanceStats


def _turn(output_len=11, decode_s=1.0, wave_turns=1, steps=4, accepted=4, ttft_s=0.01):
    at_least = np.array([min(accepted, steps), max(accepted - steps, 0)], np.int64)
    return TurnStats(session_id="s", generation=1, prompt_len=10, cached_tokens=0, path="cold", prefilled_tokens=10,
                     drafter_prefilled=0, drafter_adopted=0, drafter_appended=0, carry_outcome="disarmed",
                     carry_armed=False, carry_source=0, ttft_s=ttft_s, ttft_wait_s=0.0, start_calls=1,
                     decode_s=decode_s, wave_turns=wave_turns, output_len=output_len,
                     acceptance=AcceptanceStats(steps, 2 * steps, accepted, at_least))


def test_decode_rate_counts_a_shared_wave_once_and_not_the_prefill_token():
    # Two turns decoded together for 2 s: 10 + 30 decoded tokens (the first of each is the prefill's).
    s = summarize([_turn(output_len=11, decode_s=2.0, wave_turns=2), _turn(output_len=31, decode_s=2.0, wave_turns=2)])
    assert s["decode_tokens_per_s"] == pytest.approx(40 / 2.0)
    # Alone, each in its own wave of 1 s: 40 tokens over 2 s as well.
    assert summarize([_turn(11, 1.0), _turn(31, 1.0)])["decode_tokens_per_s"] == pytest.approx(20.0)
    # A turn that ended at its first token decoded nothing.
    assert summarize([_turn(1, 0.001), _turn(21, 1.0)])["decode_tokens_per_s"] == pytest.approx(20 / 1.001)


def test_acceptance_length_is_pooled_over_steps():
    s = summarize([_turn(steps=1, accepted=0), _turn(steps=9, accepted=9)])
    assert s["mean_acceptance_length"] == pytest.approx(1 + 9 / 10)  # per-turn mean would be 1.5
    assert s["verify_steps"] == 10


def _sessions(rng, n, turns_each):
    sid = np.repeat(np.arange(n), turns_each)
    effect = rng.normal(1.0, 1.0, n)[sid]  # one conversation, one shared effect
    return sid, effect + rng.normal(0, 0.1, sid.size)


def test_bootstrap_point_estimate_is_the_pooled_difference():
    a, a_den = [0, 9, 3], [1, 9, 2]
    b, b_den = [1, 4, 0], [1, 9, 0]  # the third turn has no verify step under b: left out of both sides
    r = paired_bootstrap(a, b, ["x", "y", "z"], 500, 0, a_den, b_den)
    assert r["mean_diff"] == pytest.approx(9 / 10 - 5 / 10)
    assert r["pairs"] == 2 and r["sessions"] == 3
    assert r["ci95"][0] <= r["mean_diff"] <= r["ci95"][1]
    plain = paired_bootstrap([3.0, 5.0, 10.0], [1.0, 1.0, 1.0], [0, 1, 2], 500, 0)
    assert plain["mean_diff"] == pytest.approx(5.0)


def test_bootstrap_resamples_sessions_not_turns():
    """Copying every turn of a session three times adds no information: a cluster bootstrap's
    interval stays put, where resampling turns would narrow it ~1.7x."""
    rng = np.random.default_rng(1)
    sid, d = _sessions(rng, 20, 1)
    once = paired_bootstrap(d, np.zeros_like(d), sid, 4000, 3)
    thrice = paired_bootstrap(np.repeat(d, 3), np.zeros(3 * d.size), np.repeat(sid, 3), 4000, 3)
    assert thrice["mean_diff"] == pytest.approx(once["mean_diff"])
    width = lambda r: r["ci95"][1] - r["ci95"][0]
    assert width(thrice) == pytest.approx(width(once), rel=1e-9)
    assert thrice["pairs"] == 60 and thrice["sessions"] == 20
    # And labelled as 60 sessions of one turn, the same numbers give the narrower, wrong interval.
    per_turn = paired_bootstrap(np.repeat(d, 3), np.zeros(3 * d.size), np.arange(60), 4000, 3)
    assert width(per_turn) < 0.7 * width(once)


def test_bootstrap_is_seeded_and_refuses_bad_input():
    rng = np.random.default_rng(2)
    sid, d = _sessions(rng, 8, 3)
    assert paired_bootstrap(d, d * 0, sid, 300, 5) == paired_bootstrap(d, d * 0, sid, 300, 5)
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap(d, d[:-1], sid, 10, 0)
    with pytest.raises(ValueError, match="not finite"):
        paired_bootstrap(np.full(3, np.nan), np.zeros(3), [0, 1, 2], 10, 0)
    with pytest.raises(ValueError, match="no turn"):
        paired_bootstrap([0, 0], [0, 0], [0, 1], 10, 0, [0, 0], [0, 0])


def test_turn_stats_serialise_with_the_wave_size():
    d = _turn(wave_turns=2).as_dict()
    assert d["wave_turns"] == 2 and d["acceptance"]["verify_steps"] == 4
    assert {f.name for f in dataclasses.fields(TurnStats)} <= set(d)


def test_an_interval_over_too_few_sessions_is_marked():
    """Over 2 sessions the bootstrap has 3 distinct resamples, and its interval looked tight."""
    rng = np.random.default_rng(4)
    for n in (2, MIN_BOOTSTRAP_SESSIONS - 1, MIN_BOOTSTRAP_SESSIONS, 25):
        sid, d = _sessions(rng, n, 3)
        r = paired_bootstrap(d, np.zeros_like(d), sid, 300, 0)
        few = n < MIN_BOOTSTRAP_SESSIONS
        assert r["sessions"] == n and r["too_few_sessions"] is few
        caveat = interval_caveat(r)
        assert (caveat == f"only {n} sessions (< {MIN_BOOTSTRAP_SESSIONS}): the interval means little") if few \
            else caveat == ""
