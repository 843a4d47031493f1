"""The jitted device steps of a turn's start and end, each on one batch slot of the engine's caches.

Every step donates the caches it updates, so a turn's start rewrites them in place, and
takes its small integer arguments as one packed row (`mtp.serving.metadata`): one
host-to-device copy per call, unpacked by static slices. Shapes are fixed per engine (the
chunk width, the `APPEND_BUCKETS` widths, the block-table width), so a served turn
compiles nothing that `DeviceState.precompile` did not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from mtp.cache.state import LinearState, TargetCache
from mtp.execution import ExecutionConfig
from mtp.model import target
from mtp.mtp_head import DrafterCache
from mtp.serving.metadata import ChunkMeta, DrafterAppend, PageCopy, TurnSetup
from mtp.turn_start import append_from_hiddens, start_turn

_FIRST_TOKEN_KEY = 1  # a turn's first token is sampled with fold_in(key(this), the turn's generation)


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


@functools.partial(jax.jit, static_argnames=("cfg", "width", "temperature", "execution"),
                   donate_argnames=("cache", "hiddens", "dcache", "starts"))
def prefill_slot(cfg, params, cache: TargetCache, hiddens, dcache: DrafterCache | None, starts: TurnStarts, chunk, *,
                 width: int, temperature: float, execution: ExecutionConfig):
    """One aligned prefill chunk; its hiddens land in the slot's hidden store.

    ``chunk`` is one packed row: a `ChunkMeta` of ``width`` tokens, then, with ``dcache``, a
    `DrafterAppend`: the drafter rows that read the hiddens written so far are appended in
    the same call. A turn's last chunk carries its first drafter append, so a carry's tail
    costs neither a dispatch nor a host-to-device copy of its own (on a GPU a small model's
    warm TTFT is mostly dispatches). The slot's first token is picked here too, from
    the chunk's last position, into ``starts`` (the last chunk's pick is the turn's), so that
    a turn's start dispatches nothing after its last chunk. The pick and the append are
    `turn_start.start_turn`, the start one-shot generation makes too. Sampled, the token's key
    depends on the turn alone (not on how many chunks ran before), so every policy draws the
    same number for the same turn. Returns the cache, the hidden store, the drafter cache (None without one)
    and ``starts``.
    """
    meta, append = ChunkMeta.unpack(chunk, tokens=width)
    b, start, num_new = meta.slot[0], meta.start, meta.count
    view = cache.replace(linear=_slot(cache.linear, b), block_tables=_slot(cache.block_tables, b),
                         lengths=_slot(cache.lengths, b))
    view, out = target.prefill(cfg, params, view, meta.tokens, start, num_new, meta.write_from, execution=execution)
    h = out.mtp_hidden(cfg.mtp_hidden_source).astype(hiddens.dtype)
    hiddens = jax.lax.dynamic_update_slice(hiddens, h, (b, start[0], 0))
    cache = cache.replace(kv=view.kv, linear=_put_slot(cache.linear, b, view.linear),
                          lengths=_put_slot(cache.lengths, b, view.lengths))
    key = jax.random.fold_in(jax.random.key(_FIRST_TOKEN_KEY), meta.turn[0])
    drafter = None if dcache is None else _drafter_of_slot(dcache, b)
    token, hidden, drafter = start_turn(cfg, params, out, num_new, _slot(hiddens, b), drafter,
                                        () if dcache is None else (DrafterAppend.read(append),),
                                        temperature=temperature, key=key, execution=execution)
    if dcache is not None:
        dcache = _put_drafter(dcache, b, drafter)
    starts = TurnStarts(token=jax.lax.dynamic_update_slice(starts.token, token, (b,)),
                        hidden=jax.lax.dynamic_update_slice(starts.hidden, hidden.astype(starts.hidden.dtype), (b, 0)))
    return cache, hiddens, dcache, starts


linear_of_slot = jax.jit(lambda linear, b: _slot(linear, b))


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_page(cache: TargetCache, copy):
    """Copy one KV page (every attention layer): a shared partial page is extended in a copy.

    ``copy``: a packed `PageCopy`."""
    pages, _ = PageCopy.unpack(copy)
    src, dst = pages.src[0], pages.dst[0]
    return cache.replace(kv=cache.kv.replace(k=tuple(k.at[dst].set(k[src]) for k in cache.kv.k),
                                             v=tuple(v.at[dst].set(v[src]) for v in cache.kv.v)))


def _with_table_row(cache: TargetCache | DrafterCache, b, row):
    return cache.replace(block_tables=jax.lax.dynamic_update_slice_in_dim(cache.block_tables, row[None], b, axis=0))


@functools.partial(jax.jit, donate_argnames=("cache",))
def set_slot_table(cache: TargetCache | DrafterCache, b, row):
    """Slot ``b``'s block-table row set on the device: no read-back of the table, so the
    host never waits for the device's queued work at a turn's end."""
    return _with_table_row(cache, b, row)


@functools.partial(jax.jit, donate_argnames=("cache", "dcache"))
def begin_turn(cache: TargetCache, dcache: DrafterCache | None, setup, linear: LinearState | None):
    """A turn's slot state in one call: its target block table, the Gated DeltaNet state it
    restores (``linear``, or None), and its drafter's block table, resident rows and newest
    key (with ``dcache``).

    ``setup`` is a packed `TurnSetup`. On the H200 each small call cost 0.17-0.25 ms,
    mostly its host arrays' copies; three calls with seven host arrays became one with one.
    """
    turn = TurnSetup.read(setup, cache.block_tables.shape[1])
    b = turn.slot[0]
    cache = _with_table_row(cache, b, turn.target_table[0])
    if linear is not None:
        cache = cache.replace(linear=_put_slot(cache.linear, b, linear))
    if dcache is not None:
        dcache = _with_table_row(dcache, b, turn.drafter_table[0])
        dcache = dcache.replace(rows=dcache.rows.at[b].set(turn.drafter_rows[0]),
                                last_pair_key=dcache.last_pair_key.at[b].set(turn.last_pair_key[0]))
    return cache, dcache


def _drafter_of_slot(dcache: DrafterCache, b) -> DrafterCache:
    """Slot ``b``'s drafter as a batch of one, over the whole (shared) page pool."""
    return dcache.replace(block_tables=_slot(dcache.block_tables, b), rows=_slot(dcache.rows, b),
                          last_pair_key=_slot(dcache.last_pair_key, b))


def _put_drafter(dcache: DrafterCache, b, view: DrafterCache) -> DrafterCache:
    return dcache.replace(kv=view.kv, rows=_put_slot(dcache.rows, b, view.rows),
                          last_pair_key=_put_slot(dcache.last_pair_key, b, view.last_pair_key))


def _append_of_slot(cfg, params, dcache: DrafterCache, hiddens, b, append, *, execution: ExecutionConfig):
    """Drafter rows for keys ``first_key ...`` of slot ``b``; key ``k`` reads ``hiddens[b, k]``.

    ``append``: a packed `DrafterAppend`."""
    view = append_from_hiddens(cfg, params, _drafter_of_slot(dcache, b), DrafterAppend.read(append),
                               _slot(hiddens, b), execution=execution)
    return _put_drafter(dcache, b, view)


append_slot = functools.partial(jax.jit, static_argnames=("cfg", "execution"), donate_argnames=("dcache",))(
    _append_of_slot)

__all__ = ["TurnStarts", "append_slot", "begin_turn", "copy_page", "linear_of_slot", "prefill_slot",
           "set_slot_table"]
