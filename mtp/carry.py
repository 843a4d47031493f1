"""Host-side bookkeeping for carrying the drafter's KV across turns of a session.

A turn's prompt extends the previous turn's full sequence (prompt + output); that is
why the target's prefix cache hits on a warm turn. It is also why the drafter rows the
previous turn built are exactly the rows this turn needs: a single-layer drafter's
K/V for pair key ``k`` depend only on ``(t[k+1], hidden[k])``, and ``hidden[k]`` is a
pure function of ``t[0..=k]``. So instead of starting the drafter empty on a warm turn
(the warm-turn defect) or re-running the whole-prompt drafter prefill (which doubles
time-to-first-token), the finished turn's drafter KV is kept in one slot and the next
turn appends only the missing tail.

Everything here is plain Python on host integers: the device part of the carry (the
row append itself) is done by the engine with the plan computed here. The one
exception is :func:`mtp_rows_to_trim`, which is also evaluated elementwise inside the
jitted decode loop and is therefore written with arithmetic that is valid for Python
ints and for numpy / jax integer arrays alike.

Conventions (DESIGN.md §2): drafter row ``r`` holds pair key ``k`` =
``(embed(t[k+1]), hidden[k])`` at RoPE position ``k + 1``; a prompt of ``L`` tokens has
pair keys ``0 ..= L-2``. Rows are compacted while keys live in sequence space, so gaps
in the keys are normal and never need filling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Optional

import numpy as np

from mtp.execution import ExecutionConfig

__all__ = [
    "AppendPlan",
    "CarriedDrafter",
    "CarryOutcome",
    "DEFAULT_MARCONI_MIN_TOKENS",
    "DrafterContext",
    "StoreRange",
    "adopt",
    "carry_armed_with",
    "merge_interval",
    "mtp_rows_to_trim",
    "plan_append",
    "stamped_merge",
]

def _check_count(name: str, value: Any) -> int:
    """Reject anything but a non-negative Python int (bools included: ``True`` rows is a bug)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _as_int_tuple(name: str, values: Sequence[Any]) -> tuple[int, ...]:
    """Freeze a token or block sequence; numpy integer scalars are accepted and unboxed."""
    try:
        return tuple(int(v) for v in values)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a sequence of ints: {e}") from None


