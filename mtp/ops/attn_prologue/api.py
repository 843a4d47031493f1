"""``attn_prologue``: a gated-attention layer's q/k norms, RoPE and page writes, reference or kernel.

`mtp.ops.dispatch.choose` picks the path under the op name ``"attn_prologue"``: the kernel
(`triton`) on a GPU for inputs it takes, the pure-JAX definition (`reference`) elsewhere.
"""

from __future__ import annotations

from mtp.ops import dispatch
from mtp.ops.attn_prologue import triton
from mtp.ops.attn_prologue.reference import AttentionShape, attn_prologue_reference
from mtp.ops.lowering import triton_interpret_scope


def attn_prologue(columns, q_norm_w, k_norm_w, rope_positions, slots, k_pages, v_pages, block_tables, write,
                  *, heads: AttentionShape, impl="auto"):
    """``attn_prologue_reference``'s signature and results; ``impl`` picks the path (`dispatch.choose`).

    Inputs the kernel cannot take (`triton.kernel_unsupported`, a prefill among them) and traces
    under a tensor-parallel mesh go to the reference. No autodiff rule: training has no cache.
    """
    mode = dispatch.choose("attn_prologue", impl,
                           lambda: triton.kernel_unsupported(columns, k_pages, rope_positions, heads))
    if mode == "reference":
        return attn_prologue_reference(columns, q_norm_w, k_norm_w, rope_positions, slots, k_pages, v_pages,
                                       block_tables, write, heads=heads)
    with triton_interpret_scope(mode) as interpret:
        return triton.attn_prologue_triton(
            tuple(c.rows for c in columns), q_norm_w, k_norm_w, rope_positions, slots, k_pages, v_pages,
            block_tables, write, heads=heads, starts=tuple(c.start for c in columns), interpret=interpret)
