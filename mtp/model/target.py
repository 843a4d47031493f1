"""The target model's entry points: no-cache forward, prefill, and verify/decode.

All three run the same decoder stack; they differ only in where attention reads
keys from (the sequence itself, or the paged cache) and which Gated DeltaNet
evaluation they use (chunked for long spans, per-step for verify). Every function
takes the static `ModelConfig` first and returns new state rather than mutating; the
jitted ones take the run's `ExecutionConfig` as a static ``execution`` too (kernel paths and
GEMM layout), so each config compiles its own program.
"""

from __future__ import annotations

import functools

import math

import jax
import jax.numpy as jnp
from flax import struct

from mtp.cache.state import LinearState, TargetCache
from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model import gated_deltanet as gdn
from mtp.model import gemm_layout, layers
from mtp.model.gemm_layout import MergedLayer, first_rows, stream_rows
from mtp.model.layers import attention_out, attention_qkv, causal_attention, ffn
from mtp.model.params import Params
from mtp.model.prepared import PreparedParams, as_prepared
from mtp.ops import fp8
from mtp.ops.add_rms_norm import add_rms_norm
from mtp.ops.attn_prologue import AttentionShape, attn_prologue
from mtp.ops.norms import rms_norm
from mtp.ops.paged_attention import paged_attention


@struct.dataclass
class StepOutput:
    """What the target hands on: logits and both views of its final hidden."""

    logits: jax.Array  # [B, T, V] (or [B, 1, V] when only the last is asked for)
    hidden_pre: jax.Array  # [B, T, H] residual stream before the final norm
    hidden_post: jax.Array  # [B, T, H] after the final norm (what the LM head reads)

    def mtp_hidden(self, source: str) -> jax.Array:
        """The hidden the MTP head consumes (`ModelConfig.mtp_hidden_source`)."""
        return self.hidden_post if source == "post_norm" else self.hidden_pre


@struct.dataclass
class VerifyOutput(StepOutput):
    """A verify step also returns the Gated DeltaNet state after every new position."""

    conv_steps: tuple[jax.Array, ...] = ()  # per linear layer [B, Q, K-1, C]
    rec_steps: tuple[jax.Array, ...] = ()  # per linear layer [B, Q, Hv, Dk, Dv]


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["model"]["embed_tokens"]["weight"], tokens, axis=0)


def lm_head(cfg: ModelConfig, params: Params, hidden_post: jax.Array) -> jax.Array:
    w = params["model"]["embed_tokens"]["weight"] if cfg.tie_word_embeddings else params["lm_head"]["weight"]
    return jnp.einsum("...h,vh->...v", hidden_post, w.astype(hidden_post.dtype),
                      preferred_element_type=jnp.float32)


# The no-cache path (`forward_with_hiddens`, `mtp.mtp_head.forward_sequence`) is the definition
# the cached paths are tested against, and what training differentiates: its fused ops run their
# references whatever the run's config names; its GEMMs (layout, FP8 weights, routed experts)
# follow the config.
DEFINITION_OPS = ("add_rms_norm", "conv_step", "gdn_step", "fc_gemm")


def definition_of(execution: ExecutionConfig) -> ExecutionConfig:
    """``execution`` as the no-cache path runs it: ``DEFINITION_OPS`` on their references."""
    return execution.with_kernels(**{op: "reference" for op in DEFINITION_OPS})


def decoder_layer(cfg: ModelConfig, p, x: jax.Array, mixer, execution: ExecutionConfig,
                  merged: MergedLayer = MergedLayer()):
    """Pre-norm residual block; ``mixer(h) -> (y, new_state)`` is the layer's token mixer on normed input.

    Returns ``(x, new_state)``, the mixer's state (its written KV pages, its recurrent state)
    passed through as gemma's attention returns its cache. ``x`` is ``[*lead, H]`` or the
    padded stream's rows (`gemm_layout.stream_rows`): the norms and the FFN are row-wise, and the
    mixer's ``y`` is ``[*lead, H]``. The mixer's residual add and the FFN's norm are one op
    (`mtp.ops.add_rms_norm`, a kernel where ``execution`` picks it). ``merged``: the layer's
    premerged weights (`mtp.model.prepared.PreparedParams`); the FFN reads its router's.
    """
    y, state = mixer(rms_norm(x, p["input_layernorm"]["weight"], cfg.rms_norm_eps))
    x, h = add_rms_norm(x, y, p["post_attention_layernorm"]["weight"], eps=cfg.rms_norm_eps,
                        impl=execution.impl_for("add_rms_norm"))
    return x + ffn(p["mlp"], h, cfg, real_rows=math.prod(y.shape[:-1]), execution=execution,
                   merged=merged.mlp), state


