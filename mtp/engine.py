"""The multi-turn session engine: prefix cache, GDN snapshots, and the drafter's context.

A *turn* is one sequence: a prompt (which extends the session's previous full
sequence) decoded to a reply. The engine serves waves of up to ``batch_slots``
turns from distinct sessions: each turn is prefilled on its own batch slot, then
the wave decodes together in one jitted speculative loop.

Per turn, host-side decisions (plain Python over `mtp.carry`'s pure functions):

1. Prefix match against the target prefix cache (block-hash chain -> pages).
2. Path: restore the longest GDN snapshot of the matched prefix when the match is
   at least the Marconi threshold (``restore``), else recompute the recurrent state
   over the prompt while reading, never rewriting, the cached KV (``kv_only``); no
   match at all is ``cold``. The prefill runs in ``SNAPSHOT_INTERVAL``-aligned
   chunks and leaves a snapshot at every aligned boundary it crosses.
3. The drafter's context, by policy (`DRAFTER_POLICIES`):
   ``cold``: no prefix cache, full drafter prefill every turn;
   ``blind``: drafter prefill only when the target prefill started at 0 (the
   reference's guard) -- a restored warm turn starts the drafter empty;
   ``rebuild``: warm turns recompute the target over the whole prompt and redo the
   whole drafter prefill;
   ``carry``: adopt the session's carried rows truncated to the common prefix, and
   append only the tail keys from this turn's captured hiddens.
4. At the turn's end its full blocks enter the prefix cache, and (``carry``) its
   drafter KV, token sequence and session are deposited in a carry slot.

Single-slot carry follows the reference: one slot for the engine, armed only when
a single sequence can be dispatched (`carry.carry_armed_with`). The multi-slot
carry (``carry_slots > 1``) keeps one slot per live session, LRU-bounded, under the
same ownership rules, and stays armed at any batch width. A turn reports what was
armed, not what was configured (`TurnStats.carry_armed`; `CarryOutcome.Disarmed`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct
from jax.sharding import Mesh

from mtp import carry as carry_lib
from mtp import quant, sharding
from mtp.cache.pages import PageAllocator, PagePoolExhausted, block_table_row
from mtp.cache.prefix import PrefixCache, Snapshot, SnapshotStore, TurnEndStore, chain_hashes
from mtp.cache.state import LinearState, TargetCache
from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.metrics import AcceptanceStats
from mtp.model import target
from mtp.generation import positions_reached
from mtp.model.params import Params
from mtp.mtp_head import APPEND_BUCKETS, DrafterCache, append_chunks, append_rows, quantize_head
from mtp.speculative import SpecConfig, greedy_loop, pick_token, speculative_loop

DRAFTER_POLICIES = ("cold", "blind", "rebuild", "carry")
SNAPSHOT_INTERVAL = 64  # prefill chunk and snapshot granularity (a multiple of the page size)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    policy: str = "carry"
    batch_slots: int = 1
    carry_slots: int = 1  # > 1: the multi-slot carry (one per live session, LRU-bounded)
    speculative: bool = True
    mtp_quant: str = "bf16"
    page_size: int = 16
    num_pages: int = 4096
    drafter_pages: int = 4096
    max_context: int = 2048  # prompt + reply tokens one slot can address
    marconi_min_tokens: int = carry_lib.DEFAULT_MARCONI_MIN_TOKENS  # 0: always restore a snapshot
    # How every step runs (kernel paths, GEMM layout, loop graphs; the carry-debug log), the loops' too.
    execution: ExecutionConfig = ExecutionConfig()
    # The one policy object and kill switch; None: as execution's kill switches leave it (`DrafterContext.of`).
    drafter_context: carry_lib.DrafterContext | None = None
    turn_end_snapshots: bool = True  # also snapshot the GDN state at each turn's end
    # Where a turn's drafter is deposited (the carry armed), its decode call rewrites the output's
    # drafter rows from the target's hiddens at its end (`SpecConfig.rebuild_output_rows`), so the
    # entry holds the rows a whole-sequence drafter prefill would, with refeed off too.
    rebuild_output_rows: bool = True
    debug: bool = False

    def __post_init__(self):
        if self.drafter_context is None:
            object.__setattr__(self, "drafter_context", carry_lib.DrafterContext.of(self.execution))
        if self.policy not in DRAFTER_POLICIES:
            raise ValueError(f"unknown drafter policy {self.policy!r}; choose one of {', '.join(DRAFTER_POLICIES)}")
        quant.parse_quant(self.mtp_quant)
        if self.batch_slots < 1 or self.carry_slots < 1:
            raise ValueError("batch_slots and carry_slots must be >= 1")
        if isinstance(self.marconi_min_tokens, bool) or not isinstance(self.marconi_min_tokens, int) \
                or self.marconi_min_tokens < 0:
            raise ValueError(f"marconi_min_tokens={self.marconi_min_tokens!r}: an integer >= 0")
        if SNAPSHOT_INTERVAL % self.page_size:
            raise ValueError(f"page_size {self.page_size} must divide the snapshot interval {SNAPSHOT_INTERVAL}")


@dataclasses.dataclass(frozen=True)
class TurnRequest:
    session_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int


@dataclasses.dataclass
class TurnStats:
    session_id: str
    generation: int
    prompt_len: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    path: str  # cold | restore | kv_only
    prefilled_tokens: int  # target tokens computed at prefill
    drafter_prefilled: int  # drafter rows written by a (whole-prompt) drafter prefill
    drafter_adopted: int  # rows taken over from the carry
    drafter_appended: int  # tail rows the carry appended
    carry_outcome: str  # a `CarryOutcome` kind (``disarmed`` where the carry was not armed)
    carry_armed: bool  # what the carry's state is reported from (DESIGN §3: configured is not armed)
    carry_source: int  # session hash of the adopted rows' owner (0: none adopted)
    ttft_s: float
    # Of ``ttft_s``, the time spent blocked on the device once the turn's start had dispatched
    # its last call; the rest is host work (decisions, dispatches). On a GPU a small model's
    # turn start is host-bound, and this split says which side a policy's extra cost is on.
    ttft_wait_s: float
    start_calls: int  # device calls of the turn's start: page copy, setup, chunks, snapshot reads, further appends
    decode_s: float  # the wave's decode loop, which all its turns share
    wave_turns: int  # turns decoded together in that loop (a throughput charges each 1/wave_turns of it)
    output_len: int  # tokens output, the first (picked by the prefill) included
    acceptance: AcceptanceStats

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["acceptance"] = self.acceptance.as_dict()
        return d


@dataclasses.dataclass
class TurnResult:
    request: TurnRequest
    output: list[int]
    stats: TurnStats


def session_hash(session_id: str) -> int:
    """A stable non-zero 64-bit id for an explicit session name (0 is 'no session')."""
    h = int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "little")
    return h or 1


# ------------------------------------------------------------------ slot-level device ops
def _slot(tree, b):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, b, 1, axis=0), tree)


def _put_slot(tree, b, value):
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v.astype(a.dtype), b, axis=0), tree, value)


@struct.dataclass
class TurnStarts:
    """Per batch slot, the first token its turn's prompt picked and the hidden at the prompt's
    last position (the first propose's input).

    Every prefill chunk writes its slot's row in place (donated), so a chunk's outputs keep
    their device buffers from call to call. On the H200 a chunk's dispatch took 1.06-1.08
    ms with the previous call's fresh outputs still held against 0.70 ms when they reused
    their buffers, synced totals equal (2026-12-01). XLA's command-buffer log (2026-12-01,
    results/engine/engine_h200.md §5) shows the served flow re-recording the chunk's CUDA graphs at
    every call even so (~1.1 ms of host time); process-wide graph-update flags (docs/gpu.md) cut
    that to ~0.3 ms.
    """

    token: jax.Array  # [B] int32
    hidden: jax.Array  # [B, H]

    @classmethod
    def create(cls, batch: int, hidden_size: int, dtype) -> "TurnStarts":
        return cls(token=jnp.zeros((batch,), jnp.int32), hidden=jnp.zeros((batch, hidden_size), dtype))


_CHUNK_META = 5  # after a chunk's tokens: slot, start, token count, write-from, turn (`_chunk_row`)
_FIRST_TOKEN_KEY = 1  # a turn's first token is sampled with fold_in(key(this), the turn's generation)


@functools.partial(jax.jit, static_argnames=("cfg", "width", "temperature", "execution"),
                   donate_argnames=("cache", "hiddens", "dcache", "starts"))
def _prefill_slot(cfg, params, cache: TargetCache, hiddens, dcache: DrafterCache | None, starts: TurnStarts, chunk, *,
                  width: int, temperature: float, execution: ExecutionConfig):
    """One aligned prefill chunk; its hiddens land in the slot's hidden store.

    ``chunk`` is one int32 row (`_chunk_row`): the chunk's ``width`` tokens, then its slot
    ``b``, start, token count, the position KV is written from and the turn, then, with ``dcache``,
    a drafter append (a row of `_drafter_appends`): the drafter rows that read the hiddens
    written so far are appended in the same call. A turn's last chunk carries its first
    drafter append, so a carry's tail costs neither a dispatch nor a host-to-device copy of
    its own (on a GPU a small model's warm TTFT is mostly dispatches, and each host array
    an argument costs one copy: a chunk took 1.49 ms with its arguments on the device
    against 1.87 ms with five host arrays). The slot's first token is picked here too, from
    the chunk's last position, into ``starts`` (the last chunk's pick is the turn's), so that
    a turn's start dispatches nothing after its last chunk; sampled, its key depends on the
    turn alone (not on how many chunks ran before), so every policy draws the same number for
    the same turn. Returns the cache, the hidden store, the drafter cache (None without one)
    and ``starts``.
    """
    tokens, b, start, num_new, write_from, turn = (chunk[:, :width], chunk[0, width], chunk[:, width + 1],
                                                   chunk[:, width + 2], chunk[:, width + 3], chunk[0, width + 4])
    view = cache.replace(linear=_slot(cache.linear, b), block_tables=_slot(cache.block_tables, b),
                         lengths=_slot(cache.lengths, b))
    view, out = target.prefill(cfg, params, view, tokens, start, num_new, write_from, execution=execution)
    h = out.mtp_hidden(cfg.mtp_hidden_source).astype(hiddens.dtype)
    hiddens = jax.lax.dynamic_update_slice(hiddens, h, (b, start[0], 0))
    cache = cache.replace(kv=view.kv, linear=_put_slot(cache.linear, b, view.linear),
                          lengths=_put_slot(cache.lengths, b, view.lengths))
    if dcache is not None:
        dcache = _append_of_slot(cfg, params, dcache, hiddens, b, chunk[:, width + _CHUNK_META:], execution=execution)
    last = num_new[0] - 1
    token = pick_token(out.logits[:, last], temperature, jax.random.fold_in(jax.random.key(_FIRST_TOKEN_KEY), turn))
    hidden = jax.lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False).astype(starts.hidden.dtype)
    starts = TurnStarts(token=jax.lax.dynamic_update_slice(starts.token, token, (b,)),
                        hidden=jax.lax.dynamic_update_slice(starts.hidden, hidden, (b, 0)))
    return cache, hiddens, dcache, starts


def _chunk_row(slot: int, tokens, start: int, width: int, write_from: int, turn: int, append=None) -> np.ndarray:
    """`_prefill_slot`'s ``chunk``: ``tokens`` padded to ``width``, then slot, start, count,
    write-from and turn (its generation), then ``append`` (a row of `_drafter_appends`) if given."""
    row = np.zeros((1, width + _CHUNK_META), np.int32)
    row[0, : len(tokens)] = tokens
    row[0, width:] = slot, start, len(tokens), write_from, turn
    return row if append is None else np.concatenate([row, append], axis=1)


_linear_of_slot = jax.jit(lambda linear, b: _slot(linear, b))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy_page(cache: TargetCache, src_dst):
    """Copy one KV page (every attention layer): a shared partial page is extended in a copy.

    ``src_dst``: the two page ids in one array (one host-to-device copy)."""
    src, dst = src_dst[0], src_dst[1]
    return cache.replace(kv=cache.kv.replace(k=tuple(k.at[dst].set(k[src]) for k in cache.kv.k),
                                             v=tuple(v.at[dst].set(v[src]) for v in cache.kv.v)))


def _with_table_row(cache: TargetCache | DrafterCache, b, row):
    return cache.replace(block_tables=jax.lax.dynamic_update_slice_in_dim(cache.block_tables, row[None], b, axis=0))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _set_slot_table(cache: TargetCache | DrafterCache, b, row):
    """Slot ``b``'s block-table row set on the device: no read-back of the table, so the
    host never waits for the device's queued work at a turn's end."""
    return _with_table_row(cache, b, row)


@functools.partial(jax.jit, donate_argnames=("cache", "dcache"))
def _begin_turn(cache: TargetCache, dcache: DrafterCache | None, setup, linear: LinearState | None):
    """A turn's slot state in one call: its target block table, the Gated DeltaNet state it
    restores (``linear``, or None), and its drafter's block table, resident rows and newest
    key (with ``dcache``).

    ``setup`` is one int32 row (`_setup_row`): slot, drafter rows, newest key, then the
    target's and the drafter's table rows. On the H200 each small call cost 0.17-0.25 ms,
    mostly its host arrays' copies; three calls with seven host arrays became one with one.
    """
    b, width = setup[0], cache.block_tables.shape[1]
    cache = _with_table_row(cache, b, setup[3: 3 + width])
    if linear is not None:
        cache = cache.replace(linear=_put_slot(cache.linear, b, linear))
    if dcache is not None:
        dcache = _with_table_row(dcache, b, setup[3 + width:])
        dcache = dcache.replace(rows=dcache.rows.at[b].set(setup[1]),
                                last_pair_key=dcache.last_pair_key.at[b].set(setup[2]))
    return cache, dcache


def _setup_row(slot: int, target_table, drafter_table, rows: int, last_key: int) -> np.ndarray:
    """`_begin_turn`'s ``setup``."""
    return np.concatenate([np.array([slot, rows, last_key], np.int32), target_table, drafter_table])