# --------------------------------------------------------------------------------------
# The carried entry and how much of it a new prompt may adopt.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CarriedDrafter:
    """A finished turn's drafter KV, held for the next turn of the same session.

    Attributes:
      block_table: the drafter KV pages, moved out of the finished sequence so that
        freeing the sequence does not free them; the slot owns them until the next
        turn adopts them or a deposit/refusal frees them.
      rows: drafter rows resident in those pages (dense, compacted).
      last_pair_key: sequence-space pair key of the newest resident row; ``None`` when
        the drafter never wrote a row.
      tokens: the full token sequence (prompt + output) that produced the rows. Its
        common prefix with a later prompt BOUNDS which rows that prompt may reuse; it
        cannot say whose rows they are (templated requests share long preambles).
      session_hash: the session that produced the rows. This, not the prefix, is what
        decides whether the entry may be reused at all; without it the single
        engine-level slot would leak one request's drafter state into another's.

    Keys of resident rows are distinct and lie in ``0 ..= last_pair_key``, so
    ``rows <= last_pair_key + 1``; a violation means the engine's bookkeeping drifted,
    and is rejected here rather than silently adopted.
    """

    block_table: tuple[int, ...]
    rows: int
    last_pair_key: Optional[int]
    tokens: tuple[int, ...]
    session_hash: int
    # ``tokens`` as an array, made once at the deposit: the next turn's prefix comparison
    # is then one vector compare at its start instead of a Python loop over the session.
    _token_array: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_table", _as_int_tuple("block_table", self.block_table))
        object.__setattr__(self, "tokens", _as_int_tuple("tokens", self.tokens))
        object.__setattr__(self, "_token_array", np.asarray(self.tokens, np.int64))
        _check_count("rows", self.rows)
        _check_count("session_hash", self.session_hash)
        if self.last_pair_key is None:
            if self.rows != 0:
                raise ValueError(
                    f"rows={self.rows} but last_pair_key is None: resident rows must have a newest key"
                )
        else:
            _check_count("last_pair_key", self.last_pair_key)
            if self.rows > self.last_pair_key + 1:
                raise ValueError(
                    f"rows={self.rows} exceeds last_pair_key+1={self.last_pair_key + 1}: "
                    "rows hold distinct keys in 0..=last_pair_key"
                )

    def common_prefix_len(self, prompt: Sequence[int]) -> int:
        """Number of leading tokens on which ``prompt`` agrees with the carried sequence."""
        n = min(len(self.tokens), len(prompt))
        differ = np.flatnonzero(self._token_array[:n] != np.asarray(prompt[:n], np.int64))
        return int(differ[0]) if differ.size else n

    def session_matches(self, session_hash: int) -> bool:
        """Whether these rows belong to ``session_hash``.

        Zero refuses, even against an entry stamped zero: a zero hash means nobody
        stamped a session, so there is nothing to prove ownership with, and a blind
        drafter only costs acceptance while a foreign one can steer the output path.
        """
        return session_hash != 0 and self.session_hash == session_hash

    def cut(self, rows: int, last_pair_key: int) -> "CarriedDrafter":
        """This entry holding its first ``rows`` rows only, the newest of key ``last_pair_key``
        (what `usable_by` keeps); itself when that is all it holds. The pages stay whole."""
        if (rows, last_pair_key) == (self.rows, self.last_pair_key):
            return self
        return dataclasses.replace(self, rows=rows, last_pair_key=last_pair_key)

    def usable_by(self, prompt: Sequence[int], session_hash: int) -> tuple[int, int] | None:
        """The ``(rows, last_pair_key)`` that ``prompt`` may adopt, or ``None``.

        The session gate comes first; the prefix rule below only ever narrows an entry
        the session already owns.

        Pair key ``k`` consumed ``tokens[0..=k+1]``, so it is reusable exactly when the
        prompt agrees on those ``k + 2`` tokens: ``k <= common - 2``. Demanding that
        the whole carried sequence reappear would refuse nearly every warm turn, since
        chat templates re-tokenize the boundary between the previous output and the
        next user message; truncating keeps all rows before that boundary.

        Rows are appended in increasing key order, so dropping ``d`` keys off the top
        drops ``d`` rows off the tail: ``rows' = rows - (last_pair_key - key)``. When
        the tail had gaps that over-counts the surviving key, which only starts the
        next append later (less coverage, never a wrong row).
        """
        if not self.session_matches(session_hash):
            return None
        if self.last_pair_key is None or self.rows == 0:
            return None
        max_key = self.common_prefix_len(prompt) - 2
        if max_key < 0:
            return None
        key = min(self.last_pair_key, max_key)
        rows = self.rows - (self.last_pair_key - key)
        if rows <= 0:
            return None
        return rows, key


# --------------------------------------------------------------------------------------
# Planning the append of the missing tail.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AppendPlan:
    """Write pair keys ``first_key .. first_key + rows - 1`` (the last is ``prompt_len - 2``)."""

    first_key: int
    rows: int

    def __post_init__(self) -> None:
        _check_count("first_key", self.first_key)
        _check_count("rows", self.rows)
        if self.rows == 0:
            raise ValueError("an AppendPlan writes at least one row; 'nothing to append' is None")

    @property
    def last_key(self) -> int:
        return self.first_key + self.rows - 1


