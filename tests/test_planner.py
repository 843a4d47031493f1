"""The host planning of a served turn (mtp/serving/planner.py), without a model or a device.

Each test drives `TurnPlanner` through the calls the engine makes (reserve, drafter fill,
prefill, finish, release), standing in for the device's results: which path a turn takes,
what its drafter adopts and appends, which pages it holds and what its end leaves behind.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtp.cache.pages import PagePoolExhausted
from mtp.cache.state import LinearState
from mtp.carry import CarriedDrafter, DrafterContext
from mtp.serving import SNAPSHOT_INTERVAL, EngineConfig, TurnRequest, session_hash
from mtp.serving.metadata import PageCopy
from mtp.serving.planner import TurnPlanner, carried_entry, carry_armed, drafter_appends
from mtp.speculative import SpecConfig

SPEC = SpecConfig(verify_width=3, max_new_tokens=10)
STATE = LinearState(conv=(), recurrent=())  # a GDN state stand-in: the planner only stores it


def _planner(**kw) -> TurnPlanner:
    base = dict(policy="carry", max_context=400, num_pages=160, drafter_pages=160, marconi_min_tokens=16,
                drafter_context=DrafterContext())
    base.update(kw)
    return TurnPlanner(EngineConfig(**base), SPEC, max_positions=512)


def _serve(planner: TurnPlanner, req: TurnRequest, output, drafter_end=None, slot: int = 0):
    """One turn as the engine runs it, the device's part stood in: the prefill leaves a snapshot
    at every aligned boundary inside the prompt, the turn outputs ``output``, and its drafter
    ends holding every key of the full sequence (``drafter_end``: its (rows, newest key))."""
    lv = planner.reserve(req, slot, {session_hash(req.session_id)})
    _, appends = planner.drafter_fill(lv)
    planner.prefill_started(lv)
    first = (lv.prefill_from // SNAPSHOT_INTERVAL + 1) * SNAPSHOT_INTERVAL
    for position in range(first, len(req.prompt), SNAPSHOT_INTERVAL):
        planner.put_snapshot(lv, position, STATE)
    planner.prefill_done(lv)
    full = list(req.prompt) + list(output)
    end = drafter_end or (len(full) - 1, len(full) - 2)
    try:
        planner.finish(lv, full, len(full) - 1, lambda: end, lambda: STATE)
    finally:
        planner.release(lv)
    return lv, appends, full


def _keys(appends):
    """The pair keys the appends write, in order, and the tokens they pair them with."""
    keys, tokens = [], []
    for a in appends:
        keys += range(a.first_key, a.first_key + a.count)
        tokens += a.tokens[: a.count].tolist()
    return keys, tokens


def test_a_warm_turn_restores_the_turn_end_copies_its_partial_page_and_appends_only_the_tail():
    p = _planner()
    prompt = tuple(range(1, 41))
    lv, appends, full = _serve(p, TurnRequest("a", prompt, 10), output=range(50, 55))
    assert (lv.stats.path, lv.stats.cached_tokens, lv.page_copy) == ("cold", 0, None)
    assert lv.stats.drafter_prefilled == 39 and _keys(appends) == (list(range(39)), list(prompt[1:]))
    (entry,) = p.carry.entries.values()
    assert (entry.rows, entry.last_pair_key, entry.tokens) == (44, 43, tuple(full))

    prompt2 = tuple(full) + (7, 8, 9)  # 48 tokens: two full pages cached, the turn end at 44
    lv = p.reserve(TurnRequest("a", prompt2, 10), 0, {session_hash("a")})
    assert (lv.stats.path, lv.cached, lv.stats.prefilled_tokens, lv.prefill_from) == ("restore", 44, 4, 44)
    assert lv.page_copy == PageCopy(src=p.turn_ends._entries[next(iter(p.turn_ends._entries))].tail_page,
                                    dst=lv.target_pages[2])
    assert lv.target_pages[:2] == list(p.prefix.match(lv.hashes, 2)) and lv.stats.start_calls == 1
    assert (lv.stats.carry_outcome, lv.stats.drafter_adopted, lv.stats.carry_source) == (
        "adopted", 44, session_hash("a"))
    pages, appends = p.drafter_fill(lv)
    assert pages[: len(entry.block_table)] == list(entry.block_table)  # the adopted rows head the table
    assert lv.stats.drafter_appended == 3 and _keys(appends) == ([44, 45, 46], [7, 8, 9])
    assert p.carry.entries[session_hash("a")] is entry  # still carried until the prefill has run
    p.prefill_done(lv)
    assert not p.carry.entries and lv.drafter_pages[: len(entry.block_table)] == list(entry.block_table)


@pytest.mark.parametrize("policy, threshold, path", [
    ("blind", 16, "restore"), ("blind", 0, "restore"), ("blind", 128, "kv_only"), ("rebuild", 16, "kv_only"),
    ("cold", 16, "cold")])
def test_the_path_follows_the_policy_and_the_marconi_threshold(policy, threshold, path):
    """Two sessions share a 100-token preamble (96 tokens in six full pages, a snapshot at 64)."""
    p = _planner(policy=policy, marconi_min_tokens=threshold)
    preamble = list(range(1, 101))
    _serve(p, TurnRequest("a", tuple(preamble + [3, 4, 5]), 10), output=[6, 7])
    lv = p.reserve(TurnRequest("b", tuple(preamble + [8, 9]), 10), 0, {session_hash("b")})
    assert lv.stats.path == path
    assert lv.stats.cached_tokens == (0 if policy == "cold" else 96)
    assert lv.stats.prefilled_tokens == 102 - (64 if path == "restore" else 0)
    _, appends = p.drafter_fill(lv)
    # The reference's guard: the whole-prompt drafter prefill needs every hidden, so a restore has none.
    assert bool(appends) == (path != "restore")


@pytest.mark.parametrize("carry_slots, outcome", [(1, "foreign_session"), (2, "no_carry")])
def test_another_sessions_turn_never_adopts_and_the_single_slot_refuses_the_entry(carry_slots, outcome):
    p = _planner(carry_slots=carry_slots)
    _serve(p, TurnRequest("a", tuple(range(1, 21)), 10), output=[5, 6])
    (entry,) = p.carry.entries.values()
    lv = p.reserve(TurnRequest("b", tuple(range(1, 21)) + (5, 6, 7), 10), 0, {session_hash("b")})
    assert lv.stats.carry_outcome == outcome and lv.adopted is None and lv.stats.drafter_adopted == 0
    if carry_slots == 1:  # a refusal frees the entry's blocks
        assert not p.carry.entries and p.dpages.num_free == p.dpages.num_pages - 1 - len(lv.drafter_pages)
    else:
        assert list(p.carry.entries.values()) == [entry]


def test_a_disarmed_carry_reserves_as_disarmed_and_deposits_nothing():
    p = _planner(batch_slots=2)  # the single slot is not armed for a multi-sequence dispatch
    lv, _, _ = _serve(p, TurnRequest("a", tuple(range(1, 21)), 10), output=[5, 6])
    assert not p.carry_armed and lv.stats.carry_armed is False and lv.stats.carry_outcome == "disarmed"
    assert not p.carry.entries and p.dpages.num_free == p.dpages.num_pages - 1


@pytest.mark.parametrize("kw, armed", [
    (dict(), True), (dict(batch_slots=2), False), (dict(batch_slots=2, carry_slots=2), True),
    (dict(speculative=False), False), (dict(policy="blind"), False), (dict(mtp_quant="fp8"), False),
    (dict(drafter_context=DrafterContext(prefill=True, carry=False)), False),
    (dict(carry_slots=2, drafter_context=DrafterContext(prefill=True, carry=False)), False)])
def test_carry_armed_is_what_runs_not_what_is_configured(kw, armed):
    assert carry_armed(EngineConfig(**{"policy": "carry", "drafter_context": DrafterContext(), **kw})) is armed


def test_a_dry_drafter_pool_evicts_other_sessions_least_recently_deposited_first():
    p = _planner(carry_slots=3, drafter_pages=7)  # 6 usable pages: 3 per short turn, two entries
    for s in "abc":
        _serve(p, TurnRequest(s, tuple(range(1, 21)), 10), output=[5])
    assert list(p.carry.entries) == [session_hash("b"), session_hash("c")]
    # A wave of c and d: d needs pages, and b's entry, of a session outside the wave, goes first.
    p.reserve(TurnRequest("d", tuple(range(1, 21)), 10), 0, {session_hash("c"), session_hash("d")})
    assert list(p.carry.entries) == [session_hash("c")]


def test_an_exhausted_drafter_pool_frees_nothing():
    p = _planner(carry_slots=2, drafter_pages=7)
    for s in "ab":
        _serve(p, TurnRequest(s, tuple(range(1, 21)), 10), output=[5])
    entries, free = dict(p.carry.entries), (p.pages.num_free, p.dpages.num_free)
    with pytest.raises(PagePoolExhausted, match="drafter KV page pool exhausted"):  # both sessions in the wave
        p.reserve(TurnRequest("c", tuple(range(1, 21)), 10), 0, {session_hash(s) for s in "abc"})
    assert p.carry.entries == entries and (p.pages.num_free, p.dpages.num_free) == free


def test_an_inconsistent_turn_end_registers_nothing_and_release_gives_every_page_back():
    p = _planner()
    lv = p.reserve(TurnRequest("a", tuple(range(1, 41)), 10), 0, {session_hash("a")})
    p.drafter_fill(lv)
    p.prefill_done(lv)
    full = list(range(1, 46))
    with pytest.raises(RuntimeError, match="the cache holds 43 positions for a sequence of 45 tokens"):
        p.finish(lv, full, 43, lambda: (44, 43), lambda: STATE)
    p.release(lv)
    assert len(p.prefix) == 0 and len(p.turn_ends) == 0 and not p.carry.entries
    assert p.pages.num_free == p.pages.num_pages - 1 and p.dpages.num_free == p.dpages.num_pages - 1


def test_a_failed_start_hands_back_only_the_kept_rows_and_an_abandoned_turn_its_taken_entry():
    p = _planner()
    _, _, full = _serve(p, TurnRequest("a", tuple(range(1, 41)), 10), output=range(50, 55))
    (entry,) = p.carry.entries.values()
    # Rewrites token 10 (keys 0..8 survive) and runs past the entry's pages.
    retok = TurnRequest("a", tuple(full[:10] + [99] + full[11:] + list(range(60, 80))), 10)
    held = p.dpages.num_pages - 1 - len(entry.block_table)  # free while only the entry holds pages

    lv = p.reserve(retok, 0, {session_hash("a")})
    assert lv.drafter_rows == (9, 8) and lv.stats.drafter_adopted == 9 and lv.drafter_pages
    p.drafter_fill(lv)
    p.prefill_started(lv)
    p.carry.hand_back(lv)  # the prefill raised: the entry, still carried, keeps the adopted rows only
    p.abandon(lv)
    kept = p.carry.entries[session_hash("a")]
    assert (kept.rows, kept.last_pair_key, kept.block_table, kept.tokens) == (9, 8, entry.block_table, entry.tokens)
    assert p.dpages.num_free == held

    lv = p.reserve(retok, 0, {session_hash("a")})
    assert lv.drafter_rows == (9, 8)
    p.drafter_fill(lv)
    p.prefill_done(lv)  # the turn took the entry's pages over
    assert not p.carry.entries and lv.drafter_pages[: len(entry.block_table)] == list(entry.block_table)
    p.abandon(lv)  # a later turn of its wave failed: the entry comes back, its pages with it
    assert p.carry.entries[session_hash("a")] == kept and p.dpages.num_free == held


def test_the_single_slot_deposit_replaces_the_previous_entry_and_multi_slot_is_lru_bounded():
    single = _planner()
    for s in "ab":
        _serve(single, TurnRequest(s, tuple(range(1, 21)), 10), output=[5])
    assert list(single.carry.entries) == [session_hash("b")]
    multi = _planner(carry_slots=2)
    for s in "abc":
        _serve(multi, TurnRequest(s, tuple(range(1, 21)), 10), output=[5])
    assert list(multi.carry.entries) == [session_hash("b"), session_hash("c")]
    held = sum(len(e.block_table) for e in multi.carry.entries.values())
    assert multi.dpages.num_free == multi.dpages.num_pages - 1 - held  # the evicted entry's pages came back


def test_carried_entry_cuts_keys_past_the_sequence_and_holds_nothing_without_rows():
    p = _planner()
    lv = p.reserve(TurnRequest("a", tuple(range(1, 9)), 10), 0, {session_hash("a")})
    full = list(range(1, 11))  # keys 0..8 are known; a budget cut left verified drafts up to key 11
    entry = carried_entry(lv, full, 12, 11)
    assert isinstance(entry, CarriedDrafter) and (entry.rows, entry.last_pair_key) == (9, 8)
    assert entry.block_table == tuple(lv.drafter_pages) and entry.session_hash == session_hash("a")
    assert carried_entry(lv, full, 0, -1) is None


@pytest.mark.parametrize("first_key, count", [(0, 1), (5, 63), (0, 64), (3, 65), (10, 600)])
def test_drafter_appends_write_each_key_once_with_its_next_token(first_key, count):
    prompt = np.random.default_rng(count).integers(1, 97, first_key + count + 1).tolist()
    keys, tokens = _keys(drafter_appends(prompt, first_key, count))
    assert keys == list(range(first_key, first_key + count))
    assert tokens == [prompt[k + 1] for k in keys]


@pytest.mark.parametrize("prompt_len, max_new, match", [
    (1, 4, "a prompt needs at least 2 tokens, got 1"),
    (395, 10, "exceeds the engine's max_context=400"),
    (20, 11, r"max_new_tokens=11 exceeds the compiled loop's buffer SpecConfig.max_new_tokens=10"),
    (390, 10, r"runs the model at 401 positions \(3-row decode steps\), more than the checkpoint's "
              r"max_position_embeddings=400")])
def test_a_request_the_engine_cannot_serve_is_refused(prompt_len, max_new, match):
    p = TurnPlanner(EngineConfig(max_context=400, drafter_context=DrafterContext()), SPEC, max_positions=400)
    with pytest.raises(ValueError, match=match):
        p.check(TurnRequest("x", tuple(range(1, prompt_len + 1)), max_new))
    p.check(TurnRequest("x", tuple(range(1, 21)), 10))