def paged_attention_mixer(cfg, p, rope_positions, slots, k_pages, v_pages, block_tables, write,
                          attn_lengths, execution: ExecutionConfig, merged: MergedLayer = MergedLayer()):
    """Gated attention that writes this step's K/V into pages, then attends over them.

    ``rope_positions`` are sequence positions; ``slots`` are where the K/V land in
    the pages. They coincide for the target; the drafter's rows are compacted, so
    its slots are row indices while RoPE stays in sequence space. ``merged``: the layer's premerged
    weights, of which the q/k/v projections read theirs.
    Returns the mixer; its new state is the updated ``(k_pages, v_pages)``.
    """

    def mixer(h):
        attn = p["self_attn"]
        columns = layers.attention_columns(attn, h, rope_positions.shape, execution, merged.self_attn)
        q, gate, kp, vp = attn_prologue(columns, attn["q_norm"]["weight"], attn["k_norm"]["weight"], rope_positions,
                                        slots, k_pages, v_pages, block_tables, write, heads=AttentionShape.of(cfg),
                                        impl=execution.impl_for("attn_prologue"))
        o = paged_attention(q, kp, vp, block_tables, attn_lengths, gate=gate,
                            impl=execution.impl_for("paged_attention"),
                            triton_impl=execution.impl_for("paged_attention_triton"))
        return attention_out(attn, o, execution), (kp, vp)

    return mixer


def _final(cfg, params, x, lead, last_only: jax.Array | None) -> StepOutput:
    """The final norm and the LM head; ``x`` may be the padded stream's rows."""
    post_rows = rms_norm(x, params["model"]["norm"]["weight"], cfg.rms_norm_eps)
    x, post = first_rows(x, lead), first_rows(post_rows, lead)
    if last_only is None:
        logits = first_rows(lm_head(cfg, params, post_rows), lead)
    else:
        logits = lm_head(cfg, params, jnp.take_along_axis(post, last_only[:, None, None], axis=1))
    return dict(logits=logits, hidden_pre=x, hidden_post=post)


def _pads_stream(params: Params, execution: ExecutionConfig) -> bool:
    """Whether a one-row step carries its residual stream padded (`gemm_layout.stream_rows`).

    Where `dense` would pad some of the layers' GEMMs (a GPU, and a plain weight above
    `gemm_layout.PAD_MIN_WEIGHT`: `gemm_layout.pads_weight`), so that the stream is padded once per step,
    not per GEMM. A model whose large weights are all FP8 keeps one row.
    """
    weights = jax.tree.leaves(params["model"]["layers"], is_leaf=lambda w: isinstance(w, fp8.BlockFp8Weight))
    return gemm_layout.pad_small_gemms(execution) and any(gemm_layout.pads_weight(w, execution) for w in weights)