def plan_append(
    last_pair_key: Optional[int], prompt_len: int, hidden_lo: int, hidden_hi: int
) -> AppendPlan | None:
    """Which pair keys to append so the drafter covers a prompt of ``prompt_len`` tokens.

    ``[hidden_lo, hidden_hi)`` is the interval of the captured-hidden store this reader
    may read (see :meth:`StoreRange.visible_to`); pair key ``k`` reads hidden row ``k``.

    ``first_key = max(last_pair_key + 1, hidden_lo)``: when the store does not reach
    back to the drafter's newest row, the keys in between are skipped rather than
    refused. That leaves no hole the drafter can trip on, because rows are compacted
    and RoPE carries the position, so a key gap is the ordinary shape of the row space.

    ``last_pair_key=None`` means the drafter has no rows yet, so the append starts at
    ``max(0, hidden_lo)``; the cold whole-prompt drafter prefill is therefore just
    ``plan_append(None, L, 0, L)``.

    Returns ``None`` when there is nothing to append (the drafter already reaches
    ``prompt_len - 2``, or the prompt has fewer than two tokens and so no pair keys),
    or when the store does not hold hidden rows up to ``prompt_len - 2``. The store
    always reaches down to ``first_key`` by construction of ``first_key``.
    """
    _check_count("prompt_len", prompt_len)
    _check_count("hidden_lo", hidden_lo)
    _check_count("hidden_hi", hidden_hi)
    if hidden_hi < hidden_lo:
        raise ValueError(f"hidden interval [{hidden_lo}, {hidden_hi}) is reversed")
    next_key = 0 if last_pair_key is None else _check_count("last_pair_key", last_pair_key) + 1
    last_needed = prompt_len - 2
    first_key = max(next_key, hidden_lo)
    if last_needed < 0 or first_key > last_needed:
        return None
    if hidden_hi <= last_needed:
        return None
    return AppendPlan(first_key=first_key, rows=last_needed - first_key + 1)


# --------------------------------------------------------------------------------------
# Ownership of the captured-hidden store.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StoreRange:
    """The valid interval ``[lo, hi)`` of the captured-hidden store, and who wrote it.

    The store is one engine-level buffer indexed by absolute sequence position with no
    per-sequence dimension, so an interval alone cannot tell a reader whether the rows
    are its own. ``owner`` is the generation of the sequence that wrote them; 0 means
    unclaimed and matches no reader, so sequences built without a generation ticket
    (test fakes, mocks) can never read anyone's rows.
    """

    owner: int
    lo: int
    hi: int

    EMPTY: ClassVar["StoreRange"]

    def __post_init__(self) -> None:
        _check_count("owner", self.owner)
        _check_count("lo", self.lo)
        _check_count("hi", self.hi)
        if self.hi < self.lo:
            raise ValueError(f"StoreRange [{self.lo}, {self.hi}) is reversed")

    def visible_to(self, reader_gen: int) -> tuple[int, int]:
        """``(lo, hi)`` if ``reader_gen`` owns the rows, else the empty ``(0, 0)``.

        An empty interval rather than an error: :func:`plan_append` already refuses an
        interval that does not cover the span it needs, so a foreign range degrades to
        "no hiddens" without a separate code path.
        """
        if reader_gen != 0 and self.owner == reader_gen:
            return self.lo, self.hi
        return 0, 0


StoreRange.EMPTY = StoreRange(owner=0, lo=0, hi=0)


def merge_interval(cur: tuple[int, int], start: int, count: int) -> tuple[int, int]:
    """Fold a write of ``[start, start + count)`` into the single interval ``cur``.

    Overlapping or abutting writes to a non-empty interval extend it to the hull. A
    disjoint write, or any write into an empty interval, replaces it: one interval
    cannot describe two islands, and spanning the gap would claim positions nobody in
    this owner's run wrote (another turn's hiddens).
    """
    lo, hi = cur
    _check_count("start", start)
    _check_count("count", count)
    end = start + count
    if hi > lo and start <= hi and end >= lo:
        return min(lo, start), max(hi, end)
    return start, end


def stamped_merge(cur: StoreRange, writer_gen: int, start: int, count: int) -> StoreRange:
    """Record a write by ``writer_gen`` into the store's ownership range.

    The same non-zero owner merges as :func:`merge_interval` does. Anyone else
    (another generation, or an unclaimed range) replaces the interval with their own
    write, stamped with their generation. Merging across owners would produce one
    interval whose lower part is another request's rows whenever the new write starts
    below the old high-water mark. This relies on :func:`merge_interval` replacing on
    a gap for the same owner; if that ever spanned gaps, the leak would come back.
    """
    _check_count("writer_gen", writer_gen)
    if cur.owner != 0 and cur.owner == writer_gen:
        lo, hi = merge_interval((cur.lo, cur.hi), start, count)
        return StoreRange(owner=writer_gen, lo=lo, hi=hi)
    _check_count("start", start)
    _check_count("count", count)
    return StoreRange(owner=writer_gen, lo=start, hi=start + count)