def _append_of_slot(cfg, params, dcache: DrafterCache, hiddens, b, append, *, execution: ExecutionConfig):
    """Drafter rows for keys ``first_key ...`` of slot ``b``; key ``k`` reads ``hiddens[b, k]``.

    ``append``: one int32 row of `_drafter_appends`, the tokens, then first key and count."""
    w = append.shape[1] - 2
    tokens, first_key, count = append[:, :w], append[:, w], append[:, w + 1]
    keys = jnp.clip(first_key[:, None] + jnp.arange(tokens.shape[1])[None, :], 0, hiddens.shape[1] - 1)
    h = jnp.take(jax.lax.dynamic_index_in_dim(hiddens, b, axis=0, keepdims=False), keys[0], axis=0)[None]
    view = dcache.replace(block_tables=_slot(dcache.block_tables, b), rows=_slot(dcache.rows, b),
                          last_pair_key=_slot(dcache.last_pair_key, b))
    view = append_rows(cfg, params, view, tokens, h, first_key, count, execution=execution)
    return dcache.replace(kv=view.kv, rows=_put_slot(dcache.rows, b, view.rows),
                          last_pair_key=_put_slot(dcache.last_pair_key, b, view.last_pair_key))


_append_slot = functools.partial(jax.jit, static_argnames=("cfg", "execution"), donate_argnames=("dcache",))(
    _append_of_slot)


