"""The session engine: every drafter policy is lossless, and the carry's ownership holds."""


import numpy as np
import pytest

from mtp.cache.pages import PagePoolExhausted
from mtp.data.sessions import Session, Turn
from mtp.engine import Engine, EngineConfig, TurnRequest, run_sessions, session_hash
from mtp.speculative import SpecConfig
from tests.conftest import random_params, tiny_config

MAX_NEW = 10
SPEC = SpecConfig(verify_width=3, max_new_tokens=MAX_NEW)


class IdPrompts:
    """Sessions whose user chunks are token ids (``Turn.user`` holds them space-separated).

    ``retokenize`` rewrites the last token of the previous full sequence, as a chat
    template re-tokenizing a turn boundary would.
    """

    def __init__(self, preamble, retokenize=False):
        self.preamble, self.retokenize = list(preamble), retokenize

    def prompt(self, session, i, prev, history):
        user = [int(x) for x in session.turns[i].user.split()]
        if prev is None:
            return self.preamble + user
        prev = list(prev)
        if self.retokenize:
            prev[-1] = (prev[-1] + 1) % 97 or 1
        return prev + user

    def reply_text(self, ids):
        return " ".join(map(str, ids))


def _sessions(n, turns, seed):
    rng = np.random.default_rng(seed)
    return [Session(f"s{k}", "synthetic", tuple(
        Turn(" ".join(map(str, rng.integers(1, 97, rng.integers(4, 20)))), int(rng.integers(4, MAX_NEW + 1)))
        for _ in range(turns))) for k in range(n)]


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("tiny_dense")
    return cfg, random_params(cfg, seed=3)


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(1)
    return IdPrompts(rng.integers(1, 97, 70).tolist()), _sessions(3, 3, seed=2)


def _engine(model, **kw):
    cfg, params = model
    base = dict(max_context=256, num_pages=160, drafter_pages=160, marconi_min_tokens=64)
    base.update(kw)
    return Engine(cfg, params, EngineConfig(**base), SPEC)


@pytest.fixture(scope="module")
def reference(model, workload):
    prompts, sessions = workload
    res = run_sessions(_engine(model, policy="cold", speculative=False), sessions, prompts)
    return {(r.request.session_id, r.request.prompt): r.output for r in res}


@pytest.mark.parametrize("policy, slots, carry_slots", [
    ("cold", 1, 1), ("blind", 1, 1), ("rebuild", 1, 1), ("carry", 1, 1), ("carry", 2, 4)])
def test_every_policy_is_token_identical_to_plain_greedy(model, workload, reference, policy, slots, carry_slots):
    prompts, sessions = workload
    res = run_sessions(_engine(model, policy=policy, batch_slots=slots, carry_slots=carry_slots), sessions, prompts)
    assert len(res) == 9
    for r in res:
        assert reference[(r.request.session_id, r.request.prompt)] == r.output
    paths = {r.stats.path for r in res}
    if policy == "cold":
        assert paths == {"cold"}
    elif policy == "rebuild":
        assert "restore" not in paths and "kv_only" in paths
    else:
        assert "restore" in paths
    warm = [r.stats for r in res if r.stats.path == "restore"]
    if policy == "blind":  # the defect: a restored warm turn starts the drafter empty
        assert all(s.drafter_prefilled == s.drafter_adopted == s.drafter_appended == 0 for s in warm)
    if policy == "carry":  # one session at a time: every warm turn adopts and appends only the tail
        adopted = [s for s in res[1:] if s.stats.carry_outcome == "adopted"]
        assert adopted and all(0 < s.stats.drafter_appended < s.stats.prompt_len - s.stats.cached_tokens + 40
                               for s in adopted)


def test_interleaved_sessions_never_adopt_foreign_rows(model):
    """Random interleavings: the multi-slot carry adopts only its own session's rows; the
    single slot thrashes between sessions and reports it as a foreign session."""
    rng = np.random.default_rng(7)
    preamble = rng.integers(1, 97, 40).tolist()
    sessions = _sessions(4, 3, seed=8)
    prompts = IdPrompts(preamble)
    for carry_slots in (1, 3):
        eng = _engine(model, policy="carry", carry_slots=carry_slots)
        full = {}
        order = [s for s in sessions for _ in s.turns]
        rng.shuffle(order)
        done = {s.session_id: 0 for s in sessions}
        outcomes = []
        for s in order:
            i = done[s.session_id]
            ids = prompts.prompt(s, i, full.get(s.session_id), [])
            (r,) = eng.run_wave([TurnRequest(s.session_id, tuple(ids), s.turns[i].max_new_tokens)])
            full[s.session_id] = list(ids) + r.output
            done[s.session_id] += 1
            outcomes.append(r.stats.carry_outcome)
            if r.stats.drafter_adopted:
                assert r.stats.carry_source == session_hash(s.session_id)
        if carry_slots == 1:
            assert "foreign_session" in outcomes
        assert "adopted" in outcomes


