"""The norms of the Qwen3-Next hybrid, as the model and the kernels' references compute them.

One definition each, shared by the model (`mtp.model.layers`) and by the ops whose kernels
fuse a norm with its neighbours (`mtp.ops.add_rms_norm`, `mtp.ops.attn_prologue`,
`mtp.ops.gdn_step`, `mtp.ops.fc_gemm`): a kernel is tested against the very arithmetic the
model runs. Numerics follow Hugging Face's: float32 throughout, one cast back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Qwen3-Next RMSNorm: scale by ``(1 + w)``, so a zero-initialised ``w`` is identity."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Unit L2 norm over the last axis (the Gated DeltaNet's queries and keys)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float,
                   sum_sq: jax.Array | None = None) -> jax.Array:
    """The Gated DeltaNet output norm: plain ``w`` scale (not ``1 + w``), then ``silu(z)``.

    ``sum_sq`` (``x.shape[:-1]``): the rows' sums of squares of ``x`` (in f32), where a
    kernel that wrote ``x`` in pieces already summed them (`mtp.ops.gdn_step`).
    """
    xf = x.astype(jnp.float32)
    if sum_sq is None:
        mean_sq = jnp.mean(xf * xf, axis=-1, keepdims=True)
    else:
        mean_sq = sum_sq[..., None] / x.shape[-1]
    y = xf * jax.lax.rsqrt(mean_sq + eps)
    y = w * y.astype(x.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
