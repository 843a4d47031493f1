"""How the experiment scripts write what they measured: whole files, strict JSON, and where a
result came from.

A benchmark on a shared machine can be cut off at any moment (a time limit, a lost lease), and most
scripts rewrite their results after every measurement, so a file is only ever replaced whole. The
JSON is strict (an undefined rate, NaN, is written as ``null``) so that tools other than Python's
``json`` read it. `provenance` is what a results file records besides its numbers (the code's
commit, the packages, the devices, the command line, the config), so that a number can be traced
to what made it. This module imports nothing heavy: the A/B runners use it without JAX.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import time

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


REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "orbax-checkpoint", "ml-collections")
_ENVIRONMENT_PREFIXES = ("MTP_", "XLA_", "JAX_")


def environment() -> dict[str, str]:
    """The variables that change what a run compiles or how it runs (XLA and JAX flags, this
    project's switches), for its results: two runs that differ only there must say so."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENVIRONMENT_PREFIXES)}


def git_state(repo: pathlib.Path = REPO_ROOT) -> dict:
    """``{"commit", "dirty"}`` of the tree the code ran from; both None, with the reason, where it is
    no git checkout (a copied tree)."""
    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain").strip())  # untracked files count: they may be code
    except (OSError, subprocess.SubprocessError) as e:
        reason = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) and e.stderr else str(e)
        return {"commit": None, "dirty": None, "error": " ".join(reason.split())}
    return {"commit": commit, "dirty": dirty}


def package_versions() -> dict[str, str | None]:
    """Python's and the numeric packages' versions (None: not installed), JAX's CUDA plugins among
    them where installed."""
    names = list(PACKAGES) + sorted({d.metadata["Name"] for d in importlib.metadata.distributions()
                                     if (d.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")})
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def devices() -> dict | None:
    """The JAX backend, device kinds and count a run used; None where the program never imported JAX
    (this module does not start it)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    ds = jax.devices()
    return {"backend": jax.default_backend(), "count": len(ds), "kinds": sorted({d.device_kind for d in ds}),
            "host": platform.processor() or platform.machine()}


def provenance(config=None) -> dict:
    """What a results file records besides its numbers: the command line as typed (and its working
    directory), the date, the git commit and whether the tree had uncommitted changes, package
    versions, the devices, the environment switches (`environment`) and the config (an
    ``ml_collections.ConfigDict``, or a plain dict)."""
    return {
        "command": shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "git": git_state(),
        "packages": package_versions(),
        "devices": devices(),
        "environment": environment(),
        "config": config.to_dict() if hasattr(config, "to_dict") else config,
    }
