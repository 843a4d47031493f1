"""The engine: serves waves of turns, each planned on the host and run on the device.

A *turn* is one sequence: a prompt (which extends the session's previous full sequence)
decoded to a reply. The engine serves waves of up to ``batch_slots`` turns from distinct
sessions: each turn is prefilled on its own batch slot, then the wave decodes together in
one jitted speculative loop. `TurnPlanner` makes every decision (prefix match, path, carry,
pages); `DeviceState` runs the calls; the engine orders them and keeps a failed wave from
leaking a page or a carried drafter. A turn reports what was armed, not what was
configured (`TurnStats.carry_armed`; `CarryOutcome.Disarmed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Sequence

import numpy as np
from jax.sharding import Mesh

from mtp import carry as carry_lib
from mtp import sharding
from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.metrics import AcceptanceStats
from mtp.model.params import Params
from mtp.serving.config import EngineConfig, TurnRequest, TurnResult, session_hash
from mtp.serving.planner import TurnPlan, TurnPlanner
from mtp.serving.state import DeviceState
from mtp.speculative import SpecConfig


class Engine:
    """Serves waves of turns; owns the host planner (page pools, prefix and snapshot stores, the
    carried drafters) and the device state (the caches).

    With ``mesh`` (``params`` laid out on it by `mtp.sharding.shard_params` or
    `load_sharded`), the caches are made in their shards and every jitted step runs
    partitioned under ``jax.set_mesh``: a checkpoint too large for one device serves the
    same sessions, and all host-side decisions (prefix match, path, carry) are unchanged.
    """

    def __init__(self, cfg: ModelConfig, params: Params, engine_cfg: EngineConfig, spec: SpecConfig,
                 mesh: Mesh | None = None):
        if engine_cfg.speculative and not cfg.has_mtp:
            raise ValueError("speculative decoding needs a checkpoint with an MTP head")
        if spec.execution not in (ExecutionConfig(), engine_cfg.execution):
            raise ValueError("SpecConfig.execution differs from EngineConfig.execution; the engine runs every "
                             "step, its loops included, with EngineConfig.execution: set it there")
        self.cfg, self.ecfg, self.mesh = cfg, engine_cfg, mesh
        self.planner = TurnPlanner(engine_cfg, spec, cfg.max_position_embeddings)
        # The loop rewrites the output's rows only where they outlive it (`EngineConfig.rebuild_output_rows`).
        self.spec = dataclasses.replace(spec, rebuild_output_rows=engine_cfg.rebuild_output_rows and self.carry_armed,
                                        execution=engine_cfg.execution)
        with sharding.on_mesh(mesh):
            self.device = DeviceState(cfg, params, engine_cfg, self.spec, mesh)

    @property
    def carry_armed(self) -> bool:
        """Configured is not armed: this is what any report of the carry's state must show."""
        return self.planner.carry_armed

    @property
    def carried(self) -> dict[int, carry_lib.CarriedDrafter]:
        """The carried drafters by session hash, least recently deposited first."""
        return self.planner.carry.entries

    def precompile(self) -> None:
        """Compile every program a turn's start runs (`DeviceState.precompile`), so that no
        timed turn compiles. Slot 0's hidden store is left marked empty (the next turn on
        slot 0 prefills every hidden it reads). Call it between waves, never with a turn in
        flight."""
        with sharding.on_mesh(self.mesh):
            self.device.precompile()
        self.planner.hidden_ranges[0] = carry_lib.StoreRange.EMPTY

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
            self.planner.check(r)
        wave_sessions = {session_hash(s) for s in sessions}
        with contextlib.ExitStack() as held:
            live = []
            for i, r in enumerate(requests):
                live.append(self._reserve_turn(r, i, wave_sessions))
                held.callback(self._abandon, live[-1])
            for turn in live:
                self._start_turn(turn)
            budget = np.zeros((b,), np.int32)  # 0: an idle slot, done from the start
            for turn in live:
                budget[turn.slot] = turn.request.max_new_tokens
            toks, n, metrics, decode_s = self.device.decode(budget)
            held.pop_all()
        results = []
        for turn in live:
            out = toks[turn.slot, : n[turn.slot]].tolist()
            turn.stats.decode_s = decode_s
            turn.stats.wave_turns = len(live)
            turn.stats.output_len = len(out)
            if metrics is not None:
                turn.stats.acceptance = AcceptanceStats.from_metrics(metrics, [turn.slot])
            results.append(TurnResult(turn.request, out, turn.stats))
        with contextlib.ExitStack() as finishing:  # runs every callback, last in first, even after one raised
            for turn, r in reversed(list(zip(live, results))):
                finishing.callback(self._finish_turn, turn, list(r.request.prompt) + r.output)
        return results

    def _reserve_turn(self, req: TurnRequest, slot: int, wave_sessions: set[int]) -> TurnPlan:
        """Plan a turn (`TurnPlanner.reserve`) and copy the partial page its restore point names,
        before another turn's reservation can evict the entry holding it: the one device write
        of a reservation."""
        t0 = time.perf_counter()
        turn = self.planner.reserve(req, slot, wave_sessions)
        if turn.page_copy is not None:
            self.device.copy_page(turn.page_copy)
        turn.stats.ttft_s = time.perf_counter() - t0
        return turn

    def _start_turn(self, turn: TurnPlan):
        """Set up a reserved turn's slot, run its prefills; nothing here allocates."""
        t0 = time.perf_counter()
        drafter_pages, appends = self.planner.drafter_fill(turn)
        self.device.begin_turn(turn.slot, turn.target_pages, drafter_pages, turn.drafter_rows, turn.snap)
        self.planner.prefill_started(turn)
        try:
            calls = self.device.prefill(turn.slot, list(turn.request.prompt), turn.prefill_from, turn.cached,
                                        turn.generation, appends, functools.partial(self.planner.put_snapshot, turn))
        except BaseException:
            self.planner.carry.hand_back(turn)
            raise
        self.planner.prefill_done(turn)
        dispatched = time.perf_counter()
        self.device.wait_for_start()
        done = time.perf_counter()
        turn.stats.ttft_s += done - t0
        turn.stats.ttft_wait_s = done - dispatched
        turn.stats.start_calls += 1 + calls  # the setup, then the prefill's

    def _abandon(self, turn: TurnPlan):
        """Undo a turn of a wave that failed before it finished (`TurnPlanner.abandon`)."""
        self.planner.abandon(turn)
        self.device.clear_tables(turn.slot)

    def _release(self, turn: TurnPlan):
        self.planner.release(turn)
        self.device.clear_tables(turn.slot)

    def _finish_turn(self, turn: TurnPlan, full: list[int]):
        """Register the turn's end and deposit its drafter (`TurnPlanner.finish`), then release
        its pages whatever raises, so a turn that fails at its end leaks nothing."""
        valid = int(self.device.cache.lengths[turn.slot])  # every token but the last is in the cache
        try:
            self.planner.finish(turn, full, valid, functools.partial(self.device.drafter_end, turn.slot),
                                functools.partial(self.device.linear_of_slot, turn.slot))
        finally:
            self._release(turn)


__all__ = ["Engine"]