def _drafter_appends(prompt, first_key, count) -> list[np.ndarray]:
    """One int32 row per `append_chunks` call that writes drafter rows for keys ``first_key ..
    first_key + count - 1`` (key ``k`` pairs ``prompt[k + 1]`` with the hidden at ``k``): the
    call's tokens (zero past ``count``), then its first key and row count. Reads only the
    tail it appends, so a carry's turn start does not walk the whole session."""
    out = []
    for off, width in append_chunks(count):
        key, n = first_key + off, min(width, count - off)
        row = np.zeros((1, width + 2), np.int32)
        row[0, :n] = prompt[key + 1: key + 1 + n]
        row[0, width:] = key, n
        out.append(row)
    return out


# ------------------------------------------------------------------ the engine
@dataclasses.dataclass
class _Live:
    """A turn on a batch slot: first reserved (every page held, every decision made), then started."""

    request: TurnRequest
    slot: int
    generation: int
    session: int
    hashes: list[bytes]
    cached: int  # prompt tokens whose KV the cache holds: the target prefill writes from here
    snap: Snapshot | None  # the GDN state the target prefill continues from
    hidden_range: carry_lib.StoreRange  # the slot's hidden store once the target prefill has run
    target_pages: list[int]
    drafter_pages: list[int]  # what the turn holds; an adopted entry's pages join when it starts
    # Stays in `Engine.carried` until the turn starts, so rolling back a reservation never
    # has to re-deposit it (and no append of this turn can have overwritten its rows).
    adopted: carry_lib.CarriedDrafter | None
    drafter_rows: tuple[int, int]  # (rows, last pair key) installed before any append
    plan: carry_lib.AppendPlan | None
    stats: TurnStats


