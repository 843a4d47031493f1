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
from mtp.ops.moe import RouterLogits, SharedExpert, moe_ffn


# ------------------------------------------------------------------ gated attention
def attention_qkv(p, x: jax.Array, positions: jax.Array, cfg: ModelConfig, execution: ExecutionConfig = DEFAULT):
    """Project to rotated ``q [.., T, Hq, D]``, ``k, v [.., T, Hkv, D]`` and the output gate."""
    lead = _lead(x, positions)
    return qkv_of(attention_columns(p, x, lead, execution), p["q_norm"]["weight"], p["k_norm"]["weight"], positions,
                  lead, cfg)


def attention_columns(p, x: jax.Array, lead: tuple[int, ...], execution: ExecutionConfig = DEFAULT,
                      merged: jax.Array | None = None) -> list[Columns]:
    """The q (with its gate), k and v projections of ``x``, as `module_columns` (``merged``: its
    `gemm_layout.MergedLayer.self_attn`)."""
    return module_columns(p, x, MERGED_GROUPS["self_attn"], lead, execution, merged)


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


def router(p, x: jax.Array, cfg: ModelConfig, execution: ExecutionConfig = DEFAULT,
           merged: jax.Array | None = None) -> tuple[RouterLogits, jax.Array | None]:
    """The router's logits for every row of ``x`` (`mtp.ops.moe.RouterLogits`, which the op routes
    by as Hugging Face's Qwen3-Next does) and the shared expert's gate ``sigmoid(shared_expert_gate(x))``,
    f32 ``[N]`` (None without a shared expert). The router and the shared expert's gate are one
    GEMM where the layout merges them (`gemm_layout.MERGED_GROUPS`): a launch less a layer;
    ``merged``: the two concatenated ahead (`gemm_layout.MergedLayer.mlp`).
    """
    names = MERGED_GROUPS["mlp"] if "shared_expert_gate" in p else ("gate",)
    lead = x.shape[:-1]
    columns = module_columns(p, x, names, lead, execution, merged)
    logits = RouterLogits(columns[0].rows, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    shared_gate = None
    if len(columns) > 1:
        shared_gate = jax.nn.sigmoid(columns[1].view(lead).reshape(-1).astype(jnp.float32))
    return logits, shared_gate


def moe(p, x: jax.Array, cfg: ModelConfig, real_rows: int | None = None,
        execution: ExecutionConfig = DEFAULT, merged: jax.Array | None = None) -> jax.Array:
    """The router (`router`), its top-k routed experts and the sigmoid-gated shared expert.

    Routing and experts run as one sparse op (`mtp.ops.moe.moe_ffn`, which reads only the selected
    experts' weights, so the layer costs what its active experts cost) on the stacked ``[E, ...]``
    expert weights, plain or quantized (an MTP head's, `mtp.ops.quantized`); the shared expert goes
    to the same op with its gate's value, so that a decode step's kernels route and stream it
    beside the routed experts. ``real_rows``: where ``x`` is the padded residual stream
    (`stream_rows`), its first rows are the tokens and the rest zeros. Only the tokens go to the op:
    a zero row's router logits tie, so it would select (and read) k experts of its own, doubling
    the experts a batch-1 decode step streams; the padding rows' output is zero, as an FFN of a
    zero row gives. ``merged``: the router's, as in `router`.
    """
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0] if real_rows is None else real_rows
    logits, shared_gate = router(p, x2, cfg, execution, merged)  # on the stream's rows as they are
    shared = None
    if shared_gate is not None:
        s = p["shared_expert"]
        shared = SharedExpert(s["gate_proj"]["weight"], s["up_proj"]["weight"], s["down_proj"]["weight"],
                              shared_gate[:rows])
    experts = p["experts"]
    out = moe_ffn(x2[:rows], logits, experts["gate_proj"]["weight"], experts["up_proj"]["weight"],
                  experts["down_proj"]["weight"], shared=shared, impl=execution.impl_for("moe"))
    if rows < x2.shape[0]:
        out = jnp.concatenate([out, jnp.zeros((x2.shape[0] - rows, out.shape[1]), out.dtype)])
    return out.reshape(x.shape).astype(x.dtype)


def ffn(p, x: jax.Array, cfg: ModelConfig, real_rows: int | None = None,
        execution: ExecutionConfig = DEFAULT, merged: jax.Array | None = None) -> jax.Array:
    """The layer's FFN; ``real_rows`` and ``merged`` (the router's) as in `moe` (a dense MLP is
    row-wise and needs no telling, and merges nothing)."""
    return moe(p, x, cfg, real_rows, execution, merged) if "gate" in p else mlp(p, x, execution)
