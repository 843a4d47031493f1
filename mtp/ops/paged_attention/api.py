"""``paged_attention``: causal attention of a few new tokens per sequence over its paged KV.

`mtp.ops.dispatch.choose` picks the path: the Mosaic GPU kernel (`mosaic`, op
``"paged_attention"``) on a GPU for inputs it takes, the Triton-lowered form (`triton`, op
``"paged_attention_triton"``) where ``triton_impl`` names it, the pure-JAX definition
(`reference`) elsewhere.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from mtp.ops import dispatch
from mtp.ops.lowering import TENSOR_AXIS, mosaic_interpret_scope, tensor_parallel_mesh
from mtp.ops.paged_attention import mosaic, triton
from mtp.ops.paged_attention.reference import check_inputs, paged_attention_reference


def unsupported(q, k_pages) -> str | None:
    """Why the Mosaic kernel path cannot take these inputs (the reference then runs), or None:
    the kernel's own limits (`mosaic.kernel_unsupported`), or KV heads that do not split over a
    tensor-parallel mesh (XLA partitions the reference, the heads replicated)."""
    if why := mosaic.kernel_unsupported(q, k_pages):
        return why
    mesh = tensor_parallel_mesh()
    if mesh is not None and k_pages.shape[2] % mesh.shape[TENSOR_AXIS]:
        return f"{k_pages.shape[2]} KV heads do not split over {mesh.shape[TENSOR_AXIS]} devices"
    return None


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, gate=None,
                    impl="auto", triton_impl="auto"):
    """Causal attention of Q new tokens per sequence over its paged KV.

    q: [B, Q, Hq, D]; k_pages, v_pages: [num_pages, page_size, Hkv, D];
    block_tables: [B, max_blocks] int32; lengths: [B] int32, the KV tokens of each
    sequence including the Q new ones. Query i of sequence b sits at position
    ``lengths[b] - Q + i``; one with a negative position (an idle slot) returns
    zeros. ``gate`` ([B, Q, Hq, D]) multiplies the output by ``sigmoid(gate)``.
    Returns [B, Q, Hq, D] in q's dtype; softmax and accumulation in f32.

    Inputs the kernel cannot take (``unsupported``) always go to the reference.
    ``triton_impl="pallas"`` (or ``"interpret"``) sends the calls it can take to the
    Triton-lowered form (`triton.paged_attention_triton`) whatever ``impl`` says; it paid only in
    the default model's loops, so ``"auto"`` leaves it (``dispatch.OPT_IN``), and the model names
    it only where ``ExecutionConfig.kernels`` has an entry of its own for it
    (``MTP_KERNELS=paged_attention_triton=pallas``; `ExecutionConfig.impl_for`).
    ``impl="interpret"`` runs the Mosaic GPU kernel through the Pallas
    interpreter (CPU tests); call it eagerly then, since interpret mode is switched on around
    this call's own lowering. Traced under a mesh that splits ``lowering.TENSOR_AXIS``
    (``jax.set_mesh``), the kernel runs per shard, on each device's own KV heads.
    """
    check_inputs(q, k_pages, v_pages, block_tables, lengths, gate)  # before either form's support reads q
    form = dispatch.choose("paged_attention_triton", triton_impl, lambda: triton.triton_unsupported(q, k_pages))
    if form != "reference":  # the Triton form, opt-in: "auto" never takes it
        return triton.paged_attention_triton(q, k_pages, v_pages, block_tables, lengths, scale=scale, gate=gate,
                                             interpret=form == "interpret")
    mode = dispatch.choose("paged_attention", impl, lambda: unsupported(q, k_pages), mesh_kernel=True)
    if mode == "reference":
        return _reference_jit(q, k_pages, v_pages, block_tables, lengths, scale=scale, gate=gate)
    args = (q, k_pages, v_pages, block_tables, lengths) + (() if gate is None else (gate,))

    def run(q, k_pages, v_pages, block_tables, lengths, gate=None):
        return mosaic.paged_attention_mosaic(q, k_pages, v_pages, block_tables, lengths, scale=scale, gate=gate)

    if (mesh := tensor_parallel_mesh()) is not None:
        # Each device attends with its own KV heads and their query groups: attention
        # needs nothing from other heads, so no communication.
        heads, whole = P(None, None, TENSOR_AXIS, None), P()
        run = jax.shard_map(run, mesh=mesh, in_specs=(heads, heads, heads, whole, whole, heads)[:len(args)],
                            out_specs=heads, check_vma=False)
    with mosaic_interpret_scope(mode):
        return run(*args)


_reference_jit = jax.jit(paged_attention_reference, static_argnames=("scale", "impl"))
