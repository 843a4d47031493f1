"""Process-wide settings a program fixes for itself: XLA's CUDA-graph update flags on a GPU, and
full-precision f32 matmuls.

The entry points that serve turns (`experiments/carry_ablation.py`, `sweep.py`, `generate.py`,
`bench_decode.py`, `sharded_generate.py`) call `configure_process` first thing in ``main``,
before anything starts JAX's backend, and put `ProcessSettings.describe` in their output. This
module is where those settings read the environment (``XLA_FLAGS``, ``JAX_PLATFORMS``,
``CUDA_VISIBLE_DEVICES``), so a user need not know either setting:

* **XLA flags.** XLA re-records a CUDA graph whenever a buffer it uses moved; in the served
  flow the engine's prefill chunk was re-recorded at every call (about half a warm turn's
  start for the default model on the H200). ``GRAPH_UPDATE_FLAGS`` let XLA update the graph
  instead (BUILD.md, results/engine/engine_h200.md section 5). XLA reads them once, process-wide,
  when JAX creates its GPU client, so they are set in ``XLA_FLAGS`` before that, and only
  when the process will run on a GPU and the user has not set ``XLA_FLAGS`` (even to an
  empty value, which keeps XLA's defaults).
* **Matmul precision.** JAX's default lets an f32 GEMM on a GPU round through TF32, by shape,
  so a speculative verify (K rows) and the plain loop (one row) could pick different tokens at
  a near-tie. A program computing in f32 runs its matmuls at ``"highest"`` precision
  (``jax_default_matmul_precision``, which every function traced afterwards sees); other
  dtypes keep JAX's default (a bf16 GEMM has no TF32 rounding to remove).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
from typing import Mapping, Sequence

GRAPH_UPDATE_FLAGS = ("--xla_gpu_command_buffer_update_mode=SKIP_TEMP",
                      "--xla_gpu_temp_buffer_use_separate_color=true")
F32_MATMUL_PRECISION = "highest"
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "jax_cuda13_plugin", "jax_cuda12_plugin")
_GPU_PLATFORMS = ("cuda", "gpu")


def _cuda_plugin_importable() -> bool:
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ImportError:  # the parent package is missing
            continue
    return False


def gpu_present(environ: Mapping[str, str] = os.environ, device_nodes: Sequence[str] | None = None,
                plugin_importable: bool | None = None) -> bool:
    """Whether JAX will run this process on a GPU, decided without starting its backend.

    True when JAX may pick a GPU platform (``JAX_PLATFORMS`` unset or naming ``cuda``/``gpu``),
    ``CUDA_VISIBLE_DEVICES`` does not hide every device, a CUDA plugin of jaxlib is importable,
    and an NVIDIA device node (``/dev/nvidia0`` ...) exists. ``device_nodes`` and
    ``plugin_importable`` default to what this machine has.
    """
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and not any(p in _GPU_PLATFORMS for p in platforms):
        return False
    if environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return False
    if not (_cuda_plugin_importable() if plugin_importable is None else plugin_importable):
        return False
    nodes = glob.glob("/dev/nvidia[0-9]*") if device_nodes is None else device_nodes
    return bool(nodes)


@dataclasses.dataclass(frozen=True)
class XlaFlagsDecision:
    """What `configure_process` does to ``XLA_FLAGS``: ``value`` is what it sets (None: leaves the
    variable as it is), ``reason`` says why, for the run's output."""

    value: str | None
    reason: str


def decide_xla_flags(environ: Mapping[str, str], gpu: bool) -> XlaFlagsDecision:
    """``GRAPH_UPDATE_FLAGS`` on a GPU unless the user set ``XLA_FLAGS``; nothing otherwise."""
    if "XLA_FLAGS" in environ:
        return XlaFlagsDecision(None, f"XLA_FLAGS={environ['XLA_FLAGS']!r} as the user set it")
    if not gpu:
        return XlaFlagsDecision(None, "XLA_FLAGS unset: no GPU, XLA's defaults")
    return XlaFlagsDecision(" ".join(GRAPH_UPDATE_FLAGS),
                            f"XLA_FLAGS={' '.join(GRAPH_UPDATE_FLAGS)!r} set by the program: on a GPU, XLA "
                            "then updates a prefill chunk's CUDA graphs in place of re-recording them at every "
                            "call (a warm turn starts sooner; BUILD.md)")


