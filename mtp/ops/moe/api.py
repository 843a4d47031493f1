"""``routed_experts``: the routed-expert FFN of a MoE layer, through the project's kernel switch.

The model's MoE layer (`mtp.model.layers.moe`) routes (softmax, top-k, normalisation, the
weights' rounding) and adds the shared expert; this op computes the rest, what the selected
experts cost and no more (`reference` for the definition and the two sparse forms). ``impl``
is resolved by `mtp.pallas.backend.resolve_impl` under the op name ``"moe"`` (so
``MTP_KERNELS=moe=reference`` and the global switch apply). No kernel exists yet, so every
choice runs the reference; a kernel file beside it (same signature) is dispatched here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp.ops.moe import reference
from mtp.pallas.backend import resolve_impl


def _shape(weight) -> tuple[int, ...]:
    """The logical shape of a stacked expert weight, plain or quantized (``dequantize()``)."""
    if hasattr(weight, "dequantize"):
        return tuple(jax.eval_shape(lambda w: w.dequantize(), weight).shape)
    return tuple(weight.shape)


def check_inputs(x, expert_ids, expert_weights, gate, up, down) -> None:
    """Raise a ValueError that names the argument and its shape or dtype when the inputs do not fit."""
    if x.ndim != 2:
        raise ValueError(f"routed_experts: x must be [N, H], got shape {tuple(x.shape)}")
    n, h = x.shape
    if expert_ids.ndim != 2 or expert_ids.shape[0] != n or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"routed_experts: expert_ids must be integer [N={n}, k], got {expert_ids.dtype} "
                         f"{tuple(expert_ids.shape)}")
    if expert_weights.shape != expert_ids.shape or expert_weights.dtype != jnp.float32:
        raise ValueError(f"routed_experts: expert_weights must be float32 {tuple(expert_ids.shape)} like "
                         f"expert_ids, got {expert_weights.dtype} {tuple(expert_weights.shape)}")
    g, u, d = _shape(gate), _shape(up), _shape(down)
    if len(g) != 3 or g[2] != h or u != g:
        raise ValueError(f"routed_experts: gate and up must be [E, I, H={h}], got gate {g}, up {u}")
    e, i, _ = g
    if d != (e, h, i):
        raise ValueError(f"routed_experts: down must be [E={e}, H={h}, I={i}], got {d}")


def routed_experts(x, expert_ids, expert_weights, gate, up, down, *, impl: str = "auto") -> jax.Array:
    """f32 ``[N, H]``: ``sum_j expert_weights[n, j] * expert_{expert_ids[n, j]}(x[n])`` (`reference`).

    ``x [N, H]`` in the activation dtype, ``expert_ids`` int ``[N, k]`` (each in ``[0, E)``),
    ``expert_weights`` f32 ``[N, k]``, ``gate``/``up`` ``[E, I, H]``, ``down`` ``[E, H, I]``.
    """
    check_inputs(x, expert_ids, expert_weights, gate, up, down)
    resolve_impl(impl, "moe")  # validates impl and MTP_KERNELS; every path is the reference for now
    return reference.routed_experts(x, expert_ids.astype(jnp.int32), expert_weights, gate, up, down)
