"""The MoE FFN through the project's kernel switch: ``moe_ffn`` (from the router's logits) and
``routed_experts`` (from chosen experts), each adding a shared expert when given one.

The model's MoE layer (`mtp.model.layers.moe`) hands ``moe_ffn`` its router's output and the
shared expert with its gate's value; the op routes (`reference.route`: softmax, top-k,
normalisation, the weights' rounding) and computes what the selected experts cost and no more
(`reference` for the definition and the sparse forms). ``impl`` is resolved by
`mtp.ops.dispatch.choose` under the op name ``"moe"`` (the model hands it
``ExecutionConfig.impl_for("moe")``, so ``MTP_KERNELS=moe=reference`` and the global value apply).
On a GPU, ``"auto"`` runs by the token count:

* up to `triton.MAX_TOKENS` (a decode, a verify, the MTP head's propose): the weight-streaming
  kernels of `triton`, which also route (from ``moe_ffn``) and take the shared expert as one more
  pair a token: four launches a layer where XLA's forms took ten, the 35B decode step 1.12x and the
  80B FP8 step 1.34x faster on an H100 (results/real_shape/moe_stream_h100_2026-12-06/), bf16 and
  block-scaled FP8 experts alike;
* more tokens: the grouped-GEMM kernels of `mosaic` (Mosaic GPU) from ``KERNEL_MIN_PAIRS`` pairs
  (prefill chunks), XLA's gather form below that, the shared expert beside them; block-scaled FP8
  experts the grouped GEMMs of `triton_grouped`, which read the 8-bit values, from
  ``FP8_GROUPED_MIN_PAIRS`` pairs (`fp8_grouped_pays`), the reference below.

Where a kernel's ``unsupported`` names why it cannot take the inputs (f32, quantized MTP-head
experts, sizes its tiles do not divide) or the trace runs under a mesh
(the kernels see whole arrays; XLA partitions the reference), the reference runs. ``"interpret"``
runs the kernels in Pallas' interpreters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp.ops import dispatch, weight_stream
from mtp.ops.moe import mosaic, reference, triton, triton_grouped
from mtp.ops.moe.reference import RouterLogits, SharedExpert, check_inputs


# Above `triton.MAX_TOKENS` tokens, a call of fewer (token, expert) pairs than this runs the
# reference's gather form under ``"auto"``: XLA's gather + batched GEMM of the selected experts
# streamed them closer to the active-bytes floor than the grouped-GEMM kernels at 1-16 tokens
# (Qwen3.5-35B-A3B's shape, one H200, 2026-12-02: 1.63x / 1.22x / 1.22x / 1.36x the floor at
# 1 / 4 / 8 / 16 tokens of top-8 against the kernel's 4.71x / 2.18x / 1.86x / 1.71x), while the
# grouped GEMMs win from 32 tokens (Qwen3-Next's 1.12x at 32) and in prefill chunks
# (results/kernels/moe_kernels_h200.md).
KERNEL_MIN_PAIRS = 129

# Above `triton.MAX_TOKENS` tokens, block-scaled FP8 experts run the FP8 grouped GEMMs
# (`triton_grouped`) from this many (token, expert) pairs, the reference below. One H100
# (2026-12-06, results/kernels/moe_fp8_grouped_h100_2026-12-06/, CUPTI, L2 cold): at Qwen3-Next's
# shape the reference's gather form took 250 / 347 us at 17 / 24 tokens (170 / 240 pairs) against
# the kernels' 393 / 484, its segments form 1710 us at 32 tokens (320 pairs) against 627 and 5725
# at 512 against 1317 (the bf16 experts' Mosaic GPU kernels: 1339, in another call); Qwen3.5-35B-A3B's shape alike.
FP8_GROUPED_MIN_PAIRS = 256


def pays(expert_ids) -> bool:
    """Whether `auto` hands a call of these pairs to the kernels (``KERNEL_MIN_PAIRS``)."""
    return expert_ids.size >= KERNEL_MIN_PAIRS


def fp8_grouped_pays(expert_ids) -> bool:
    """Whether `auto` hands FP8 experts above `triton.MAX_TOKENS` rows to `triton_grouped`
    (``FP8_GROUPED_MIN_PAIRS``)."""
    return expert_ids.size >= FP8_GROUPED_MIN_PAIRS


def routed_experts(x, expert_ids, expert_weights, gate, up, down, *, shared: SharedExpert | None = None,
                   impl: str = "auto") -> jax.Array:
    """f32 ``[N, H]``: ``sum_j expert_weights[n, j] * expert_{expert_ids[n, j]}(x[n])`` (`reference`),
    plus ``shared``'s gated output when given.

    ``x [N, H]`` in the activation dtype, ``expert_ids`` int ``[N, k]`` (each in ``[0, E)``),
    ``expert_weights`` f32 ``[N, k]``, ``gate``/``up`` ``[E, I, H]``, ``down`` ``[E, H, I]``.
    Up to `triton.MAX_TOKENS` rows (a decode or verify step) the kernel path is the weight-streaming
    kernels of `triton`, which take the shared expert as one more pair a token; more rows go to the
    grouped GEMMs of `mosaic` (from ``KERNEL_MIN_PAIRS`` pairs under ``"auto"``), or of
    `triton_grouped` for block-scaled FP8 experts (from ``FP8_GROUPED_MIN_PAIRS``), the shared
    expert beside them.
    """
    check_inputs(x, expert_ids, expert_weights, gate, up, down, shared)
    ids = expert_ids.astype(jnp.int32)
    if x.shape[0] <= triton.MAX_TOKENS:
        mode = dispatch.choose("moe", impl, lambda: _mesh_unsupported() or triton.unsupported(
            x, gate, up, down, shared), mesh_kernel=True)
        if mode != "reference":
            return triton.routed_experts_stream(x, ids, expert_weights, gate, up, down, shared, impl=mode)
        return reference.routed_experts(x, ids, expert_weights, gate, up, down, shared)
    fp8 = all(weight_stream.is_fp8(w) for w in (gate, up, down))
    if fp8:
        mode = dispatch.choose("moe", impl, lambda: _mesh_unsupported() or triton_grouped.unsupported(
            x, gate, up, down), kernel_pays=lambda: fp8_grouped_pays(ids), mesh_kernel=True)
    else:
        mode = dispatch.choose("moe", impl, lambda: _mesh_unsupported() or mosaic.unsupported(
            x, ids, expert_weights, gate, up, down), mesh_kernel=True)
    if mode == "reference":
        return reference.routed_experts(x, ids, expert_weights, gate, up, down, shared)
    if fp8:
        out = triton_grouped.routed_experts_fp8(x, ids, expert_weights, gate, up, down, impl=mode)
    elif impl != "auto" or pays(ids):  # a named path runs the kernels at any size
        out = mosaic.routed_experts_mosaic(x, ids, expert_weights, gate, up, down, impl=mode)
    else:
        out = reference.routed_experts_gather(x, ids, expert_weights, gate, up, down)
    return out if shared is None else out + reference.shared_expert(x, shared)


def moe_ffn(x, router: RouterLogits, gate, up, down, *, shared: SharedExpert | None = None,
            impl: str = "auto") -> jax.Array:
    """f32 ``[N, H]``: the MoE FFN of ``x [N, H]`` from its router's logits: `reference.route`'s
    experts and weights, then `routed_experts`.

    Where the weight-streaming kernels take the call (up to `triton.MAX_TOKENS` rows), they also
    route: each gate/up program finds its pair's expert from the logits itself (`triton.moe_stream`),
    so that a decode step launches no softmax, top-k or weight kernels of its own.
    """
    if x.shape[0] <= triton.MAX_TOKENS:
        mode = dispatch.choose("moe", impl, lambda: _mesh_unsupported() or triton.unsupported(
            x, gate, up, down, shared, router), mesh_kernel=True)
        if mode != "reference":
            return triton.moe_stream(x, router, gate, up, down, shared, impl=mode)
    ids, weights = reference.route(router, x.shape[0], x.dtype)
    return routed_experts(x, ids, weights, gate, up, down, shared=shared, impl=impl)


def _mesh_unsupported() -> str | None:
    """Why a trace under a mesh of more than one device (``jax.set_mesh``) runs the reference, or None:
    the kernels see whole arrays, and XLA partitions the reference."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        return f"a mesh of {mesh.size} devices"
    return None
