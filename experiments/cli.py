"""Flag checks the experiment scripts share: a bad value stops the run at parse time, by name."""

from __future__ import annotations

from absl import flags


def require_ints(name: str, lo: int, hi: int | None = None, what: str = "") -> None:
    """Register a check that every entry of list flag ``name`` is an integer in ``lo..hi``."""
    def ok(values) -> bool:
        try:
            return all(lo <= int(v) and (hi is None or int(v) <= hi) for v in values or ())
        except ValueError:
            return False

    bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    flags.register_validator(name, ok, f"--{name}: integers {bounds}{f' ({what})' if what else ''}")
