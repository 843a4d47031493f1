"""The session engine: every drafter policy is lossless, and the carry's ownership holds."""

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.cache.pages import PagePoolExhausted
from mtp.cache.prefix import PrefixCache, TurnEndStore
from mtp.carry import DrafterContext
from mtp.execution import ExecutionConfig
from mtp.serving import Engine, EngineConfig, TurnRequest, run_sessions, session_hash, session_waves
from mtp.model import target
from mtp.model.layers import attention_kv
from mtp.mtp_head import DrafterCache, fc_input
from mtp.ops.norms import rms_norm
from mtp.speculative import SpecConfig
from mtp.turn_start import append_from_hiddens, drafter_rows
from tests.conftest import IdPrompts, agreeing_params, id_sessions, random_params, tiny_config

MAX_NEW = 10
SPEC = SpecConfig(verify_width=3, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("tiny_dense")
    return cfg, random_params(cfg, seed=3)


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(1)
    return IdPrompts(rng.integers(1, 97, 70).tolist()), id_sessions(3, 3, seed=2)


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
    sessions = id_sessions(4, 3, seed=8)
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
    prompts = IdPrompts(rng.integers(1, 97, 70).tolist(), retokenize=1)
    res = run_sessions(_engine(model, policy="carry"), sessions[:1], prompts)
    warm = [r.stats for r in res[1:]]
    assert all(s.carry_outcome == "adopted" for s in warm)
    prev_full = [len(r.request.prompt) + len(r.output) for r in res[:-1]]
    for s, full_len in zip(warm, prev_full):
        # The rewritten boundary token's keys are dropped: the rows kept hold distinct keys up to
        # full_len - 3, so at most full_len - 2 of them (exactly that: the rebuilt rows are dense).
        assert 0 < s.drafter_adopted <= full_len - 2


def _carried_keys(eng, entry):
    """The pair key each of ``entry``'s rows holds, and how far the row's K is from it: the nearest
    of the keys' K computed from the true target hiddens of ``entry.tokens`` (DESIGN §2: row r
    holds key k = (embed(t[k+1]), hidden[k]) at RoPE position k + 1)."""
    cfg, hp = eng.cfg, eng.device.head_params.params
    t = jnp.asarray(entry.tokens, jnp.int32)[None]
    h = target.forward_with_hiddens(cfg, hp, t).mtp_hidden(cfg.mtp_hidden_source)
    x = fc_input(cfg, hp, t[:, 1:], h[:, :-1], ExecutionConfig.everywhere("reference"))
    p = hp["mtp"]["layers"]["0"]
    k, _ = attention_kv(p["self_attn"], rms_norm(x, p["input_layernorm"]["weight"], cfg.rms_norm_eps),
                        jnp.arange(1, t.shape[1])[None], cfg)
    want = np.asarray(k[0]).reshape(t.shape[1] - 1, -1)
    ps, pages = eng.ecfg.page_size, np.asarray(eng.device.dcache.kv.k[0])
    got = np.stack([pages[entry.block_table[r // ps], r % ps].reshape(-1) for r in range(entry.rows)])
    dist = np.abs(got[:, None] - want[None]).max(-1)  # [rows, keys]
    return dist.argmin(1), dist.min(1)


@pytest.mark.parametrize("verify_width, refeed, retokenize, rebuild", [
    (5, False, 0, False), (5, True, 0, False), (3, False, 4, False), (5, True, 4, False), (5, False, 0, True),
    (3, False, 4, True)])
def test_every_carried_row_holds_the_key_its_entry_says(verify_width, refeed, retokenize, rebuild):
    """After every turn the carried rows hold distinct pair keys in increasing order, the newest
    being ``last_pair_key``, none past the entry's tokens (a budget cuts off verified drafts);
    with refeed, or with the output's rows rebuilt at the turn's end, every row is computed from
    the target's true hiddens; with neither, the accepted drafts after a step's first keep the
    rows the drafter's own hiddens wrote. Rebuilt, the keys are dense (a session whose first turn
    prefilled its drafter holds every key, as a whole-sequence prefill does). The next turn
    adopts every row, or, when its prompt rewrote a token inside the previous output, exactly
    the rows before it."""
    cfg = tiny_config("tiny_dense")
    params = agreeing_params(cfg, 3, 0.01)
    h = cfg.hidden_size  # the fc reads the hidden too, so a row's K tells which hidden wrote it
    params["mtp"]["fc"]["weight"] = jnp.concatenate(
        [jnp.eye(h), 0.1 * jax.random.normal(jax.random.key(5), (h, h))], axis=1)
    spec = SpecConfig(verify_width=verify_width, max_new_tokens=12, refeed_accepted=refeed)
    eng = Engine(cfg, params, EngineConfig(policy="carry", max_context=400, num_pages=200, drafter_pages=200,
                                           marconi_min_tokens=16, rebuild_output_rows=rebuild), spec)
    prompts = IdPrompts(np.random.default_rng(0).integers(1, 97, 40).tolist(), retokenize=retokenize)
    prev, dropped, off_target = None, 0, 0
    for (res,) in session_waves(eng, id_sessions(1, 6, seed=11, max_new=7), prompts):
        if prev is not None:
            assert res.stats.carry_outcome == "adopted"
            # Keys up to common - 2 survive; `retokenize` = 4 rewrote tokens[-4], so common = len - 4.
            max_key = len(prev.tokens) - retokenize - 2 if retokenize else prev.last_pair_key
            assert res.stats.drafter_adopted == prev.rows - (prev.last_pair_key - min(prev.last_pair_key, max_key))
            dropped += prev.rows - res.stats.drafter_adopted
        entry = eng.carried[session_hash(res.request.session_id)]
        keys, err = _carried_keys(eng, entry)
        if refeed or rebuild:
            assert err.max() < 1e-4, err
        if rebuild and not retokenize:
            np.testing.assert_array_equal(keys, np.arange(len(entry.tokens) - 1))
        off_target += int((err > 1e-4).sum())
        assert np.all(np.diff(keys) > 0) and keys[-1] == entry.last_pair_key <= len(entry.tokens) - 2
        prev = entry
    assert (dropped > 0) == bool(retokenize)
    assert (off_target > 0) == (not (refeed or rebuild))  # else some rows come from drafter hiddens


def _entry_rows(eng, entry):
    """The K and V of ``entry``'s rows, in row order, read from the engine's drafter pages."""
    ps = eng.ecfg.page_size
    pages = [np.asarray(eng.device.dcache.kv.k[0]), np.asarray(eng.device.dcache.kv.v[0])]
    return [np.stack([a[entry.block_table[r // ps], r % ps] for r in range(entry.rows)]) for a in pages]


def _prefilled_rows(eng, tokens):
    """The K and V of the rows a whole-sequence drafter prefill writes for ``tokens`` (keys
    0 .. len - 2, from the target's hiddens of the same sequence), read back the same way."""
    cfg, hp, ps = eng.cfg, eng.device.head_params.params, eng.ecfg.page_size
    n = len(tokens)
    blocks = math.ceil(n / ps)
    dcache = DrafterCache.create(cfg, 1, blocks + 1, ps, blocks, jnp.float32).replace(
        block_tables=jnp.arange(1, blocks + 1, dtype=jnp.int32)[None])
    t = jnp.asarray(tokens, jnp.int32)[None]
    h = target.forward_with_hiddens(cfg, hp, t).mtp_hidden(cfg.mtp_hidden_source)
    for rows in drafter_rows(t, [0], [n - 1]):
        dcache = append_from_hiddens(cfg, hp, dcache, rows, h, execution=ExecutionConfig.everywhere("reference"))
    pages = [np.asarray(dcache.kv.k[0]), np.asarray(dcache.kv.v[0])]
    return [np.stack([a[1 + r // ps, r % ps] for r in range(n - 1)]) for a in pages]


def test_rebuilt_output_rows_are_the_rows_a_full_rebuild_writes_without_refeed():
    """Refeed off, the output's rows rebuilt at each turn's end: after every turn the carried
    entry's K and V equal (f32) those of a whole-sequence drafter prefill over its tokens, row for
    row, and every warm turn accepts exactly what the rebuild policy's does, token-identical.
    Without the rebuild each verify step leaves a gap (the key of its first rejected draft).
    (On this tiny model acceptance hardly depends on the drafter's context, so the shipped
    model's sweep measures what the rows are worth.)"""
    cfg = tiny_config("tiny_dense")
    params = agreeing_params(cfg, 3, 0.01)
    h = cfg.hidden_size  # the fc reads the hidden too, so a row written from a drafter hidden shows
    params["mtp"]["fc"]["weight"] = jnp.concatenate(
        [jnp.eye(h), 0.1 * jax.random.normal(jax.random.key(5), (h, h))], axis=1)
    spec = SpecConfig(verify_width=4, max_new_tokens=12)
    sessions = id_sessions(1, 6, seed=11, max_new=12)
    prompts = IdPrompts(np.random.default_rng(0).integers(1, 97, 40).tolist())

    def serve(policy, rebuild=True):
        eng = Engine(cfg, params, EngineConfig(policy=policy, max_context=400, num_pages=200, drafter_pages=200,
                                               marconi_min_tokens=16, rebuild_output_rows=rebuild), spec)
        out = []
        for (res,) in session_waves(eng, sessions, prompts):
            out.append(res)
            if policy == "carry" and rebuild:
                entry = eng.carried[session_hash(res.request.session_id)]
                assert entry.rows == len(entry.tokens) - 1 == entry.last_pair_key + 1  # every key, densely
                for got, want in zip(_entry_rows(eng, entry), _prefilled_rows(eng, list(entry.tokens))):
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        return out

    carry = serve("carry")
    rebuild = serve("rebuild")
    assert [r.output for r in carry] == [r.output for r in rebuild]
    assert all(r.stats.carry_outcome == "adopted" and r.stats.drafter_prefilled == 0 for r in carry[1:])
    warm = [(r.stats.acceptance.steps, r.stats.acceptance.accepted) for r in carry[1:]]
    assert warm == [(r.stats.acceptance.steps, r.stats.acceptance.accepted) for r in rebuild[1:]]
    accepted = [r.stats.acceptance.accepted for r in carry[1:]]
    steps = [r.stats.acceptance.steps for r in carry[1:]]
    assert 0 < sum(accepted) < sum(steps) * (spec.verify_width - 1)  # drafts both accepted and rejected
    # The same check has teeth: without the rebuild the entry holds fewer rows (a gap per step)
    # and not a prefill's values.
    eng = Engine(cfg, params, EngineConfig(policy="carry", max_context=400, num_pages=200, drafter_pages=200,
                                           marconi_min_tokens=16, rebuild_output_rows=False), spec)
    served = [res for (res,) in session_waves(eng, sessions, prompts)]
    entry = eng.carried[session_hash(served[-1].request.session_id)]
    assert [r.output for r in served] == [r.output for r in carry] and entry.rows < len(entry.tokens) - 1


@pytest.mark.parametrize("threshold", [0, 64, 128])
def test_marconi_threshold_decides_restore_or_kv_only(model, threshold):
    rng = np.random.default_rng(4)
    preamble = rng.integers(1, 97, 100).tolist()  # sessions share 96 tokens (6 full pages)
    sessions = id_sessions(2, 1, seed=5)
    res = run_sessions(_engine(model, policy="blind", marconi_min_tokens=threshold), sessions, IdPrompts(preamble))
    second = res[1].stats
    assert second.cached_tokens == 96
    assert second.path == ("restore" if 96 >= threshold and threshold > 0 or threshold == 0 else "kv_only")
    if second.path == "restore":
        assert second.prefilled_tokens == second.prompt_len - 64  # from the 64-token snapshot
    else:
        assert second.prefilled_tokens == second.prompt_len


def _held_pages_are_owned(eng):
    """Every held page's refcount is exactly the number of owners that name it: the prefix
    cache and the turn-end store (target pool), the carried drafters (drafter pool). Run
    between waves, when no turn holds anything; a leaked reference is a page nobody owns."""
    target = collections.Counter(eng.planner.prefix._pages.values())
    target.update(e.tail_page for e in eng.planner.turn_ends._entries.values() if e.tail_page is not None)
    drafter = collections.Counter(p for e in eng.carried.values() for p in e.block_table)
    for pool, owned in ((eng.planner.pages, target), (eng.planner.dpages, drafter)):
        held = {p: pool.refcount(p) for p in range(1, pool.num_pages) if pool.refcount(p) > 0}
        assert held == dict(owned), f"{pool.num_free} free; held {held}; owned {dict(owned)}"
        assert pool.num_free == pool.num_pages - 1 - len(held)


def test_small_pool_evicts_and_stays_lossless(model, workload, reference, monkeypatch):
    prompts, sessions = workload
    evicted = {"prefix": 0, "turn_ends": 0}

    def counting(name, cls):
        orig = cls.evict

        def evict(self, pages_needed):
            freed = orig(self, pages_needed)
            evicted[name] += freed
            return freed

        monkeypatch.setattr(cls, "evict", evict)

    counting("prefix", PrefixCache)
    counting("turn_ends", TurnEndStore)
    # 13 usable pages, a few more than the longest sequence needs: both caches must give pages back
    eng = _engine(model, policy="carry", num_pages=14)
    carried = []

    def check(*_):
        _held_pages_are_owned(eng)
        carried.append(len(eng.carried))

    res = run_sessions(eng, sessions, prompts, on_turn=check)
    assert len(res) == 9
    for r in res:
        assert reference[(r.request.session_id, r.request.prompt)] == r.output
    assert evicted["prefix"] > 0 and evicted["turn_ends"] > 0, evicted  # pages freed by evictions
    _held_pages_are_owned(eng)
    assert len(eng.planner.prefix) > 0 and max(carried) > 0  # the checks above had owners to account for


def test_exhausted_pool_and_oversized_prompt_are_clear_errors(model):
    eng = _engine(model, policy="cold", num_pages=4)
    with pytest.raises(PagePoolExhausted, match="target KV page pool exhausted"):
        eng.run_wave([TurnRequest("x", tuple(range(1, 60)), MAX_NEW)])
    eng = _engine(model, policy="cold")
    with pytest.raises(ValueError, match="exceeds the engine's max_context=256"):
        eng.run_wave([TurnRequest("x", tuple([5] * 250), MAX_NEW)])
    with pytest.raises(ValueError, match="unknown drafter policy 'greedy'"):
        EngineConfig(policy="greedy")
    cfg, params = model
    short = Engine(cfg.replace(max_position_embeddings=64), params,
                   EngineConfig(policy="carry", max_context=256, num_pages=160, drafter_pages=160), SPEC)
    with pytest.raises(ValueError, match=r"session x: .* runs the model at 65 positions .* max_position_embeddings=64"):
        short.run_wave([TurnRequest("x", tuple(range(1, 55)), MAX_NEW)])  # 54 + 10 - 2 cached, 3 verified on top
    assert short.planner.pages.num_free == short.planner.pages.num_pages - 1
    (res,) = short.run_wave([TurnRequest("x", tuple(range(1, 54)), MAX_NEW)])
    assert len(res.output) == MAX_NEW


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
    assert len(eng.planner.turn_ends) == (len(res) if turn_end else 0)


def test_budget_cut_mid_acceptance_keeps_cache_and_snapshots_exact(workload):
    """A perfect drafter accepts every draft, so turns end with accepted tokens beyond the
    budget: none of them may stay in the cache a turn-end snapshot or the prefix cache reads."""
    cfg = tiny_config("tiny_dense")
    params = agreeing_params(cfg, 9, mixing=0.0)  # mixers off: the head predicts the target exactly
    prompts, sessions = workload
    ref = run_sessions(_engine((cfg, params), policy="cold", speculative=False), sessions, prompts)
    for policy in ("blind", "carry"):
        res = run_sessions(_engine((cfg, params), policy=policy, marconi_min_tokens=0), sessions, prompts)
        assert [r.output for r in res] == [r.output for r in ref]
        assert all(r.stats.acceptance.draft_acceptance_rate == 1.0 for r in res if r.stats.acceptance.steps)
        assert any(r.stats.path == "restore" and r.stats.cached_tokens % 16 for r in res)  # turn-end restores


def _pool_state(eng):
    """Free counts and every page's refcount, of both pools."""
    return [(p.num_free, [p.refcount(i) for i in range(p.num_pages)]) for p in (eng.planner.pages, eng.planner.dpages)]


def test_an_invalid_request_fails_its_wave_before_any_turn_takes_anything(model):
    eng = _engine(model, policy="carry", batch_slots=2, carry_slots=2)
    prompts = [tuple(range(1, 21)), tuple(range(2, 22))]
    res = eng.run_wave([TurnRequest(s, p, MAX_NEW) for s, p in zip("ab", prompts)])
    carried, state = dict(eng.carried), _pool_state(eng)
    valid = TurnRequest("a", prompts[0] + tuple(res[0].output) + (5, 6), MAX_NEW)
    with pytest.raises(ValueError, match="session b: .* exceeds the engine's max_context=256"):
        eng.run_wave([valid, TurnRequest("b", (5,) * 250, MAX_NEW)])
    assert eng.carried == carried and _pool_state(eng) == state
    (r,) = eng.run_wave([valid])
    assert r.stats.carry_outcome == "adopted"


def test_an_exhausted_drafter_pool_leaves_the_carry_and_every_refcount_intact(model):
    eng = _engine(model, policy="carry", drafter_pages=4)  # 3 pages: one short turn's (20 + 10 + 4 positions)
    prompt = tuple(range(1, 21))
    (r,) = eng.run_wave([TurnRequest("a", prompt, MAX_NEW)])
    carried, state = dict(eng.carried), _pool_state(eng)
    assert state[1][0] == 0  # the carried entry holds the whole drafter pool
    longer = prompt + tuple(r.output) + tuple(range(1, 41))  # 6 drafter pages
    with pytest.raises(PagePoolExhausted, match="drafter KV page pool exhausted"):
        eng.run_wave([TurnRequest("a", longer, MAX_NEW)])
    assert eng.carried == carried and _pool_state(eng) == state
    (r,) = eng.run_wave([TurnRequest("a", prompt + tuple(r.output) + (5,), MAX_NEW)])  # fits the entry's pages
    assert r.stats.carry_outcome == "adopted"


def test_a_wave_that_runs_dry_gives_back_the_turns_it_already_reserved(model):
    eng = _engine(model, policy="carry", batch_slots=2, carry_slots=2, drafter_pages=7)  # 2 short turns' pages
    prompts = [tuple(range(1, 21)), tuple(range(2, 22))]
    res = eng.run_wave([TurnRequest(s, p, MAX_NEW) for s, p in zip("ab", prompts)])
    carried, state = dict(eng.carried), _pool_state(eng)
    fits = TurnRequest("a", prompts[0] + tuple(res[0].output) + (5,), MAX_NEW)
    too_long = TurnRequest("b", prompts[1] + tuple(res[1].output) + tuple(range(1, 41)), MAX_NEW)
    with pytest.raises(PagePoolExhausted, match="drafter KV page pool exhausted"):
        eng.run_wave([fits, too_long])  # a's turn adopts its entry, then b's runs dry
    assert eng.carried == carried and _pool_state(eng) == state


def test_a_dry_drafter_pool_evicts_the_least_recently_deposited_carry_of_another_session(model):
    eng = _engine(model, policy="carry", carry_slots=3, drafter_pages=7)  # room for two carried entries
    for s, first in zip("abc", (1, 2, 3)):
        (r,) = eng.run_wave([TurnRequest(s, tuple(range(first, first + 20)), MAX_NEW)])
        assert r.stats.carry_outcome == "no_carry"
    assert list(eng.carried) == [session_hash("b"), session_hash("c")]


def test_a_failing_turn_end_still_releases_every_turn_of_the_wave(model, monkeypatch):
    from mtp import carry as carry_lib

    def drifted(**kw):
        raise ValueError("rows exceed last_pair_key+1")

    eng = _engine(model, policy="carry", batch_slots=2, carry_slots=2)
    monkeypatch.setattr(carry_lib, "CarriedDrafter", drifted)
    with pytest.raises(ValueError, match="rows exceed"):
        eng.run_wave([TurnRequest(s, tuple(range(k, k + 20)), MAX_NEW) for k, s in enumerate("ab", 1)])
    pools = (eng.planner.pages, eng.planner.dpages)
    assert all(pool.num_free == pool.num_pages - 1 for pool in pools)
    assert not eng.carried and len(eng.planner.prefix) == 0


@pytest.mark.parametrize("kw, armed", [
    (dict(), True),
    (dict(batch_slots=2), False),  # the single slot is configured, but not armed for a multi-sequence dispatch
    (dict(drafter_context=DrafterContext(prefill=True, carry=False)), False),
])
def test_a_disarmed_carry_reports_itself_apart_from_an_empty_slot(model, kw, armed):
    eng = _engine(model, policy="carry", **kw)
    (r,) = eng.run_wave([TurnRequest("a", tuple(range(1, 21)), MAX_NEW)])
    assert eng.carry_armed is armed and r.stats.carry_armed is armed
    assert r.stats.carry_outcome == ("no_carry" if armed else "disarmed")
    assert r.stats.as_dict()["carry_outcome"] == r.stats.carry_outcome


def test_a_turns_first_drafter_append_rides_on_its_last_prefill_call(workload, monkeypatch):
    """On a GPU a small model's warm TTFT is mostly dispatches, so a turn's first drafter append
    (the carry's tail, or a whole-prompt drafter prefill up to one chunk) runs inside its
    last target-prefill call: no standalone append is dispatched, and the drafter KV,
    the carried entries and the acceptance are those of the same appends run as calls of
    their own. `precompile` compiles every prefill and append program a turn runs, so a
    timed run compiles none of them."""
    import jax

    from mtp.mtp_head import APPEND_BUCKETS
    from mtp.serving import steps
    from mtp.serving.metadata import ChunkMeta

    cfg = tiny_config("tiny_dense").replace(tie_word_embeddings=False)
    params = agreeing_params(cfg, 3, 0.01)
    prompts, sessions = workload
    kw = dict(max_context=256, num_pages=160, drafter_pages=160, marconi_min_tokens=64)
    prefill, append = steps.prefill_slot, steps.append_slot

    def unfused(cfg, params, cache, hiddens, dcache, starts, chunk, *, width, temperature, execution):
        meta, drafter_append = ChunkMeta.unpack(chunk, tokens=width)
        cache, hiddens, _, starts = prefill(cfg, params, cache, hiddens, None, starts, meta.pack(),
                                            width=width, temperature=temperature, execution=execution)
        if dcache is not None:
            dcache = append(cfg, params, dcache, hiddens, int(meta.slot[0]), drafter_append, execution=execution)
        return cache, hiddens, dcache, starts

    monkeypatch.setattr(steps, "prefill_slot", unfused)
    separate = Engine(cfg, params, EngineConfig(policy="carry", **kw), SPEC)
    want = run_sessions(separate, sessions, prompts)
    monkeypatch.setattr(steps, "prefill_slot", prefill)

    jax.clear_caches()
    eng = Engine(cfg, params, EngineConfig(policy="carry", **kw), SPEC)
    eng.precompile()
    compiled = (prefill._cache_size(), append._cache_size(), steps.begin_turn._cache_size())
    assert compiled == (1 + len(APPEND_BUCKETS), len(APPEND_BUCKETS), 2)
    standalone = []
    monkeypatch.setattr(steps, "append_slot", lambda *a, **k: standalone.append(1) or append(*a, **k))
    got = run_sessions(eng, sessions, prompts)
    assert not standalone  # every append here fits one chunk
    assert (prefill._cache_size(), append._cache_size(), steps.begin_turn._cache_size()) == compiled
    assert sum(r.stats.drafter_appended > 0 for r in got) >= 4 and sum(r.stats.drafter_prefilled > 0 for r in got) >= 1
    for g, w in zip(got, want):
        assert g.output == w.output and g.stats.acceptance.counts() == w.stats.acceptance.counts()
    assert {k: (e.rows, e.last_pair_key, e.block_table) for k, e in eng.carried.items()} == \
        {k: (e.rows, e.last_pair_key, e.block_table) for k, e in separate.carried.items()}
    got_kv, want_kv = eng.device.dcache.kv, separate.device.dcache.kv
    np.testing.assert_allclose(np.asarray(got_kv.k[0]), np.asarray(want_kv.k[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_kv.v[0]), np.asarray(want_kv.v[0]), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(eng.device.dcache.kv.k[0])[1:]).sum() > 0  # rows were written, not two empty pools


def test_a_prefill_chunk_writes_every_output_into_its_donated_inputs(model, workload, reference):
    """A turn's prefill chunks (plain, and fused with a drafter append) leave every cache, the
    hidden store and the turns' first tokens and hiddens in the buffers they came in: on a
    GPU a chunk whose outputs moved took 1.06 against 0.70 ms to dispatch (session 21). The
    turns still equal their greedy references."""
    import jax

    eng = _engine(model, policy="carry")
    eng.precompile()

    def buffers():
        d = eng.device
        return [x.unsafe_buffer_pointer() for x in jax.tree.leaves((d.cache, d.hiddens, d.dcache, d.starts))]

    before = buffers()
    prompts, sessions = workload
    results = run_sessions(eng, sessions[:2], prompts)
    assert sum(r.stats.drafter_appended > 0 for r in results) >= 1  # the fused chunk ran
    assert buffers() == before
    assert int(eng.device.starts.token[0]) == results[-1].output[0]
    for r in results:
        assert r.output == reference[(r.request.session_id, r.request.prompt)]


def test_a_turns_start_reports_its_device_calls_and_its_wait(model, workload):
    """A turn's stats count the device calls its start made and split its TTFT into host work
    and the wait on the device after the last dispatch. Under ``cold`` every turn prefills
    from 0: one setup call, its chunks, a snapshot read at each chunk end inside the prompt,
    and the drafter prefill's appends but the first, which rides on the last chunk."""
    from mtp.mtp_head import append_chunks
    from mtp.serving import SNAPSHOT_INTERVAL

    prompts, sessions = workload
    results = run_sessions(_engine(model, policy="cold"), sessions, prompts)
    for r in results:
        chunks = math.ceil(r.stats.prompt_len / SNAPSHOT_INTERVAL)
        appends = len(append_chunks(r.stats.prompt_len - 1))
        assert r.stats.start_calls == 1 + chunks + (chunks - 1) + (appends - 1)
        assert 0 <= r.stats.ttft_wait_s <= r.stats.ttft_s
    assert len({r.stats.start_calls for r in results}) > 1


def test_a_sampled_first_token_depends_on_its_turn_alone(model, workload):
    """At temperature > 0 a turn's first token is drawn with a key of its own turn, so neither
    the chunks a prefill ran before it (precompile's included) nor the policy changes it:
    policies compared turn by turn draw the same random numbers for it."""
    prompts, sessions = workload
    spec = dataclasses.replace(SPEC, temperature=1.0)
    firsts = []
    for policy, precompile in (("carry", True), ("carry", False), ("blind", False)):
        cfg, params = model
        eng = Engine(cfg, params, EngineConfig(policy=policy, max_context=256, num_pages=160, drafter_pages=160,
                                               marconi_min_tokens=64), spec)
        if precompile:
            eng.precompile()
        firsts.append([r.output[0] for r in run_sessions(eng, sessions, prompts)])
    assert firsts[0] == firsts[1] == firsts[2]
    assert len(set(firsts[0])) > 1


def test_a_turn_that_fails_to_start_leaves_its_session_the_carry(model, monkeypatch):
    """The adopted entry leaves `Engine.carried` only once the turn's prefill has run."""
    from mtp.serving import steps

    prompts, sessions = IdPrompts(list(range(1, 71))), id_sessions(1, 2, seed=9)
    eng = _engine(model, policy="carry")
    run_sessions(eng, [dataclasses.replace(sessions[0], turns=sessions[0].turns[:1])], prompts)
    (entry,) = eng.carried.values()
    held = eng.planner.dpages.num_free
    first = run_sessions(_engine(model, policy="cold", speculative=False), sessions[:1], prompts)[0]
    req = TurnRequest("s0", tuple(first.request.prompt) + tuple(first.output) + (5, 6, 7), 4)
    real = steps.prefill_slot
    monkeypatch.setattr(steps, "prefill_slot", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device")))
    with pytest.raises(RuntimeError, match="device"):
        eng.run_wave([req])
    assert list(eng.carried.values()) == [entry] and eng.planner.dpages.num_free == held
    monkeypatch.setattr(steps, "prefill_slot", real)
    (res,) = eng.run_wave([req])
    assert res.stats.carry_outcome == "adopted" and res.stats.drafter_adopted == entry.rows


def _rows_k(eng, entry):
    ps, pages = eng.ecfg.page_size, np.asarray(eng.device.dcache.kv.k[0])
    return np.stack([pages[entry.block_table[r // ps], r % ps] for r in range(entry.rows)])


def test_a_truncated_adoption_that_fails_to_start_hands_back_only_the_kept_rows(model, monkeypatch):
    """A prompt that rewrote a token inside the previous output adopts fewer rows than the entry
    holds, and its tail append writes from there on, over the entry's later rows: a turn that then
    fails leaves the session the kept rows, untouched, and no more."""
    from mtp.serving import steps

    cfg, params = model  # the tail needs two appends, so the prompt runs past the tiny config's 512 positions
    eng = _engine((cfg.replace(max_position_embeddings=1024), params), policy="carry", max_context=800,
                  num_pages=400, drafter_pages=400, marconi_min_tokens=10**6)
    (first,) = eng.run_wave([TurnRequest("a", tuple(range(1, 41)), MAX_NEW)])
    (entry,) = eng.carried.values()
    before = _rows_k(eng, entry)
    full = list(first.request.prompt) + first.output
    # A tail of 700 tokens: the chunk's fused append, then a second one that fails.
    retok = full[:10] + [full[10] % 90 + 1] + full[11:] + np.random.default_rng(0).integers(1, 97, 700).tolist()
    monkeypatch.setattr(steps, "append_slot", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("append")))
    with pytest.raises(RuntimeError, match="append"):
        eng.run_wave([TurnRequest("a", tuple(retok), MAX_NEW)])
    (kept,) = eng.carried.values()
    assert kept.rows == 9 and kept.last_pair_key == 8  # keys 0..8 read tokens 0..9, before the rewritten one
    assert kept.block_table == entry.block_table and kept.tokens == entry.tokens
    np.testing.assert_array_equal(_rows_k(eng, kept), before[:9])
    _held_pages_are_owned(eng)
    monkeypatch.undo()
    (res,) = eng.run_wave([TurnRequest("a", tuple(full + [5, 6, 7]), 4)])
    assert res.stats.carry_outcome == "adopted" and res.stats.drafter_adopted == 9


def test_a_failed_wave_hands_back_the_carry_of_a_turn_that_had_started(model, workload, monkeypatch):
    prompts, sessions = workload
    eng = _engine(model, policy="carry", batch_slots=2, carry_slots=4)
    firsts = eng.run_wave([TurnRequest(s.session_id, tuple(prompts.prompt(s, 0, None, [])), 6) for s in sessions[:2]])
    entries = dict(eng.carried)
    warm = [TurnRequest(r.request.session_id, tuple(r.request.prompt) + tuple(r.output) + (5, 6, 7), 6)
            for r in firsts]
    real, calls = Engine._start_turn, []

    def second_fails(self, lv):
        calls.append(lv.slot)
        if len(calls) == 2:
            raise RuntimeError("second start")
        return real(self, lv)

    monkeypatch.setattr(Engine, "_start_turn", second_fails)
    with pytest.raises(RuntimeError, match="second start"):
        eng.run_wave(warm)
    assert eng.carried == entries  # the first turn had taken its entry over, and handed it back whole
    _held_pages_are_owned(eng)
    monkeypatch.undo()
    res = eng.run_wave(warm)
    assert [r.stats.drafter_adopted for r in res] == [entries[session_hash(r.request.session_id)].rows for r in res]


def test_a_turn_whose_end_fails_leaks_nothing(model, monkeypatch):
    eng = _engine(model, policy="carry")
    monkeypatch.setattr(TurnEndStore, "put", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("snapshot")))
    with pytest.raises(RuntimeError, match="snapshot"):
        eng.run_wave([TurnRequest("a", tuple(range(1, 21)), MAX_NEW)])
    assert not eng.carried
    _held_pages_are_owned(eng)


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_turn_that_leaves_no_drafter_row_deposits_nothing_and_replaces_the_slot(model, rebuild):
    """A fresh session that restores the shared preamble's snapshot gets no drafter prefill, so
    a turn of it that ends at its first token leaves no row of its own drafting: nothing is
    carried (its pages go back), and the single slot's previous entry, another session's, is
    replaced all the same (the deposit replaces it, as in the reference). With the output's rows
    rebuilt at the turn's end, that turn leaves the one key its output made known (its prompt's
    last position paired with its first token), and that entry replaces the previous one."""
    preamble = np.random.default_rng(3).integers(1, 97, 100).tolist()
    eng = _engine(model, policy="carry", rebuild_output_rows=rebuild)
    eng.run_wave([TurnRequest("a", tuple(preamble + [5, 6, 7]), MAX_NEW)])
    (entry,) = eng.carried.values()
    assert entry.rows > 0
    prompt = tuple(preamble + [8, 9])
    (short,) = eng.run_wave([TurnRequest("b", prompt, 1)])
    assert short.stats.path == "restore" and short.stats.drafter_prefilled == 0 and len(short.output) == 1
    if rebuild:
        (entry,) = eng.carried.values()
        assert entry.session_hash == session_hash("b") and entry.rows == 1 and entry.last_pair_key == len(prompt) - 1
        assert eng.planner.dpages.num_free == eng.planner.dpages.num_pages - 1 - len(entry.block_table)
    else:
        assert eng.carried == {}
        assert eng.planner.dpages.num_free == eng.planner.dpages.num_pages - 1
    _held_pages_are_owned(eng)
