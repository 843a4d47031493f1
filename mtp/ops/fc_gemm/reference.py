"""The MTP drafter's input projection in pure JAX: both RMSNorms, the concat and the fc GEMM.

``out = concat(norm_e(embed), norm_h(hidden)) @ w.T`` with Qwen3-Next's ``(1 + w)`` RMSNorm,
``w`` in the Hugging Face Linear layout ``[H, 2H]`` (embedding columns first).
`fc_gemm_reference` is the definition (the Hugging Face numerics) the kernels (`mosaic`) are
tested against; `fold_fc_weight`, `row_mean_squares` and `normed_embed_rows` make the kernel
path's inputs (the module docstring of `mosaic` says why).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def row_mean_squares(x):
    """Each row's mean square in f32, the statistic its RMSNorm needs.

    Of the embedding table it is a per-token table: an embed row's norm depends on its token
    alone, so the drafter gathers it (made once, at load: ``mtp.mtp_head.quantize_head``)
    instead of a pass over the rows.
    """
    return jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1)


def _rms_norm(x, weight, eps):
    """Qwen3-Next RMSNorm from `row_mean_squares`: f32 throughout, scale by (1 + w), one cast back.

    The fc's own form of `mtp.ops.norms.rms_norm`: the two reduce in different orders (f32 results
    a rounding apart), and this one is what the fc's numerics were checked against.
    """
    y = x.astype(jnp.float32) * lax.rsqrt(row_mean_squares(x) + eps)[..., None]
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def check_inputs(embed, hidden, norm_e_w, norm_h_w, w):
    if embed.ndim != 2 or embed.shape != hidden.shape:
        raise ValueError(
            f"embed and hidden must both be [M, H]; got {embed.shape} and {hidden.shape}"
        )
    m, h = embed.shape
    if norm_e_w.shape != (h,) or norm_h_w.shape != (h,):
        raise ValueError(
            f"norm weights must be [H={h}]; got {norm_e_w.shape} and {norm_h_w.shape}"
        )
    if w.shape != (h, 2 * h):
        raise ValueError(
            f"w must be [H, 2H] = [{h}, {2 * h}] (out_features, in_features); got {w.shape}"
        )


def fc_gemm_reference(embed, hidden, norm_e_w, norm_h_w, w, *, eps, impl="reference"):
    """Norm both inputs, concat (embedding first), one f32-accumulated dot; bf16 out.

    The definition the kernel is tested against and the CPU path of the model.
    ``impl`` is accepted (and ignored) so both functions share one signature.
    """
    del impl
    check_inputs(embed, hidden, norm_e_w, norm_h_w, w)
    x = jnp.concatenate(
        [_rms_norm(embed, norm_e_w, eps), _rms_norm(hidden, norm_h_w, eps)], axis=-1
    )
    out = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    return out.astype(embed.dtype)


def fold_fc_weight(norm_e_w, norm_h_w, w):
    """``W_f = W * (1 + concat(norm_e_w, norm_h_w))`` per column, in ``w``'s dtype.

    The kernel path's weight: do it once, at load (``mtp.mtp_head.quantize_head``), not
    per step (it reads and writes all of ``w``).
    """
    h = w.shape[0] if w.ndim == 2 else None
    if w.ndim != 2 or w.shape[1] != 2 * w.shape[0]:
        raise ValueError(f"w must be [H, 2H] (out_features, in_features); got {w.shape}")
    if norm_e_w.shape != (h,) or norm_h_w.shape != (h,):
        raise ValueError(
            f"norm weights must be [H={h}]; got {norm_e_w.shape} and {norm_h_w.shape}")
    col = 1.0 + jnp.concatenate([norm_e_w, norm_h_w]).astype(jnp.float32)
    return (w.astype(jnp.float32) * col[None, :]).astype(w.dtype)


def normed_embed_rows(embed, mean_square, eps):
    """``embed`` rows times their RMSNorm scale ``rsqrt(mean_square + eps)``, in embed's dtype:
    the input of ``mosaic.fc_gemm_folded(embed_normed=True)``. Elementwise, so XLA fuses it into
    whatever made the rows (the embedding gather)."""
    scale = lax.rsqrt(mean_square.astype(jnp.float32) + eps)
    return (embed.astype(jnp.float32) * scale[:, None]).astype(embed.dtype)
