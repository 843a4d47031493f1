"""Gated DeltaNet: the linear-attention layer of the hybrid, with explicit state.

Per value head the layer keeps a matrix ``S [Dk, Dv]`` updated by the gated delta
rule ``S <- exp(g) S + k (beta (v - k^T exp(g) S))`` and reads ``q^T S``. Two
evaluations of the same recurrence:

* `chunked_delta_rule` — the chunk-parallel (WY) form over 64-token chunks: prefill
  and training, where a token-by-token scan would serialise thousands of steps;
* `mtp.ops.gdn_step` — decode and speculative verify, token by token, with the state
  after every step, which must be able to keep the state at whichever position
  acceptance stops (no recompute): one kernel on a GPU, whose reference
  (`mtp.ops.gdn_step.reference`) holds the layer's per-token math (the gates, the head
  split, the masked update and the token-by-token recurrence) that prefill runs too.

Masked positions (padding of a ragged batch) leave the state untouched: their key,
``beta`` and log-decay are zeroed, which makes their update the identity.

The depthwise conv and its grouped channel order are `mtp.ops.conv_step`'s (its
reference, `mtp.ops.conv_step.reference`, says why the order); the conv state
(`LinearState.conv`) is kept grouped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model.gemm_layout import DEFAULT, MERGED_GROUPS, dense, module_columns
from mtp.ops.conv_step import conv_steps
from mtp.ops.conv_step.reference import conv_state_after, conv_windows
from mtp.ops.gdn_step import HeadShape, gdn_steps
from mtp.ops.gdn_step.reference import gates, mask_updates, qkvz_groups, split_heads
from mtp.ops.norms import gated_rms_norm

CHUNK = 64


def project(p, x: jax.Array, cfg: ModelConfig, lead: tuple[int, ...], execution: ExecutionConfig = DEFAULT,
            merged: jax.Array | None = None):
    """The input projections ``(mixed_qkv, qkvz, ba)``; ``mixed_qkv`` in the grouped conv order.

    ``in_proj_qkvz`` is laid out per key-head group as ``[q, k, v.., z..]``, so the
    conv input is the first ``2 Dk + r Dv`` channels of every group; ``gates`` takes
    ``z, b, a`` out of ``qkvz`` and ``ba`` where they are used. ``qkvz`` and ``ba`` are
    `gemm_layout.Columns` of the GEMM output (one GEMM where `gemm_layout.dense_columns` merges
    them, ``qkvz`` first), padding rows kept (``gemm_layout.dense_rows``): the fused step
    kernel reads z, b and a in place, so that XLA never copies a slice of them.
    ``x`` is ``[*lead, H]`` or the padded stream's rows (`gemm_layout.stream_rows`); ``merged``: the
    two weights concatenated ahead (`gemm_layout.MergedLayer.linear_attn`).
    """
    qkvz, ba = module_columns(p, x, MERGED_GROUPS["linear_attn"], lead, execution, merged)
    groups, qkv_width = qkvz_groups(qkvz.view(lead), cfg)
    mixed = groups[..., :qkv_width].reshape(*lead, -1)
    return mixed, qkvz, ba


def chunked_delta_rule(q, k, v, beta, g, state):
    """Chunk-parallel gated delta rule.

    q, k: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``; beta, g: ``[B, T, H]``;
    state: ``[B, H, Dk, Dv]``. Returns ``(out [B, T, H, Dv], final_state)``.
    Within a chunk the rank-one updates compose into ``(I + L)^-1`` (L strictly
    lower triangular), solved as a triangular system rather than a Python loop.
    """
    bsz, t, h, dk = q.shape
    pad = (-t) % CHUNK
    padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, beta, g = map(padt, (q, k, v, beta, g))
    n = (t + pad) // CHUNK
    # -> [B, H, n, C, ...]
    to_chunks = lambda x: jnp.moveaxis(x.reshape(bsz, n, CHUNK, h, *x.shape[3:]), 3, 1)
    q, k, v, beta, g = map(to_chunks, (q, k, v, beta, g))
    q = q * dk**-0.5
    g = jnp.cumsum(g, axis=-1)  # [B, H, n, C]
    tril = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))
    decay = jnp.where(tril, jnp.exp(jnp.where(tril, g[..., :, None] - g[..., None, :], 0.0)), 0.0)
    k_beta = k * beta[..., None]
    lower = jnp.where(jnp.tril(tril, -1), jnp.einsum("...id,...jd->...ij", k_beta, k) * decay, 0.0)
    eye = jnp.eye(CHUNK, dtype=jnp.float32)
    solve = lambda m: jax.scipy.linalg.solve_triangular(eye + m, jnp.broadcast_to(eye, m.shape), lower=True)
    tmat = solve(lower)  # (I + L)^-1
    v_w = tmat @ (v * beta[..., None])
    k_cumdecay = tmat @ (k_beta * jnp.exp(g)[..., None])

    def step(s, xs):
        q_i, k_i, v_i, kc_i, g_i, dec_i = xs  # [B, H, C, ...]
        attn = jnp.where(tril, q_i @ jnp.swapaxes(k_i, -1, -2) * dec_i, 0.0)
        v_new = v_i - kc_i @ s
        out = (q_i * jnp.exp(g_i)[..., None]) @ s + attn @ v_new
        g_last = g_i[..., -1]
        s = s * jnp.exp(g_last)[..., None, None] + jnp.swapaxes(
            k_i * jnp.exp(g_last[..., None] - g_i)[..., None], -1, -2) @ v_new
        return s, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v_w, k_cumdecay, g, decay))
    state, out = jax.lax.scan(step, state.astype(jnp.float32), xs)
    out = jnp.moveaxis(out, 0, 2).reshape(bsz, h, n * CHUNK, -1)[:, :, :t]
    return jnp.swapaxes(out, 1, 2), state


def out_project(p, y: jax.Array, execution: ExecutionConfig = DEFAULT) -> jax.Array:
    """``out_proj`` over the gated, normed per-head outputs ``[.., H, Dv]``."""
    return dense(y.reshape(*y.shape[:-2], -1), p["out_proj"]["weight"], execution=execution)


def output(p, core: jax.Array, z: jax.Array, x_dtype, cfg: ModelConfig, execution: ExecutionConfig = DEFAULT):
    return out_project(p, gated_rms_norm(core.astype(x_dtype), z, p["norm"]["weight"], cfg.rms_norm_eps), execution)


def gdn_layer(p, x, cfg: ModelConfig, conv_state, rec_state, valid, per_step: bool,
              execution: ExecutionConfig = DEFAULT, merged: jax.Array | None = None):
    """One Gated DeltaNet layer over ``x [B, T, H]`` (or the padded stream's rows, `gemm_layout.stream_rows`).

    ``valid [B, T]`` marks the real tokens, which are a prefix of each row. With
    ``per_step`` (decode and verify) the state after every position is returned as well,
    and the conv and the tokens after it are `mtp.ops.conv_step.conv_steps` and
    `mtp.ops.gdn_step.gdn_steps` (one kernel each for up to 8 tokens where ``execution``
    picks it). ``merged`` as in `project`. Returns ``(y, new_conv, new_rec, step_states)``.
    """
    lead = valid.shape
    mixed, qkvz, ba = project(p, x, cfg, lead, execution, merged)
    mixed = jnp.where(valid[..., None], mixed, 0)
    steps = None
    if per_step:  # decode and verify: the conv and the state after every token as one op
        assert qkvz.start == 0, "conv_steps reads in_proj_qkvz from the GEMM output's first columns"
        conv_out, conv_states = conv_steps(mixed, qkvz.rows, valid, conv_state, p["conv1d"]["weight"],
                                           heads=HeadShape.of(cfg), impl=execution.impl_for("conv_step"))
        y, rec_steps = gdn_steps(conv_out, qkvz.rows, ba.rows, valid, rec_state, p["A_log"], p["dt_bias"],
                                 p["norm"]["weight"], num_k_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps,
                                 ba_col=ba.start, impl=execution.impl_for("gdn_step"))
        out = out_project(p, y, execution)
        # A masked token keeps the states: the last step's are the final ones.
        new_conv, new_rec = conv_states[:, -1], rec_steps[:, -1]
        steps = (conv_states, rec_steps)
    else:
        conv_out = conv_windows(p, cfg, conv_state, mixed)
        z, b, a = gates(qkvz.view(lead), ba.view(lead), cfg)
        q, k, v, beta, g = split_heads(conv_out, b, a, p, cfg)
        k, beta, g = mask_updates(k, beta, g, valid)
        core, new_rec = chunked_delta_rule(q, k, v, beta, g, rec_state)
        out = output(p, core, z, x.dtype, cfg, execution)
        new_conv = conv_state_after(conv_state, mixed, jnp.sum(valid, axis=1).astype(jnp.int32))
    return out, new_conv, new_rec, steps
