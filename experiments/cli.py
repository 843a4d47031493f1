"""Flag checks the experiment scripts share: a bad value stops the run at parse time, by name."""

from __future__ import annotations

from absl import app, flags


def require_ints(name: str, lo: int, hi: int | None = None, what: str = "") -> None:
    """Register a check that every entry of list flag ``name`` is an integer in ``lo..hi``."""
    def ok(values) -> bool:
        try:
            return all(lo <= int(v) and (hi is None or int(v) <= hi) for v in values or ())
        except ValueError:
            return False

    bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    flags.register_validator(name, ok, f"--{name}: integers {bounds}{f' ({what})' if what else ''}")


def refuse_flags_of(module: str, used: set[str]) -> None:
    """Stop on any flag ``module`` defines that this script was given but does not read.

    Scripts that import another's helpers inherit all of its flags; without this,
    ``count_kernels.py --tp 2`` would parse and count one device's kernels.
    """
    ignored = sorted(f.name for f in flags.FLAGS.get_flags_for_module(module)
                     if f.present and f.name not in used)
    if ignored:
        raise app.UsageError(f"{', '.join('--' + n for n in ignored)}: {module}'s flag(s), which this "
                             f"script does not use (it reads {', '.join('--' + n for n in sorted(used))})")
