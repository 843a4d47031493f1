"""Host planning of a served turn: the pages it holds, the path of its target prefill, what its
drafter starts from, and what its end leaves behind.

Plain Python over `mtp.carry`'s pure functions and the host stores of `mtp.cache`: nothing
here reads or writes a device array, so every decision can be checked without a model
(tests/test_planner.py), and the engine only executes a `TurnPlan`. Per turn:

1. Prefix match against the target prefix cache (block-hash chain -> pages).
2. Path: restore the longest GDN snapshot of the matched prefix when the match is at least
   the Marconi threshold (``restore``), else recompute the recurrent state over the prompt
   while reading, never rewriting, the cached KV (``kv_only``); no match at all is
   ``cold``. The prefill runs in ``SNAPSHOT_INTERVAL``-aligned chunks and leaves a
   snapshot at every aligned boundary it crosses (`TurnPlanner.put_snapshot`).
3. The drafter's context, by policy (`DRAFTER_POLICIES`):
   ``cold``: no prefix cache, full drafter prefill every turn;
   ``blind``: drafter prefill only when the target prefill started at 0 (the reference's
   guard) -- a restored warm turn starts the drafter empty;
   ``rebuild``: warm turns recompute the target over the whole prompt and redo the whole
   drafter prefill;
   ``carry``: adopt the session's carried rows truncated to the common prefix, and append
   only the tail keys from this turn's captured hiddens.
4. At the turn's end its full blocks enter the prefix cache, and (``carry``) its drafter KV,
   token sequence and session are deposited in a carry slot (`CarriedDrafters`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
from typing import Callable

import numpy as np
from absl import logging

from mtp import carry as carry_lib
from mtp import quant
from mtp.cache.pages import PageAllocator, PagePoolExhausted
from mtp.cache.prefix import PrefixCache, Snapshot, SnapshotStore, TurnEndStore, chain_hashes
from mtp.cache.state import LinearState
from mtp.generation import positions_reached
from mtp.metrics import AcceptanceStats
from mtp.mtp_head import append_chunks
from mtp.serving.config import SNAPSHOT_INTERVAL, EngineConfig, TurnRequest, TurnStats, session_hash
from mtp.serving.metadata import DrafterAppend, PageCopy
from mtp.speculative import SpecConfig


def carry_armed(ecfg: EngineConfig) -> bool:
    """Configured is not armed: this is what any report of the carry's state must show.

    Single-slot carry follows the reference: one slot for the engine, armed only when a
    single sequence can be dispatched (`carry.carry_armed_with`). The multi-slot carry
    (``carry_slots > 1``) keeps one slot per live session, LRU-bounded, under the same
    ownership rules, and stays armed at any batch width.
    """
    ctx = ecfg.drafter_context
    if ecfg.policy != "carry" or not ecfg.speculative:
        return False
    if not quant.supports_drafter_prefill(ecfg.mtp_quant):
        return False
    if ecfg.carry_slots > 1:
        return ctx.carry
    return carry_lib.carry_armed_with(ctx, multi_seq=ecfg.batch_slots > 1)


def drafter_prefill_on(ecfg: EngineConfig) -> bool:
    """Whether a turn whose target prefill starts at 0 also fills its drafter over the whole prompt."""
    return ecfg.speculative and ecfg.drafter_context.prefill and quant.supports_drafter_prefill(ecfg.mtp_quant)


def check_request(req: TurnRequest, ecfg: EngineConfig, spec: SpecConfig, max_positions: int):
    """Refuse a request this engine cannot serve, before any turn of its wave takes a page."""
    n = len(req.prompt)
    if n < 2:
        raise ValueError(f"session {req.session_id}: a prompt needs at least 2 tokens, got {n}")
    if n + req.max_new_tokens > ecfg.max_context:
        raise ValueError(f"session {req.session_id}: prompt of {n} tokens + {req.max_new_tokens} new tokens "
                         f"exceeds the engine's max_context={ecfg.max_context}")
    if req.max_new_tokens > spec.max_new_tokens:
        raise ValueError(f"session {req.session_id}: max_new_tokens={req.max_new_tokens} exceeds the compiled "
                         f"loop's buffer SpecConfig.max_new_tokens={spec.max_new_tokens}")
    width = spec.verify_width if ecfg.speculative else spec.plain_width
    reach = positions_reached(n, req.max_new_tokens, width)
    if reach > max_positions:
        raise ValueError(f"session {req.session_id}: prompt of {n} tokens + {req.max_new_tokens} new tokens runs "
                         f"the model at {reach} positions ({width}-row decode steps), more than the "
                         f"checkpoint's max_position_embeddings={max_positions}")


def drafter_appends(prompt, first_key, count) -> list[DrafterAppend]:
    """One `DrafterAppend` per `append_chunks` call that writes drafter rows for keys
    ``first_key .. first_key + count - 1``. Reads only the tail it appends, so a carry's turn
    start does not walk the whole session."""
    out = []
    for off, width in append_chunks(count):
        key, n = first_key + off, min(width, count - off)
        tokens = np.zeros((width,), np.int32)
        tokens[:n] = prompt[key + 1: key + 1 + n]
        out.append(DrafterAppend(tokens=tokens, first_key=key, count=n))
    return out


@dataclasses.dataclass
class TurnPlan:
    """A turn on a batch slot: first reserved (every page held, every decision made), then started."""

    request: TurnRequest
    slot: int
    generation: int
    session: int
    hashes: list[bytes]
    cached: int  # prompt tokens whose KV the cache holds: the target prefill writes from here
    snap: Snapshot | None  # the GDN state the target prefill continues from
    # A turn end's partial last page, copied into the turn's first own page before any
    # other turn's reservation can evict the entry holding it.
    page_copy: PageCopy | None
    hidden_range: carry_lib.StoreRange  # the slot's hidden store once the target prefill has run
    target_pages: list[int]
    drafter_pages: list[int]  # what the turn holds; an adopted entry's pages join when it starts
    # Stays in `CarriedDrafters.entries` until the turn starts, so rolling back a reservation
    # never has to re-deposit it (and no append of this turn can have overwritten its rows).
    adopted: carry_lib.CarriedDrafter | None
    drafter_rows: tuple[int, int]  # (rows, last pair key) installed before any append
    append_plan: carry_lib.AppendPlan | None  # the carry's tail: keys the adopted rows lack
    stats: TurnStats

    @property
    def prefill_from(self) -> int:
        """The first position the target prefill computes: the restored snapshot's, or 0."""
        return self.snap.position if self.snap else 0

    def kept_part(self) -> carry_lib.CarriedDrafter:
        """The entry this turn adopted, cut to the rows it kept: all a turn that went no further
        can hand back, since its appends and drafts wrote from the kept rows on."""
        return self.adopted.cut(*self.drafter_rows)


