"""The single switch that picks how the project's kernel ops run.

Every op in ``mtp.ops`` takes ``impl="auto"`` and passes it, with its name and its
kernel's ``unsupported`` rule, through `choose`, so that the model, the tests and the
benchmarks agree on one rule: compiled Pallas kernels on a GPU, the pure-JAX references
everywhere else, and Pallas interpret mode when a test wants the kernel's own code on a
CPU. The model hands each op the path its `mtp.execution.ExecutionConfig` names for it
(`ExecutionConfig.impl_for`; an entry point fills that from ``MTP_KERNELS``), so a whole run
can be flipped (say, to the reference path on a GPU to rule a kernel out) without touching
code; the ops see only the string.
"""

from __future__ import annotations

from typing import Callable

from mtp import execution
from mtp.ops import lowering

CHOICES = execution.KERNEL_CHOICES
OPS = execution.KERNEL_OPS  # the op names `ExecutionConfig.kernels` (MTP_KERNELS) takes
OPT_IN = execution.OPT_IN  # ops "auto" leaves on their references (each with its reason)


def resolve_impl(impl: str, op: str | None = None) -> str:
    """Returns the concrete implementation ("reference", "pallas" or "interpret").

    An explicit choice is kept; "auto" asks the target device (`lowering.on_gpu`), so a
    CPU-only process never tries to compile a GPU kernel, and an op in ``OPT_IN`` stays on its
    reference (only a path named for it takes its kernel).
    """
    execution.check_kernel_choice(impl, "impl")
    if impl == "auto":
        impl = "pallas" if lowering.on_gpu() and op not in OPT_IN else "reference"
    return impl


def choose(op: str, impl: str, unsupported: Callable[[], str | None] = lambda: None,
           kernel_pays: Callable[[], bool] | None = None, *, mesh_kernel: bool = False) -> str:
    """The path one call of ``op`` takes: ``"reference"``, ``"pallas"`` or ``"interpret"``.

    The reference runs where ``impl`` resolves to it (`resolve_impl`), where ``kernel_pays()``
    says False while ``impl`` is ``"auto"`` (an op's measured rule for inputs where XLA's own
    fusions do better; a named ``"pallas"``, an A/B run's ``MTP_KERNELS=op=pallas``, must run
    the kernel, or the run compares the reference with itself), where ``unsupported()``
    names why the kernel cannot take the inputs, and under a tensor-parallel mesh
    (`lowering.tensor_parallel_mesh`: a kernel is an opaque custom call whose operands XLA
    would gather whole, while it partitions the reference) unless ``mesh_kernel`` says the
    op runs its kernel there itself (per shard, its ``unsupported`` naming the splits it
    cannot take). The callables are called only when the answer still depends on them.
    """
    mode = resolve_impl(impl, op)
    if mode == "reference":
        return mode
    if kernel_pays is not None and impl == "auto" and not kernel_pays():
        return "reference"
    if unsupported() or (not mesh_kernel and lowering.tensor_parallel_mesh() is not None):
        return "reference"
    return mode
