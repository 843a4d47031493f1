"""``gdn_steps``: a Gated DeltaNet layer's decode or verify tokens after its conv, reference or kernel.

`mtp.ops.dispatch.choose` picks the path under the op name ``"gdn_step"``: the kernel
(`triton`) on a GPU for inputs it takes, the pure-JAX definition (`reference`) elsewhere.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from mtp.ops import dispatch
from mtp.ops.gdn_step import triton
from mtp.ops.gdn_step.reference import gdn_steps_reference, heads_of
from mtp.ops.lowering import TENSOR_AXIS, tensor_parallel_mesh, triton_interpret_scope


def unsupported(mixed, qkvz, ba, state, num_k_heads, ba_col=0) -> str | None:
    """Why the kernel path cannot take these inputs (the reference then runs), or None.

    The kernel's own limits (`triton.kernel_unsupported`), and under a mesh that splits
    ``TENSOR_AXIS`` the splits it cannot run per shard: key heads that do not divide over
    the mesh, or qkvz and ba merged into one buffer (their columns then do not split on
    key-head groups).
    """
    if why := triton.kernel_unsupported(mixed, qkvz, ba, state, num_k_heads, ba_col):
        return why
    mesh = tensor_parallel_mesh()
    tp = mesh.shape[TENSOR_AXIS] if mesh is not None else 1
    if num_k_heads % tp:
        return f"{num_k_heads} key heads do not split over {tp} devices"
    if tp > 1 and (ba_col or qkvz.shape[-1] != heads_of(num_k_heads, state).qkvz_width):
        return "qkvz merged with ba: its columns do not split on key-head groups"
    return None


def gdn_steps(mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w, *, num_k_heads, eps,
              ba_col=0, impl="auto"):
    """``gdn_steps_reference``'s signature and results; ``impl`` picks the path (`dispatch.choose`).

    Inputs the kernel cannot take (``unsupported``) go to the reference. ``auto``
    takes the kernel on a GPU: reading ``in_proj_qkvz``'s padded GEMM
    output in place (no device memcpy of a slice of it per layer) made a batch-1 decode
    step of the 1.38B model 1.290 vs 1.336 ms and a batch-8 step 1.678 vs 1.805 ms, side
    by side on the H200 (results/decode/decode_h200.md, 2026-11-29). Before that the kernel cut
    kernel time but not the step. ``impl="reference"`` turns it off (the model's config:
    ``ExecutionConfig.kernels``, ``MTP_KERNELS=gdn_step=reference`` at an entry point).
    Traced under a mesh that splits ``lowering.TENSOR_AXIS`` over the key heads, the
    kernel runs per shard on each device's key-head groups (a step never mixes heads);
    splits it cannot take run the reference, which XLA partitions.
    """
    mode = dispatch.choose("gdn_step", impl, lambda: unsupported(mixed, qkvz, ba, state, num_k_heads, ba_col),
                           mesh_kernel=True)
    if mode == "reference":
        return gdn_steps_reference(mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w,
                                   num_k_heads=num_k_heads, eps=eps, ba_col=ba_col)
    mesh = tensor_parallel_mesh()
    tp = mesh.shape[TENSOR_AXIS] if mesh is not None else 1

    def run(mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w):
        with triton_interpret_scope(mode) as interpret:
            return triton.gdn_steps_triton(mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w,
                                           num_k_heads=num_k_heads // tp, eps=eps, ba_col=ba_col,
                                           interpret=interpret)

    if mesh is not None:
        # The channels of mixed, qkvz and ba are grouped per key head, so an even split is a
        # split on groups.
        ax = TENSOR_AXIS
        run = jax.shard_map(run, mesh=mesh, check_vma=False,
                            in_specs=(P(None, None, ax), P(None, ax), P(None, ax), P(),
                                      P(None, ax, None, None), P(ax), P(ax), P()),
                            out_specs=(P(None, None, ax, None), P(None, None, ax, None, None)))
    return run(mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w)


def gdn_step(mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w, *, num_k_heads, eps,
             ba_col=0, impl="auto"):
    """One step (decode): ``gdn_steps`` with T = 1, mixed [B, C] and valid [B]; ``(y [B, nv, Dv], new_state)``."""
    y, states = gdn_steps(mixed[:, None], qkvz, ba, valid[:, None], state, a_log, dt_bias, norm_w,
                          num_k_heads=num_k_heads, eps=eps, ba_col=ba_col, impl=impl)
    return y[:, 0], states[:, 0]
