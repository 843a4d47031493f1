"""The Gated DeltaNet layer's causal depthwise conv, in pure JAX: the model's own functions.

The conv runs on its channels grouped per key head, ``[q, k, v of its value heads]`` for
each key head in turn: the order ``in_proj_qkvz`` produces them in, so the conv input is a
slice of the projection, and a split of the channel axis on key-head boundaries gives every
device of a tensor-parallel mesh its own heads' q, k and v (`mtp.sharding`). The
checkpoint's ``conv1d`` weight stays in Hugging Face's ``[q of all heads | k | v]`` order and
is regrouped where it is used (`grouped_conv_weight`); the conv state, the last ``K - 1``
inputs, is kept grouped. A depthwise conv multiplies each channel by its own taps, so the
order changes no value.

`mtp.model.gated_deltanet` runs these for every path; `conv_steps_reference` composes them
into the definition the kernel (`triton`) is tested against. Head counts are read under
`mtp.config.ModelConfig`'s field names (`mtp.ops.gdn_step.HeadShape` carries them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtp.ops.gdn_step.reference import HeadShape


@functools.lru_cache(maxsize=16)
def _grouped_channels(nk: int, nv: int, dk: int, dv: int) -> np.ndarray:
    """For each channel of the grouped order, its index in the checkpoint's ``[q | k | v]``."""
    kd = nk * dk
    q = np.arange(kd).reshape(nk, dk)
    v = 2 * kd + np.arange(nv * dv).reshape(nk, -1)  # value heads are numbered group-major
    return np.concatenate([q, kd + q, v], axis=1).reshape(-1)


def grouped_conv_weight(w: jax.Array, cfg) -> jax.Array:
    """The ``conv1d`` weight ``[C, 1, K]`` (HF order ``[q | k | v]``) as ``[C, K]`` in the grouped order.

    A gather with constant indices rather than slices and a concat: under a
    tensor-parallel mesh the partitioner gathers each device's rows of the replicated
    weight locally, where slicing the q, k and v blocks at their offsets made it move
    weight pieces between devices every step.
    """
    order = _grouped_channels(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                              cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return jnp.take(w[:, 0, :], order, axis=0)


def conv_windows(p, cfg, conv_state: jax.Array, mixed: jax.Array) -> jax.Array:
    """Causal depthwise conv + SiLU over ``[conv_state, mixed]``: ``[B, T, C]`` out.

    ``p``: ``{"conv1d": {"weight": [C, 1, K]}}``, the layer's checkpoint weight.
    """
    w = grouped_conv_weight(p["conv1d"]["weight"], cfg)  # [C, K]
    kern = w.shape[-1]
    full = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
    t = mixed.shape[1]
    out = sum(full[:, i : i + t, :].astype(jnp.float32) * w[:, i].astype(jnp.float32) for i in range(kern))
    return jax.nn.silu(out).astype(mixed.dtype)


def conv_state_after(conv_state: jax.Array, mixed: jax.Array, counts: jax.Array | int) -> jax.Array:
    """The last ``K - 1`` conv inputs after consuming ``counts[b]`` of ``mixed[b]`` (an int: of every row).

    A static count is a plain slice; XLA keeps a per-row one (a gather) as a kernel of
    its own even at constant counts.
    """
    keep = conv_state.shape[1]
    full = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)
    if isinstance(counts, int):
        return full[:, counts:counts + keep]
    return jax.vmap(lambda f, c: jax.lax.dynamic_slice_in_dim(f, c, keep, axis=0))(full, counts)


def conv_states_per_step(conv_state: jax.Array, mixed: jax.Array, valid: jax.Array) -> jax.Array:
    """The conv state after each of ``mixed``'s ``T`` positions, ``[B, T, K-1, C]``.

    A masked position keeps the state before it, as the recurrent state does
    (`mtp.ops.gdn_step.reference.mask_updates`), so every position of an inactive slot returns
    its old state: a commit can take any position without a select against the old state
    (`mtp.model.target.commit`'s ``masked_verify``).
    """
    before, steps = conv_state.astype(mixed.dtype), []
    for i in range(mixed.shape[1]):
        before = jnp.where(valid[:, i, None, None], conv_state_after(conv_state, mixed, i + 1), before)
        steps.append(before)
    return jnp.stack(steps, axis=1)


def check_inputs(mixed, valid, conv_state, conv_w, heads: HeadShape):
    """Raises on shapes no path can take: the reference would slice them into an empty or
    misaligned output without a word."""
    c = heads.conv_dim
    if conv_w.ndim != 3 or conv_w.shape[:2] != (c, 1):
        raise ValueError(f"conv_w {conv_w.shape} is not the conv1d weight [C={c}, 1, K]")
    want = (valid.shape[0], conv_w.shape[2] - 1, c)
    if conv_state.shape != want:
        raise ValueError(f"conv_state {conv_state.shape} is not [B, K - 1, C] = {want} for valid "
                         f"{valid.shape} and conv_w {conv_w.shape}")
    if mixed.shape != (*valid.shape, c):
        raise ValueError(f"mixed {mixed.shape} is not [B, T, C] = {(*valid.shape, c)} for valid {valid.shape}")


def conv_steps_reference(mixed, qkvz, valid, conv_state, conv_w, *, heads: HeadShape):
    """``T`` tokens' conv outputs ``[B, T, C]`` and the state after each ``[B, T, K - 1, C]``, as the model computes them.

    mixed: ``[B, T, C]``, the conv input (the layer's projection, zero at masked tokens);
    qkvz: ``[R >= B T, >= nk (2 Dk + 2 r Dv)]``, the ``in_proj_qkvz`` output it was sliced from,
    in its first columns (the GEMM's whole output, padding rows and a merged ``in_proj_ba``
    included: `mtp.model.gemm_layout.dense_rows`, ``dense_columns``; token t of sequence b in row
    b T + t), which the kernel reads in place instead; valid: ``[B, T]``, a prefix of each row;
    conv_state: ``[B, K - 1, C]`` in the grouped channel order; conv_w: the checkpoint's
    ``conv1d`` weight ``[C, 1, K]``. A masked token leaves the state as it was, as it leaves the
    recurrent state (``mask_updates``): a loop can then keep a finished row's
    state without selecting between old and new (`mtp.model.target.commit`).
    """
    del qkvz
    check_inputs(mixed, valid, conv_state, conv_w, heads)
    out = conv_windows({"conv1d": {"weight": conv_w}}, heads, conv_state, mixed)
    return out, conv_states_per_step(conv_state, mixed, valid)
