"""Property and example tests for the drafter-KV carry bookkeeping (mtp/carry.py)."""

from __future__ import annotations

import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp import carry
from mtp.carry import (
    DEFAULT_MARCONI_MIN_TOKENS,
    AppendPlan,
    CarriedDrafter,
    CarryOutcome,
    DrafterContext,
    StoreRange,
    adopt,
    carry_armed_with,
    merge_interval,
    mtp_rows_to_trim,
    plan_append,
    stamped_merge,
)
from mtp.execution import ExecutionConfig

FAST = settings(max_examples=200, deadline=None)

# A small alphabet makes long common prefixes between entry and prompt likely.
tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=24)
sessions_st = st.integers(0, 3)


@st.composite
def entries(draw, session=sessions_st):
    """A consistent CarriedDrafter: rows hold distinct keys in 0..=last_pair_key."""
    toks = draw(tokens_st)
    last = draw(st.one_of(st.none(), st.integers(0, len(toks) + 4)))
    rows = 0 if last is None else draw(st.integers(0, last + 1))
    blocks = draw(st.lists(st.integers(0, 1000), max_size=4))
    return CarriedDrafter(
        block_table=blocks, rows=rows, last_pair_key=last, tokens=toks, session_hash=draw(session)
    )


@st.composite
def entry_and_prompt(draw):
    e = draw(entries())
    cut = draw(st.integers(0, len(e.tokens)))
    prompt = list(e.tokens[:cut]) + draw(tokens_st)
    return e, prompt


def brute_common(a, b):
    c = 0
    while c < min(len(a), len(b)) and a[c] == b[c]:
        c += 1
    return c


# ------------------------------------------------------------------ CarriedDrafter


@FAST
@given(entry_and_prompt())
def test_common_prefix_len_is_the_longest_agreeing_prefix(ep):
    e, prompt = ep
    c = e.common_prefix_len(prompt)
    assert list(e.tokens[:c]) == list(prompt[:c])
    assert c == min(len(e.tokens), len(prompt)) or e.tokens[c] != prompt[c]


def _usable_oracle(e, prompt):
    """Independent oracle: key k is reusable iff the prompt agrees on tokens[0..=k+1]; dropping
    keys off the top drops as many rows off the tail."""
    common = brute_common(e.tokens, prompt)
    usable_keys = [k for k in range(e.last_pair_key + 1) if k + 2 <= common]
    if not usable_keys:
        return None
    key = max(usable_keys)
    rows = e.rows - (e.last_pair_key - key)
    return (rows, key) if rows > 0 else None


@st.composite
def adoptable_entry_and_prompt(draw):
    """A stamped entry with rows, and a prompt that keeps at least one of them: the main path."""
    toks = draw(st.lists(st.integers(0, 3), min_size=2, max_size=24))
    last = draw(st.integers(0, len(toks) + 4))
    cut = draw(st.integers(2, len(toks)))
    prompt = list(toks[:cut]) + draw(tokens_st)
    dropped = last - min(last, brute_common(toks, prompt) - 2)
    rows = draw(st.integers(dropped + 1, last + 1))  # keeps rows - dropped >= 1
    e = CarriedDrafter(block_table=draw(st.lists(st.integers(0, 1000), max_size=4)), rows=rows,
                       last_pair_key=last, tokens=toks, session_hash=draw(st.integers(1, 3)))
    return e, prompt


def test_usable_by_truncates_to_the_common_prefix():
    reached = {"main": 0, "truncated": 0}

    @FAST
    @given(adoptable_entry_and_prompt())
    def prop(ep):
        e, prompt = ep
        got = e.usable_by(prompt, e.session_hash)
        assert got is not None and got == _usable_oracle(e, prompt)
        rows, key = got
        common = brute_common(e.tokens, prompt)
        assert key == min(e.last_pair_key, common - 2)
        assert rows == e.rows - (e.last_pair_key - key)
        assert 0 < rows <= e.rows and rows <= key + 1
        reached["main"] += 1
        reached["truncated"] += key < e.last_pair_key

    prop()
    # Most examples reach the adopting branch, and a fair share of them truncate.
    assert reached["main"] >= 150 and reached["truncated"] >= 30, reached


