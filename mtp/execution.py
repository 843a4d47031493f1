"""How a run executes, as one frozen, hashable value: kernel paths, GEMM layout, loop graphs, carry switches.

`ExecutionConfig` holds every switch that changes how the same model computes the same
tokens: the kernel path of each op (``MTP_KERNELS``), the GEMM-layout switches
(``MTP_PAD_SMALL_GEMMS``, ``MTP_MERGE_PROJECTIONS``, ``MTP_SMALL_GEMMS_AS_REDUCE``), the decode
loops' graph mode (``MTP_DECODE_LOOP_GRAPH``) and the drafter-context and carry-debug switches
(``MTP_DRAFTER_CONTEXT_OFF``, ``MTP_DRAFTER_CARRY_OFF``, ``MTP_CARRY_DEBUG``). Being hashable it
can travel as a ``jax.jit`` static, so two configs compile two programs and changing one
needs no ``jax.clear_caches``.

`ExecutionConfig.from_environ` is the one parser of those variables: an entry point (a
script, an experiment's ``main``) calls it once with ``os.environ``; a bad value raises a
one-line ``ValueError`` naming the variable and the values it takes. This module imports
only the standard library, so the ops may import it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

KERNEL_CHOICES = ("auto", "reference", "pallas", "interpret")
KERNEL_OPS = ("paged_attention", "fc_gemm", "gdn_step", "add_rms_norm", "conv_step", "attn_prologue",
              "paged_attention_triton", "moe", "fp8_gemm")  # MTP_KERNELS' per-op names (moe: mtp.ops.moe,
# fp8_gemm: mtp.ops.fp8)
LOOP_GRAPH_MODES = ("0", "1", "while")

KERNELS_VAR = "MTP_KERNELS"
PAD_VAR = "MTP_PAD_SMALL_GEMMS"
MERGE_VAR = "MTP_MERGE_PROJECTIONS"
REDUCE_VAR = "MTP_SMALL_GEMMS_AS_REDUCE"
LOOP_GRAPH_VAR = "MTP_DECODE_LOOP_GRAPH"
DRAFTER_CONTEXT_OFF_VAR = "MTP_DRAFTER_CONTEXT_OFF"
DRAFTER_CARRY_OFF_VAR = "MTP_DRAFTER_CARRY_OFF"
CARRY_DEBUG_VAR = "MTP_CARRY_DEBUG"

_COMMAND_BUFFER_DEFAULTS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"  # XLA's own


def check_kernel_choice(impl: str, where: str) -> str:
    """``impl`` if it names a kernel path, else a ``ValueError`` naming ``where`` and the paths."""
    if impl not in KERNEL_CHOICES:
        raise ValueError(f"{where}={impl!r} is not a kernel implementation; choose one of "
                         f"{', '.join(KERNEL_CHOICES)}")
    return impl


def parse_kernels(value: str) -> tuple[tuple[str, str], ...]:
    """``MTP_KERNELS``' text as ``(op, choice)`` pairs, ``op`` empty for a value that sets every op.

    ``"auto,gdn_step=reference"``: ``(("", "auto"), ("gdn_step", "reference"))``.
    """
    pairs = []
    for entry in filter(None, value.split(",")):
        name, _, choice = entry.rpartition("=")
        if name and name not in KERNEL_OPS:
            raise ValueError(f"{KERNELS_VAR} entry {entry!r}: no op named {name!r}; the ops are "
                             f"{', '.join(KERNEL_OPS)}")
        check_kernel_choice(choice, f"{KERNELS_VAR} entry {name}" if name else KERNELS_VAR)
        pairs.append((name, choice))
    return tuple(pairs)


def _switch(environ: Mapping[str, str], var: str) -> bool | None:
    value = environ.get(var)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{var}={value!r}: set it to 0 or 1")
    return value == "1"


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """The execution switches of one run (frozen and hashable: a ``jax.jit`` static).

    ``kernels``: ``(op, choice)`` pairs as `parse_kernels` reads them (``op`` empty: every op);
    `kernel_choice` is what ``"auto"`` means for one op. The three GEMM-layout switches are
    ``None`` for their default (on exactly on a GPU) or a forced value. ``loop_graph``: ``"1"``
    records the decode ``while_loop`` as a CUDA graph with concurrent scheduling, ``"while"``
    the graph with XLA's scheduling, ``"0"`` XLA's defaults (`loop_compiler_options`).
    """

    kernels: tuple[tuple[str, str], ...] = ()
    pad_small_gemms: bool | None = None
    merge_projections: bool | None = None
    small_gemms_as_reduce: bool | None = None
    loop_graph: str = "1"
    drafter_context_off: bool = False
    drafter_carry_off: bool = False
    carry_debug: bool = False

    def __post_init__(self):
        for name, choice in self.kernels:
            if name and name not in KERNEL_OPS:
                raise ValueError(f"ExecutionConfig.kernels: no op named {name!r}; the ops are {', '.join(KERNEL_OPS)}")
            check_kernel_choice(choice, f"ExecutionConfig.kernels[{name!r}]")
        if self.loop_graph not in LOOP_GRAPH_MODES:
            raise ValueError(f"ExecutionConfig.loop_graph={self.loop_graph!r}: set it to 0, 1 or while")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "ExecutionConfig":
        """The config the ``MTP_*`` variables of ``environ`` set (unset: the defaults)."""
        loop_graph = environ.get(LOOP_GRAPH_VAR, "1")
        if loop_graph not in LOOP_GRAPH_MODES:
            raise ValueError(f"{LOOP_GRAPH_VAR}={loop_graph!r}: set it to 0, 1 or while")
        return cls(
            kernels=parse_kernels(environ.get(KERNELS_VAR, "")),
            pad_small_gemms=_switch(environ, PAD_VAR),
            merge_projections=_switch(environ, MERGE_VAR),
            small_gemms_as_reduce=_switch(environ, REDUCE_VAR),
            loop_graph=loop_graph,
            drafter_context_off=environ.get(DRAFTER_CONTEXT_OFF_VAR) == "1",
            drafter_carry_off=environ.get(DRAFTER_CARRY_OFF_VAR) == "1",
            carry_debug=environ.get(CARRY_DEBUG_VAR) == "1",
        )

    def kernel_choice(self, op: str | None, opt_in: bool = False) -> str:
        """What ``"auto"`` means for ``op``: its own entry, else the global value, else ``"auto"``.

        An ``opt_in`` op (`mtp.ops.dispatch.OPT_IN`) reads only its own entry: a global value
        flips every op's kernel at once, and an opt-in kernel was measured slower in some programs.
        """
        choice = "auto"
        for name, value in self.kernels:
            if not name:
                choice = value
            elif name == op:
                return value
        return "auto" if opt_in else choice

    def loop_compiler_options(self) -> dict[str, str]:
        """XLA options for the jitted decode loops: the ``while_loop`` itself inside the CUDA graph.

        By default XLA records a loop iteration's kernels into CUDA graphs but drives the
        loop from the host, which copies the loop predicate back and waits for it every
        iteration: a host round trip per verify step. With WHILE and CONDITIONAL command
        buffers XLA can record the loop as a graph with device-side conditional nodes, and
        CONCURRENT scheduling lets independent kernels of an iteration overlap. Side by side on
        the H200 (results/decode/decode_h200.md, 2026-11-29) this sped the default model's
        batch-1 decode loop up by about a fifth. These are GPU fields of XLA's DebugOptions;
        other backends ignore them.
        """
        if self.loop_graph == "0":
            return {}
        graphs = {"xla_gpu_enable_command_buffer": _COMMAND_BUFFER_DEFAULTS + ",WHILE,CONDITIONAL"}
        if self.loop_graph == "while":
            return graphs
        return {**graphs, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def of_process() -> ExecutionConfig:
    """`ExecutionConfig.from_environ` of this process's environment: the one place ``mtp`` reads the ``MTP_*`` switches."""
    return ExecutionConfig.from_environ(os.environ)
