"""How a run executes, as one frozen, hashable value: kernel paths, GEMM layout, loop graphs, carry switches.

`ExecutionConfig` holds every switch that changes how the same model computes the same
tokens: the kernel path of each op (``kernels``), the GEMM-layout switches (``pad_small_gemms``,
``merge_projections``, ``small_gemms_as_reduce``), the decode loops' graph mode (``loop_graph``)
and the drafter-context and carry-debug switches (``drafter_context_off``, ``drafter_carry_off``,
``carry_debug``). The model's jitted functions and the decode loops take it as a ``jax.jit``
static (it is frozen and hashable), so two configs compile two programs and changing one needs
no ``jax.clear_caches``. The model hands each op a plain path string (`ExecutionConfig.impl_for`);
the ops never see the config.

An entry point (a script, an experiment's ``main``) reads the environment once,
`ExecutionConfig.from_environ` of ``os.environ``, so that a user can still flip a run with the
``MTP_*`` variables (``MTP_KERNELS``, ``MTP_PAD_SMALL_GEMMS``, ``MTP_MERGE_PROJECTIONS``,
``MTP_SMALL_GEMMS_AS_REDUCE``, ``MTP_DECODE_LOOP_GRAPH``, ``MTP_DRAFTER_CONTEXT_OFF``,
``MTP_DRAFTER_CARRY_OFF``, ``MTP_CARRY_DEBUG``); a bad value raises a one-line ``ValueError``
naming the variable and the values it takes. Nothing in ``mtp`` reads them anywhere else. This
module imports only the standard library, so the ops may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

KERNEL_CHOICES = ("auto", "reference", "pallas", "interpret")
KERNEL_OPS = ("paged_attention", "fc_gemm", "gdn_step", "add_rms_norm", "conv_step", "attn_prologue",
              "paged_attention_triton", "moe", "fp8_gemm", "fp8_gemv")  # MTP_KERNELS' per-op names (moe:
# mtp.ops.moe; fp8_gemm: mtp.ops.fp8's few-row kernel, fp8_gemv its one-row kernel)
LOOP_GRAPH_MODES = ("0", "1", "while")
# Kernels "auto" leaves on their references (a ``kernels`` entry of their own, such as
# ``MTP_KERNELS=<op>=pallas``, takes them): not yet measured faster inside the model on a GPU, or
# measured faster only in some programs. Each entry says why it is here; scripts/gpu_check.sh
# times every one off and on.
OPT_IN = {
    # Measured on the H200 (results/decode/decode_h200.md, 2026-11-30): the default model's loops
    # 1.045x (plain) and 1.006x (speculative K = 2) at batch 1, but the 1.38B decode step
    # 0.96-0.98x (batch 1) and 0.94x (batch 8).
    "paged_attention_triton": "faster only in the small default model's loops",
}

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

    ``kernels``: ``(op, choice)`` pairs as `parse_kernels` reads them (``op`` empty: every op;
    ``MTP_KERNELS``); `impl_for` is the path one op is handed. The three GEMM-layout switches are
    ``None`` for their default (on exactly on a GPU) or a forced value (``MTP_PAD_SMALL_GEMMS``,
    ``MTP_MERGE_PROJECTIONS``, ``MTP_SMALL_GEMMS_AS_REDUCE``). ``loop_graph``
    (``MTP_DECODE_LOOP_GRAPH``): ``"1"`` records the decode ``while_loop`` as a CUDA graph with
    concurrent scheduling, ``"while"`` the graph with XLA's scheduling, ``"0"`` XLA's defaults
    (`loop_compiler_options`). ``drafter_context_off`` / ``drafter_carry_off``: the kill switches
    of the drafter's context (`mtp.carry.DrafterContext.of`); ``carry_debug``: one log line per
    carry decision.
    """

    kernels: tuple[tuple[str, str], ...] = ()
    pad_small_gemms: bool | None = None
    merge_projections: bool | None = None
    small_gemms_as_reduce: bool | None = None
    # The layout's bounds (`mtp.model.layers`: PAD_ROWS, PAD_MIN_WEIGHT, REDUCE_MAX_ROWS,
    # REDUCE_MAX_WEIGHT): None keeps the measured values; tests force them so that a tiny model
    # takes the GPU's layouts.
    pad_rows: int | None = None
    pad_min_weight: int | None = None
    reduce_max_rows: int | None = None
    reduce_max_weight: int | None = None
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
        for name in ("pad_rows", "pad_min_weight", "reduce_max_rows", "reduce_max_weight"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"ExecutionConfig.{name}={value!r}: an integer >= 0, or None for the measured bound")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "ExecutionConfig":
        """The config the ``MTP_*`` variables of ``environ`` set (unset: the defaults).

        The three kill switches count only for the exact value ``1``: a switch that also fired on
        ``0`` or ``false`` would turn features off in exactly the runs that tried to say they were on.
        """
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

    @classmethod
    def everywhere(cls, choice: str) -> "ExecutionConfig":
        """Every op on one path (``"reference"``, ``"pallas"``, ``"interpret"``), as ``MTP_KERNELS=choice``.

        An opt-in op (``OPT_IN``) still needs an entry of its own (`impl_for`).
        """
        return cls(kernels=(("", check_kernel_choice(choice, "ExecutionConfig.everywhere")),))

    def with_global_kernel(self, choice: str) -> "ExecutionConfig":
        """This config with ``choice`` the path of every op without an entry of its own (a script's
        ``--kernels`` flag over ``MTP_KERNELS``); ``"auto"`` leaves the config as it is."""
        if check_kernel_choice(choice, "kernels") == "auto":
            return self
        return dataclasses.replace(self, kernels=(("", choice),) + tuple(e for e in self.kernels if e[0]))

    def with_kernels(self, **choices: str) -> "ExecutionConfig":
        """This config with ``op=choice`` entries of its own for the named ops (others as they were)."""
        kept = tuple((name, value) for name, value in self.kernels if name not in choices)
        return dataclasses.replace(self, kernels=kept + tuple(choices.items()))

    def impl_for(self, op: str) -> str:
        """The path the model hands ``op``: its own entry, else the global value, else ``"auto"``.

        An op in ``OPT_IN`` reads only its own entry: a global value flips every op's kernel at
        once, and an opt-in kernel was measured slower in some programs (``MTP_KERNELS=pallas``
        would otherwise swap it in where the op's default kernel does better). What ``"auto"``
        then means is the op's own rule (`mtp.ops.dispatch.choose`).
        """
        choice = "auto"
        for name, value in self.kernels:
            if not name:
                choice = value
            elif name == op:
                return value
        return "auto" if op in OPT_IN else choice

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
