"""What a served turn is: the engine's configuration, a turn's request, its stats and its result.

`EngineConfig` is static for an engine's life (its page pools, batch and carry slots,
drafter policy and Marconi threshold); a `TurnRequest` names its session explicitly, and
`session_hash` turns that name into the carry's ownership stamp.
"""

from __future__ import annotations

import dataclasses
import hashlib

from mtp import carry as carry_lib
from mtp import quant
from mtp.execution import ExecutionConfig
from mtp.metrics import AcceptanceStats

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
