"""Gated DeltaNet: the linear-attention layer of the hybrid, with explicit state.

Per value head the layer keeps a matrix ``S [Dk, Dv]`` updated by the gated delta
rule ``S <- exp(g) S + k (beta (v - k^T exp(g) S))`` and reads ``q^T S``. Two
evaluations of the same recurrence:

* `chunked_delta_rule` — the chunk-parallel (WY) form over 64-token chunks: prefill
  and training, where a token-by-token scan would serialise thousands of steps;
* `recurrent_delta_rule` — a token-by-token scan that also returns the state after
  every step: decode and speculative verify, which must be able to keep the state
  at whichever position acceptance stops (no recompute).

Masked positions (padding of a ragged batch) leave the state untouched: their key,
``beta`` and log-decay are zeroed, which makes their update the identity.

The depthwise conv runs on its channels grouped per key head, ``[q, k, v of its value
heads]`` for each key head in turn: the order ``in_proj_qkvz`` produces them in, so the
conv input is a slice of the projection, and a split of the channel axis on key-head
boundaries gives every device of a tensor-parallel mesh its own heads' q, k and v
(`mtp.sharding`). The checkpoint's ``conv1d`` weight stays in Hugging Face's
``[q of all heads | k | v]`` order and is regrouped where it is used
(`grouped_conv_weight`); the conv state (`LinearState.conv`) is kept grouped. A
depthwise conv multiplies each channel by its own taps, so the order changes no value.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtp.config import ModelConfig
from mtp.model.layers import MERGED_GROUPS, dense, gated_rms_norm, l2norm, module_columns
from mtp.pallas import conv_step  # modules: they import mtp.model.layers too
from mtp.pallas import gdn_step as fused_step

CHUNK = 64
UNROLL_STEPS = 8  # verify widths up to this many steps run as straight-line code


def project(p, x: jax.Array, cfg: ModelConfig, lead: tuple[int, ...]):
    """The input projections ``(mixed_qkv, qkvz, ba)``; ``mixed_qkv`` in the grouped conv order.

    ``in_proj_qkvz`` is laid out per key-head group as ``[q, k, v.., z..]``, so the
    conv input is the first ``2 Dk + r Dv`` channels of every group; ``gates`` takes
    ``z, b, a`` out of ``qkvz`` and ``ba`` where they are used. ``qkvz`` and ``ba`` are
    `layers.Columns` of the GEMM output (one GEMM where `layers.dense_columns` merges
    them, ``qkvz`` first), padding rows kept (``layers.dense_rows``): the fused step
    kernel reads z, b and a in place, so that XLA never copies a slice of them.
    ``x`` is ``[*lead, H]`` or the padded stream's rows (`layers.stream_rows`).
    """
    qkvz, ba = module_columns(p, x, MERGED_GROUPS["linear_attn"], lead)
    groups, qkv_width = _qkvz_groups(qkvz.view(lead), cfg)
    mixed = groups[..., :qkv_width].reshape(*lead, -1)
    return mixed, qkvz, ba


def _qkvz_groups(qkvz: jax.Array, cfg):
    """``qkvz`` as ``[.., nk, 2 Dk + 2 r Dv]`` key-head groups, and the width of a group's q, k, v."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    return qkvz.reshape(*qkvz.shape[:-1], nk, 2 * dk + 2 * r * dv), 2 * dk + r * dv


def output_gate(qkvz: jax.Array, cfg) -> jax.Array:
    """``z [.., nv, Dv]``, the output norm's gate, out of ``in_proj_qkvz``'s output."""
    groups, qkv_width = _qkvz_groups(qkvz, cfg)
    return groups[..., qkv_width:].reshape(*qkvz.shape[:-1], cfg.linear_num_value_heads, cfg.linear_value_head_dim)