def matmul_precision_for(compute_dtype) -> str | None:
    """The matmul precision a program computing in ``compute_dtype`` runs at (None: JAX's default)."""
    import numpy as np

    return F32_MATMUL_PRECISION if compute_dtype is not None and np.dtype(compute_dtype) == np.float32 else None


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """What `configure_process` decided, for a run's header and its results file."""

    gpu: bool
    xla_flags: XlaFlagsDecision
    matmul_precision: str | None  # None: JAX's default
    compute_dtype: str | None

    def describe(self) -> str:
        precision = (f"f32 matmuls at {self.matmul_precision!r} precision (set by the program)"
                     if self.matmul_precision else
                     f"matmul precision JAX's default (compute dtype {self.compute_dtype or 'per checkpoint'})")
        return f"{self.xla_flags.reason}; {precision}"

    def for_compute_dtype(self, compute_dtype) -> "ProcessSettings":
        """These settings with the matmul precision for ``compute_dtype`` applied process-wide
        (`set_matmul_precision_for`), for a program that learns its dtype from the checkpoint."""
        return dataclasses.replace(self, matmul_precision=set_matmul_precision_for(compute_dtype),
                                   compute_dtype=None if compute_dtype is None else str(compute_dtype))

    def as_dict(self) -> dict:
        return {"gpu_detected": self.gpu, "xla_flags_set": self.xla_flags.value, "xla_flags": self.xla_flags.reason,
                "matmul_precision": self.matmul_precision, "compute_dtype": self.compute_dtype}


def configure_process(compute_dtype=None, environ=None, gpu: bool | None = None) -> ProcessSettings:
    """Set the process-wide XLA flags (`decide_xla_flags`) and, for f32 compute, the matmul
    precision (`matmul_precision_for`); returns what was set and why.

    Must run before JAX starts its backend (XLA reads ``XLA_FLAGS`` once, then), so first in a
    program's ``main``: afterwards it raises rather than report flags that took no effect.
    ``environ`` defaults to ``os.environ`` (written when a flag is set); ``gpu`` to `gpu_present`.
    ``compute_dtype`` None leaves the precision alone (a program that learns its dtype from the
    checkpoint applies it once it has it: `ProcessSettings.for_compute_dtype`).
    """
    from jax._src import xla_bridge

    environ = os.environ if environ is None else environ
    gpu = gpu_present(environ) if gpu is None else gpu
    decision = decide_xla_flags(environ, gpu)
    if decision.value is not None:
        if environ is os.environ and xla_bridge.backends_are_initialized():  # a given dict is no process's
            raise RuntimeError("configure_process ran after JAX started its backend, so the XLA flags it would set "
                               f"({decision.value}) could no longer take effect; call it first in main")
        environ["XLA_FLAGS"] = decision.value
    return ProcessSettings(gpu=gpu, xla_flags=decision, matmul_precision=None,
                           compute_dtype=None).for_compute_dtype(compute_dtype)


def set_matmul_precision_for(compute_dtype) -> str | None:
    """Apply `matmul_precision_for` ``compute_dtype`` process-wide (before the functions it should
    reach are traced); returns the precision set, None where JAX's default stays."""
    import jax

    precision = matmul_precision_for(compute_dtype)
    if precision is not None:
        jax.config.update("jax_default_matmul_precision", precision)
    return precision


__all__ = ["F32_MATMUL_PRECISION", "GRAPH_UPDATE_FLAGS", "ProcessSettings", "XlaFlagsDecision", "configure_process",
           "decide_xla_flags", "gpu_present", "matmul_precision_for", "set_matmul_precision_for"]