@FAST
@given(entry_and_prompt())
def test_usable_by_matches_the_oracle_on_any_entry(ep):
    """Every branch, refusals included, against the same oracle."""
    e, prompt = ep
    got = e.usable_by(prompt, e.session_hash)
    if e.session_hash == 0 or e.last_pair_key is None or e.rows == 0:
        assert got is None
    else:
        assert got == _usable_oracle(e, prompt)


@pytest.mark.parametrize("entry, prompt, session", [
    (dict(rows=3, last_pair_key=4, session_hash=0), [5, 6, 7, 8, 9, 10], 0),  # unstamped: session 0
    (dict(rows=3, last_pair_key=4, session_hash=2), [5, 6, 7, 8, 9, 10], 1),  # another session's
    (dict(rows=0, last_pair_key=None, session_hash=2), [5, 6, 7, 8, 9, 10], 2),  # no key yet
    (dict(rows=0, last_pair_key=4, session_hash=2), [5, 6, 7, 8, 9, 10], 2),  # a key but no rows
    (dict(rows=3, last_pair_key=4, session_hash=2), [5, 0, 7, 8], 2),  # common=1: no usable key
    (dict(rows=3, last_pair_key=4, session_hash=2), [], 2),  # empty prompt
    (dict(rows=2, last_pair_key=4, session_hash=2), [5, 6, 7, 0], 2),  # keeps key 1: drops 3 of 2 rows
])
def test_usable_by_refusal_branches(entry, prompt, session):
    e = CarriedDrafter(block_table=(1, 2), tokens=(5, 6, 7, 8, 9, 10), **entry)
    assert e.usable_by(prompt, session) is None


def test_usable_by_keeps_rows_when_just_enough_survive():
    e = CarriedDrafter(block_table=(1, 2), rows=4, last_pair_key=4, tokens=(5, 6, 7, 8, 9, 10), session_hash=2)
    assert e.usable_by([5, 6, 7, 0], 2) == (1, 1)  # common=3 keeps keys <= 1: 4 - (4 - 1) = 1 row


@FAST
@given(entry_and_prompt(), sessions_st)
def test_usable_by_refuses_other_sessions_and_zero(ep, session):
    e, prompt = ep
    if session != e.session_hash or session == 0:
        assert e.usable_by(prompt, session) is None
    assert e.usable_by(prompt, 0) is None
    assert not e.session_matches(0)


def test_session_zero_refuses_even_a_zero_stamped_entry():
    e = CarriedDrafter(block_table=[1], rows=3, last_pair_key=4, tokens=[5, 6, 7, 8, 9, 10], session_hash=0)
    assert not e.session_matches(0)
    assert e.usable_by([5, 6, 7, 8, 9, 10], 0) is None


def test_usable_by_full_match_keeps_everything():
    toks = [11, 12, 13, 14, 15, 16, 17]
    e = carry.CarriedDrafter(block_table=(3, 4), rows=5, last_pair_key=5, tokens=toks, session_hash=0xABC)
    assert e.usable_by(toks + [99, 98], 0xABC) == (5, 5)
    # Diverging at index 4 keeps keys <= 2: three keys dropped off the top.
    assert e.usable_by(toks[:4] + [0, 0, 0, 0], 0xABC) == (2, 2)
    assert e.usable_by([11, 0, 0], 0xABC) is None


