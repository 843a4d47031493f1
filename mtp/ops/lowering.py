"""What a kernel's lowering needs to know of the device a trace targets, shared by every op.

The target device (which a deviceless compile sets apart from the process's own), its
multiprocessor count (the tile plans fill it), the tensor-parallel mesh a trace runs under
(an op then runs its kernel per shard, or its reference), the compiler parameters of
Pallas' Triton lowering, Mosaic GPU's swizzled shared-memory tiles, and the scopes that
run a kernel in Pallas' interpreters on a CPU.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def target_device():
    """The device a trace is compiled for: ``jax_default_device`` when set, else the first device.

    A deviceless compile (``experiments/count_kernels.py``) sets ``jax_default_device``
    to a compile-only GPU of a topology while the process itself runs on the CPU; the
    kernel switch, the tile plans (``num_sms``) and the model's GPU-default GEMM switches
    (`mtp.model.gemm_layout.pad_small_gemms`) then decide as they would on that GPU.
    """
    dev = jax.config.jax_default_device
    if isinstance(dev, str):  # a platform name ("cpu")
        return jax.devices(dev)[0]
    return dev if dev is not None else jax.devices()[0]


def on_gpu() -> bool:
    return target_device().platform == "gpu"


def num_sms() -> int:
    """Streaming multiprocessors of the target device (132 on an H100/H200; the plan's default)."""
    return getattr(target_device(), "core_count", None) or 132


TENSOR_AXIS = "tp"  # the mesh axis `mtp.sharding` splits heads over; the kernels split on it too


def tensor_parallel_mesh():
    """The mesh the current trace runs under (``jax.set_mesh``) if it splits ``TENSOR_AXIS``.

    A Pallas kernel is an opaque custom call to XLA's partitioner, which would gather
    its sharded operands whole onto every device. Under such a mesh an op runs its
    kernel per shard in a ``shard_map`` instead, or its reference. Returns None without one.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TENSOR_AXIS not in mesh.axis_names or mesh.shape[TENSOR_AXIS] == 1:
        return None
    return mesh


def triton_compiler_params(interpret: bool, num_warps: int, num_stages: int = 1) -> dict:
    """``pallas_call``'s keyword arguments for a Triton-lowered kernel (none when interpreted)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pl_triton

    return {"compiler_params": pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def swizzle_transforms(minor_elems: int, dtype):
    """The widest TMA swizzle for a tile ``minor_elems`` wide, and the matching tiling."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


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

    ``mode``: `mtp.ops.dispatch.choose`'s kernel path, "pallas" or "interpret". Tests also
    force Mosaic GPU's interpreter around a whole model (``interpret_forced``), and it takes
    every ``pallas_call`` traced inside; it runs only kernels whose BlockSpecs have trivial
    windows, which the per-program blocks of the Triton kernels (`mtp.ops.gdn_step`,
    `mtp.ops.add_rms_norm`, `mtp.ops.conv_step`, `mtp.ops.attn_prologue`) are not. Inside
    this scope such a kernel, called with ``interpret=True``, gets Pallas' generic
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


@contextlib.contextmanager
def mosaic_interpret_scope(mode: str):
    """The scope a Mosaic GPU kernel is traced in; yields whether it runs interpreted.

    ``mode`` "interpret" switches Pallas' GPU interpreter on around the call (call it
    eagerly then: the switch applies to this call's own lowering); "pallas" leaves it as
    the caller set it (a test may have forced it around a whole model, ``interpret_forced``).
    """
    if mode != "interpret":
        yield interpret_forced()
        return
    from jax.experimental.pallas import mosaic_gpu as plgpu

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        yield True
