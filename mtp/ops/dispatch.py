"""The single switch that picks how the project's kernel ops run.

Every op in ``mtp.ops`` takes ``impl="auto"`` and passes it, with its name and its
kernel's ``unsupported`` rule, through `choose`, so that the model, the tests and the
benchmarks agree on one rule: compiled Pallas kernels on a GPU, the pure-JAX references
everywhere else, and Pallas interpret mode when a test wants the kernel's own code on a
CPU. The ``MTP_KERNELS`` environment variable overrides what ``"auto"`` means, so a whole
run can be flipped (say, to the reference path on a GPU to rule a kernel out) without
touching code.
"""

from __future__ import annotations

from typing import Callable

from mtp import execution
from mtp.ops import lowering

CHOICES = execution.KERNEL_CHOICES
OPS = execution.KERNEL_OPS  # MTP_KERNELS' per-op names
ENV_VAR = execution.KERNELS_VAR
# Kernels "auto" leaves on their references (``MTP_KERNELS=<op>=pallas`` takes them): not yet
# measured faster inside the model on a GPU, or measured faster only in some programs. Each
# entry says why it is here; scripts/gpu_check.sh times every one off and on.
OPT_IN = {
    # Measured on the H200 (results/decode/decode_h200.md, 2026-11-30): the default model's loops
    # 1.045x (plain) and 1.006x (speculative K = 2) at batch 1, but the 1.38B decode step
    # 0.96-0.98x (batch 1) and 0.94x (batch 8).
    "paged_attention_triton": "faster only in the small default model's loops",
}


def env_choice(op: str | None) -> str:
    """``MTP_KERNELS``' setting for ``op``: ``"auto,gdn_step=reference"`` sets all, then one op.

    An op in ``OPT_IN`` reads only its own entry: a global value flips every op's kernel at
    once, and an opt-in kernel was measured slower in some programs (``MTP_KERNELS=pallas``
    would otherwise swap it in where the op's default kernel does better).
    """
    return execution.of_process().kernel_choice(op, op in OPT_IN)


def auto_decides(impl: str, op: str) -> bool:
    """Whether neither ``impl`` nor ``MTP_KERNELS`` names a path for ``op``.

    Only then may an op's measured rule of where its kernel pays send it to the reference:
    a named ``pallas`` (an A/B run's ``MTP_KERNELS=op=pallas``) must run the kernel, or the
    run compares the reference with itself.
    """
    return impl == "auto" and env_choice(op) == "auto"


def resolve_impl(impl: str, op: str | None = None) -> str:
    """Returns the concrete implementation ("reference", "pallas" or "interpret").

    An explicit choice wins; "auto" first consults ``MTP_KERNELS`` (a global value
    and/or ``op=value`` entries, e.g. ``MTP_KERNELS=gdn_step=reference`` to compare a
    run without one kernel) and then the target device (`lowering.on_gpu`), so a CPU-only
    process never tries to compile a GPU kernel; an op in ``OPT_IN`` stays on its reference
    unless its own entry names another path (`env_choice`).
    """
    execution.check_kernel_choice(impl, "impl")
    if impl == "auto":
        impl = env_choice(op)
    if impl == "auto":
        impl = "pallas" if lowering.on_gpu() and op not in OPT_IN else "reference"
    return impl


def choose(op: str, impl: str, unsupported: Callable[[], str | None] = lambda: None,
           kernel_pays: Callable[[], bool] | None = None, *, mesh_kernel: bool = False) -> str:
    """The path one call of ``op`` takes: ``"reference"``, ``"pallas"`` or ``"interpret"``.

    The reference runs where ``impl`` resolves to it (`resolve_impl`), where ``kernel_pays()``
    says False while the choice is ``auto`` all the way (``impl`` and ``MTP_KERNELS``: an op's
    measured rule for inputs where XLA's own fusions do better), where ``unsupported()``
    names why the kernel cannot take the inputs, and under a tensor-parallel mesh
    (`lowering.tensor_parallel_mesh`: a kernel is an opaque custom call whose operands XLA
    would gather whole, while it partitions the reference) unless ``mesh_kernel`` says the
    op runs its kernel there itself (per shard, its ``unsupported`` naming the splits it
    cannot take). The callables are called only when the answer still depends on them.
    """
    mode = resolve_impl(impl, op)
    if mode == "reference":
        return mode
    if kernel_pays is not None and auto_decides(impl, op) and not kernel_pays():
        return "reference"
    if unsupported() or (not mesh_kernel and lowering.tensor_parallel_mesh() is not None):
        return "reference"
    return mode
