"""How the experiment scripts write what they measured: whole files, strict JSON.

A benchmark on a shared machine can be cut off at any moment (a time limit, a lost lease), and most
scripts rewrite their results after every measurement, so a file is only ever replaced whole. The
JSON is strict (an undefined rate, NaN, is written as ``null``) so that tools other than Python's
``json`` read it. This module imports nothing heavy: the A/B runners use it without JAX.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import numpy as np


def write_atomic(path: pathlib.Path | str, text: str) -> None:
    """Replace ``path`` whole: a run killed mid-write keeps the previous complete file."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file left beside the whole one
        raise


def _strict(x):
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    if isinstance(x, np.ndarray):
        return _strict(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def to_json(obj, indent: int = 1) -> str:
    """``obj`` as strict JSON: NaN and infinities become ``null``, numpy values plain numbers, and
    anything else JSON has no form for its ``str``."""
    return json.dumps(_strict(obj), indent=indent, allow_nan=False, default=str)


def write_json(path: pathlib.Path | str, obj, indent: int = 1) -> None:
    write_atomic(path, to_json(obj, indent))
