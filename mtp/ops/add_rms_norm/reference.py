"""The residual add and the norm after it, in pure JAX: the model's own ``add_rows`` and ``rms_norm``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp.ops.norms import rms_norm


def add_rows(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x + y`` where ``x`` may be the padded stream's rows and ``y`` is ``[*lead, H]``.

    The padded stream (`mtp.model.gemm_layout.stream_rows`) carries zero rows past the tokens;
    they get zeros added.
    """
    y2 = y.reshape(x.shape) if y.size == x.size else y.reshape(-1, y.shape[-1])
    if y2.shape != x.shape:  # x carries padding rows
        y2 = jnp.pad(y2, ((0, x.shape[0] - y2.shape[0]), (0, 0)))
    return x + y2


def check_inputs(x, y, w):
    """Raises on shapes no path can add: ``add_rows`` would fail deep inside with a negative pad."""
    h = x.shape[-1]
    if y.shape[-1] != h or w.shape != (h,):
        raise ValueError(f"y {y.shape} and w {w.shape} must both end in the stream x {x.shape}'s hidden size {h}")
    if y.size > x.size:
        raise ValueError(f"y {y.shape} has more rows than the stream x {x.shape}")


def add_rms_norm_reference(x, y, w, *, eps):
    """``(s, rms_norm(s, w))`` with ``s = x + y``, ``x`` and ``s`` as ``x`` is.

    x: the residual stream, ``[*lead, H]`` or the padded stream's rows ``[R, H]``
    (`mtp.model.gemm_layout.stream_rows`); y: ``[*lead, H]``, the real rows (``add_rows``: padding
    rows of ``x`` get zeros); w: ``[H]``, the ``(1 + w)`` norm's weight.
    """
    check_inputs(x, y, w)
    s = add_rows(x, y)
    return s, rms_norm(s, w, eps)