# ------------------------------------------------------------------ reference path
def forward_with_hiddens(cfg: ModelConfig, params: Params, tokens: jax.Array,
                         gdn_mode: str = "chunked", execution: ExecutionConfig = gemm_layout.DEFAULT) -> StepOutput:
    """The whole sequence from an empty state, no cache: the reference path (and training).

    ``execution``: its GEMM layout and GEMM paths (`definition_of`)."""
    execution = definition_of(execution)
    b, t = tokens.shape
    x = embed(params, tokens)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    valid = jnp.ones((b, t), bool)
    zeros = LinearState.zeros(cfg, b, x.dtype)
    for i, kind in enumerate(cfg.layer_types):
        p = params["model"]["layers"][str(i)]
        if kind == "full_attention":
            def mixer(h, p=p):
                q, k, v, gate = attention_qkv(p["self_attn"], h, positions, cfg, execution)
                return attention_out(p["self_attn"], causal_attention(q, k, v, gate), execution), None
        else:
            def mixer(h, p=p):
                return gdn.gdn_layer(p["linear_attn"], h, cfg, zeros.conv[0], zeros.recurrent[0],
                                     valid, per_step=gdn_mode == "recurrent", execution=execution)[0], None
        x, _ = decoder_layer(cfg, p, x, mixer, execution)
    return StepOutput(**_final(cfg, params, x, (b, t), None))


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array,
            execution: ExecutionConfig = gemm_layout.DEFAULT) -> jax.Array:
    """Logits ``[B, T, vocab]`` of the whole sequence with no cache (``execution`` as `forward_with_hiddens`)."""
    return forward_with_hiddens(cfg, params, tokens, execution=execution).logits


# ------------------------------------------------------------------ cached paths
def _run_cached(cfg, prepared: PreparedParams, cache: TargetCache, tokens, start, valid, write, attn_lengths,
                per_step: bool, execution: ExecutionConfig, linear_init: LinearState):
    """Shared body of prefill and verify: the stack over cached state."""
    b, t = tokens.shape
    params = prepared.params
    positions = start[:, None] + jnp.arange(t)[None, :]
    x = stream_rows(embed(params, tokens), _pads_stream(params, execution), execution)
    ks, vs, convs, recs, conv_steps, rec_steps = [], [], [], [], [], []
    for i, kind in enumerate(cfg.layer_types):
        p, merged = params["model"]["layers"][str(i)], prepared.merged[i]
        if kind == "full_attention":
            j = len(ks)
            mixer = paged_attention_mixer(cfg, p, positions, positions, cache.kv.k[j], cache.kv.v[j],
                                          cache.block_tables, write, attn_lengths, execution, merged)
            x, (k, v) = decoder_layer(cfg, p, x, mixer, execution, merged)
            ks.append(k)
            vs.append(v)
        else:
            j = len(convs)

            def mixer(h, p=p, j=j, merged=merged):
                y, conv, rec, steps = gdn.gdn_layer(p["linear_attn"], h, cfg, linear_init.conv[j],
                                                    linear_init.recurrent[j], valid, per_step, execution,
                                                    merged.linear_attn)
                return y, (conv, rec, steps)

            x, (conv, rec, steps) = decoder_layer(cfg, p, x, mixer, execution, merged)
            convs.append(conv)
            recs.append(rec)
            if per_step:
                conv_steps.append(steps[0])
                rec_steps.append(steps[1])
    kv = cache.kv.replace(k=tuple(ks), v=tuple(vs))
    linear = LinearState(conv=tuple(convs), recurrent=tuple(recs))
    return x, kv, linear, (tuple(conv_steps), tuple(rec_steps))


@functools.partial(jax.jit, static_argnames=("cfg", "execution", "all_logits"), donate_argnames=("cache",))
def prefill(cfg: ModelConfig, params: Params | PreparedParams, cache: TargetCache, tokens: jax.Array,
            start: jax.Array, num_new: jax.Array, write_from: jax.Array | None = None, *,
            execution: ExecutionConfig = gemm_layout.DEFAULT, all_logits: bool = True) -> tuple[TargetCache, StepOutput]:
    """Prefill ``num_new[b]`` tokens of ``tokens[b]`` at positions ``start[b]...`` of each slot.

    A slot with ``start > 0`` continues from the cache's Gated DeltaNet state (a
    restored snapshot) and attends to the KV already in its pages (a cached
    prefix); ``start == 0`` begins from an empty state. K/V are written only for
    positions ``>= write_from[b]``: a prefix shared with other sequences is read,
    never rewritten. Slots with ``num_new == 0`` are left as they were.
    Returns logits for every position (or only each slot's last, with
    ``all_logits=False``) and the hiddens of every position. ``params``: the checkpoint dict,
    or with the tensors a run derives from it (`mtp.model.prepared.prepare_params`).
    """
    prepared = as_prepared(params)
    b, t = tokens.shape
    write_from = start if write_from is None else write_from
    valid = jnp.arange(t)[None, :] < num_new[:, None]
    positions = start[:, None] + jnp.arange(t)[None, :]
    write = valid & (positions >= write_from[:, None])
    zeros = LinearState.zeros(cfg, b, cache.linear.conv[0].dtype if cache.linear.conv else jnp.float32)
    init = cache.linear.select_slots(start > 0, zeros)
    x, kv, linear, _ = _run_cached(cfg, prepared, cache, tokens, start, valid, write,
                                   start + t, False, execution, init)
    active = num_new > 0
    out = _final(cfg, prepared.params, x, (b, t), None if all_logits else jnp.maximum(num_new - 1, 0))
    new_cache = cache.replace(
        kv=kv,
        linear=linear.select_slots(active, cache.linear),
        lengths=jnp.where(active, start + num_new, cache.lengths).astype(jnp.int32),
    )
    return new_cache, StepOutput(**out)