def carried_entry(turn: TurnPlan, full: list[int], rows: int, last_pair_key: int) -> carry_lib.CarriedDrafter | None:
    """The slot's drafter (``rows``, newest key ``last_pair_key``) as the entry ``full`` leaves,
    its keys cut at ``len(full) - 2``; None when no row survives the cut (nothing to hold: its
    pages go back at the turn's end).

    A turn cut short by its budget or by an EOS inside an accepted run of drafts
    holds rows for keys past the tokens it output (the drafts were verified, not
    emitted); the cut, `CarriedDrafter.usable_by` against ``full`` itself, keeps an
    entry's rows within the sequence it names.
    """
    entry = carry_lib.CarriedDrafter(block_table=tuple(turn.drafter_pages), rows=rows,
                                     last_pair_key=last_pair_key if last_pair_key >= 0 else None, tokens=tuple(full),
                                     session_hash=turn.session)
    kept = entry.usable_by(full, turn.session)
    return None if kept is None else entry.cut(*kept)


class CarriedDrafters:
    """The carried drafters, keyed by session hash in deposit order, and the drafter page pool.

    One entry for the engine, or (``carry_slots > 1``) one per live session, at most
    ``carry_slots``. Carried drafters are a cache, as the target's prefix cache is: dropping
    one costs its session the drafter's context on a later warm turn (a cold drafter or a
    whole-prompt drafter prefill), never a wrong token.
    """

    def __init__(self, ecfg: EngineConfig, pages: PageAllocator):
        self.ecfg, self.pages = ecfg, pages
        self.multi_slot = ecfg.carry_slots > 1
        self.entries: collections.OrderedDict[int, carry_lib.CarriedDrafter] = collections.OrderedDict()

    def reserve(self, turn: TurnPlan, prompt, need, wave_sessions, armed: bool):
        """Decide the carry over the hidden range the target prefill will leave, and take the pages."""
        entry, refused = None, None
        outcome: carry_lib.CarryOutcome = carry_lib.CarryOutcome.Disarmed()
        if armed:
            entry = self.entries.get(turn.session) if self.multi_slot else next(iter(self.entries.values()), None)
            adopted, turn.append_plan, outcome = carry_lib.adopt(entry, prompt, turn.session, turn.hidden_range,
                                                                 turn.generation)
            if adopted is None:
                refused, entry = entry, None  # a refusal frees the entry's blocks
            else:
                turn.adopted, turn.drafter_rows = entry, adopted
                turn.stats.drafter_adopted = adopted[0]
                turn.stats.carry_source = entry.session_hash
            turn.stats.carry_outcome = outcome.kind
        held = len(entry.block_table) if entry is not None else 0
        turn.drafter_pages = self._allocate(max(0, math.ceil(need / self.ecfg.page_size) - held), refused,
                                            wave_sessions)
        if self.ecfg.debug or self.ecfg.execution.carry_debug:
            logging.info("carry gen=%d session=%x slot=%d: %s", turn.generation, turn.session, turn.slot, outcome)

    def _allocate(self, count: int, refused, wave_sessions) -> list[int]:
        """``count`` drafter pages, after freeing ``refused`` (an entry the carry just refused)
        and, while still short, the carried entries of sessions outside ``wave_sessions``,
        least recently deposited first.

        Live turns' pages are never taken. The wave's own sessions are spared because they
        are about to adopt theirs. Nothing is freed unless the allocation then succeeds, so
        running dry leaves every entry in place.
        """
        drop = [refused] if refused is not None else []
        avail = self.pages.num_free + sum(len(e.block_table) for e in drop)
        for sess, e in self.entries.items():
            if avail >= count:
                break
            if sess not in wave_sessions and e is not refused:
                drop.append(e)
                avail += len(e.block_table)
        if avail < count:
            raise PagePoolExhausted(
                f"drafter KV page pool exhausted: a turn needs {count} pages of {self.ecfg.page_size} tokens; "
                f"{self.pages.num_free} of {self.pages.num_pages - 1} are free and the carried drafters it may "
                f"evict hold {avail - self.pages.num_free}; nothing was freed")
        for e in drop:
            self.drop(e)
        return self.pages.allocate(count)

    def drop(self, entry: carry_lib.CarriedDrafter):
        self.entries.pop(entry.session_hash, None)
        self.pages.release(list(entry.block_table))

    def take_over(self, turn: TurnPlan):
        """The turn's prefill (and the append in it) ran: an adopted entry's blocks are the turn's now."""
        if turn.adopted is not None:
            del self.entries[turn.adopted.session_hash]
            turn.drafter_pages = list(turn.adopted.block_table) + turn.drafter_pages

    def hand_back(self, turn: TurnPlan):
        """The turn's prefill failed: an adopted entry, still carried, keeps only the rows the turn
        kept (the appends may have written over its rows past them)."""
        if turn.adopted is not None:
            self.entries[turn.adopted.session_hash] = turn.kept_part()

    def abandon(self, turn: TurnPlan):
        """A failed wave's turn gives an entry it adopted and took over (its prefill ran) back."""
        if turn.adopted is not None and turn.adopted.session_hash not in self.entries:
            self.entries[turn.adopted.session_hash] = turn.kept_part()
            turn.drafter_pages = turn.drafter_pages[len(turn.adopted.block_table):]

    def deposit(self, turn: TurnPlan, entry: carry_lib.CarriedDrafter | None):
        """The turn's end replaces its slot's previous entry, even with nothing to hold."""
        if not self.multi_slot:
            for old in list(self.entries.values()):
                self.drop(old)
        elif turn.session in self.entries:
            self.drop(self.entries[turn.session])
        if entry is not None:
            self.entries[turn.session] = entry
            turn.drafter_pages = []  # the carry slot owns them now
            while len(self.entries) > self.ecfg.carry_slots:
                self.drop(next(iter(self.entries.values())))


