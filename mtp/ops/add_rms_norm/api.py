"""``add_rms_norm``: the residual add and the norm after it, reference or kernel.

`mtp.ops.dispatch.choose` picks the path under the op name ``"add_rms_norm"``: the kernel
(`triton`) on a GPU where it pays (``kernel_pays``) and takes the inputs, the pure-JAX
definition (`reference`) elsewhere.
"""

from __future__ import annotations

from mtp.ops import dispatch
from mtp.ops.add_rms_norm import triton
from mtp.ops.add_rms_norm.reference import add_rms_norm_reference, check_inputs
from mtp.ops.lowering import triton_interpret_scope


def kernel_pays(y) -> bool:
    """Where ``auto`` takes the kernel: ``y`` is one row (a decode step at batch 1).

    XLA computes a one-row product as a row reduction, and the add and norm after it as
    two kernels more. From two rows on it runs the product as a GEMM that splits K, and
    fuses the partial sums with the add and the norm; the kernel, a custom call, would
    leave that reduction a launch of its own. Counted for an H200
    (`experiments/count_kernels.py`): the default model's plain loop at batch 1 takes 96 -> 80
    launches with the kernel, while taking it for every stream of up to two rows would add 6
    launches to the speculative loop's iteration (K = 2: its verify runs 2 rows) and 12 to
    the plain loop's at batch 8.
    """
    return y.size == y.shape[-1]


def add_rms_norm(x, y, w, *, eps, impl="auto"):
    """``add_rms_norm_reference``'s signature and results; ``impl`` picks the path (`dispatch.choose`).

    Inputs the kernel cannot take (`triton.kernel_unsupported`), streams where it does not pay
    (``kernel_pays``, for ``impl="auto"``) and traces under a tensor-parallel mesh
    (where the stream is replicated and XLA's fusions are as cheap) go to the reference.
    The kernel has no autodiff rule: training passes ``impl="reference"``.
    """
    check_inputs(x, y, w)
    mode = dispatch.choose("add_rms_norm", impl, lambda: triton.kernel_unsupported(x, y, w), lambda: kernel_pays(y))
    if mode == "reference":
        return add_rms_norm_reference(x, y, w, eps=eps)
    with triton_interpret_scope(mode) as interpret:
        return triton.add_rms_norm_triton(x, y, w, eps=eps, interpret=interpret)
