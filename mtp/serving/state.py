"""The engine's device arrays and the calls that advance them.

`DeviceState` holds the batch slots' target cache, drafter cache, captured-hidden store and
turn starts, and runs the jitted steps (`mtp.serving.steps`) and decode loops over them,
packing each step's metadata on the host (`mtp.serving.metadata`). It decides nothing: what
to run comes from a `TurnPlan`.

With ``mesh`` (``params`` laid out on it by `mtp.sharding.shard_params` or `load_sharded`),
the caches are made in their shards, the captured hiddens and block tables live whole on
every device, and every step runs partitioned under the caller's ``sharding.on_mesh``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mtp import sharding
from mtp.cache.pages import block_table_row
from mtp.cache.prefix import Snapshot
from mtp.cache.state import LinearState, TargetCache
from mtp.config import ModelConfig
from mtp.model.params import Params
from mtp.model.prepared import prepare_params
from mtp.mtp_head import APPEND_BUCKETS, DrafterCache, quantize_head
from mtp.serving import steps
from mtp.serving.config import SNAPSHOT_INTERVAL, EngineConfig
from mtp.serving.metadata import ChunkMeta, DrafterAppend, PageCopy, TurnSetup, pack_rows
from mtp.speculative import SpecConfig, greedy_loop, speculative_loop


class DeviceState:
    """The device side of an engine: its caches per batch slot, and one method per device call."""

    def __init__(self, cfg: ModelConfig, params: Params, ecfg: EngineConfig, spec: SpecConfig, mesh):
        self.cfg, self.ecfg, self.spec = cfg, ecfg, spec
        self.head_params = prepare_params(quantize_head(params, ecfg.mtp_quant) if ecfg.speculative else params,
                                          ecfg.execution, drafting=ecfg.speculative)
        dtype = params["model"]["embed_tokens"]["weight"].dtype
        ps, b = ecfg.page_size, ecfg.batch_slots
        self.max_blocks = math.ceil((ecfg.max_context + spec.verify_width + 1) / ps)
        self.cache = sharding.create_cache(TargetCache, cfg, mesh, b, ecfg.num_pages, ps, self.max_blocks, dtype)
        self.dcache = sharding.create_cache(DrafterCache, cfg, mesh, b, ecfg.drafter_pages, ps, self.max_blocks,
                                            dtype)
        # The captured target hiddens, indexed by absolute position (one row per
        # position, a prefill chunk of headroom); who wrote them is `TurnPlanner.hidden_ranges`.
        self.hiddens = sharding.replicated(
            jnp.zeros((b, self.max_blocks * ps + SNAPSHOT_INTERVAL, cfg.hidden_size), dtype), mesh)
        self.starts = sharding.replicated(steps.TurnStarts.create(b, cfg.hidden_size, dtype), mesh)
        self._rng = jax.random.key(0)

    # -------------------------------------------------------------- a turn's start
    def copy_page(self, copy: PageCopy):
        self.cache = steps.copy_page(self.cache, copy.pack())

    def begin_turn(self, slot: int, target_pages, drafter_pages, drafter_rows: tuple[int, int],
                   snap: Snapshot | None):
        """Set the slot's tables, drafter rows (``(rows, last pair key)``) and restored GDN state."""
        setup = TurnSetup(slot=slot, drafter_rows=drafter_rows[0], last_pair_key=drafter_rows[1],
                          target_table=block_table_row(target_pages, self.max_blocks),
                          drafter_table=block_table_row(drafter_pages, self.max_blocks))
        self._begin(setup, LinearState(snap.conv, snap.recurrent) if snap is not None else None)

    def _begin(self, setup: TurnSetup, linear: LinearState | None):
        spec = self.ecfg.speculative
        self.cache, dcache = steps.begin_turn(self.cache, self.dcache if spec else None, setup.pack(), linear)
        if spec:
            self.dcache = dcache

    def prefill(self, slot: int, prompt, start: int, cached: int, turn: int, appends: list[DrafterAppend],
                on_snapshot: Callable[[int, LinearState], None]) -> int:
        """Prefill of ``prompt[start:]`` in chunks that end on multiples of ``SNAPSHOT_INTERVAL``.

        ``start`` is 0, a prefill snapshot's position (a multiple), or a turn end's
        length (anywhere). Ending chunks on absolute multiples keeps every snapshot this
        prefill leaves where `SnapshotStore` looks for it, and from 0 or a prefill
        snapshot gives the chunks (so the chunked recurrence's arithmetic) a prefill
        from 0 would run. A turn-end start is off that grid: its first chunk is short
        and the state it continues was built by the decode loop in verify-sized steps,
        so that state, and the snapshots this prefill then leaves, may differ by
        rounding from what a recompute would produce; no exactness is claimed there.
        KV is written from position ``cached``. The hiddens of positions ``start..L-1`` land
        in the slot's hidden store, and each aligned boundary inside the prompt hands its
        GDN state to ``on_snapshot``. ``appends`` then run, the first inside the last
        chunk's call. The turn's first token and the hidden at ``L-1`` land in the slot's
        `TurnStarts` row. Returns how many calls it dispatched.
        """
        n = len(prompt)
        chunk = SNAPSHOT_INTERVAL
        pos, calls = start, 0
        while pos < n:
            end = min(n, (pos // chunk + 1) * chunk)
            fused = end == n and appends
            meta = ChunkMeta.of(slot, prompt[pos:end], pos, chunk, cached, turn)
            self.cache, self.hiddens, dcache, self.starts = self._prefill_chunk(
                pack_rows(meta, appends[0]) if fused else meta.pack(), self.dcache if fused else None)
            if fused:
                self.dcache = dcache
            calls += 1
            if end % chunk == 0 and end < n:
                on_snapshot(end, self.linear_of_slot(slot))
                calls += 1
            pos = end
        for append in appends[1:]:
            self._append(slot, append.pack())
        return calls + len(appends[1:])

    def _prefill_chunk(self, row, dcache):
        return steps.prefill_slot(self.cfg, self.head_params, self.cache, self.hiddens, dcache, self.starts, row,
                                  width=SNAPSHOT_INTERVAL, temperature=self.spec.temperature,
                                  execution=self.spec.execution)

    def _append(self, slot: int, row):
        self.dcache = steps.append_slot(self.cfg, self.head_params, self.dcache, self.hiddens, slot, row,
                                        execution=self.spec.execution)

    def wait_for_start(self):
        """Block until every turn started so far has its first token and drafter rows."""
        jax.block_until_ready((self.starts.token, self.dcache.rows))

    def precompile(self) -> None:
        """Compile a turn's setup, the prefill chunk and, speculative, every drafter-append width,
        standalone and inside a turn's last prefill chunk, so that no timed turn compiles.

        Runs each program once on slot 0 with nothing to write (its own setup, a prefill of
        0 tokens from position 0, appends of 0 rows). What it leaves: garbage in slot 0's
        hidden store (the caller marks it empty); no page is written, and slot 0's tables,
        lengths, recurrent state and drafter rows are left as they were.
        """
        chunk = ChunkMeta.of(0, [], 0, SNAPSHOT_INTERVAL, 0, 0)
        spec = self.ecfg.speculative
        rows, last_key = self.drafter_end(0)
        setup = TurnSetup(slot=0, drafter_rows=rows, last_pair_key=last_key,
                          target_table=np.asarray(self.cache.block_tables[0]),
                          drafter_table=np.asarray(self.dcache.block_tables[0]))
        for linear in (None, self.linear_of_slot(0)):
            self._begin(setup, linear)
        # The calls exactly as `prefill` makes them (an omitted default would be
        # another jit signature, compiled again by the first turn).
        self.cache, self.hiddens, _, self.starts = self._prefill_chunk(chunk.pack(), None)
        for width in APPEND_BUCKETS if spec else ():
            empty = DrafterAppend(tokens=np.zeros((width,), np.int32), first_key=0, count=0)
            self._append(0, empty.pack())
            self.cache, self.hiddens, self.dcache, self.starts = self._prefill_chunk(pack_rows(chunk, empty),
                                                                                     self.dcache)

    def linear_of_slot(self, slot: int) -> LinearState:
        return steps.linear_of_slot(self.cache.linear, slot)

    # -------------------------------------------------------------- decode and a turn's end
    def decode(self, budget: np.ndarray):
        """The wave's decode loop: ``budget[b]`` new tokens for slot ``b`` (0: idle). Returns the
        tokens, their counts, the loop's metrics (None when not speculative) and its seconds."""
        first, hidden, spec = self.starts.token, self.starts.hidden, self.spec
        self._rng, key = jax.random.split(self._rng)
        t0 = time.perf_counter()
        if self.ecfg.speculative:
            self.cache, self.dcache, toks, n, metrics = speculative_loop(
                self.cfg, self.head_params, self.cache, self.dcache, first, hidden, jnp.asarray(budget), spec, key)
        else:
            self.cache, toks, n = greedy_loop(self.cfg, self.head_params, self.cache, first, jnp.asarray(budget), spec,
                                              key)
            metrics = None
        toks, n = np.asarray(toks), np.asarray(n)
        return toks, n, metrics, time.perf_counter() - t0

    def drafter_end(self, slot: int) -> tuple[int, int]:
        """The slot's drafter rows and newest pair key."""
        return int(self.dcache.rows[slot]), int(self.dcache.last_pair_key[slot])

    def clear_tables(self, slot: int):
        """Both of the slot's block-table rows back to the null page."""
        self.cache = steps.set_slot_table(self.cache, slot, block_table_row([], self.max_blocks))
        self.dcache = steps.set_slot_table(self.dcache, slot, block_table_row([], self.max_blocks))


__all__ = ["DeviceState"]