def test_retokenized_boundary_truncates_instead_of_refusing(model, workload):
    _, sessions = workload
    rng = np.random.default_rng(1)
    prompts = IdPrompts(rng.integers(1, 97, 70).tolist(), retokenize=True)
    res = run_sessions(_engine(model, policy="carry"), sessions[:1], prompts)
    warm = [r.stats for r in res[1:]]
    assert all(s.carry_outcome == "adopted" for s in warm)
    prev_full = [len(r.request.prompt) + len(r.output) for r in res[:-1]]
    for s, full_len in zip(warm, prev_full):
        assert 0 < s.drafter_adopted <= full_len - 3  # the rewritten boundary token's keys are dropped


@pytest.mark.parametrize("threshold", [0, 64, 128])
def test_marconi_threshold_decides_restore_or_kv_only(model, threshold):
    rng = np.random.default_rng(4)
    preamble = rng.integers(1, 97, 100).tolist()  # sessions share 96 tokens (6 full pages)
    sessions = _sessions(2, 1, seed=5)
    res = run_sessions(_engine(model, policy="blind", marconi_min_tokens=threshold), sessions, IdPrompts(preamble))
    second = res[1].stats
    assert second.cached_tokens == 96
    assert second.path == ("restore" if 96 >= threshold and threshold > 0 or threshold == 0 else "kv_only")
    if second.path == "restore":
        assert second.prefilled_tokens == second.prompt_len - 64  # from the 64-token snapshot
    else:
        assert second.prefilled_tokens == second.prompt_len


def test_small_pool_evicts_and_stays_lossless(model, workload, reference):
    prompts, sessions = workload
    eng = _engine(model, policy="carry", num_pages=40)  # room for ~2 sequences' pages, not the whole history
    res = run_sessions(eng, sessions, prompts)
    for r in res:
        assert reference[(r.request.session_id, r.request.prompt)] == r.output
    assert eng.pages.num_free + sum(eng.pages.refcount(p) > 0 for p in range(1, eng.pages.num_pages)) \
        == eng.pages.num_pages - 1


def test_exhausted_pool_and_oversized_prompt_are_clear_errors(model):
    eng = _engine(model, policy="cold", num_pages=4)
    with pytest.raises(PagePoolExhausted, match="target KV page pool exhausted"):
        eng.run_wave([TurnRequest("x", tuple(range(1, 60)), MAX_NEW)])
    eng = _engine(model, policy="cold")
    with pytest.raises(ValueError, match="exceeds the engine's max_context=256"):
        eng.run_wave([TurnRequest("x", tuple([5] * 250), MAX_NEW)])
    with pytest.raises(ValueError, match="unknown drafter policy 'greedy'"):
        EngineConfig(policy="greedy")


@pytest.mark.parametrize("turn_end", [True, False])
def test_turn_end_snapshot_prefills_only_the_new_tokens(model, workload, reference, turn_end):
    prompts, sessions = workload
    eng = _engine(model, policy="blind", turn_end_snapshots=turn_end, marconi_min_tokens=0)
    res = run_sessions(eng, sessions[:1], prompts)
    for prev, r in zip(res, res[1:]):
        assert reference[(r.request.session_id, r.request.prompt)] == r.output
        in_cache = len(prev.request.prompt) + len(prev.output) - 1  # all but the last token
        assert r.stats.path == "restore"
        if turn_end:
            assert r.stats.cached_tokens == in_cache
            assert r.stats.prefilled_tokens == r.stats.prompt_len - in_cache
        else:  # restored from the last 64-aligned prefill snapshot instead
            assert r.stats.prefilled_tokens > r.stats.prompt_len - in_cache
    assert len(eng.turn_ends) == (len(res) if turn_end else 0)


def test_budget_cut_mid_acceptance_keeps_cache_and_snapshots_exact(workload):
    """A perfect drafter accepts every draft, so turns end with accepted tokens beyond the
    budget: none of them may stay in the cache a turn-end snapshot or the prefix cache reads."""
    from tests.test_speculative import _oracle_head

    cfg = tiny_config("tiny_dense")
    params = _oracle_head(cfg, random_params(cfg, seed=9), agree=True)
    prompts, sessions = workload
    ref = run_sessions(_engine((cfg, params), policy="cold", speculative=False), sessions, prompts)
    for policy in ("blind", "carry"):
        res = run_sessions(_engine((cfg, params), policy=policy, marconi_min_tokens=0), sessions, prompts)
        assert [r.output for r in res] == [r.output for r in ref]
        assert all(r.stats.acceptance.draft_acceptance_rate == 1.0 for r in res if r.stats.acceptance.steps)
        assert any(r.stats.path == "restore" and r.stats.cached_tokens % 16 for r in res)  # turn-end restores