# --------------------------------------------------------------------------------------
# What happened, for logs and statistics.
# --------------------------------------------------------------------------------------


class CarryOutcome:
    """Result of one carry attempt; the variants are ``CarryOutcome.<Variant>``.

    Every variant's ``str()`` reads differently, because the logs are how a wrong
    decision gets noticed: a foreign session (the cross-request channel being refused)
    must never read like a prefix mismatch (an expected re-tokenized turn boundary).
    ``kind`` is a short stable name for counting outcomes.
    """

    __slots__ = ()
    kind: ClassVar[str]

    Adopted: ClassVar[type["CarryOutcome"]]
    NoCarry: ClassVar[type["CarryOutcome"]]
    PrefixMismatch: ClassVar[type["CarryOutcome"]]
    ForeignHiddens: ClassVar[type["CarryOutcome"]]
    ForeignSession: ClassVar[type["CarryOutcome"]]
    NoHiddens: ClassVar[type["CarryOutcome"]]
    Disarmed: ClassVar[type["CarryOutcome"]]

    def __new__(cls, *args: Any, **kwargs: Any) -> "CarryOutcome":
        if cls is CarryOutcome:
            raise TypeError("CarryOutcome is abstract; build one of its variants, e.g. CarryOutcome.NoCarry()")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # Every variant's fields are counts, generations or session ids: all non-negative ints.
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            _check_count(f"{type(self).__name__}.{field.name}", getattr(self, field.name))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Repr and pickling both resolve the class through this dotted name.
        cls.__qualname__ = f"CarryOutcome.{cls.__name__}"


def _outcome(cls: type) -> type:
    """Make a variant a frozen keyword-only dataclass reachable as ``CarryOutcome.<name>``."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    setattr(CarryOutcome, cls.__name__, cls)
    return cls


@_outcome
class Adopted(CarryOutcome):
    """The entry's rows were installed (``rows``) and ``appended`` keys from ``first_key`` written."""

    kind: ClassVar[str] = "adopted"
    rows: int
    appended: int
    first_key: int

    def __str__(self) -> str:
        return f"adopted rows={self.rows} appended={self.appended} first_key={self.first_key}"


@_outcome
class NoCarry(CarryOutcome):
    """The slot held no rows to offer."""

    kind: ClassVar[str] = "no_carry"

    def __str__(self) -> str:
        return "no carried drafter state"


@_outcome
class PrefixMismatch(CarryOutcome):
    """Same session, but the prompt diverges from the carried sequence before any row survives."""

    kind: ClassVar[str] = "prefix_mismatch"
    common: int
    entry_rows: int

    def __str__(self) -> str:
        return (
            f"prefix mismatch: prompt agrees on {self.common} tokens, "
            f"which keeps none of the entry's {self.entry_rows} rows"
        )


@_outcome
class ForeignHiddens(CarryOutcome):
    """The captured hiddens the append needs were written by generation ``owner``, not ``expected``.

    Control flow is the same as :class:`NoHiddens` (the adopted rows are kept, nothing
    is appended); the separate variant exists so the log names who owns the rows.
    """

    kind: ClassVar[str] = "foreign_hiddens"
    owner: int
    expected: int

    def __str__(self) -> str:
        return f"hidden rows belong to sequence generation {self.owner}, not {self.expected}"


@_outcome
class ForeignSession(CarryOutcome):
    """The slot held another session's rows, or the request carries no session id."""

    kind: ClassVar[str] = "foreign_session"
    entry_session: int
    prompt_session: int

    def __str__(self) -> str:
        if self.prompt_session == 0:
            return f"foreign session refused: request has no session id (entry={self.entry_session:#x})"
        return f"foreign session refused (entry={self.entry_session:#x} request={self.prompt_session:#x})"


