"""The Gated DeltaNet conv of a decode or verify step, and the state after each token, as one kernel.

A decode step runs a layer's depthwise conv over ``[conv state (K - 1 inputs), the new
input]`` and shifts the new input into the state. XLA makes that two kernels per layer (the
conv with its SiLU, and the shifted state), and because the shifted state reads the loop
carry at other positions than it writes, a device memcpy of it into the carry on top: 36
launches per step of the 1.38B model at batch 1 (results/decode/decode_h200.md, 2026-11-29
count). Here one program per ``(sequence, key head, q/k/v block)`` reads its channels of
the ``in_proj_qkvz`` output in place, its state rows and its conv taps, writes the conv
output, and writes the shifted state over the old one (aliased: each program reads its
block before writing it), so nothing is copied.

A verify of T <= 8 tokens is one call too, writing the state after every token (the commit
keeps the accepted one). XLA made that two kernels per layer as well (the windows' conv, and
the per-token states), and the speculative loop's commit, which XLA fused with the per-token
states and so read the old state, copied every layer's conv state into the carry per step
(`experiments/count_kernels.py --count speculative_loop`).

On the H200 (2026-11-30, results/decode/decode_h200.md) the decode form makes the 1.38B decode step
1.02x faster at batch 1 and 1.05x at batch 8 (interleaved twice against the reference), so
``auto`` takes it on a GPU. A related form measured before it (2026-11-29), the shift inside the fused
delta-rule kernel with the conv left to XLA: 1.0% faster at batch 1 but 3.2% slower at batch 8.

Pallas' Triton lowering, like `mtp.ops.gdn_step`: elementwise work along the channels
with no matmul, where Mosaic GPU's wgmma-shaped register layouts offer nothing.

`reference.conv_steps_reference` is the definition: the model's own ``conv_windows`` and
``conv_states_per_step``; `api.conv_steps` picks between the two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtp.ops.gdn_step.reference import HeadShape
from mtp.ops.gdn_step.triton import MAX_STEPS
from mtp.ops.lowering import triton_compiler_params


def kernel_unsupported(qkvz, valid, conv_state, conv_w, heads: HeadShape) -> str | None:
    """Why the kernel cannot take these (well-formed, `reference.check_inputs`) inputs, or None: the caller
    then runs the reference."""
    d = heads.linear_key_head_dim
    bsz, steps = valid.shape
    if d != heads.linear_value_head_dim or d & (d - 1) or d < 8:
        return f"key and value head dims {d}, {heads.linear_value_head_dim} are not one power of two >= 8"
    if steps > MAX_STEPS:
        return f"{steps} tokens per sequence: the kernel unrolls at most {MAX_STEPS}"
    if qkvz.shape[-1] < heads.qkvz_width or qkvz.shape[0] < bsz * steps:
        return f"qkvz {qkvz.shape} holds fewer than {bsz * steps} rows of {heads.qkvz_width} channels"
    return None


def _kernel(x_ref, valid_ref, state_ref, w_ref, out_ref, states_ref):
    f32 = jnp.float32
    keep = state_ref.shape[-2]
    dtype = out_ref.dtype
    full = [state_ref[0, 0, i, :].astype(dtype) for i in range(keep)]  # the state first: the long loads
    taps = [w_ref[:, 0, i].astype(f32) for i in range(keep + 1)]
    before = full
    for t in range(out_ref.shape[0]):  # verify's few tokens, unrolled
        live = valid_ref[0, t] != 0
        full = full + [jnp.where(live, x_ref[t, :], jnp.zeros_like(x_ref[t, :])).astype(dtype)]
        acc = 0
        for i, tap in enumerate(taps):  # the model's order of the sum (`conv_windows`)
            acc = acc + full[t + i].astype(f32) * tap
        out_ref[t, :] = jax.nn.silu(acc).astype(dtype)
        # A masked token leaves the state as it was (`conv_states_per_step`).
        before = [jnp.where(live, full[t + 1 + i], before[i]) for i in range(keep)]
        for i in range(keep):
            states_ref[0, t, i, :] = before[i].astype(states_ref.dtype)


@functools.partial(jax.jit, static_argnames=("heads", "interpret"))
def conv_steps_triton(qkvz, valid, conv_state, conv_w, *, heads: HeadShape, interpret=False):
    """The kernel path of `reference.conv_steps_reference` (which also takes ``mixed``: the kernel
    reads its channels in place in ``qkvz``); ``interpret``: Pallas' interpreter (CPU tests)."""
    bsz, steps = valid.shape
    keep = conv_state.shape[1]
    nk, d = heads.linear_num_key_heads, heads.linear_key_head_dim
    r = heads.linear_num_value_heads // nk
    blocks = 2 + r  # q, k and r v blocks of D channels per key head
    grouped = lambda h, j: h * blocks + j  # the block's index in the grouped channel order
    # The checkpoint's conv weight is [q of all heads | k | v]: block j of key head h sits at
    # q: h, k: nk + h, v: 2 nk + h r + (j - 2).
    checkpoint = lambda h, j: jnp.where(j == 0, h, jnp.where(j == 1, nk + h, 2 * nk + h * r + j - 2))
    out, states = pl.pallas_call(
        _kernel,
        grid=(bsz, nk, blocks),
        in_specs=[pl.BlockSpec((steps, d), lambda b, h, j: (b, h * (2 + 2 * r) + j)),  # in place in qkvz
                  pl.BlockSpec((1, steps), lambda b, h, j: (b, 0)),
                  pl.BlockSpec((1, 1, keep, d), lambda b, h, j: (b, 0, 0, grouped(h, j))),
                  pl.BlockSpec((d, 1, keep + 1), lambda b, h, j: (checkpoint(h, j), 0, 0))],
        out_specs=[pl.BlockSpec((steps, d), lambda b, h, j: (b, grouped(h, j))),
                   pl.BlockSpec((1, steps, keep, d), lambda b, h, j: (b, 0, 0, grouped(h, j)))],
        out_shape=[jax.ShapeDtypeStruct((bsz * steps, heads.conv_dim), qkvz.dtype),
                   jax.ShapeDtypeStruct((bsz, steps, keep, heads.conv_dim), qkvz.dtype)],
        # Decode: the shifted state overwrites the old one where the dtypes allow (each program
        # reads its block before writing it), so nothing is copied into a loop carry. Verify
        # writes the state after every token, a new buffer that the commit picks from without
        # reading the old state: nothing copied either.
        input_output_aliases={2: 1} if steps == 1 and conv_state.dtype == qkvz.dtype else {},
        interpret=interpret,
        name="conv_step",  # the kernel's name in a profile (CUPTI)
        **triton_compiler_params(interpret, num_warps=1),
    )(qkvz, valid.astype(jnp.int32), conv_state[:, None], conv_w)
    return out.reshape(bsz, steps, heads.conv_dim), states

