"""The multi-turn session engine: prefix cache, GDN snapshots, and the drafter's context.

A *turn* is one sequence: a prompt (which extends the session's previous full sequence)
decoded to a reply. `Engine.run_wave` serves up to ``batch_slots`` turns of distinct
sessions, each prefilled on its own batch slot, decoded together in one jitted loop;
`run_sessions` / `session_waves` serve whole sessions turn by turn.

The modules, in the order a turn meets them:

* `config`: `EngineConfig` (drafter policy, page pools, batch and carry slots, the Marconi
  threshold), `TurnRequest`, `TurnStats`, `TurnResult`, `session_hash`.
* `planner`: every host decision of a turn (prefix match, restore vs KV-only path, carry
  adoption and eviction, the drafter's appends, what its end registers and deposits).
* `metadata`: the named fields of each device step's one packed int32 argument.
* `steps`: the jitted per-slot device steps (prefill chunk, drafter append, setup).
* `state`: the device arrays and the calls that advance them.
* `engine`: `Engine`, which runs a wave's plans on the device state.
* `scheduling`: prompts from a session's text, and the waves that serve sessions.
"""

from mtp.serving.config import (DRAFTER_POLICIES, SNAPSHOT_INTERVAL, EngineConfig, TurnRequest, TurnResult,
                                TurnStats, session_hash)
from mtp.serving.engine import Engine
from mtp.serving.scheduling import TextPrompts, run_sessions, session_waves

__all__ = ["DRAFTER_POLICIES", "Engine", "EngineConfig", "SNAPSHOT_INTERVAL", "TextPrompts", "TurnRequest",
           "TurnResult", "TurnStats", "run_sessions", "session_hash", "session_waves"]