@_outcome
class NoHiddens(CarryOutcome):
    """The adopted rows are kept but the hidden store does not cover the keys still missing."""

    kind: ClassVar[str] = "no_hiddens"

    def __str__(self) -> str:
        return "hidden store does not cover the append span"


@_outcome
class Disarmed(CarryOutcome):
    """The carry was not armed for the turn (configured off, or a single slot with several
    sequences: ``carry_armed_with``), so nothing was offered. Apart from ``NoCarry`` (armed,
    slot empty): configured is not armed, and what reports the carry's state says which."""

    kind: ClassVar[str] = "disarmed"

    def __str__(self) -> str:
        return "carry not armed for this turn: nothing offered"


def adopt(
    entry: CarriedDrafter | None,
    prompt: Sequence[int],
    session_hash: int,
    hidden_range: StoreRange,
    reader_gen: int,
) -> tuple[tuple[int, int] | None, AppendPlan | None, CarryOutcome]:
    """Decide a warm turn's carry: ``(adopted, plan, outcome)``.

    The whole decision of the reference run-time flow, so the engine only executes it:

    1. No entry, or an entry without rows: ``(None, None, NoCarry)`` (after the session
       check, so an empty foreign entry still reports the foreign session).
    2. :meth:`CarriedDrafter.usable_by` refuses: ``(None, None, ForeignSession)`` when
       the session does not match, else ``(None, None, PrefixMismatch(common,
       entry_rows))``. ``adopted is None`` tells the engine to free the entry's pages.
    3. Otherwise ``adopted = (rows, last_key)`` is installed and the missing keys
       ``last_key + 1 ..= L - 2`` are planned over ``hidden_range.visible_to(reader_gen)``:

       * none missing (``last_key + 1 > L - 2``): ``Adopted(appended=0,
         first_key=last_key + 1)`` with ``plan=None``;
       * a plan exists: ``Adopted(rows, plan.rows, plan.first_key)`` with that plan;
       * keys are missing but no plan, and the range has an owner other than
         ``reader_gen``: ``ForeignHiddens(owner, expected=reader_gen)``; adopted rows
         kept, ``plan=None``;
       * keys are missing but the visible interval does not reach ``L - 2``
         (including one that starts past ``L - 2``): ``NoHiddens``; adopted rows kept.

    "None missing" is judged from ``last_key`` alone, not from the store: a store that
    starts past the last needed key cannot supply the missing keys, which is a
    coverage failure rather than a fully covered drafter.
    """
    _check_count("session_hash", session_hash)
    _check_count("reader_gen", reader_gen)
    if entry is None:
        return None, None, CarryOutcome.NoCarry()
    if not entry.session_matches(session_hash):
        return None, None, CarryOutcome.ForeignSession(
            entry_session=entry.session_hash, prompt_session=session_hash
        )
    if entry.rows == 0:
        return None, None, CarryOutcome.NoCarry()
    adopted = entry.usable_by(prompt, session_hash)
    if adopted is None:
        return None, None, CarryOutcome.PrefixMismatch(
            common=entry.common_prefix_len(prompt), entry_rows=entry.rows
        )
    rows, last_key = adopted
    last_needed = len(prompt) - 2
    if last_key + 1 > last_needed:
        return adopted, None, CarryOutcome.Adopted(rows=rows, appended=0, first_key=last_key + 1)
    lo, hi = hidden_range.visible_to(reader_gen)
    plan = plan_append(last_key, len(prompt), lo, hi)
    if plan is not None:
        return adopted, plan, CarryOutcome.Adopted(rows=rows, appended=plan.rows, first_key=plan.first_key)
    if hidden_range.owner != 0 and hidden_range.owner != reader_gen:
        return adopted, None, CarryOutcome.ForeignHiddens(owner=hidden_range.owner, expected=reader_gen)
    return adopted, None, CarryOutcome.NoHiddens()


