"""What a gated-attention layer does between its q/k/v GEMM and paged attention, as one kernel.

For a few new tokens per sequence (decode, verify, a draft), the layer RMS-normalises q
and k per head, rotates their first ``rotary_dim`` channels (RoPE), and writes k and v
into the paged KV cache. In the 1.38B decode step XLA runs that as 7 kernels per attention
layer (`experiments/count_kernels.py --list`: the key norm's reduction, the key's RoPE, a
select, the query's norm and RoPE, a slice, two page writes), each a few µs inside a CUDA
graph. Here one program per ``(token, head)`` reads its head's columns of the GEMM output in
place, normalises and rotates them, and stores q (and copies its output gate out, for the
attention's merge kernel), or writes k and v into their page slot over the old cache
(aliased), so nothing else runs and nothing is copied. Counted: the
1.38B step's loop body goes from 208 to 183 launches at batch 1, the default model's plain
loop from 105 to 96 (results/decode/decode_h200.md, 2026-11-30).

Timed off and on, interleaved twice, on the H200 (2026-11-30): the 1.38B step's kernel time
1.01-1.04x less at batch 1 and 1.01-1.02x at batch 8 (wall 1.00x and 1.02x), the default
model's loops 1.02x (speculative) and within noise (plain); ``auto`` takes it on a GPU.
Pallas' Triton lowering, as `mtp.ops.conv_step`: per-row norms, rotations and stores, no matmul.

`reference.attn_prologue_reference` is the definition: the model's own ``qkv_of`` and
``write_pages``; `api.attn_prologue` picks between the two.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from mtp.ops.attn_prologue.reference import AttentionShape
from mtp.ops.lowering import triton_compiler_params
from mtp.ops.paged_kv import NULL_PAGE

MAX_TOKENS = 8  # new tokens per sequence the kernel takes (decode, verify, drafts); prefill runs the reference


def kernel_unsupported(columns, k_pages, rope_positions, heads: AttentionShape) -> str | None:
    """Why the kernel cannot take these inputs (the caller then runs the reference), or None."""
    d, half = heads.head_dim, heads.rotary_dim // 2
    if d & (d - 1) or half & (half - 1) or half < 2:
        return f"head dim {d} and half rotary dim {half} are not powers of two >= 2"
    if any(c.start % d or c.rows.dtype != k_pages.dtype for c in columns):
        return f"projection columns not {d}-aligned or not in the cache's {k_pages.dtype}"
    if k_pages.size >= 2**31:
        return f"a page pool of {k_pages.size} elements: past int32 offsets"
    tokens = math.prod(rope_positions.shape)
    if rope_positions.shape[1] > MAX_TOKENS or any(c.rows.shape[0] < tokens for c in columns):
        return f"{rope_positions.shape} tokens: the kernel takes up to {MAX_TOKENS} per sequence"
    return None


def _kernel(pos_ref, slot_ref, write_ref, table_ref, qg_ref, k_ref, v_ref, wq_ref, wk_ref, _k_in, _v_in,
            q_ref, gate_ref, k_pages_ref, v_pages_ref, *, heads: AttentionShape, starts):
    f32 = jnp.float32
    d, hq, half = heads.head_dim, heads.num_attention_heads, heads.rotary_dim // 2
    dtype = q_ref.dtype
    h = pl.program_id(1)
    # RoPE's angles, as `reference.rope`: f32 frequencies, cos and sin rounded to the model's dtype.
    inv_freq = 1.0 / (heads.rope_theta ** (jax.lax.broadcasted_iota(f32, (half,), 0) * 2.0 / heads.rotary_dim))
    angle = pos_ref[0, 0].astype(f32) * inv_freq
    cos, sin = jnp.cos(angle).astype(dtype), jnp.sin(angle).astype(dtype)
    keep = jax.lax.broadcasted_iota(jnp.int32, (d,), 0) >= heads.rotary_dim

    def normed_rotated(x_ref, col, w_ref, store):
        """`mtp.ops.norms.rms_norm` then `reference.rope` of the head at ``col``; ``store(sl, value, mask)``."""
        x = x_ref[0, pl.ds(col, d)].astype(f32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x * x) + heads.rms_norm_eps)
        normed = lambda sl: ((x_ref[0, pl.ds(col + sl.start, sl.size)].astype(f32) * inv_rms)
                             * (1.0 + w_ref[sl].astype(f32))).astype(dtype)
        store(pl.ds(0, d), normed(pl.ds(0, d)), keep)  # the channels past the rotary ones, as normed
        a, b = normed(pl.ds(0, half)), normed(pl.ds(half, half))
        store(pl.ds(0, half), a * cos - b * sin, None)
        store(pl.ds(half, half), b * cos + a * sin, None)

    def into(ref, *index):
        index = tuple(jnp.asarray(i, jnp.int32) for i in index)  # traced scalars, as the interpreter wants

        def store(sl, value, mask):
            plt.store(ref.at[(*index, sl)], value, mask=mask)
        return store

    @pl.when(h < hq)
    def _query():
        normed_rotated(qg_ref, starts[0] + h * 2 * d, wq_ref, into(q_ref, 0, h))
        # The gate too, as its own array: the attention's merge kernel takes it, and a
        # custom call's sliced operand would be a copy of its own (a kernel, in XLA).
        gate_ref[0, h, :] = qg_ref[0, pl.ds(starts[0] + h * 2 * d + d, d)]

    @pl.when(h >= hq)
    def _key_value():
        j = h - hq
        page_size, max_blocks = k_pages_ref.shape[1], table_ref.shape[1]
        slot = slot_ref[0, 0]
        block = slot // page_size
        page = table_ref[0, jnp.clip(block, 0, max_blocks - 1)]
        ok = (write_ref[0, 0] != 0) & (slot >= 0) & (block < max_blocks) & (page != NULL_PAGE)

        @pl.when(ok)  # a token that writes nothing leaves the cache, the null page included, as it was
        def _write():
            row = slot % page_size
            normed_rotated(k_ref, starts[1] + j * d, wk_ref, into(k_pages_ref, page, row, j))
            v_pages_ref[page, row, j, :] = v_ref[0, pl.ds(starts[2] + j * d, d)].astype(v_pages_ref.dtype)


@functools.partial(jax.jit, static_argnames=("heads", "starts", "interpret"))
def attn_prologue_triton(rows, q_norm_w, k_norm_w, rope_positions, slots, k_pages, v_pages, block_tables, write,
                         *, heads: AttentionShape, starts, interpret=False):
    """The kernel path of `reference.attn_prologue_reference`, its columns given as the GEMM outputs
    ``rows`` and each projection's first column ``starts``; ``interpret``: Pallas' interpreter (CPU tests)."""
    b, t = rope_positions.shape
    hq, hkv, d = heads.num_attention_heads, heads.num_key_value_heads, heads.head_dim
    per_token = lambda a: a.reshape(b * t, 1).astype(jnp.int32)
    token = pl.BlockSpec((1, 1), lambda r, h: (r, 0))
    whole = lambda a: pl.BlockSpec(a.shape, lambda r, h: (0,) * a.ndim)
    row = lambda a: pl.BlockSpec((1, a.shape[1]), lambda r, h: (r, 0))
    q, gate, k_pages, v_pages = pl.pallas_call(
        functools.partial(_kernel, heads=heads, starts=starts),
        grid=(b * t, hq + hkv),
        in_specs=[token, token, token, pl.BlockSpec((1, block_tables.shape[1]), lambda r, h: (r // t, 0)),
                  *(row(a) for a in rows), whole(q_norm_w), whole(k_norm_w), whole(k_pages), whole(v_pages)],
        out_specs=[pl.BlockSpec((1, hq, d), lambda r, h: (r, 0, 0))] * 2 + [whole(k_pages), whole(v_pages)],
        out_shape=[jax.ShapeDtypeStruct((b * t, hq, d), rows[0].dtype)] * 2 + [
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={9: 2, 10: 3},  # the pages are written in place
        interpret=interpret,
        name="attn_prologue",  # the kernel's name in a profile (CUPTI)
        **triton_compiler_params(interpret, num_warps=1),
    )(per_token(rope_positions), per_token(slots), per_token(write), block_tables.astype(jnp.int32), *rows,
      q_norm_w, k_norm_w, k_pages, v_pages)
    return q.reshape(b, t, hq, d), gate.reshape(b, t, hq, d), k_pages, v_pages

