"""The single switch that picks how the project's Pallas ops run.

Every op in ``mtp.pallas`` takes ``impl="auto"`` and passes it through
``resolve_impl`` so that the model, the tests and the benchmarks agree on one
rule: compiled Pallas kernels on a GPU, the pure-JAX references everywhere else,
and Pallas interpret mode when a test wants the kernel's own code on a CPU.
The ``MTP_KERNELS`` environment variable overrides what ``"auto"`` means, so a
whole run can be flipped (say, to the reference path on a GPU to rule a kernel
out) without touching code.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp

CHOICES = ("auto", "reference", "pallas", "interpret")
OPS = ("paged_attention", "fc_gemm", "gdn_step", "add_rms_norm", "conv_step", "attn_prologue",
       "paged_attention_triton", "moe", "fp8_gemm")  # MTP_KERNELS' per-op names (moe: mtp.ops.moe,
       # fp8_gemm: mtp.ops.fp8)
ENV_VAR = "MTP_KERNELS"
# Kernels "auto" leaves on their references (``MTP_KERNELS=<op>=pallas`` takes them): not yet
# measured faster inside the model on a GPU, or measured faster only in some programs. Each
# entry says why it is here; scripts/gpu_check.sh times every one off and on.
OPT_IN = {
    # Measured on the H200 (results/decode/decode_h200.md, 2026-11-30): the default model's loops
    # 1.045x (plain) and 1.006x (speculative K = 2) at batch 1, but the 1.38B decode step
    # 0.96-0.98x (batch 1) and 0.94x (batch 8).
    "paged_attention_triton": "faster only in the small default model's loops",
}


def _check(impl: str, where: str) -> str:
    if impl not in CHOICES:
        raise ValueError(
            f"{where}={impl!r} is not a kernel implementation; choose one of "
            f"{', '.join(CHOICES)}"
        )
    return impl


def env_choice(op: str | None) -> str:
    """``MTP_KERNELS``' setting for ``op``: ``"auto,gdn_step=reference"`` sets all, then one op.

    An op in ``OPT_IN`` reads only its own entry: a global value flips every op's kernel at
    once, and an opt-in kernel was measured slower in some programs (``MTP_KERNELS=pallas``
    would otherwise swap it in where the op's default kernel does better).
    """
    choice = "auto"
    for entry in filter(None, os.environ.get(ENV_VAR, "").split(",")):
        name, _, value = entry.rpartition("=")
        if name and name not in OPS:
            raise ValueError(f"{ENV_VAR} entry {entry!r}: no op named {name!r}; the ops are "
                             f"{', '.join(OPS)}")
        if not name:
            choice = _check(value, ENV_VAR)
        elif name == op:
            return _check(value, f"{ENV_VAR} entry {name}")
    return "auto" if op in OPT_IN else choice


def auto_decides(impl: str, op: str) -> bool:
    """Whether neither ``impl`` nor ``MTP_KERNELS`` names a path for ``op``.

    Only then may an op's measured rule of where its kernel pays send it to the reference:
    a named ``pallas`` (an A/B run's ``MTP_KERNELS=op=pallas``) must run the kernel, or the
    run compares the reference with itself.
    """
    return impl == "auto" and env_choice(op) == "auto"


def target_device():
    """The device a trace is compiled for: ``jax_default_device`` when set, else the first device.

    A deviceless compile (``experiments/count_kernels.py``) sets ``jax_default_device``
    to a compile-only GPU of a topology while the process itself runs on the CPU; the
    kernel switch, the tile plans (``num_sms``) and ``pad_small_gemms`` then decide as
    they would on that GPU.
    """
    dev = jax.config.jax_default_device
    if isinstance(dev, str):  # a platform name ("cpu")
        return jax.devices(dev)[0]
    return dev if dev is not None else jax.devices()[0]


def on_gpu() -> bool:
    return target_device().platform == "gpu"


def resolve_impl(impl: str, op: str | None = None) -> str:
    """Returns the concrete implementation ("reference", "pallas" or "interpret").

    An explicit choice wins; "auto" first consults ``MTP_KERNELS`` (a global value
    and/or ``op=value`` entries, e.g. ``MTP_KERNELS=gdn_step=reference`` to compare a
    run without one kernel) and then the default backend, so a CPU-only process never
    tries to compile a GPU kernel; an op in ``OPT_IN`` stays on its reference unless its
    own entry names another path (`env_choice`).
    """
    _check(impl, "impl")
    if impl == "auto":
        impl = env_choice(op)
    if impl == "auto":
        impl = "pallas" if on_gpu() and op not in OPT_IN else "reference"
    return impl


TENSOR_AXIS = "tp"  # the mesh axis `mtp.sharding` splits heads over; the kernels split on it too


def tensor_parallel_mesh():
    """The mesh the current trace runs under (``jax.set_mesh``) if it splits ``TENSOR_AXIS``.

    A Pallas kernel is an opaque custom call to XLA's partitioner, which would gather
    its sharded operands whole onto every device. Under such a mesh an op runs its
    kernel per shard in a ``shard_map`` instead. Returns None without one.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TENSOR_AXIS not in mesh.axis_names or mesh.shape[TENSOR_AXIS] == 1:
        return None
    return mesh


PAD_ENV_VAR = "MTP_PAD_SMALL_GEMMS"
MERGE_ENV_VAR = "MTP_MERGE_PROJECTIONS"
REDUCE_ENV_VAR = "MTP_SMALL_GEMMS_AS_REDUCE"


def _gpu_default_switch(env_var: str) -> bool:
    """A 0/1 switch read from ``env_var`` when a function is traced; unset, on exactly on a GPU."""
    value = os.environ.get(env_var)
    if value is None:
        return on_gpu()
    if value not in ("0", "1"):
        raise ValueError(f"{env_var}={value!r}: set it to 0 or 1")
    return value == "1"


def pad_small_gemms() -> bool:
    """Whether `mtp.model.layers.dense` pads a one-row product with a large weight to 2 rows.

    On by default on a GPU, where XLA's GEMM streams such weights faster for 2 rows
    than for 1 (measured, see ``dense``); ``MTP_PAD_SMALL_GEMMS=0`` or ``1`` decides
    instead (benchmarks flip it to compare).
    """
    return _gpu_default_switch(PAD_ENV_VAR)


def merge_projections() -> bool:
    """Whether `mtp.model.layers.dense_columns` runs projections of one input as one GEMM.

    On by default on a GPU, where a decode step's launches cost more than its small
    GEMMs' bytes (see ``dense_columns``); ``MTP_MERGE_PROJECTIONS=0`` or ``1`` decides instead.
    """
    return _gpu_default_switch(MERGE_ENV_VAR)


def small_gemms_as_reduce() -> bool:
    """Whether `mtp.model.layers.linear` writes a few-row product with a small weight as a reduction.

    On by default on a GPU, where a small model's verify ran faster so (see ``linear``);
    ``MTP_SMALL_GEMMS_AS_REDUCE=0`` or ``1`` decides instead (benchmarks flip it to compare).
    """
    return _gpu_default_switch(REDUCE_ENV_VAR)


def interpret_forced() -> bool:
    """Whether Pallas' GPU interpreter is switched on around the current trace.

    Tests turn it on around a whole jitted model (``plgpu.force_gpu_interpret_mode``);
    a kernel with a form the interpreter cannot run picks its other form then.
    jax keeps this setting in a private config entry, so a jax without it reads False.
    """
    try:
        from jax._src import config as jax_config

        return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None
    except AttributeError:
        return False


@contextlib.contextmanager
def triton_interpret_scope(mode: str):
    """The scope a Triton-lowered kernel is traced in; yields whether it runs interpreted.

    ``mode``: ``resolve_impl``'s choice, "pallas" or "interpret". Tests also force Mosaic
    GPU's interpreter around a whole model (``interpret_forced``), and it takes every
    ``pallas_call`` traced inside; it runs only kernels whose BlockSpecs have trivial
    windows, which the per-program blocks of the Triton kernels (`mtp.pallas.gdn_step`,
    `mtp.pallas.add_rms_norm`, `mtp.pallas.conv_step`, `mtp.pallas.attn_prologue`) are not.
    Inside this scope such a kernel, called with ``interpret=True``, gets Pallas' generic
    interpreter instead.
    """
    if not (mode == "interpret" or interpret_forced()):
        yield False
        return
    from jax._src import config as jax_config

    prev = jax_config.pallas_tpu_interpret_mode_context_manager.swap_local(None)
    try:
        yield True
    finally:
        jax_config.pallas_tpu_interpret_mode_context_manager.set_local(prev)


def run_triton_op(op: str, impl: str, unsupported, reference, kernel, kernel_pays=None):
    """The dispatch of a Triton-lowered op: ``reference()``, or ``kernel(interpret)``.

    The reference runs where ``impl`` resolves to it (`resolve_impl`), where
    ``unsupported()`` names why the kernel cannot take the inputs, under a tensor-parallel
    mesh (the kernels see whole arrays, and XLA partitions the reference), and where
    ``kernel_pays()`` says False while the choice is ``auto`` all the way (``impl`` and
    ``MTP_KERNELS``): an op's measured rule for inputs where XLA's own fusions do better.
    """
    mode = resolve_impl(impl, op=op)
    declined = kernel_pays is not None and auto_decides(impl, op) and not kernel_pays()
    if mode == "reference" or declined or unsupported() or tensor_parallel_mesh() is not None:
        return reference()
    with triton_interpret_scope(mode) as interpret:
        return kernel(interpret)


def triton_compiler_params(interpret: bool, num_warps: int, num_stages: int = 1) -> dict:
    """``pallas_call``'s keyword arguments for a Triton-lowered kernel (none when interpreted)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pl_triton

    return {"compiler_params": pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def num_sms() -> int:
    """Streaming multiprocessors of the target device (132 on an H100/H200; the plan's default)."""
    return getattr(target_device(), "core_count", None) or 132


def swizzle_transforms(minor_elems: int, dtype):
    """The widest TMA swizzle for a tile ``minor_elems`` wide, and the matching tiling."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


LOOP_GRAPH_ENV_VAR = "MTP_DECODE_LOOP_GRAPH"
_COMMAND_BUFFER_DEFAULTS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"  # XLA's own


def decode_loop_compiler_options() -> dict[str, str]:
    """XLA options for the jitted decode loops: the ``while_loop`` itself inside the CUDA graph.

    By default XLA records a loop iteration's kernels into CUDA graphs but drives the
    loop from the host, which copies the loop predicate back and waits for it every
    iteration: a host round trip per verify step. With WHILE and CONDITIONAL command
    buffers XLA can record the loop as a graph with device-side conditional nodes, and CONCURRENT
    scheduling lets independent kernels of an iteration overlap. Side by side on the
    H200 (results/decode/decode_h200.md, 2026-11-29) this sped the default model's batch-1
    decode loop up by about a fifth. These are GPU fields of XLA's DebugOptions; other
    backends ignore them. ``MTP_DECODE_LOOP_GRAPH=0`` keeps XLA's defaults, ``while`` takes
    the loop graphs with XLA's default scheduling; the variable is read when
    ``mtp.speculative`` is imported.
    """
    value = os.environ.get(LOOP_GRAPH_ENV_VAR, "1")
    if value not in ("0", "1", "while"):
        raise ValueError(f"{LOOP_GRAPH_ENV_VAR}={value!r}: set it to 0, 1 or while")
    if value == "0":
        return {}
    graphs = {"xla_gpu_enable_command_buffer": _COMMAND_BUFFER_DEFAULTS + ",WHILE,CONDITIONAL"}
    return graphs if value == "while" else {**graphs, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