def test_carried_drafter_validates_bookkeeping():
    with pytest.raises(ValueError, match="last_pair_key is None"):
        CarriedDrafter(block_table=[], rows=2, last_pair_key=None, tokens=[1, 2, 3], session_hash=1)
    with pytest.raises(ValueError, match="exceeds last_pair_key"):
        CarriedDrafter(block_table=[], rows=5, last_pair_key=3, tokens=[1, 2, 3], session_hash=1)
    with pytest.raises(ValueError, match="rows"):
        CarriedDrafter(block_table=[], rows=-1, last_pair_key=3, tokens=[1], session_hash=1)
    with pytest.raises(TypeError, match="tokens"):
        CarriedDrafter(block_table=[], rows=0, last_pair_key=None, tokens=["a"], session_hash=1)
    e = CarriedDrafter(block_table=np.array([7, 9]), rows=1, last_pair_key=2, tokens=np.arange(4), session_hash=5)
    assert e.block_table == (7, 9) and e.tokens == (0, 1, 2, 3)
    assert all(type(t) is int for t in e.tokens)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.rows = 2  # type: ignore[misc]


# ------------------------------------------------------------------ plan_append


@FAST
@given(
    st.one_of(st.none(), st.integers(0, 40)),
    st.integers(0, 40),
    st.integers(0, 45),
    st.integers(0, 45),
)
def test_plan_append_matches_a_brute_force_oracle(last, prompt_len, a, b):
    lo, hi = min(a, b), max(a, b)
    plan = plan_append(last, prompt_len, lo, hi)
    start = 0 if last is None else last + 1
    last_needed = prompt_len - 2
    # Oracle: the smallest missing key from which every key up to last_needed is in the store.
    feasible = [k for k in range(start, last_needed + 1) if all(lo <= j < hi for j in range(k, last_needed + 1))]
    if not feasible:
        assert plan is None
        return
    assert plan == AppendPlan(first_key=min(feasible), rows=last_needed - min(feasible) + 1)
    # Never reads outside the visible interval, never rewrites a resident key.
    assert lo <= plan.first_key and plan.last_key < hi
    assert plan.first_key >= start and plan.last_key == last_needed


@FAST
@given(st.integers(0, 64))
def test_cold_prefill_is_a_plan_from_none(length):
    plan = plan_append(None, length, 0, length)
    if length < 2:
        assert plan is None
    else:
        assert plan == AppendPlan(first_key=0, rows=length - 1)


def test_plan_append_examples_and_errors():
    assert plan_append(9, 20, 0, 20) == AppendPlan(first_key=10, rows=9)
    assert plan_append(9, 20, 14, 19) == AppendPlan(first_key=14, rows=5)  # skips keys 10..13
    assert plan_append(9, 20, 0, 18) is None  # store stops short of key 18
    assert plan_append(18, 20, 0, 20) is None  # nothing missing
    with pytest.raises(ValueError, match="reversed"):
        plan_append(1, 10, 5, 4)
    with pytest.raises(ValueError, match="prompt_len"):
        plan_append(1, -3, 0, 4)
    with pytest.raises(ValueError, match="zero|at least one"):
        AppendPlan(first_key=3, rows=0)


# ------------------------------------------------------------------ StoreRange & merges


@FAST
@given(st.integers(0, 4), st.integers(0, 30), st.integers(0, 30), st.integers(0, 4))
def test_visible_to_only_for_the_nonzero_owner(owner, a, b, reader):
    r = StoreRange(owner=owner, lo=min(a, b), hi=max(a, b))
    got = r.visible_to(reader)
    if reader != 0 and reader == owner:
        assert got == (r.lo, r.hi)
    else:
        assert got == (0, 0)
    assert r.visible_to(0) == (0, 0)
    assert StoreRange.EMPTY.visible_to(reader) == (0, 0)


def test_store_range_validates():
    with pytest.raises(ValueError, match="reversed"):
        StoreRange(owner=1, lo=5, hi=2)
    assert StoreRange.EMPTY == StoreRange(owner=0, lo=0, hi=0)


intervals = st.tuples(st.integers(0, 30), st.integers(0, 30)).map(lambda t: (min(t), max(t)))


