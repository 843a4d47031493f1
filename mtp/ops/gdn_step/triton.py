"""The per-token steps of a Gated DeltaNet layer, after its conv, as one kernel: decode and verify.

At batch 1 the step's arithmetic is tiny, but XLA spreads it over ~10 kernels per
layer (two l2norms, the gates, three delta-rule fusions, the gated RMSNorm's reduce
and scale), each a few microseconds of launch and tail: together about as long as
streaming the layer's weights (results/decode/decode_h200.md). Here one program per
``(sequence, value head)`` does all of it on its ``[Dk, Dv]`` state in registers:

    q, k = l2norm(q) * Dk^-1/2, l2norm(k);  beta = sigmoid(b);  g = -exp(A_log) softplus(a + dt_bias)
    S = exp(g) S;  S += k (beta (v - k^T S));  o = q^T S
    y = silu(z) * w * rmsnorm(o)

and writes ``y`` (the out projection's input) and the new state. Where one program per head
leaves SMs idle (batch 1), a head's value columns are split over several programs instead
(``default_chunks``) and the norm, which needs the whole row, runs after them. A verify of T <= 8 tokens
per sequence is one call too: each program keeps its state in registers across the T tokens
and writes the state after every one (verify keeps the accepted one), where XLA ran the
step token by token (results/decode/decode_h200.md, 2026-11-29: 363 -> 232 kernels at K = 4).

Why Pallas' Triton lowering and not Mosaic GPU (the project's default, since Triton's
Pallas backend is deprecated): the step is two mat-vec reductions over the state's
rows and an outer-product update, on 128 x 128 f32 blocks with no matmul to feed a
wgmma; Triton expresses reductions along either axis of a block directly, while the
Mosaic GPU register layouts are built around wgmma tiles.

`reference.gdn_steps_reference` is the definition: the model's own functions, composed;
`api.gdn_steps` picks between the two.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtp.ops.gdn_step.reference import HeadShape, heads_of, output_gate
from mtp.ops.lowering import num_sms, triton_compiler_params
from mtp.ops.norms import gated_rms_norm, l2norm

MAX_STEPS = 8  # tokens per sequence a call unrolls (verify widths); more go to the reference


def kernel_unsupported(mixed, qkvz, ba, state, num_k_heads, ba_col=0) -> str | None:
    """Why the kernel cannot take these inputs (the caller then runs the reference), or None."""
    _, nv, dk, dv = state.shape
    nk = num_k_heads
    if dk != dv:
        return f"key and value head dims differ ({dk} vs {dv})"
    if dk & (dk - 1) or dk < 8:
        return f"head dim {dk} is not a power of two >= 8"
    if nv % nk:
        return f"{nv} value heads do not group over {nk} key heads"
    if mixed.shape[-1] != (2 * nk + nv) * dk:
        return f"mixed has {mixed.shape[-1]} channels, not {(2 * nk + nv) * dk} (nk={nk}, nv={nv}, D={dk})"
    tokens = math.prod(mixed.shape[:-1])
    if tokens // mixed.shape[0] > MAX_STEPS:
        return f"{tokens // mixed.shape[0]} steps per sequence; the kernel unrolls at most {MAX_STEPS}"
    for name, x, want in (("qkvz", qkvz, heads_of(nk, state).qkvz_width), ("ba", ba, ba_col + 2 * nv)):
        if x.shape[-1] < want:
            return f"{name} has {x.shape[-1]} channels, fewer than {want} (nk={nk}, nv={nv}, D={dk})"
        if x.shape[0] < tokens:
            return f"{name} has {x.shape[0]} rows for {tokens} tokens"
    return None


def _kernel(q_ref, k_ref, v_ref, z_ref, b_ref, a_ref, valid_ref, s_ref, alog_ref, dtb_ref, w_ref,
            y_ref, s_out_ref, *chunk_sum_sq, eps):
    """One program: a value head's state columns, all of them or a chunk (``chunk_sum_sq``: the
    output ref of each token's sum of squares over the chunk's columns)."""
    d = q_ref.shape[-1]
    f32 = jnp.float32
    steps = y_ref.shape[1]
    s = s_ref[0, 0, 0]  # the state first: its bytes are the program's long load
    scale_a = -jnp.exp(alog_ref[0, 0].astype(f32))
    for t in range(steps):  # verify's few tokens, unrolled; the state stays in registers
        q = l2norm(q_ref[0, t, 0, :].astype(f32)) * (d ** -0.5)
        k = l2norm(k_ref[0, t, 0, :].astype(f32))
        v = v_ref[0, t, 0, :].astype(f32)
        live = valid_ref[0, t] != 0
        beta = jnp.where(live, jax.nn.sigmoid(b_ref[t, 0].astype(f32)), 0.0)
        g = scale_a * jax.nn.softplus(a_ref[t, 0].astype(f32) + dtb_ref[0, 0].astype(f32))
        decay = jnp.exp(jnp.where(live, g, 0.0))
        k = jnp.where(live, k, 0.0)
        # Both reads of the old state in one pass: with S' = decay S + k delta^T,
        # k^T S' needs k^T S and q^T S' = decay q^T S + (q . k) delta. Every value column is
        # independent of the others, so a program may own a chunk of them.
        sk = jnp.sum(s * k[:, None], axis=0)
        sq = jnp.sum(s * q[:, None], axis=0)
        delta = (v - decay * sk) * beta
        s = decay * s + k[:, None] * delta[None, :]
        s_out_ref[0, t, 0] = s
        o = (decay * sq + jnp.sum(q * k) * delta).astype(y_ref.dtype)
        if chunk_sum_sq:  # a chunk: the norm needs the whole row, so it runs after the kernel
            y_ref[0, t, 0, :] = o
            chunk_sum_sq[0][0, t, 0, 0] = jnp.sum(jnp.square(o.astype(f32)))
        else:  # the model's own gated norm, on [1, Dv] rows: Triton lowers 2-D reductions directly
            y_ref[0, t, 0, :] = gated_rms_norm(o[None, :], z_ref[pl.ds(t, 1), :], w_ref[...], eps)[0]


def default_num_warps(programs: int) -> int:
    """Warps per program (one value head's 128 x 128 state), by how many programs the step has.

    Measured on the H200 (results/kernels/kernels_h200.md, 2026-11-29; ``bench_kernels --only gdn
    --gdn_warps 4,8,16``): a grid that fits on the SMs at once (batch 1: 32 programs) is
    latency-bound and best at 8 (5.1 vs 5.3 µs at 4); a larger one runs more programs per
    SM at 4 (batch 8: 9.3 vs 11.0 µs at 8).
    """
    return 8 if programs <= num_sms() else 4


def default_chunks(heads: int, d: int) -> int:
    """Programs per value head: its state's columns split into this many chunks.

    A grid of one program per head that leaves SMs idle (batch 1: 32 heads on 132 SMs) is
    latency-bound: each program streams a whole 64 KB state. The columns of a head's state
    update independently, so such a step splits them over up to 8 programs (one warp each,
    at least 16 columns), about two programs per SM. The gated norm, which needs a token's
    whole row, then runs after the kernel as one XLA fusion from the kernel's per-chunk sums
    of squares. Measured on the H200 (results/decode/decode_h200.md, 2026-11-30), the 1.38B model's
    layer at batch 1: 2.9 µs in 8 chunks of one warp against 6.3 µs whole in the same probe
    (which adds a small convert of its inputs; in the model 3.4 µs plus 1.2 for the norm's
    fusion, against 5.5: the loop 1.010x, the default model's speculative loop 1.042x); at
    batch 8 (256 heads) 7.7 µs in 4 chunks against 10.2 whole (9.3 in the 2026-11-29 timing of
    results/kernels/kernels_h200.md), which the extra fusion would mostly eat, so larger grids stay whole.
    """
    if heads > num_sms():
        return 1
    chunks = 1
    while chunks < 8 and d // (2 * chunks) >= 16 and heads * 2 * chunks <= 2 * num_sms():
        chunks *= 2
    return chunks


@functools.partial(jax.jit, static_argnames=("num_k_heads", "eps", "ba_col", "num_warps", "chunks", "interpret"))
def gdn_steps_triton(mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w, *, num_k_heads, eps,
                      ba_col=0, num_warps=None, chunks=None, interpret=False):
    """The kernel path of `reference.gdn_steps_reference`, for inputs `kernel_unsupported` takes.

    ``chunks`` (programs per value head) and ``num_warps`` override the plan
    (``default_chunks``, ``default_num_warps``: benchmarks sweep them); ``interpret``:
    Pallas' interpreter (CPU tests).
    """
    bsz, t = mixed.shape[:2]
    _, nv, d, _ = state.shape
    chunks = chunks or default_chunks(bsz * nv, d)
    if d % chunks:
        raise ValueError(f"chunks={chunks} does not divide the head dim {d}")
    num_warps = num_warps or (1 if chunks > 1 else default_num_warps(bsz * nv))
    dc = d // chunks
    nk = num_k_heads
    r = nv // nk
    # d-wide blocks of all T tokens; the index maps pick each value head's blocks where the
    # projections put them, so z, b and a are never sliced out into arrays of their own.
    # qkvz is per key head [q, k, v x r, z x r]; it and ba may be one merged buffer wider
    # than either, with token t of sequence i in row i T + t. Program (i, h, c) owns value
    # columns c dc ... (c + 1) dc of head h.
    heads = mixed.reshape(bsz, t, nk * (2 + r), d)     # per key head [q, k, v x r]
    col = lambda off: pl.BlockSpec((1, t, 1, d), lambda i, h, c, off=off: (i, 0, off(h), 0))
    scalar = lambda off: pl.BlockSpec((t, 1), lambda i, h, c, off=off: (i, ba_col + off(h)))
    per_head = pl.BlockSpec((1, 1), lambda i, h, c: (h, 0))
    group = lambda h: (h // r) * (2 + r)     # the value head's key-head group
    head_state = pl.BlockSpec((1, 1, 1, d, dc), lambda i, h, c: (i, 0, h, 0, c))
    z_col = lambda h: (h // r) * (2 + 2 * r) + 2 + r + h % r  # z of head h, in qkvz's d-blocks
    in_specs = [
        col(group),                          # q of the value head's key head
        col(lambda h: group(h) + 1),         # k
        pl.BlockSpec((1, t, 1, dc), lambda i, h, c: (i, 0, group(h) + 2 + h % r, c)),  # v
        pl.BlockSpec((t, dc), lambda i, h, c: (i, z_col(h) * chunks + c)),             # z, in qkvz
        scalar(lambda h: (h // r) * 2 * r + h % r),             # b, in ba ([b x r, a x r] per group)
        scalar(lambda h: (h // r) * 2 * r + r + h % r),         # a
        pl.BlockSpec((1, t), lambda i, h, c: (i, 0)),           # valid
        head_state,                          # the state, as [B, 1, nv, D, D]
        per_head, per_head,                  # A_log, dt_bias
        pl.BlockSpec((dc,), lambda i, h, c: (c,)),              # norm weight
    ]
    out_specs = [pl.BlockSpec((1, t, 1, dc), lambda i, h, c: (i, 0, h, c)),
                 pl.BlockSpec((1, t, 1, d, dc), lambda i, h, c: (i, 0, h, 0, c))]
    out_shape = [jax.ShapeDtypeStruct((bsz, t, nv, d), mixed.dtype),
                 jax.ShapeDtypeStruct((bsz, t, nv, d, d), jnp.float32)]
    if chunks > 1:  # each chunk's share of every token's sum of squares
        out_specs.append(pl.BlockSpec((1, t, 1, 1), lambda i, h, c: (i, 0, h, c)))
        out_shape.append(jax.ShapeDtypeStruct((bsz, t, nv, chunks), jnp.float32))
    y, states, *sum_sq = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        grid=(bsz, nv, chunks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        # One step (decode): the new state overwrites the old one in place (each program
        # reads its (b, h, c) block before writing it). Without this, a decode loop that carries
        # the state copied the kernel's output into the carry every step: a device memcpy of
        # 2 MB per layer (`experiments/count_kernels.py --loop`). T > 1 (verify) writes every
        # step's state, a new buffer.
        input_output_aliases={7: 1} if t == 1 else {},
        interpret=interpret,
        name="gdn_step",  # the kernel's name in a profile (CUPTI)
        **triton_compiler_params(interpret, num_warps),
    )(heads, heads, heads, qkvz, ba, ba, valid.astype(jnp.int32), state.astype(jnp.float32)[:, None],
      a_log[:, None], dt_bias[:, None], norm_w)
    if sum_sq:  # chunks: y holds o; the gated norm as the model computes it, from the chunks' sums
        # Added one by one, not `jnp.sum`: elementwise adds fuse into the norm's kernel, where a
        # reduction would be a kernel of its own.
        total = functools.reduce(jnp.add, [sum_sq[0][..., c] for c in range(chunks)])
        y = gated_rms_norm(y, _z_of(qkvz, bsz, t, nk, nv, d), norm_w, eps, sum_sq=total)
    return y, states


def _z_of(qkvz, bsz, t, nk, nv, d):
    """``z [B, T, nv, D]`` out of the ``in_proj_qkvz`` rows, as the model slices it."""
    heads = HeadShape(nk, nv, d, d)
    return output_gate(qkvz[:bsz * t, :heads.qkvz_width].reshape(bsz, t, heads.qkvz_width), heads)