# --------------------------------------------------------------------------------------
# Policy: whether drafter prefill and carry run at all.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DrafterContext:
    """The drafter-context policy: prefill the drafter on cold turns, carry it on warm ones.

    One object with one kill switch because the halves only pay off together: the
    carry appends to rows the prefill built and reads the hiddens the prefill captured,
    so carry without prefill does nothing, while prefill without carry was a measured
    loss (it buys a warm drafter only on cold turns). ``carry=True, prefill=False`` is
    therefore rejected rather than silently normalised.
    """

    prefill: bool = True
    carry: bool = True

    def __post_init__(self) -> None:
        for name in ("prefill", "carry"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DrafterContext.{name} must be a bool, got {getattr(self, name)!r}")
        if self.carry and not self.prefill:
            raise ValueError("DrafterContext(carry=True, prefill=False): the carry needs the drafter prefill")

    @classmethod
    def off(cls) -> "DrafterContext":
        return cls(prefill=False, carry=False)

    @classmethod
    def of(cls, execution: ExecutionConfig) -> "DrafterContext":
        """The default policy unless ``execution``'s kill switches turn it off:
        ``drafter_context_off`` both halves, ``drafter_carry_off`` the carry alone
        (``MTP_DRAFTER_CONTEXT_OFF=1`` / ``MTP_DRAFTER_CARRY_OFF=1`` at an entry point; only the exact
        value ``1`` counts, so that ``0`` or ``false`` never turns a feature off)."""
        if execution.drafter_context_off:
            return cls.off()
        if execution.drafter_carry_off:
            return cls(prefill=True, carry=False)
        return cls()


def carry_armed_with(cfg: DrafterContext, multi_seq: bool) -> bool:
    """Whether the carry actually runs: configured on, and MTP dispatching one sequence.

    The slot holds one sequence's rows, and this check is what keeps it out of
    multi-sequence dispatch. Configured is not armed: anything that reports the carry's
    state must report this value, not ``cfg.carry``.
    """
    return cfg.carry and not multi_seq


# --------------------------------------------------------------------------------------
# Rows to drop after verify.
# --------------------------------------------------------------------------------------


def _sat_sub(x: Any, y: Any) -> Any:
    """``max(x - y, 0)`` written as ``(x - y) * (x > y)``.

    The product form works unchanged on Python ints, numpy arrays and jax tracers,
    and is also right for unsigned arrays, where ``x - y`` wraps when ``x < y`` but is
    then multiplied by zero.
    """
    return (x - y) * (x > y)


def mtp_rows_to_trim(num_drafted: Any, num_accepted: Any, refeed_accepted: Any) -> Any:
    """Drafter rows to drop after verify: ``min(D, (D - A)+ + (refeed ? (A - 1)+ : 0))``.

    Rejected drafts always go. With ``refeed_accepted`` the accepted drafts after the
    first go too: draft 1 was built from the target's verified hidden, drafts 2.. from
    the drafter's own output hidden, and refeed rebuilds those rows from the target's
    true hidden. The cap at ``num_drafted`` holds even for an out-of-range accepted
    count: the drafter cannot drop rows it never wrote, and over-trimming would
    desynchronise the row count from the newest key.

    Accepts Python ints (checked non-negative) or integer arrays / jax tracers of
    broadcastable shapes (elementwise, no checks: it runs inside the jitted loop);
    ``refeed_accepted`` may be a bool or a boolean array.
    """
    if isinstance(num_drafted, int) and isinstance(num_accepted, int):
        _check_count("num_drafted", num_drafted)
        _check_count("num_accepted", num_accepted)
        refeed_accepted = bool(refeed_accepted)
    want = _sat_sub(num_drafted, num_accepted) + _sat_sub(num_accepted, 1) * refeed_accepted
    return num_drafted - _sat_sub(num_drafted, want)


# --------------------------------------------------------------------------------------
# Marconi threshold: minimum matched prefix before an SSM snapshot restore is taken.
# --------------------------------------------------------------------------------------

DEFAULT_MARCONI_MIN_TOKENS = 256
"""Restoring a recurrent-state snapshot skips the target prefill, so the drafter cannot
be prefilled for that prefix; below this matched length the drafter loss outweighs the
prefill saved. The crossover was measured between ~99 and ~219 tokens; 256 is inside
the win region and a whole number of 16-token pages. `mtp.serving.EngineConfig`'s
``marconi_min_tokens`` is the one setting of it; an experiment records the value it ran with."""
