"""Building blocks of the Qwen3-Next hybrid: gated attention and the FFNs (dense and MoE).

Each block is a plain function of ``(params_subtree, inputs)``; parameter subtrees
are the checkpoint's own nesting. ``execution`` (`mtp.execution.ExecutionConfig`, a static of
the jitted callers) sets the path of each op a block calls and, through `mtp.model.gemm_layout`
(every projection's `dense`), the GEMM layout. The math a
kernel reproduces is its op's: the norms (`mtp.ops.norms`), the attention's q/k norms, RoPE and gate split
(`mtp.ops.attn_prologue.reference`), the routed experts (`mtp.ops.moe`). Numerics follow the Hugging Face implementation
(norms in float32 and cast back, f32 softmax, f32 matmul accumulation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model.gemm_layout import DEFAULT, MERGED_GROUPS, Columns, dense, module_columns
from mtp.ops.attn_prologue.reference import key_values, qkv_of, rope
from mtp.ops.moe import SharedExpert, routed_experts


# ------------------------------------------------------------------ gated attention
def attention_qkv(p, x: jax.Array, positions: jax.Array, cfg: ModelConfig, execution: ExecutionConfig = DEFAULT):
    """Project to rotated ``q [.., T, Hq, D]``, ``k, v [.., T, Hkv, D]`` and the output gate."""
    lead = _lead(x, positions)
    return qkv_of(attention_columns(p, x, lead, execution), p["q_norm"]["weight"], p["k_norm"]["weight"], positions,
                  lead, cfg)


def attention_columns(p, x: jax.Array, lead: tuple[int, ...], execution: ExecutionConfig = DEFAULT) -> list[Columns]:
    """The q (with its gate), k and v projections of ``x``, as `module_columns`."""
    return module_columns(p, x, MERGED_GROUPS["self_attn"], lead, execution)


def _lead(x, positions):
    """The tokens' shape: ``x``'s, or ``positions``' when ``x`` is the padded stream's rows."""
    return positions.shape if x.ndim == positions.ndim else x.shape[:-1]


def _projections(p, x, lead, names, execution):
    """The named projections of ``x``, each ``[*lead, out]``."""
    return [c.view(lead) for c in module_columns(p, x, names, lead, execution)]


def attention_kv(p, x: jax.Array, positions: jax.Array, cfg: ModelConfig, execution: ExecutionConfig = DEFAULT):
    """Only the rotated keys and values: all a drafter prefill needs (no queries)."""
    lead = _lead(x, positions)
    k, v = key_values(*_projections(p, x, lead, ("k_proj", "v_proj"), execution), p["k_norm"]["weight"], lead, cfg)
    return rope(k, positions, cfg), v


def attention_out(p, attn: jax.Array, execution: ExecutionConfig = DEFAULT) -> jax.Array:
    """``o_proj`` over the (already gated) per-head outputs ``[.., T, Hq, D]``."""
    return dense(attn.reshape(*attn.shape[:-2], -1), p["o_proj"]["weight"], execution=execution)


def causal_attention(q, k, v, gate) -> jax.Array:
    """Dense causal GQA attention over a whole sequence, ``[B, T, H, D]`` each.

    The no-cache reference path and training use it; decode uses the paged kernel.
    """
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    qf = q.astype(jnp.float32).reshape(b, t, k.shape[2], g, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(jnp.float32)) * d**-0.5
    mask = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(mask, s, -jnp.inf)
    o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
    o = o.reshape(b, t, hq, d) * jax.nn.sigmoid(gate.astype(jnp.float32))
    return o.astype(q.dtype)


# ------------------------------------------------------------------ FFNs
def mlp(p, x: jax.Array, execution: ExecutionConfig = DEFAULT) -> jax.Array:
    gate = jax.nn.silu(dense(x, p["gate_proj"]["weight"], execution=execution))
    return dense(gate * dense(x, p["up_proj"]["weight"], execution=execution), p["down_proj"]["weight"],
                 execution=execution)


def route(p, x: jax.Array, cfg: ModelConfig, execution: ExecutionConfig = DEFAULT) -> tuple[jax.Array, jax.Array]:
    """Each row's experts and their weights: int32 ``[N, k]`` and f32 ``[N, k]``, ``N`` = x's rows.

    As Hugging Face's Qwen3-Next routes: an f32 softmax over the router logits, the top
    ``k``, renormalised when ``norm_topk_prob``, rounded to the activation dtype.
    """
    logits = dense(x, p["gate"]["weight"], execution=execution).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    top_w = top_w.astype(x.dtype).astype(jnp.float32)  # HF casts the weights to the activation dtype
    k = cfg.num_experts_per_tok
    return top_i.reshape(-1, k).astype(jnp.int32), top_w.reshape(-1, k)


def moe(p, x: jax.Array, cfg: ModelConfig, real_rows: int | None = None,
        execution: ExecutionConfig = DEFAULT) -> jax.Array:
    """Top-k routed experts (`route`) plus the sigmoid-gated shared expert.

    The experts run as one sparse op (`mtp.ops.moe.routed_experts`, which reads only the selected
    experts' weights, so the layer costs what its active experts cost) on the stacked ``[E, ...]``
    expert weights, plain or quantized (an MTP head's, `mtp.ops.quantized`); the shared expert goes
    to the same op with its gate's value, so that a decode step's kernel streams it beside the
    routed experts. ``real_rows``: where ``x`` is the padded residual stream (`stream_rows`), its
    first rows are the tokens and the rest zeros. Only the tokens go to the op: a zero row's router
    logits tie, so it would select (and read) k experts of its own, doubling the experts a batch-1
    decode step streams; the padding rows' output is zero, as an FFN of a zero row gives.
    """
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0] if real_rows is None else real_rows
    expert_ids, expert_weights = route(p, x2, cfg, execution)  # the router GEMM on the stream's rows as they are
    tokens = x2[:rows]
    shared = None
    if "shared_expert" in p:
        s = p["shared_expert"]
        gate = dense(tokens, p["shared_expert_gate"]["weight"], execution=execution).astype(jnp.float32)
        shared = SharedExpert(s["gate_proj"]["weight"], s["up_proj"]["weight"], s["down_proj"]["weight"],
                              jax.nn.sigmoid(gate[:, 0]))
    experts = p["experts"]
    out = routed_experts(tokens, expert_ids[:rows], expert_weights[:rows], experts["gate_proj"]["weight"],
                         experts["up_proj"]["weight"], experts["down_proj"]["weight"], shared=shared,
                         impl=execution.impl_for("moe"))
    if rows < x2.shape[0]:
        out = jnp.concatenate([out, jnp.zeros((x2.shape[0] - rows, out.shape[1]), out.dtype)])
    return out.reshape(x.shape).astype(x.dtype)


def ffn(p, x: jax.Array, cfg: ModelConfig, real_rows: int | None = None,
        execution: ExecutionConfig = DEFAULT) -> jax.Array:
    """The layer's FFN; ``real_rows`` as in `moe` (a dense MLP is row-wise and needs no telling)."""
    return moe(p, x, cfg, real_rows, execution) if "gate" in p else mlp(p, x, execution)
