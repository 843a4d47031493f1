"""Acceptance metrics with the common serving definitions (DESIGN §2).

Per verify step of one sequence: ``drafts`` = 1, ``draft_tokens`` = drafts proposed,
``accepted`` = drafts accepted (the bonus token excluded). Mean acceptance length
is ``1 + accepted / drafts``; per-position acceptance ``i`` is the fraction of steps
with at least ``i + 1`` accepted, so it is non-increasing in ``i``.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class AcceptanceStats:
    steps: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_at_least: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def from_metrics(cls, metrics, slots=None) -> "AcceptanceStats":
        """Sum the per-slot device counters (`speculative.DecodeMetrics`) of ``slots``."""
        sel = slice(None) if slots is None else np.asarray(slots)
        return cls(
            steps=int(np.asarray(metrics.steps)[sel].sum()),
            draft_tokens=int(np.asarray(metrics.draft_tokens)[sel].sum()),
            accepted=int(np.asarray(metrics.accepted)[sel].sum()),
            accepted_at_least=np.asarray(metrics.accepted_at_least)[sel].sum(axis=0).astype(np.int64),
        )

    def __add__(self, other: "AcceptanceStats") -> "AcceptanceStats":
        a, b = self.accepted_at_least, other.accepted_at_least
        n = max(len(a), len(b))
        pad = lambda x: np.pad(x, (0, n - len(x)))
        return AcceptanceStats(self.steps + other.steps, self.draft_tokens + other.draft_tokens,
                               self.accepted + other.accepted, pad(a) + pad(b))

    def counts(self) -> tuple:
        """The raw counters, for exact comparisons of one turn's (or one run's) stats between
        runs: the derived rates are NaN, never equal to themselves, for a turn without a
        verify step. Sums over turns of different widths may differ in trailing zeros."""
        return self.steps, self.draft_tokens, self.accepted, tuple(self.accepted_at_least.tolist())

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else float("nan")

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else float("nan")

    @property
    def per_position(self) -> list[float]:
        if not self.steps:
            return [float("nan")] * len(self.accepted_at_least)
        return (self.accepted_at_least / self.steps).tolist()

    def as_dict(self) -> dict:
        return {
            "verify_steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_per_position": self.per_position,
        }