class Engine:
    """Serves waves of turns; owns the page pools, the caches, the prefix and snapshot stores and
    the carried drafters.

    With ``mesh`` (``params`` laid out on it by `mtp.sharding.shard_params` or
    `load_sharded`), the caches are made in their shards, the captured hiddens and
    block tables live whole on every device, and every jitted step runs partitioned
    under ``jax.set_mesh``: a checkpoint too large for one device serves the same
    sessions, and all host-side decisions (prefix match, path, carry) are unchanged.
    """

    def __init__(self, cfg: ModelConfig, params: Params, engine_cfg: EngineConfig, spec: SpecConfig,
                 mesh: Mesh | None = None):
        if engine_cfg.speculative and not cfg.has_mtp:
            raise ValueError("speculative decoding needs a checkpoint with an MTP head")
        if spec.execution not in (ExecutionConfig(), engine_cfg.execution):
            raise ValueError("SpecConfig.execution differs from EngineConfig.execution; the engine runs every "
                             "step, its loops included, with EngineConfig.execution: set it there")
        with sharding.on_mesh(mesh):
            self._init(cfg, params, engine_cfg, spec, mesh)

    def _init(self, cfg, params, engine_cfg, spec, mesh):
        self.cfg, self.ecfg, self.mesh = cfg, engine_cfg, mesh
        self.multi_slot_carry = engine_cfg.carry_slots > 1
        # The loop rewrites the output's rows only where they outlive it (`EngineConfig.rebuild_output_rows`).
        self.spec = dataclasses.replace(spec, rebuild_output_rows=engine_cfg.rebuild_output_rows and self.carry_armed,
                                        execution=engine_cfg.execution)
        self.params = params
        self.head_params = (quantize_head(params, engine_cfg.mtp_quant, execution=engine_cfg.execution)
                            if engine_cfg.speculative else params)
        self.dtype = params["model"]["embed_tokens"]["weight"].dtype
        self.marconi = engine_cfg.marconi_min_tokens
        ps = engine_cfg.page_size
        self.max_blocks = math.ceil((engine_cfg.max_context + spec.verify_width + 1) / ps)
        b = engine_cfg.batch_slots
        self.pages = PageAllocator(engine_cfg.num_pages, ps, "target KV")
        self.dpages = PageAllocator(engine_cfg.drafter_pages, ps, "drafter KV")
        self.prefix = PrefixCache(self.pages)
        self.snapshots = SnapshotStore(SNAPSHOT_INTERVAL, ps)
        self.turn_ends = TurnEndStore(self.pages, max(8, 2 * engine_cfg.carry_slots, 2 * b))
        self.cache = sharding.create_cache(TargetCache, cfg, mesh, b, engine_cfg.num_pages, ps, self.max_blocks,
                                           self.dtype)
        self.dcache = sharding.create_cache(DrafterCache, cfg, mesh, b, engine_cfg.drafter_pages, ps,
                                            self.max_blocks, self.dtype)
        # The captured target hiddens, indexed by absolute position (one row per
        # position, a prefill chunk of headroom); who wrote them is `hidden_ranges`.
        self.hiddens = sharding.replicated(
            jnp.zeros((b, self.max_blocks * ps + SNAPSHOT_INTERVAL, cfg.hidden_size), self.dtype), mesh)
        self.hidden_ranges = [carry_lib.StoreRange.EMPTY] * b
        self.carried: collections.OrderedDict[int, carry_lib.CarriedDrafter] = collections.OrderedDict()
        self._tickets = itertools.count(1)
        self._rng = jax.random.key(0)
        self.starts = sharding.replicated(TurnStarts.create(b, cfg.hidden_size, self.dtype), mesh)

    # -------------------------------------------------------------- policy switches
    @property
    def carry_armed(self) -> bool:
        """Configured is not armed: this is what any report of the carry's state must show."""
        ctx = self.ecfg.drafter_context
        if self.ecfg.policy != "carry" or not self.ecfg.speculative:
            return False
        if not quant.supports_drafter_prefill(self.ecfg.mtp_quant):
            return False
        if self.multi_slot_carry:
            return ctx.carry
        return carry_lib.carry_armed_with(ctx, multi_seq=self.ecfg.batch_slots > 1)

    @property
    def drafter_prefill_on(self) -> bool:
        return (self.ecfg.speculative and self.ecfg.drafter_context.prefill
                and quant.supports_drafter_prefill(self.ecfg.mtp_quant))

    # -------------------------------------------------------------- page helpers
    def _alloc(self, count: int) -> list[int]:
        if count > self.pages.num_free:
            self.prefix.evict(count - self.pages.num_free)
        if count > self.pages.num_free:
            self.turn_ends.evict(count - self.pages.num_free)
        return self.pages.allocate(count)

    def _set_target_table(self, slot: int, pages):
        self.cache = _set_slot_table(self.cache, slot, block_table_row(pages, self.max_blocks))

    def _set_drafter_table(self, slot: int, pages):
        self.dcache = _set_slot_table(self.dcache, slot, block_table_row(pages, self.max_blocks))

    # -------------------------------------------------------------- prefill of one turn
    def _target_prefill(self, slot, prompt, hashes, start, cached, gen, sess, appends):
        """Prefill of ``prompt[start:]`` in chunks that end on multiples of ``SNAPSHOT_INTERVAL``.

        ``start`` is 0, a prefill snapshot's position (a multiple), or a turn end's
        length (anywhere). Ending chunks on absolute multiples keeps every snapshot this
        prefill leaves where `SnapshotStore` looks for it, and from 0 or a prefill
        snapshot gives the chunks (so the chunked recurrence's arithmetic) a prefill
        from 0 would run. A turn-end start is off that grid: its first chunk is short
        and the state it continues was built by the decode loop in verify-sized steps,
        so that state, and the snapshots this prefill then leaves, may differ by
        rounding from what a recompute would produce; no exactness is claimed there.
        The hiddens of positions ``start..L-1`` land in the slot's hidden store.
        ``appends`` (`_drafter_appends`) then run, the first inside the last chunk's call.
        The turn's first token and the hidden at ``L-1`` land in the slot's `TurnStarts` row.
        Returns how many calls it dispatched.
        """
        n = len(prompt)
        chunk = SNAPSHOT_INTERVAL
        pos, calls = start, 0
        while pos < n:
            end = min(n, (pos // chunk + 1) * chunk)
            fused = end == n and appends
            self.cache, self.hiddens, dcache, self.starts = self._prefill_chunk(
                _chunk_row(slot, prompt[pos:end], pos, chunk, cached, gen, appends[0] if fused else None),
                self.dcache if fused else None)
            if fused:
                self.dcache = dcache
            calls += 1
            if end % chunk == 0 and end < n:
                lin = _linear_of_slot(self.cache.linear, slot)
                self.snapshots.put(hashes, Snapshot(end, lin.conv, lin.recurrent, sess, gen))
                calls += 1
            pos = end
        for row in appends[1:]:
            self.dcache = _append_slot(self.cfg, self.head_params, self.dcache, self.hiddens, slot, row,
                                       execution=self.spec.execution)
        return calls + len(appends[1:])

    def _prefill_chunk(self, row, dcache):
        return _prefill_slot(self.cfg, self.head_params, self.cache, self.hiddens, dcache, self.starts, row,
                             width=SNAPSHOT_INTERVAL, temperature=self.spec.temperature,
                             execution=self.spec.execution)

    def _check_request(self, req: TurnRequest):
        """Refuse a request this engine cannot serve, before any turn of its wave takes a page."""
        n = len(req.prompt)
        if n < 2:
            raise ValueError(f"session {req.session_id}: a prompt needs at least 2 tokens, got {n}")
        if n + req.max_new_tokens > self.ecfg.max_context:
            raise ValueError(f"session {req.session_id}: prompt of {n} tokens + {req.max_new_tokens} new tokens "
                             f"exceeds the engine's max_context={self.ecfg.max_context}")
        if req.max_new_tokens > self.spec.max_new_tokens:
            raise ValueError(f"session {req.session_id}: max_new_tokens={req.max_new_tokens} exceeds the compiled "
                             f"loop's buffer SpecConfig.max_new_tokens={self.spec.max_new_tokens}")
        width = self.spec.verify_width if self.ecfg.speculative else self.spec.plain_width
        reach = positions_reached(n, req.max_new_tokens, width)
        if reach > self.cfg.max_position_embeddings:
            raise ValueError(f"session {req.session_id}: prompt of {n} tokens + {req.max_new_tokens} new tokens runs "
                             f"the model at {reach} positions ({width}-row decode steps), more than the "
                             f"checkpoint's max_position_embeddings={self.cfg.max_position_embeddings}")

    def _reserve_turn(self, req: TurnRequest, slot: int, wave_sessions: set[int]) -> _Live:
        """Take every page a turn needs and make its path and carry decisions; write no device state
        but the copy of a turn end's partial page into the turn's own first page.

        Raises (`PagePoolExhausted`) holding nothing and with the carry untouched, so
        a wave can reserve all its turns before starting any and give the
        reservations back if one fails. Prefix-cache and turn-end entries the target
        pool evicted on the way stay evicted: they are caches, and nobody lost a page.
        """
        t0 = time.perf_counter()
        prompt = list(req.prompt)
        n = len(prompt)
        need = n + req.max_new_tokens + self.spec.verify_width + 1
        gen, sess = next(self._tickets), session_hash(req.session_id)
        ps = self.ecfg.page_size
        hashes = chain_hashes(prompt, ps)
        use_prefix = self.ecfg.policy != "cold"
        with contextlib.ExitStack() as undo:
            shared = self.prefix.match(hashes, (n - 1) // ps) if use_prefix else []
            self.pages.share(shared)  # before allocating, so eviction cannot free a page this turn reads
            undo.callback(self.pages.release, shared)
            own = self._alloc(math.ceil(need / ps) - len(shared))
            undo.callback(self.pages.release, own)
            cached = len(shared) * ps

            # Path: restore a snapshot, or recompute the recurrent state (KV-only), or cold.
            # Candidates: the longest page-aligned prefill snapshot within the cached
            # pages, and the end state of an earlier turn this prompt extends (its
            # partial last page is then copied into this sequence's first own page,
            # now, before another turn's allocation can evict the entry holding it).
            snap, turn_end, copies = None, None, 0
            if use_prefix and self.ecfg.turn_end_snapshots:
                turn_end = self.turn_ends.match(prompt, len(shared))
            matched = max(cached, turn_end.length if turn_end else 0)
            warm = matched > 0
            if warm and matched >= self.marconi and self.ecfg.policy != "rebuild":
                snap = self.snapshots.best(hashes, cached)
                if turn_end is not None and (snap is None or turn_end.length > snap.position):
                    snap = turn_end.snapshot
                    if turn_end.tail_page is not None:
                        self.cache = _copy_page(self.cache, np.array([turn_end.tail_page, own[0]], np.int32))
                        copies = 1
                    cached = turn_end.length
            path = "cold" if not warm else ("restore" if snap else "kv_only")
            start = snap.position if snap else 0
            stats = TurnStats(session_id=req.session_id, generation=gen, prompt_len=n, cached_tokens=cached,
                              path=path, prefilled_tokens=n - start, drafter_prefilled=0, drafter_adopted=0,
                              drafter_appended=0, carry_outcome=carry_lib.CarryOutcome.Disarmed.kind,
                              carry_armed=self.carry_armed,
                              carry_source=0, ttft_s=0.0, ttft_wait_s=0.0, start_calls=copies, decode_s=0.0,
                              wave_turns=1, output_len=0, acceptance=AcceptanceStats())
            lv = _Live(request=req, slot=slot, generation=gen, session=sess, hashes=hashes, cached=cached, snap=snap,
                       hidden_range=carry_lib.stamped_merge(self.hidden_ranges[slot], gen, start, n - start),
                       target_pages=shared + own, drafter_pages=[], adopted=None, drafter_rows=(0, -1), plan=None,
                       stats=stats)
            if self.ecfg.speculative:
                self._reserve_drafter(lv, prompt, need, wave_sessions)
            undo.pop_all()
        stats.ttft_s = time.perf_counter() - t0
        return lv

    # -------------------------------------------------------------- the drafter's context
    def _reserve_drafter(self, lv: _Live, prompt, need, wave_sessions):
        """Decide the carry over the hidden range the target prefill will leave, and take the pages."""
        entry, refused = None, None
        outcome: carry_lib.CarryOutcome = carry_lib.CarryOutcome.Disarmed()
        if self.carry_armed:
            entry = self.carried.get(lv.session) if self.multi_slot_carry else next(iter(self.carried.values()), None)
            adopted, lv.plan, outcome = carry_lib.adopt(entry, prompt, lv.session, lv.hidden_range, lv.generation)
            if adopted is None:
                refused, entry = entry, None  # a refusal frees the entry's blocks
            else:
                lv.adopted, lv.drafter_rows = entry, adopted
                lv.stats.drafter_adopted = adopted[0]
                lv.stats.carry_source = entry.session_hash
            lv.stats.carry_outcome = outcome.kind
        held = len(entry.block_table) if entry is not None else 0
        lv.drafter_pages = self._alloc_drafter(max(0, math.ceil(need / self.ecfg.page_size) - held), refused,
                                               wave_sessions)
        if self.ecfg.debug or self.ecfg.execution.carry_debug:
            logging.info("carry gen=%d session=%x slot=%d: %s", lv.generation, lv.session, lv.slot, outcome)

    def _alloc_drafter(self, count: int, refused, wave_sessions) -> list[int]:
        """``count`` drafter pages, after freeing ``refused`` (an entry the carry just refused)
        and, while still short, the carried entries of sessions outside ``wave_sessions``,
        least recently deposited first.

        Carried drafters are a cache, as the target's prefix cache is: dropping one
        costs its session the drafter's context on a later warm turn (a cold drafter
        or a whole-prompt drafter prefill), never a wrong token, and live turns' pages
        are never taken. The wave's own sessions are spared because they are about
        to adopt theirs. Nothing is freed unless the allocation then succeeds, so
        running dry leaves every entry in place.
        """
        drop = [refused] if refused is not None else []
        avail = self.dpages.num_free + sum(len(e.block_table) for e in drop)
        for sess, e in self.carried.items():
            if avail >= count:
                break
            if sess not in wave_sessions and e is not refused:
                drop.append(e)
                avail += len(e.block_table)
        if avail < count:
            raise PagePoolExhausted(
                f"drafter KV page pool exhausted: a turn needs {count} pages of {self.ecfg.page_size} tokens; "
                f"{self.dpages.num_free} of {self.dpages.num_pages - 1} are free and the carried drafters it may "
                f"evict hold {avail - self.dpages.num_free}; nothing was freed")
        for e in drop:
            self._drop_carry(e)
        return self.dpages.allocate(count)

    def _start_turn(self, lv: _Live):
        """Set up a reserved turn's slot, run its prefills; nothing here allocates."""
        t0 = time.perf_counter()
        prompt, slot = list(lv.request.prompt), lv.slot
        start = lv.snap.position if lv.snap else 0
        drafter_pages, appends = self._drafter_start(lv, prompt, start) if self.ecfg.speculative else ([], [])
        self.cache, dcache = _begin_turn(
            self.cache, self.dcache if self.ecfg.speculative else None,
            _setup_row(slot, block_table_row(lv.target_pages, self.max_blocks),
                       block_table_row(drafter_pages, self.max_blocks), *lv.drafter_rows),
            LinearState(lv.snap.conv, lv.snap.recurrent) if lv.snap is not None else None)
        if self.ecfg.speculative:
            self.dcache = dcache
        # The chunks overwrite the slot's hidden store as they go: until the prefill is
        # done, nothing in it is vouched for.
        self.hidden_ranges[slot] = carry_lib.StoreRange.EMPTY
        try:
            calls = self._target_prefill(slot, prompt, lv.hashes, start, lv.cached, lv.generation, lv.session,
                                         appends)
        except BaseException:
            if lv.adopted is not None:  # still carried: the appends may have written over its rows past the kept
                self.carried[lv.adopted.session_hash] = self._kept_part(lv)
            raise
        self.hidden_ranges[slot] = lv.hidden_range
        if lv.adopted is not None:  # the prefill (and the append in it) ran: the blocks are this turn's now
            del self.carried[lv.adopted.session_hash]
            lv.drafter_pages = list(lv.adopted.block_table) + lv.drafter_pages
        dispatched = time.perf_counter()
        jax.block_until_ready((self.starts.token, self.dcache.rows))
        done = time.perf_counter()
        lv.stats.ttft_s += done - t0
        lv.stats.ttft_wait_s = done - dispatched
        lv.stats.start_calls += 1 + calls  # the setup, then the prefill's

    def _drafter_start(self, lv: _Live, prompt, start) -> tuple[list[int], list[np.ndarray]]:
        """The turn's drafter pages in table order, and the appends that the target prefill
        then runs (`_drafter_appends`): the carry's tail, or a whole-prompt prefill.

        An adopted entry's blocks head the slot's table, but the entry stays in
        `Engine.carried` (and its pages out of ``lv.drafter_pages``) until the prefill has
        run, so a turn that fails to start leaves the session its carry (`_kept_part`: the
        appends start after the rows the turn kept, which a truncated adoption leaves
        fewer than the entry's).
        """
        pages = (list(lv.adopted.block_table) if lv.adopted is not None else []) + lv.drafter_pages
        if lv.plan is not None:
            lv.stats.drafter_appended = lv.plan.rows
            return pages, _drafter_appends(prompt, lv.plan.first_key, lv.plan.rows)
        if lv.drafter_rows[0] == 0 and self.drafter_prefill_on and start == 0:
            # A whole-prompt drafter prefill needs the hiddens of every prompt position,
            # so it runs only when the target prefill started at 0 (the reference's guard).
            lv.stats.drafter_prefilled = len(prompt) - 1
            return pages, _drafter_appends(prompt, 0, len(prompt) - 1)
        return pages, []

    @staticmethod
    def _kept_part(lv: _Live) -> carry_lib.CarriedDrafter:
        """The entry ``lv`` adopted, cut to the rows it kept: all a turn that went no further can
        hand back, since its appends and drafts wrote from the kept rows on."""
        return lv.adopted.cut(*lv.drafter_rows)

    def precompile(self) -> None:
        """Compile a turn's setup, the prefill chunk and, speculative, every drafter-append width,
        standalone and inside a turn's last prefill chunk, so that no timed turn compiles.

        Runs each program once on slot 0 with nothing to write (its own setup, a prefill of
        0 tokens from position 0, appends of 0 rows). What it leaves: garbage in slot 0's
        hidden store, which is marked empty (the next turn on slot 0 prefills every hidden
        it reads); no page is written, and slot 0's tables, lengths, recurrent state and
        drafter rows are left as they were. Call it between waves, never with a turn in flight.
        """
        chunk = _chunk_row(0, [], 0, SNAPSHOT_INTERVAL, 0, 0)
        spec = self.ecfg.speculative
        with sharding.on_mesh(self.mesh):
            setup = _setup_row(0, np.asarray(self.cache.block_tables[0]), np.asarray(self.dcache.block_tables[0]),
                               int(self.dcache.rows[0]), int(self.dcache.last_pair_key[0]))
            for linear in (None, _linear_of_slot(self.cache.linear, 0)):
                self.cache, dcache = _begin_turn(self.cache, self.dcache if spec else None, setup, linear)
                if spec:
                    self.dcache = dcache
            # The calls exactly as `_target_prefill` makes them (an omitted default would be
            # another jit signature, compiled again by the first turn).
            self.cache, self.hiddens, _, self.starts = self._prefill_chunk(chunk, None)
            for width in APPEND_BUCKETS if spec else ():
                empty = np.zeros((1, width + 2), np.int32)
                self.dcache = _append_slot(self.cfg, self.head_params, self.dcache, self.hiddens, 0, empty,
                                           execution=self.spec.execution)
                self.cache, self.hiddens, self.dcache, self.starts = self._prefill_chunk(
                    _chunk_row(0, [], 0, SNAPSHOT_INTERVAL, 0, 0, empty), self.dcache)
        self.hidden_ranges[0] = carry_lib.StoreRange.EMPTY

    def _drop_carry(self, entry: carry_lib.CarriedDrafter):
        self.carried.pop(entry.session_hash, None)
        self.dpages.release(list(entry.block_table))

    # -------------------------------------------------------------- a wave of turns
    def run_wave(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        """Serve up to ``batch_slots`` turns of distinct sessions, decoded together.

        A wave that fails before its decode ends gives back everything its turns
        took: every request is checked before any turn takes a page, and every turn
        reserves its pages and carry entry before any turn starts, so no turn has
        consumed a carried entry when another runs dry; a turn that had started hands
        the entry it adopted back, cut to the rows it kept (`_abandon`). What a
        reservation freed for good stays freed: a refused carry entry (a retry would
        refuse it again), and cache or carry entries evicted to make room. A turn that fails
        at its end, after its decode, releases its pages, the adopted rows among them: its
        session's next turn starts without a carry (`_finish_turn`).
        """
        with sharding.on_mesh(self.mesh):
            return self._run_wave(requests)

    def _run_wave(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        b = self.ecfg.batch_slots
        if len(requests) > b:
            raise ValueError(f"{len(requests)} requests for {b} batch slots")
        sessions = [r.session_id for r in requests]
        if len(set(sessions)) != len(sessions):
            raise ValueError("a wave may hold at most one turn per session")
        for r in requests:
            self._check_request(r)
        wave_sessions = {session_hash(s) for s in sessions}
        with contextlib.ExitStack() as held:
            live = []
            for i, r in enumerate(requests):
                live.append(self._reserve_turn(r, i, wave_sessions))
                held.callback(self._abandon, live[-1])
            for lv in live:
                self._start_turn(lv)
            toks, n, metrics, decode_s = self._decode(live)
            held.pop_all()
        results = []
        for lv in live:
            out = toks[lv.slot, : n[lv.slot]].tolist()
            lv.stats.decode_s = decode_s
            lv.stats.wave_turns = len(live)
            lv.stats.output_len = len(out)
            if metrics is not None:
                lv.stats.acceptance = AcceptanceStats.from_metrics(metrics, [lv.slot])
            results.append(TurnResult(lv.request, out, lv.stats))
        with contextlib.ExitStack() as finishing:  # runs every callback, last in first, even after one raised
            for lv, r in reversed(list(zip(live, results))):
                finishing.callback(self._finish_turn, lv, list(r.request.prompt) + r.output)
        return results

    def _decode(self, live: list[_Live]):
        budget = np.zeros((self.ecfg.batch_slots,), np.int32)  # 0: an idle slot, done from the start
        for lv in live:
            budget[lv.slot] = lv.request.max_new_tokens
        first, hidden, spec = self.starts.token, self.starts.hidden, self.spec
        self._rng, key = jax.random.split(self._rng)
        t0 = time.perf_counter()
        if self.ecfg.speculative:
            self.cache, self.dcache, toks, n, metrics = speculative_loop(
                self.cfg, self.head_params, self.cache, self.dcache, first, hidden, jnp.asarray(budget), spec, key)
        else:
            self.cache, toks, n = greedy_loop(self.cfg, self.params, self.cache, first, jnp.asarray(budget), spec,
                                              key)
            metrics = None
        toks, n = np.asarray(toks), np.asarray(n)
        return toks, n, metrics, time.perf_counter() - t0

    def _abandon(self, lv: _Live):
        """Undo a turn of a wave that failed before it finished: its pages go back, and an entry
        it adopted and took over (its prefill ran) goes back to the carry (`_kept_part`)."""
        if lv.adopted is not None and lv.adopted.session_hash not in self.carried:
            self.carried[lv.adopted.session_hash] = self._kept_part(lv)
            lv.drafter_pages = lv.drafter_pages[len(lv.adopted.block_table):]
        self._release(lv)

    def _release(self, lv: _Live):
        """Give back every page a turn holds, without registering or depositing anything."""
        self.pages.release(lv.target_pages)
        self.dpages.release(lv.drafter_pages)
        self._set_target_table(lv.slot, [])
        self._set_drafter_table(lv.slot, [])

    def _finish_turn(self, lv: _Live, full: list[int]):
        """Register full blocks and the end state, deposit the drafter, release the turn's pages.

        The consistency check runs before anything is registered, so a turn whose end
        state is inconsistent leaves nothing behind that describes other tokens; and the
        pages are released whatever raises, so a turn that fails at its end leaks nothing.
        """
        ps = self.ecfg.page_size
        valid = int(self.cache.lengths[lv.slot])  # every token but the last is in the cache
        try:
            if valid != len(full) - 1:
                raise RuntimeError(f"session {lv.request.session_id}: the cache holds {valid} positions for a "
                                   f"sequence of {len(full)} tokens; its KV, snapshot and carry would describe "
                                   f"other tokens")
            entry = self._carried_entry(lv, full) if self.carry_armed else None
            if self.ecfg.policy != "cold":
                hashes = chain_hashes(full[:valid], ps)
                self.prefix.insert(hashes, lv.target_pages[: len(hashes)])
                if self.ecfg.turn_end_snapshots:
                    lin = _linear_of_slot(self.cache.linear, lv.slot)
                    tail = lv.target_pages[valid // ps] if valid % ps else None
                    self.turn_ends.put(full[:valid], tail,
                                       Snapshot(valid, lin.conv, lin.recurrent, lv.session, lv.generation))
            if self.carry_armed:  # the deposit replaces the previous entry, even with nothing to hold
                if not self.multi_slot_carry:
                    for old in list(self.carried.values()):
                        self._drop_carry(old)
                elif lv.session in self.carried:
                    self._drop_carry(self.carried[lv.session])
            if entry is not None:
                self.carried[lv.session] = entry
                lv.drafter_pages = []  # the carry slot owns them now
                while len(self.carried) > self.ecfg.carry_slots:
                    self._drop_carry(next(iter(self.carried.values())))
        finally:
            self._release(lv)

    def _carried_entry(self, lv: _Live, full: list[int]) -> carry_lib.CarriedDrafter | None:
        """The slot's drafter as the entry ``full`` leaves, its keys cut at ``len(full) - 2``;
        None when no row survives the cut (nothing to hold: its pages go back at the turn's end).

        A turn cut short by its budget or by an EOS inside an accepted run of drafts
        holds rows for keys past the tokens it output (the drafts were verified, not
        emitted); the cut, `CarriedDrafter.usable_by` against ``full`` itself, keeps an
        entry's rows within the sequence it names.
        """
        last = int(self.dcache.last_pair_key[lv.slot])
        entry = carry_lib.CarriedDrafter(block_table=tuple(lv.drafter_pages), rows=int(self.dcache.rows[lv.slot]),
                                         last_pair_key=last if last >= 0 else None, tokens=tuple(full),
                                         session_hash=lv.session)
        kept = entry.usable_by(full, lv.session)
        return None if kept is None else entry.cut(*kept)


# ------------------------------------------------------------------ sessions of turns
class TextPrompts:
    """Forms each turn's prompt from a session's text, by token append or by re-rendering.

    ``append``: the previous full sequence's ids plus the encoded user suffix (the
    serving engine's view; prompts strictly extend the previous sequence).
    ``rerender``: the whole conversation rendered as text and tokenized afresh, as a
    chat client does, so turn boundaries may re-tokenize.
    """

    MODES = ("append", "rerender")

    def __init__(self, tokenizer, preamble: str, mode: str = "append"):
        if mode not in self.MODES:
            raise ValueError(f"unknown prompt mode {mode!r}; choose one of {', '.join(self.MODES)}")
        self.tokenizer, self.preamble, self.mode = tokenizer, preamble, mode

    def prompt(self, session, turn_index: int, prev_full: list[int] | None, history) -> list[int]:
        from mtp.data import sessions as S

        user = session.turns[turn_index].user
        if prev_full is None:
            return S.first_prompt_ids(self.preamble, user, self.tokenizer)
        if self.mode == "append":
            return S.next_prompt_ids_append(prev_full, user, self.tokenizer)
        return S.next_prompt_ids_rerender(self.preamble, history, user, self.tokenizer)

    def reply_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def session_waves(engine: Engine, sessions, prompts):
    """Serve every turn of every session, one wave of up to ``batch_slots`` distinct sessions
    per step of this generator, which yields each wave's results.

    Turn ``i`` of a session is served only after its turn ``i - 1`` (its prompt
    extends that turn's full sequence). Sessions take slots in order, so with one
    slot each session runs to its end before the next begins. A caller that advances
    several engines' generators in turn serves them side by side, each on exactly the
    schedule it would follow alone.
    """
    state = {s.session_id: (0, None, []) for s in sessions}  # next turn, prev full ids, history
    pending = collections.deque(sessions)
    while pending:
        wave = []
        for s in list(pending):
            if len(wave) == engine.ecfg.batch_slots:
                break
            wave.append(s)
        reqs = []
        for s in wave:
            i, prev, history = state[s.session_id]
            ids = prompts.prompt(s, i, prev, history)
            reqs.append(TurnRequest(s.session_id, tuple(ids), s.turns[i].max_new_tokens))
        results = engine.run_wave(reqs)
        for s, res in zip(wave, results):
            i, prev, history = state[s.session_id]
            history = history + [(s.turns[i].user, prompts.reply_text(res.output))]
            state[s.session_id] = (i + 1, list(res.request.prompt) + res.output, history)
            if i + 1 == len(s.turns):
                pending.remove(s)
        yield results


def run_sessions(engine: Engine, sessions, prompts, on_turn=None) -> list[TurnResult]:
    """Every turn of every session (`session_waves`), in the order served."""
    results = []
    for wave in session_waves(engine, sessions, prompts):
        for res in wave:
            results.append(res)
            if on_turn is not None:
                on_turn(res)
    return results