def gates(qkvz: jax.Array, ba: jax.Array, cfg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``z [.., nv, Dv]``, ``b [.., nv]``, ``a [.., nv]`` out of the projections of `project`."""
    lead = qkvz.shape[:-1]
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r = nv // nk
    ba = ba.reshape(*lead, nk, 2 * r)
    return output_gate(qkvz, cfg), ba[..., :r].reshape(*lead, nv), ba[..., r:].reshape(*lead, nv)


@functools.lru_cache(maxsize=16)
def _grouped_channels(nk: int, nv: int, dk: int, dv: int) -> np.ndarray:
    """For each channel of the grouped order, its index in the checkpoint's ``[q | k | v]``."""
    kd = nk * dk
    q = np.arange(kd).reshape(nk, dk)
    v = 2 * kd + np.arange(nv * dv).reshape(nk, -1)  # value heads are numbered group-major
    return np.concatenate([q, kd + q, v], axis=1).reshape(-1)


def grouped_conv_weight(w: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The ``conv1d`` weight ``[C, 1, K]`` (HF order ``[q | k | v]``) as ``[C, K]`` in the grouped order.

    A gather with constant indices rather than slices and a concat: under a
    tensor-parallel mesh the partitioner gathers each device's rows of the replicated
    weight locally, where slicing the q, k and v blocks at their offsets made it move
    weight pieces between devices every step.
    """
    order = _grouped_channels(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                              cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return jnp.take(w[:, 0, :], order, axis=0)


def conv_windows(p, cfg: ModelConfig, conv_state: jax.Array, mixed: jax.Array) -> jax.Array:
    """Causal depthwise conv + SiLU over ``[conv_state, mixed]``: ``[B, T, C]`` out."""
    w = grouped_conv_weight(p["conv1d"]["weight"], cfg)  # [C, K]
    kern = w.shape[-1]
    full = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
    t = mixed.shape[1]
    out = sum(full[:, i : i + t, :].astype(jnp.float32) * w[:, i].astype(jnp.float32) for i in range(kern))
    return jax.nn.silu(out).astype(mixed.dtype)


def split_heads(mixed: jax.Array, b: jax.Array, a: jax.Array, p, cfg: ModelConfig):
    """Grouped conv output to per-value-head ``q, k`` (l2-normalised, f32), ``v``, ``beta``, ``g``."""
    lead = mixed.shape[:-1]
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    groups = mixed.reshape(*lead, nk, -1)
    q, k = groups[..., :dk], groups[..., dk : 2 * dk]
    v = groups[..., 2 * dk :].reshape(*lead, nv, dv).astype(jnp.float32)
    r = nv // nk
    q = l2norm(jnp.repeat(q, r, axis=-2).astype(jnp.float32))
    k = l2norm(jnp.repeat(k, r, axis=-2).astype(jnp.float32))
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    return q, k, v, beta, g


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


def recurrent_delta_rule(q, k, v, beta, g, state):
    """Token-by-token gated delta rule; also returns the state after every step.

    Shapes as in `chunked_delta_rule`; returns ``(out, final_state, states [B, T, H, Dk, Dv])``.
    """
    scale = q.shape[-1] ** -0.5

    def step(s, xs):
        q_t, k_t, v_t, b_t, g_t = xs  # [B, H, ...]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        out = jnp.einsum("bhkv,bhk->bhv", s, q_t * scale)
        return s, (out, s)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, beta, g))
    # Verify runs T = K <= 8 steps: unrolled, they are straight-line code, where a
    # loop would cost a GPU while-loop (a predicate read back by the host) per layer.
    state, (out, states) = jax.lax.scan(step, state.astype(jnp.float32), xs,
                                        unroll=min(q.shape[1], UNROLL_STEPS))
    return jnp.moveaxis(out, 0, 1), state, jnp.moveaxis(states, 0, 1)


def mask_updates(k, beta, g, valid):
    """Zero the update of masked positions so they leave the state as it was."""
    m = valid[..., None]
    return jnp.where(m[..., None], k, 0.0), jnp.where(m, beta, 0.0), jnp.where(m, g, 0.0)


def out_project(p, y: jax.Array) -> jax.Array:
    """``out_proj`` over the gated, normed per-head outputs ``[.., H, Dv]``."""
    return dense(y.reshape(*y.shape[:-2], -1), p["out_proj"]["weight"])


def output(p, core: jax.Array, z: jax.Array, x_dtype, cfg: ModelConfig) -> jax.Array:
    return out_project(p, gated_rms_norm(core.astype(x_dtype), z, p["norm"]["weight"], cfg.rms_norm_eps))


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

    A masked position keeps the state before it, as the recurrent state does (`mask_updates`),
    so every position of an inactive slot returns its old state: a commit can take any position
    without a select against the old state (`mtp.model.target.commit`'s ``masked_verify``).
    """
    before, steps = conv_state.astype(mixed.dtype), []
    for i in range(mixed.shape[1]):
        before = jnp.where(valid[:, i, None, None], conv_state_after(conv_state, mixed, i + 1), before)
        steps.append(before)
    return jnp.stack(steps, axis=1)


def gdn_layer(p, x, cfg: ModelConfig, conv_state, rec_state, valid, per_step: bool,
              impl: str = "reference"):
    """One Gated DeltaNet layer over ``x [B, T, H]`` (or the padded stream's rows, `layers.stream_rows`).

    ``valid [B, T]`` marks the real tokens, which are a prefix of each row. With
    ``per_step`` (decode and verify) the state after every position is returned as well,
    and the tokens after the conv are `mtp.pallas.gdn_step.gdn_steps` (one kernel for up
    to 8 tokens where ``impl`` picks it). Returns ``(y, new_conv, new_rec, step_states)``.
    """
    lead = valid.shape
    mixed, qkvz, ba = project(p, x, cfg, lead)
    mixed = jnp.where(valid[..., None], mixed, 0)
    steps = None
    if per_step:  # decode and verify: the conv and the state after every token as one op
        assert qkvz.start == 0, "conv_steps reads in_proj_qkvz from the GEMM output's first columns"
        conv_out, conv_steps = conv_step.conv_steps(mixed, qkvz.rows, valid, conv_state, p["conv1d"]["weight"],
                                                    heads=fused_step.HeadShape.of(cfg), impl=impl)
        y, rec_steps = fused_step.gdn_steps(conv_out, qkvz.rows, ba.rows, valid, rec_state, p["A_log"],
                                            p["dt_bias"], p["norm"]["weight"],
                                            num_k_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps,
                                            ba_col=ba.start, impl=impl)
        out = out_project(p, y)
        # A masked token keeps the states: the last step's are the final ones.
        new_conv, new_rec = conv_steps[:, -1], rec_steps[:, -1]
        steps = (conv_steps, rec_steps)
    else:
        conv_out = conv_windows(p, cfg, conv_state, mixed)
        z, b, a = gates(qkvz.view(lead), ba.view(lead), cfg)
        q, k, v, beta, g = split_heads(conv_out, b, a, p, cfg)
        k, beta, g = mask_updates(k, beta, g, valid)
        core, new_rec = chunked_delta_rule(q, k, v, beta, g, rec_state)
        out = output(p, core, z, x.dtype, cfg)
        new_conv = conv_state_after(conv_state, mixed, jnp.sum(valid, axis=1).astype(jnp.int32))
    return out, new_conv, new_rec, steps