class TurnPlanner:
    """Every host decision of a served turn, over the engine's page pools, its prefix, snapshot
    and turn-end stores, the carried drafters, and which turn wrote each slot's hidden store."""

    def __init__(self, ecfg: EngineConfig, spec: SpecConfig, max_positions: int):
        self.ecfg, self.spec, self.max_positions = ecfg, spec, max_positions
        self.carry_armed = carry_armed(ecfg)
        ps, b = ecfg.page_size, ecfg.batch_slots
        self.pages = PageAllocator(ecfg.num_pages, ps, "target KV")
        self.dpages = PageAllocator(ecfg.drafter_pages, ps, "drafter KV")
        self.prefix = PrefixCache(self.pages)
        self.snapshots = SnapshotStore(SNAPSHOT_INTERVAL, ps)
        self.turn_ends = TurnEndStore(self.pages, max(8, 2 * ecfg.carry_slots, 2 * b))
        self.carry = CarriedDrafters(ecfg, self.dpages)
        # Who wrote each slot's captured hiddens, indexed by absolute position.
        self.hidden_ranges = [carry_lib.StoreRange.EMPTY] * b
        self._tickets = itertools.count(1)

    def check(self, req: TurnRequest):
        check_request(req, self.ecfg, self.spec, self.max_positions)

    def reserve(self, req: TurnRequest, slot: int, wave_sessions: set[int]) -> TurnPlan:
        """Take every page a turn needs and make its path and carry decisions.

        Raises (`PagePoolExhausted`) holding nothing and with the carry untouched, so
        a wave can reserve all its turns before starting any and give the
        reservations back if one fails. Prefix-cache and turn-end entries the target
        pool evicted on the way stay evicted: they are caches, and nobody lost a page.
        """
        prompt = list(req.prompt)
        n = len(prompt)
        need = n + req.max_new_tokens + self.spec.verify_width + 1
        gen, sess = next(self._tickets), session_hash(req.session_id)
        ps = self.ecfg.page_size
        hashes = chain_hashes(prompt, ps)
        with contextlib.ExitStack() as undo:
            shared = self.prefix.match(hashes, (n - 1) // ps) if self.ecfg.policy != "cold" else []
            self.pages.share(shared)  # before allocating, so eviction cannot free a page this turn reads
            undo.callback(self.pages.release, shared)
            own = self._alloc(math.ceil(need / ps) - len(shared))
            undo.callback(self.pages.release, own)
            path, snap, cached, copy = self._restore_point(prompt, hashes, len(shared), own[0])
            start = snap.position if snap else 0
            stats = TurnStats(session_id=req.session_id, generation=gen, prompt_len=n, cached_tokens=cached,
                              path=path, prefilled_tokens=n - start, drafter_prefilled=0, drafter_adopted=0,
                              drafter_appended=0, carry_outcome=carry_lib.CarryOutcome.Disarmed.kind,
                              carry_armed=self.carry_armed, carry_source=0, ttft_s=0.0, ttft_wait_s=0.0,
                              start_calls=int(copy is not None), decode_s=0.0, wave_turns=1, output_len=0,
                              acceptance=AcceptanceStats())
            turn = TurnPlan(request=req, slot=slot, generation=gen, session=sess, hashes=hashes, cached=cached,
                            snap=snap, page_copy=copy,
                            hidden_range=carry_lib.stamped_merge(self.hidden_ranges[slot], gen, start, n - start),
                            target_pages=shared + own, drafter_pages=[], adopted=None, drafter_rows=(0, -1),
                            append_plan=None, stats=stats)
            if self.ecfg.speculative:
                self.carry.reserve(turn, prompt, need, wave_sessions, self.carry_armed)
            undo.pop_all()
        return turn

    def _restore_point(self, prompt, hashes, shared_pages: int, first_own_page: int):
        """``(path, snapshot, cached tokens, page copy)``: restore a snapshot, or recompute the
        recurrent state (KV-only), or cold.

        Candidates: the longest page-aligned prefill snapshot within the cached pages, and
        the end state of an earlier turn this prompt extends (its partial last page is then
        copied into this sequence's first own page).
        """
        cached = shared_pages * self.ecfg.page_size
        snap, turn_end, copy = None, None, None
        if self.ecfg.policy != "cold" and self.ecfg.turn_end_snapshots:
            turn_end = self.turn_ends.match(prompt, shared_pages)
        matched = max(cached, turn_end.length if turn_end else 0)
        warm = matched > 0
        if warm and matched >= self.ecfg.marconi_min_tokens and self.ecfg.policy != "rebuild":
            snap = self.snapshots.best(hashes, cached)
            if turn_end is not None and (snap is None or turn_end.length > snap.position):
                snap = turn_end.snapshot
                if turn_end.tail_page is not None:
                    copy = PageCopy(src=turn_end.tail_page, dst=first_own_page)
                cached = turn_end.length
        path = "cold" if not warm else ("restore" if snap else "kv_only")
        return path, snap, cached, copy

    def _alloc(self, count: int) -> list[int]:
        if count > self.pages.num_free:
            self.prefix.evict(count - self.pages.num_free)
        if count > self.pages.num_free:
            self.turn_ends.evict(count - self.pages.num_free)
        return self.pages.allocate(count)

    def drafter_fill(self, turn: TurnPlan) -> tuple[list[int], list[DrafterAppend]]:
        """The turn's drafter pages in table order, and the appends that the target prefill
        then runs: the carry's tail, or a whole-prompt prefill (none when not speculative).

        An adopted entry's blocks head the slot's table, but the entry stays carried (and
        its pages out of ``turn.drafter_pages``) until the prefill has run, so a turn that
        fails to start leaves the session its carry (`CarriedDrafters.hand_back`: the
        appends start after the rows the turn kept, which a truncated adoption leaves
        fewer than the entry's).
        """
        if not self.ecfg.speculative:
            return [], []
        prompt = list(turn.request.prompt)
        pages = (list(turn.adopted.block_table) if turn.adopted is not None else []) + turn.drafter_pages
        if turn.append_plan is not None:
            turn.stats.drafter_appended = turn.append_plan.rows
            return pages, drafter_appends(prompt, turn.append_plan.first_key, turn.append_plan.rows)
        if turn.drafter_rows[0] == 0 and drafter_prefill_on(self.ecfg) and turn.prefill_from == 0:
            # A whole-prompt drafter prefill needs the hiddens of every prompt position,
            # so it runs only when the target prefill started at 0 (the reference's guard).
            turn.stats.drafter_prefilled = len(prompt) - 1
            return pages, drafter_appends(prompt, 0, len(prompt) - 1)
        return pages, []

    def prefill_started(self, turn: TurnPlan):
        """The chunks overwrite the slot's hidden store as they go: until the prefill is done,
        nothing in it is vouched for."""
        self.hidden_ranges[turn.slot] = carry_lib.StoreRange.EMPTY

    def prefill_done(self, turn: TurnPlan):
        self.hidden_ranges[turn.slot] = turn.hidden_range
        self.carry.take_over(turn)

    def put_snapshot(self, turn: TurnPlan, position: int, linear: LinearState):
        """The GDN state a prefill chunk of ``turn`` left at the aligned ``position``."""
        snap = Snapshot(position, linear.conv, linear.recurrent, turn.session, turn.generation)
        self.snapshots.put(turn.hashes, snap)

    def finish(self, turn: TurnPlan, full: list[int], valid: int, drafter_end: Callable[[], tuple[int, int]],
               end_state: Callable[[], LinearState]):
        """Register full blocks and the end state, and deposit the drafter, of a decoded turn
        whose sequence is ``full`` and whose slot's cache holds ``valid`` positions.

        ``drafter_end()`` reads the slot's drafter (rows, newest key), ``end_state()`` its GDN
        state; each is read only when needed. The consistency check runs before anything is
        registered, so a turn whose end state is inconsistent leaves nothing behind that
        describes other tokens. The turn's pages stay held: `release` gives them back, whatever
        this raises.
        """
        ps = self.ecfg.page_size
        if valid != len(full) - 1:
            raise RuntimeError(f"session {turn.request.session_id}: the cache holds {valid} positions for a "
                               f"sequence of {len(full)} tokens; its KV, snapshot and carry would describe "
                               f"other tokens")
        entry = carried_entry(turn, full, *drafter_end()) if self.carry_armed else None
        if self.ecfg.policy != "cold":
            hashes = chain_hashes(full[:valid], ps)
            self.prefix.insert(hashes, turn.target_pages[: len(hashes)])
            if self.ecfg.turn_end_snapshots:
                lin = end_state()
                tail = turn.target_pages[valid // ps] if valid % ps else None
                self.turn_ends.put(full[:valid], tail,
                                   Snapshot(valid, lin.conv, lin.recurrent, turn.session, turn.generation))
        if self.carry_armed:
            self.carry.deposit(turn, entry)

    def abandon(self, turn: TurnPlan):
        """Undo a turn of a wave that failed before it finished: its pages go back, and an entry
        it adopted and took over goes back to the carry (`CarriedDrafters.abandon`)."""
        self.carry.abandon(turn)
        self.release(turn)

    def release(self, turn: TurnPlan):
        """Give back every page a turn holds, without registering or depositing anything."""
        self.pages.release(turn.target_pages)
        self.dpages.release(turn.drafter_pages)


__all__ = ["CarriedDrafters", "TurnPlan", "TurnPlanner", "carried_entry", "carry_armed", "check_request",
           "drafter_appends", "drafter_prefill_on"]