@FAST
@given(intervals, st.integers(0, 30), st.integers(0, 10))
def test_merge_interval_laws(cur, start, count):
    lo, hi = cur
    new = merge_interval(cur, start, count)
    cur_set, write_set, got_set = set(range(lo, hi)), set(range(start, start + count)), set(range(*new))
    # Always a contiguous interval holding the write, and never claiming an unwritten gap.
    assert new[0] <= new[1]
    assert write_set <= got_set
    assert got_set <= cur_set | write_set
    joins = hi > lo and start <= hi and start + count >= lo
    if joins:
        assert new == (min(lo, start), max(hi, start + count))
        assert cur_set <= got_set
    else:
        assert new == (start, start + count)


def test_merge_interval_replaces_on_a_gap():
    assert merge_interval((10, 20), 20, 5) == (10, 25)  # abutting extends
    assert merge_interval((10, 20), 5, 5) == (5, 20)
    assert merge_interval((10, 20), 21, 5) == (21, 26)  # one-position gap replaces
    assert merge_interval((0, 0), 3, 4) == (3, 7)  # empty current replaced


@FAST
@given(st.integers(0, 3), intervals, st.integers(0, 3), st.integers(0, 30), st.integers(0, 10))
def test_stamped_merge_laws(owner, cur, writer, start, count):
    r = StoreRange(owner=owner, lo=cur[0], hi=cur[1])
    got = stamped_merge(r, writer, start, count)
    assert got.owner == writer
    if owner != 0 and owner == writer:
        assert (got.lo, got.hi) == merge_interval(cur, start, count)
    else:
        assert got == StoreRange(owner=writer, lo=start, hi=start + count)


@FAST
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(0, 8)), max_size=25))
def test_stamped_merge_never_shows_a_reader_rows_it_did_not_write(writes):
    """Simulate the shared store: whatever a generation may read, it wrote last."""
    last_writer: dict[int, int] = {}
    r = StoreRange.EMPTY
    for gen, start, count in writes:
        for p in range(start, start + count):
            last_writer[p] = gen
        r = stamped_merge(r, gen, start, count)
        for reader in range(4):
            lo, hi = r.visible_to(reader)
            assert all(last_writer.get(p) == reader for p in range(lo, hi))


# ------------------------------------------------------------------ CarryOutcome


def all_outcomes():
    return [
        CarryOutcome.Adopted(rows=12, appended=3, first_key=40),
        CarryOutcome.NoCarry(),
        CarryOutcome.PrefixMismatch(common=1, entry_rows=12),
        CarryOutcome.ForeignHiddens(owner=77, expected=78),
        CarryOutcome.ForeignSession(entry_session=0x1F, prompt_session=0x2E),
        CarryOutcome.ForeignSession(entry_session=0x1F, prompt_session=0),
        CarryOutcome.NoHiddens(),
        CarryOutcome.Disarmed(),
    ]


def test_outcome_strings_and_kinds_are_distinct():
    outs = all_outcomes()
    texts = [str(o) for o in outs]
    assert len(set(texts)) == len(texts)
    variants = [o for o in outs if not (isinstance(o, CarryOutcome.ForeignSession) and o.prompt_session == 0)]
    assert len({o.kind for o in variants}) == len(variants) == 7
    for o in outs:
        assert isinstance(o, CarryOutcome)
        assert repr(o).startswith(f"CarryOutcome.{type(o).__name__}(")
        assert pickle.loads(pickle.dumps(o)) == o


def test_foreign_session_never_reads_like_a_prefix_mismatch():
    fs = [o for o in all_outcomes() if isinstance(o, CarryOutcome.ForeignSession)]
    pm = CarryOutcome.PrefixMismatch(common=1, entry_rows=12)
    for o in fs:
        assert "prefix" not in str(o).lower() and "mismatch" not in str(o).lower()
        assert "session" in str(o)
    assert "session" not in str(pm) and "prefix mismatch" in str(pm)
    assert "0x1f" in str(fs[0]) and "0x2e" in str(fs[0])


def test_foreign_hiddens_names_the_owner():
    o = CarryOutcome.ForeignHiddens(owner=4242, expected=17)
    assert "4242" in str(o) and "17" in str(o)


