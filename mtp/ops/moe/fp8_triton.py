"""The routed experts' gather form with FP8 experts on the weight-streaming kernel (`mtp.ops.fp8.triton`).

`reference.routed_experts_gather`'s signature and roundings: each (token, expert) pair's row goes
through its own expert's gate, up and down GEMMs, each accumulated in f32 and rounded to ``x``'s
dtype, ``silu(gate) * up`` in ``x``'s dtype, the pairs' outputs weighted and summed in f32. The
difference is where the weights come from: `triton.grouped_w8a16` reads each pair's expert out of
the stacked E4M3 values in place, where the reference gathers the selected experts' values and
scales and dequantizes the copy (on an H200 that form ran no faster than bf16 experts,
results/kernels/fp8_few_rows_h200/results.md). The kernel's products are of the exact
dequantized weights in f32 (the reference rounds them to ``x``'s dtype first), so the two agree
to the activations' rounding, not bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp.ops.fp8 import triton
from mtp.ops.fp8.reference import BlockFp8Weight
from mtp.ops.moe.reference import combine

# The most (token, expert) pairs `routed_experts` sends here: a verify of 16 tokens at Qwen3-Next's
# top-10. Every pair streams its own expert, so from there on the segments form (each touched
# expert read once) or the grouped-GEMM kernels read fewer bytes.
MAX_PAIRS = 160


def unsupported(x, expert_ids, gate, up, down) -> str | None:
    """Why the kernel path cannot take these inputs (the caller runs the reference), or None."""
    if not all(isinstance(w, BlockFp8Weight) for w in (gate, up, down)):
        return "the experts are not all BlockFp8Weight"
    pairs = x.shape[0] * expert_ids.shape[1]
    rows = jax.ShapeDtypeStruct((pairs, x.shape[1]), x.dtype)
    ids = jax.ShapeDtypeStruct((pairs,), jnp.int32)
    hidden = jax.ShapeDtypeStruct((pairs, gate.shape[1]), x.dtype)
    return (triton.grouped_unsupported(rows, ids, gate) or triton.grouped_unsupported(rows, ids, up)
            or triton.grouped_unsupported(hidden, ids, down))


def routed_experts_gather(x, expert_ids, expert_weights, gate, up, down, *, interpret: bool = False) -> jax.Array:
    """f32 ``[N, H]``: `reference.routed_experts_gather` with the GEMMs on `triton.grouped_w8a16`."""
    n, k = expert_ids.shape
    ids = expert_ids.reshape(n * k).astype(jnp.int32)
    rows = jnp.repeat(x, k, axis=0)  # pair p = (n, j) is row n * k + j
    dt = x.dtype
    g = triton.grouped_w8a16(rows, ids, gate, interpret=interpret).astype(dt)
    u = triton.grouped_w8a16(rows, ids, up, interpret=interpret).astype(dt)
    out = triton.grouped_w8a16(jax.nn.silu(g) * u, ids, down, interpret=interpret).astype(dt)
    return combine(out.reshape(n, k, -1), expert_weights)