@functools.partial(jax.jit, static_argnames=("cfg", "execution"), donate_argnames=("cache",))
def verify(cfg: ModelConfig, params: Params | PreparedParams, cache: TargetCache, tokens: jax.Array,
           active: jax.Array | None = None, *,
           execution: ExecutionConfig = gemm_layout.DEFAULT) -> tuple[TargetCache, VerifyOutput]:
    """Run ``Q`` new tokens per slot after its ``lengths[b]`` cached positions.

    Writes their K/V but does not advance ``lengths`` or the Gated DeltaNet
    state: the caller decides how many positions to keep (`commit`), choosing
    among the per-position states returned here. ``active [B]`` (default: all):
    an inactive slot's tokens run as padding, which writes no K/V and returns the slot's
    Gated DeltaNet state unchanged at every position (`commit`'s ``masked_verify``). ``params`` as
    in `prefill`.
    """
    prepared = as_prepared(params)
    b, q = tokens.shape
    valid = jnp.ones((b, q), bool) if active is None else jnp.broadcast_to(active[:, None], (b, q))
    x, kv, _, steps = _run_cached(cfg, prepared, cache, tokens, cache.lengths, valid, valid,
                                  cache.lengths + q, True, execution, cache.linear)
    out = _final(cfg, prepared.params, x, (b, q), None)
    return cache.replace(kv=kv), VerifyOutput(**out, conv_steps=steps[0], rec_steps=steps[1])


def commit(cache: TargetCache, out: VerifyOutput, num_keep: jax.Array, masked_verify: bool = False) -> TargetCache:
    """Keep the first ``num_keep[b]`` verified positions of each slot (0 keeps none).

    ``masked_verify``: the slots that keep none were verified inactive (`verify`'s ``active``),
    so every position returned their old states and no select against those is needed. The
    select reads the old state, which in a decode loop made XLA copy every Gated DeltaNet
    layer's conv and recurrent state each step (`experiments/count_kernels.py --count`).
    """
    idx = jnp.maximum(num_keep - 1, 0)

    def at(steps):
        if steps.shape[1] == 1:
            # One position (decode): the only choice. Said statically, because XLA keeps a
            # batched gather at constant indices, which copied every layer's recurrent state
            # twice per batch-8 decode step (`experiments/count_kernels.py --batches 8 --loop`).
            return steps[:, 0]
        return jax.vmap(lambda s, i: s[i])(steps, idx)

    chosen = LinearState(conv=tuple(at(s) for s in out.conv_steps),
                         recurrent=tuple(at(s) for s in out.rec_steps))
    return cache.replace(
        linear=chosen if masked_verify else chosen.select_slots(num_keep > 0, cache.linear),
        lengths=(cache.lengths + num_keep).astype(jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("cfg", "execution"), donate_argnames=("cache",))
def decode(cfg: ModelConfig, params: Params | PreparedParams, cache: TargetCache, tokens: jax.Array, *,
           execution: ExecutionConfig = gemm_layout.DEFAULT) -> tuple[TargetCache, VerifyOutput]:
    """One or more new tokens per slot, all kept: verify followed by a full commit."""
    cache, out = verify(cfg, params, cache, tokens, execution=execution)
    return commit(cache, out, jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)), out