def test_outcomes_are_frozen_keyword_only_and_validated():
    with pytest.raises(TypeError):
        CarryOutcome.Adopted(1, 2, 3)  # type: ignore[misc]
    with pytest.raises(TypeError, match="abstract"):
        CarryOutcome()
    with pytest.raises(ValueError, match="Adopted.rows"):
        CarryOutcome.Adopted(rows=-1, appended=0, first_key=0)
    o = CarryOutcome.NoHiddens()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.x = 1  # type: ignore[attr-defined]


# ------------------------------------------------------------------ adopt


def _entry(rows=6, last=9, tokens=tuple(range(100, 112)), session=0x5E55):
    return CarriedDrafter(block_table=(2, 3), rows=rows, last_pair_key=last, tokens=tokens, session_hash=session)


TOKS = tuple(range(100, 112))  # carried sequence: 12 tokens, keys up to 10 possible
PROMPT = list(TOKS) + [200, 201, 202]  # 15 tokens: needs keys ..= 13


def test_adopt_no_entry():
    assert adopt(None, PROMPT, 0x5E55, StoreRange(owner=1, lo=0, hi=15), 1) == (None, None, CarryOutcome.NoCarry())


def test_adopt_foreign_session_and_missing_session():
    e = _entry()
    got = adopt(e, PROMPT, 0x1234, StoreRange(owner=1, lo=0, hi=15), 1)
    assert got == (None, None, CarryOutcome.ForeignSession(entry_session=0x5E55, prompt_session=0x1234))
    got = adopt(e, PROMPT, 0, StoreRange(owner=1, lo=0, hi=15), 1)
    assert got[2] == CarryOutcome.ForeignSession(entry_session=0x5E55, prompt_session=0)


def test_adopt_prefix_mismatch():
    e = _entry()
    got = adopt(e, [100, 7, 7, 7], 0x5E55, StoreRange(owner=1, lo=0, hi=4), 1)
    assert got == (None, None, CarryOutcome.PrefixMismatch(common=1, entry_rows=6))


def test_adopt_empty_entry_is_no_carry():
    e = CarriedDrafter(block_table=(), rows=0, last_pair_key=None, tokens=TOKS, session_hash=0x5E55)
    assert adopt(e, PROMPT, 0x5E55, StoreRange(owner=1, lo=0, hi=15), 1)[2] == CarryOutcome.NoCarry()


def test_adopt_appends_the_tail():
    adopted, plan, out = adopt(_entry(), PROMPT, 0x5E55, StoreRange(owner=3, lo=8, hi=15), 3)
    assert adopted == (6, 9)
    assert plan == AppendPlan(first_key=10, rows=4)
    assert out == CarryOutcome.Adopted(rows=6, appended=4, first_key=10)


def test_adopt_truncated_then_appended():
    prompt = list(TOKS[:7]) + [300, 301, 302, 303]  # common 7 -> keys <= 5 survive
    adopted, plan, out = adopt(_entry(), prompt, 0x5E55, StoreRange(owner=3, lo=0, hi=11), 3)
    assert adopted == (2, 5)
    assert plan == AppendPlan(first_key=6, rows=4)
    assert out == CarryOutcome.Adopted(rows=2, appended=4, first_key=6)


def test_adopt_nothing_to_append_is_adopted_even_with_foreign_hiddens():
    prompt = list(TOKS)  # 12 tokens need keys ..= 10, which the entry already holds
    adopted, plan, out = adopt(_entry(last=10, rows=7), prompt, 0x5E55, StoreRange(owner=9, lo=0, hi=12), 3)
    assert adopted == (7, 10) and plan is None
    assert out == CarryOutcome.Adopted(rows=7, appended=0, first_key=11)


def test_adopt_foreign_hiddens_keeps_rows():
    adopted, plan, out = adopt(_entry(), PROMPT, 0x5E55, StoreRange(owner=9, lo=0, hi=15), 3)
    assert adopted == (6, 9) and plan is None
    assert out == CarryOutcome.ForeignHiddens(owner=9, expected=3)


