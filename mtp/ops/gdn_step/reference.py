"""The Gated DeltaNet layer's per-token math after its conv, in pure JAX: the model's own functions.

Per value head the layer keeps a matrix ``S [Dk, Dv]`` updated by the gated delta rule
``S <- exp(g) S + k (beta (v - k^T exp(g) S))`` and reads ``q^T S``. The functions here take
the layer's gates and heads out of its projections (`gates`, `split_heads`), zero the update
of masked tokens (`mask_updates`) and run the recurrence token by token
(`recurrent_delta_rule`); `mtp.model.gated_deltanet` composes them for every path, and
`gdn_steps_reference` composes them, with the gated output norm, into the definition the
kernel (`triton`) is tested against. They read a config's head counts under
`mtp.config.ModelConfig`'s field names, which `HeadShape` carries for a kernel's inputs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp.ops.norms import gated_rms_norm, l2norm

UNROLL_STEPS = 8  # verify widths up to this many steps run as straight-line code


@dataclasses.dataclass(frozen=True)
class HeadShape:
    """A Gated DeltaNet layer's head counts and dims, under `ModelConfig`'s field names.

    What the layer's functions (``gates``, ``split_heads``, `mtp.ops.conv_step`'s
    ``conv_windows``) read of a config, so that a kernel's reference can call them with
    the shapes of its inputs (a tensor-parallel shard has fewer heads than the config).
    Hashable: a jit static.
    """

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int

    @classmethod
    def of(cls, cfg) -> "HeadShape":
        return cls(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim)

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q and k of every key head, v of every value head."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def qkvz_width(self) -> int:
        """``in_proj_qkvz``'s output channels: the conv's, and z of every value head."""
        return self.conv_dim + self.linear_num_value_heads * self.linear_value_head_dim


def heads_of(num_k_heads: int, state: jax.Array) -> HeadShape:
    """The layer's heads from a recurrent state ``[B, nv, Dk, Dv]`` and its key-head count."""
    return HeadShape(num_k_heads, *state.shape[1:])


def qkvz_groups(qkvz: jax.Array, cfg):
    """``qkvz`` as ``[.., nk, 2 Dk + 2 r Dv]`` key-head groups, and the width of a group's q, k, v."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    return qkvz.reshape(*qkvz.shape[:-1], nk, 2 * dk + 2 * r * dv), 2 * dk + r * dv


def output_gate(qkvz: jax.Array, cfg) -> jax.Array:
    """``z [.., nv, Dv]``, the output norm's gate, out of ``in_proj_qkvz``'s output."""
    groups, qkv_width = qkvz_groups(qkvz, cfg)
    return groups[..., qkv_width:].reshape(*qkvz.shape[:-1], cfg.linear_num_value_heads, cfg.linear_value_head_dim)


def gates(qkvz: jax.Array, ba: jax.Array, cfg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``z [.., nv, Dv]``, ``b [.., nv]``, ``a [.., nv]`` out of the ``in_proj_qkvz`` and ``in_proj_ba`` outputs."""
    lead = qkvz.shape[:-1]
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r = nv // nk
    ba = ba.reshape(*lead, nk, 2 * r)
    return output_gate(qkvz, cfg), ba[..., :r].reshape(*lead, nv), ba[..., r:].reshape(*lead, nv)


def split_heads(mixed: jax.Array, b: jax.Array, a: jax.Array, p, cfg):
    """Grouped conv output to per-value-head ``q, k`` (l2-normalised, f32), ``v``, ``beta``, ``g``.

    ``p``: the layer's ``{"A_log": [nv], "dt_bias": [nv]}``.
    """
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


def mask_updates(k, beta, g, valid):
    """Zero the update of masked positions so they leave the state as it was."""
    m = valid[..., None]
    return jnp.where(m[..., None], k, 0.0), jnp.where(m, beta, 0.0), jnp.where(m, g, 0.0)


def recurrent_delta_rule(q, k, v, beta, g, state):
    """Token-by-token gated delta rule; also returns the state after every step.

    q, k: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``; beta, g: ``[B, T, H]``; state:
    ``[B, H, Dk, Dv]``. Returns ``(out [B, T, H, Dv], final_state, states [B, T, H, Dk, Dv])``.
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


def gdn_steps_reference(mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w, *, num_k_heads, eps,
                        ba_col=0):
    """T steps as the model computes them (``gates`` + ``split_heads`` + the delta rule + gated norm).

    mixed: [B, T, 2 nk Dk + nv Dv] conv output, grouped per key head ([q, k, v of its
    value heads] for each key head, the layer's conv order); qkvz: [R >= B T, >= nk
    (2 Dk + 2 r Dv)] with the ``in_proj_qkvz`` output in its first columns (token t of
    sequence b in row b T + t), and ba: [R' >= B T, >= ba_col + 2 nv] with the
    ``in_proj_ba`` output at columns ``ba_col...``: where ``z`` and ``b, a`` come from. Rows
    past B T and other columns are ignored: the model passes whole GEMM outputs, padding
    rows and merged projections included (`mtp.model.gemm_layout.dense_rows`, ``dense_columns``;
    qkvz and ba are then one buffer), so that XLA need not copy a slice of them; valid: [B, T]
    bool (a masked token leaves the state as it was); state: [B, nv, Dk, Dv] f32; a_log,
    dt_bias: [nv]; norm_w: [Dv]. Returns ``(y [B, T, nv, Dv] in mixed's dtype, states [B,
    T, nv, Dk, Dv])``, the state after every step (verify keeps the accepted one). The
    kernel takes Dk = Dv (Qwen3-Next's 128) only.
    """
    heads = heads_of(num_k_heads, state)
    nv = heads.linear_num_value_heads
    bsz, t = mixed.shape[:2]
    rows = lambda x, lo, n: x[:bsz * t, lo:lo + n].reshape(bsz, t, n)
    z, b, a = gates(rows(qkvz, 0, heads.qkvz_width), rows(ba, ba_col, 2 * nv), heads)
    q, k, v, beta, g = split_heads(mixed, b, a, {"A_log": a_log, "dt_bias": dt_bias}, heads)
    k, beta, g = mask_updates(k, beta, g, valid)
    core, _, states = recurrent_delta_rule(q, k, v, beta, g, state)
    return gated_rms_norm(core.astype(mixed.dtype), z, norm_w, eps), states


def gdn_step_reference(mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w, *, num_k_heads, eps,
                       ba_col=0):
    """One step (decode): ``gdn_steps_reference`` with T = 1, mixed [B, C] and valid [B]; ``(y, new_state)``."""
    y, states = gdn_steps_reference(mixed[:, None], qkvz, ba, valid[:, None], state, a_log, dt_bias, norm_w,
                                    num_k_heads=num_k_heads, eps=eps, ba_col=ba_col)
    return y[:, 0], states[:, 0]
