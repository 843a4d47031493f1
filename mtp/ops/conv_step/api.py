"""``conv_steps``: the Gated DeltaNet conv of a decode or verify step and the state after each token.

`mtp.ops.dispatch.choose` picks the path under the op name ``"conv_step"``: the kernel
(`triton`) on a GPU for inputs it takes, the pure-JAX definition (`reference`) elsewhere.
"""

from __future__ import annotations

from mtp.ops import dispatch
from mtp.ops.conv_step import triton
from mtp.ops.conv_step.reference import check_inputs, conv_steps_reference
from mtp.ops.gdn_step.reference import HeadShape
from mtp.ops.lowering import triton_interpret_scope


def conv_steps(mixed, qkvz, valid, conv_state, conv_w, *, heads: HeadShape, impl="auto"):
    """``conv_steps_reference``'s signature and results; ``impl`` picks the path (`dispatch.choose`).

    Inputs the kernel cannot take (`triton.kernel_unsupported`) and traces under a
    tensor-parallel mesh go to the reference. No autodiff rule: training never decodes.
    """
    check_inputs(mixed, valid, conv_state, conv_w, heads)  # the kernel reads no mixed, so here too
    mode = dispatch.choose("conv_step", impl, lambda: triton.kernel_unsupported(qkvz, valid, conv_state, conv_w, heads))
    if mode == "reference":
        return conv_steps_reference(mixed, qkvz, valid, conv_state, conv_w, heads=heads)
    with triton_interpret_scope(mode) as interpret:
        return triton.conv_steps_triton(qkvz, valid, conv_state, conv_w, heads=heads, interpret=interpret)