def test_adopt_no_hiddens_keeps_rows():
    for rng, reader in [
        (StoreRange(owner=3, lo=0, hi=13), 3),  # stops one short of key 13
        (StoreRange(owner=3, lo=14, hi=20), 3),  # starts past the last needed key
        (StoreRange.EMPTY, 3),
        (StoreRange(owner=0, lo=0, hi=15), 0),
    ]:
        adopted, plan, out = adopt(_entry(), PROMPT, 0x5E55, rng, reader)
        assert adopted == (6, 9) and plan is None
        assert out == CarryOutcome.NoHiddens(), rng


@FAST
@given(entry_and_prompt(), sessions_st, st.integers(0, 3), intervals, st.integers(0, 3))
def test_adopt_is_consistent_with_its_parts(ep, session, owner, interval, reader):
    e, prompt = ep
    rng = StoreRange(owner=owner, lo=interval[0], hi=interval[1])
    adopted, plan, out = adopt(e, prompt, session, rng, reader)
    assert adopted == e.usable_by(prompt, session)
    if adopted is None:
        assert plan is None
        assert out.kind in {"no_carry", "prefix_mismatch", "foreign_session"}
        assert (out.kind == "foreign_session") == (not e.session_matches(session))
        return
    rows, key = adopted
    assert rows <= e.rows and key <= e.last_pair_key
    lo, hi = rng.visible_to(reader)
    if plan is not None:
        assert out == CarryOutcome.Adopted(rows=rows, appended=plan.rows, first_key=plan.first_key)
        assert lo <= plan.first_key and plan.last_key < hi and plan.first_key > key
        assert plan.last_key == len(prompt) - 2
    elif out.kind == "adopted":
        assert out.appended == 0 and key >= len(prompt) - 2
    else:
        assert out.kind in {"foreign_hiddens", "no_hiddens"}
        assert (out.kind == "foreign_hiddens") == (owner not in (0, reader))


# ------------------------------------------------------------------ policy switches


def test_drafter_context_defaults_and_coupling():
    assert DrafterContext() == DrafterContext(prefill=True, carry=True)
    assert DrafterContext.off() == DrafterContext(prefill=False, carry=False)
    assert DrafterContext(prefill=True, carry=False).prefill
    with pytest.raises(ValueError, match="carry"):
        DrafterContext(prefill=False, carry=True)
    with pytest.raises(TypeError, match="bool"):
        DrafterContext(prefill="0", carry=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("ctx_off", [None, "1", "0", "true", "", " 1", "yes"])
@pytest.mark.parametrize("carry_off", [None, "1", "0", "true", "TRUE"])
def test_drafter_context_from_env_counts_only_exact_one(ctx_off, carry_off):
    env = {}
    if ctx_off is not None:
        env["MTP_DRAFTER_CONTEXT_OFF"] = ctx_off
    if carry_off is not None:
        env["MTP_DRAFTER_CARRY_OFF"] = carry_off
    got = DrafterContext.of(ExecutionConfig.from_environ(env))
    if ctx_off == "1":
        assert got == DrafterContext.off()
    elif carry_off == "1":
        assert got == DrafterContext(prefill=True, carry=False)
    else:
        assert got == DrafterContext()


def test_drafter_context_follows_the_engine_config():
    """`EngineConfig`'s policy defaults from its execution config's kill switches; an explicit one is kept."""
    from mtp.serving import EngineConfig

    assert EngineConfig().drafter_context == DrafterContext()
    carry_off = ExecutionConfig(drafter_carry_off=True)
    assert EngineConfig(execution=carry_off).drafter_context == DrafterContext(prefill=True, carry=False)
    assert EngineConfig(execution=ExecutionConfig(drafter_context_off=True)).drafter_context == DrafterContext.off()
    assert EngineConfig(execution=carry_off, drafter_context=DrafterContext()).drafter_context == DrafterContext()


@pytest.mark.parametrize("cfg", [DrafterContext(), DrafterContext(True, False), DrafterContext.off()])
@pytest.mark.parametrize("multi_seq", [False, True])
def test_carry_armed_with(cfg, multi_seq):
    assert carry_armed_with(cfg, multi_seq) == (cfg.carry and not multi_seq)
    if multi_seq:
        assert not carry_armed_with(cfg, multi_seq)


@pytest.mark.parametrize("value,want", [(None, False), ("1", True), ("0", False), ("true", False), ("1 ", False)])
def test_carry_debug_enabled(value, want):
    env = {} if value is None else {"MTP_CARRY_DEBUG": value}
    assert ExecutionConfig.from_environ(env).carry_debug is want


# ------------------------------------------------------------------ mtp_rows_to_trim


@pytest.mark.parametrize(
    "drafted,accepted,refeed,want",
    [
        (1, 0, False, 1),
        (1, 1, False, 0),
        (2, 0, False, 2),
        (2, 1, False, 1),
        (2, 2, False, 0),
        (3, 3, False, 0),
        (1, 1, True, 0),
        (2, 1, True, 1),
        (2, 2, True, 1),
        (3, 2, True, 2),
        (3, 3, True, 2),
    ],
)
def test_rows_to_trim_reference_table(drafted, accepted, refeed, want):
    assert mtp_rows_to_trim(drafted, accepted, refeed) == want


def _trim_oracle(d, a, r):
    return min(d, max(d - a, 0) + (max(a - 1, 0) if r else 0))


@FAST
@given(st.integers(0, 64), st.integers(0, 70), st.booleans())
def test_rows_to_trim_ints(d, a, r):
    got = mtp_rows_to_trim(d, a, r)
    assert type(got) is int
    assert got == _trim_oracle(d, a, r)
    assert 0 <= got <= d
    if a == 0:
        assert got == mtp_rows_to_trim(d, 0, not r) == d


def test_rows_to_trim_rejects_negative_ints():
    with pytest.raises(ValueError, match="num_accepted"):
        mtp_rows_to_trim(2, -1, True)


_trim_jit = jax.jit(mtp_rows_to_trim)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 16), st.integers(0, 20), st.booleans()), min_size=5, max_size=5),
    st.sampled_from([np.int32, np.uint32, np.int64]),
)
def test_rows_to_trim_arrays_numpy_and_jit(rows, dtype):
    d = np.array([r[0] for r in rows], dtype=dtype)
    a = np.array([r[1] for r in rows], dtype=dtype)
    refeed = np.array([r[2] for r in rows])
    want = np.array([_trim_oracle(*r) for r in rows])
    np.testing.assert_array_equal(mtp_rows_to_trim(d, a, refeed), want)
    assert np.all(mtp_rows_to_trim(d, a, True) <= d)
    # Fixed shape (5,) and dtype set keep the jit cache to a few entries.
    got = _trim_jit(jnp.asarray(d, dtype=jnp.int32), jnp.asarray(a, dtype=jnp.int32), jnp.asarray(refeed))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_the_marconi_threshold_is_the_engine_configs_own():
    from mtp.serving import EngineConfig

    assert DEFAULT_MARCONI_MIN_TOKENS == 256 == EngineConfig().marconi_min_tokens
    assert EngineConfig(marconi_min_tokens=0).marconi_min_tokens == 0  # always restore
    for bad in (-1, True, 12.5):
        with pytest.raises(ValueError, match=f"marconi_min_tokens={bad!r}: an integer >= 0"):
            EngineConfig(marconi_min_tokens=bad)


def test_cut_keeps_the_first_rows_and_the_pages():
    e = carry.CarriedDrafter(block_table=(3, 4), rows=5, last_pair_key=7, tokens=tuple(range(10)), session_hash=9)
    assert e.cut(5, 7) is e
    kept = e.cut(*e.usable_by(list(range(6)) + [99], 9))  # keys 0..4 read tokens 0..5
    assert (kept.rows, kept.last_pair_key, kept.block_table, kept.tokens) == (2, 4, e.block_table, e.tokens)
