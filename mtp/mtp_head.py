"""The MTP head: one decoder layer that drafts the token after next.

Input of pair key ``k`` is ``concat(norm_e(embed(t[k+1])), norm_h(hidden[k]))``
(embedding first) -> ``fc`` (2H -> H) -> one gated-attention decoder layer ->
``mtp.norm`` -> the target's shared LM head; it predicts ``t[k+2]``.

The drafter keeps its own paged KV with **compacted rows**: row ``r`` is a dense
slot, while the key it holds is rotated at its sequence position ``k + 1``. Rows
are appended (drafter prefill, carry append, refeed catch-up, each proposed draft)
and trimmed from the tail after verify; gaps in keys are normal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from mtp import quant
from mtp.cache.state import PagedKV
from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model.gemm_layout import DEFAULT, dense
from mtp.model.layers import attention_kv, attention_out, attention_qkv, causal_attention
from mtp.model.params import Params
from mtp.model.prepared import PreparedParams, as_prepared
from mtp.model.target import decoder_layer, definition_of, embed, lm_head, paged_attention_mixer
from mtp.ops.fc_gemm import fc_gemm
from mtp.ops.norms import rms_norm
from mtp.ops.paged_kv import write_pages

PREFILL_CHUNK = 512  # drafter-prefill rows per call, as in the reference system
APPEND_BUCKETS = (64, 128, 256, PREFILL_CHUNK)  # widths of a last, partial chunk (one compile each)


@struct.dataclass
class DrafterCache:
    """The drafter's single-layer paged KV and its row bookkeeping, per batch slot."""

    kv: PagedKV  # one layer
    block_tables: jax.Array  # [B, max_blocks] int32
    rows: jax.Array  # [B] int32 resident rows
    last_pair_key: jax.Array  # [B] int32 key of the newest row, -1 when empty

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, num_pages: int, page_size: int,
               max_blocks_per_seq: int, dtype) -> "DrafterCache":
        return cls(
            kv=PagedKV.create(1, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim, dtype),
            block_tables=jnp.zeros((batch, max_blocks_per_seq), jnp.int32),
            rows=jnp.zeros((batch,), jnp.int32),
            last_pair_key=jnp.full((batch,), -1, jnp.int32),
        )

    def trim(self, count: jax.Array, last_pair_key: jax.Array) -> "DrafterCache":
        """Drop the ``count`` newest rows; the caller knows which key is newest after that.

        (Keys may have gaps, so it cannot be derived from the count.)
        """
        return self.replace(rows=self.rows - count, last_pair_key=last_pair_key)


def quantize_head(params: Params, mtp_quant: str) -> Params:
    """The params with the MTP head's projections at ``mtp_quant`` (the target untouched; at
    bf16, ``params`` itself): the load-time hook for the head's weights, before the tensors a
    run derives from them (`mtp.model.prepared.prepare_params`).
    """
    if quant.parse_quant(mtp_quant) == "bf16":
        return params
    head = quant.quantize_params({"mtp": params["mtp"]}, mtp_quant,
                                 lambda name: quant.is_projection_weight(name) and not name.endswith("mlp.gate.weight"))
    return {**params, "mtp": head["mtp"]}


def fc_input(cfg: ModelConfig, params: Params | PreparedParams, next_tokens: jax.Array, hidden: jax.Array,
             execution: ExecutionConfig) -> jax.Array:
    """``fc(concat(norm_e(embed(t)), norm_h(hidden)))`` for any leading shape; the fc kernel reads
    its inputs made at load where ``params`` has them (`mtp.model.prepared.FcPrepared`)."""
    prepared = as_prepared(params)
    m = prepared.params["mtp"]
    e = embed(prepared.params, next_tokens).astype(hidden.dtype)
    w = m["fc"]["weight"]
    ne, nh = m["pre_fc_norm_embedding"]["weight"], m["pre_fc_norm_hidden"]["weight"]
    if not isinstance(w, jax.Array):  # quantized fc: no fused kernel for it
        x = jnp.concatenate([rms_norm(e, ne, cfg.rms_norm_eps), rms_norm(hidden, nh, cfg.rms_norm_eps)], -1)
        return dense(x, w, execution=execution)
    lead = hidden.shape[:-1]
    flat = lambda a: a.reshape(-1, a.shape[-1])
    fc = prepared.fc
    ms = None if fc is None else fc.embed_mean_square
    out = fc_gemm(flat(e), flat(hidden), ne, nh, w.astype(hidden.dtype), eps=cfg.rms_norm_eps,
                  impl=execution.impl_for("fc_gemm"),
                  w_folded=None if fc is None else fc.weight_folded.astype(hidden.dtype),
                  embed_mean_square=None if ms is None else jnp.take(ms, next_tokens.reshape(-1)))
    return out.reshape(*lead, -1)


def draft_vocabulary(token_counts, size: int) -> jax.Array | None:
    """The ``size`` most frequent token ids (ascending), the drafter's reduced vocabulary.

    ``size == 0`` means the full vocabulary. Drafting over fewer ids cuts the MTP LM
    head's cost; the target still verifies over the full vocabulary, so a draft the
    reduced head cannot name only costs acceptance. Ties break toward lower ids.
    """
    import numpy as np

    counts = np.asarray(token_counts)
    if size == 0:
        return None
    if not 0 < size <= counts.size:
        raise ValueError(f"mtp_vocab_size={size} must be in 1..{counts.size} (0 = full vocabulary)")
    order = np.lexsort((np.arange(counts.size), -counts))[:size]
    return jnp.asarray(np.sort(order).astype(np.int32))


def _head_out(cfg, params, x, draft_vocab):
    """Final norm, logits over the (optionally reduced) draft vocabulary, chained hidden."""
    post = rms_norm(x, params["mtp"]["norm"]["weight"], cfg.rms_norm_eps)
    if draft_vocab is None:
        logits = lm_head(cfg, params, post)
    else:
        w = params["model"]["embed_tokens"]["weight"] if cfg.tie_word_embeddings else params["lm_head"]["weight"]
        logits = jnp.einsum("...h,vh->...v", post, jnp.take(w, draft_vocab, axis=0).astype(post.dtype),
                            preferred_element_type=jnp.float32)
    chained = post if cfg.mtp_hidden_source == "post_norm" else x
    return logits, chained


def forward_sequence(cfg: ModelConfig, params: Params, tokens: jax.Array, hidden: jax.Array,
                     execution: ExecutionConfig = DEFAULT):
    """All pair keys of whole sequences at once (training, and the test reference).

    tokens ``[B, T]``, hidden ``[B, T, H]`` (the target's, per `mtp_hidden_source`).
    Returns logits ``[B, T-1, V]`` where entry ``k`` predicts ``tokens[:, k+2]``.
    The no-cache path: ``execution`` sets its GEMMs (`mtp.model.target.definition_of`).
    """
    execution = definition_of(execution)
    b, t = tokens.shape
    x = fc_input(cfg, params, tokens[:, 1:], hidden[:, :-1], execution)
    positions = jnp.broadcast_to(jnp.arange(1, t), (b, t - 1))
    p = params["mtp"]["layers"]["0"]

    def mixer(h):
        q, k, v, gate = attention_qkv(p["self_attn"], h, positions, cfg, execution)
        return attention_out(p["self_attn"], causal_attention(q, k, v, gate), execution), None

    x, _ = decoder_layer(cfg, p, x, mixer, execution)
    return _head_out(cfg, params, x, None)[0]


@functools.partial(jax.jit, static_argnames=("cfg", "execution"), donate_argnames=("dcache",))
def append_rows(cfg: ModelConfig, params: Params | PreparedParams, dcache: DrafterCache, next_tokens: jax.Array,
                hiddens: jax.Array, first_key: jax.Array, count: jax.Array, *,
                execution: ExecutionConfig = DEFAULT) -> DrafterCache:
    """Write rows for pair keys ``first_key[b] + i`` (``i < count[b]``) after the resident rows.

    ``next_tokens[b, i]`` is ``t[key + 1]`` and ``hiddens[b, i]`` is ``hidden[key]``.
    A single-layer drafter's K/V depend only on its input pair, so this is fc,
    norms, k/v projections, k_norm, RoPE at ``key + 1`` and the cache write — no
    attention. Drafter prefill, the carry's tail append and the refeed catch-up
    are all this call. ``params``: the checkpoint dict, or with the tensors a run derives from it
    (`mtp.model.prepared.prepare_params`).
    """
    prepared = as_prepared(params)
    t = next_tokens.shape[1]
    i = jnp.arange(t)[None, :]
    valid = i < count[:, None]
    keys = first_key[:, None] + i
    x = fc_input(cfg, prepared, next_tokens, hiddens, execution)
    p = prepared.params["mtp"]["layers"]["0"]
    k, v = attention_kv(p["self_attn"], rms_norm(x, p["input_layernorm"]["weight"], cfg.rms_norm_eps),
                        keys + 1, cfg, execution)
    slots = dcache.rows[:, None] + i
    kv = dcache.kv.replace(
        k=(write_pages(dcache.kv.k[0], k, dcache.block_tables, slots, valid),),
        v=(write_pages(dcache.kv.v[0], v, dcache.block_tables, slots, valid),),
    )
    some = count > 0
    return dcache.replace(
        kv=kv,
        rows=dcache.rows + count,
        last_pair_key=jnp.where(some, first_key + count - 1, dcache.last_pair_key),
    )


def draft_step(cfg: ModelConfig, params: Params | PreparedParams, dcache: DrafterCache, token: jax.Array,
               hidden: jax.Array, pair_key: jax.Array, active: jax.Array, execution: ExecutionConfig,
               draft_vocab: jax.Array | None = None):
    """One draft for every slot: pair ``(token, hidden)`` at key ``pair_key`` -> next token.

    Appends the pair's row (where ``active``) and attends over all resident rows. ``params`` as
    in `append_rows`. Returns ``(dcache, logits [B, V'], chained_hidden [B, H])``.
    """
    prepared = as_prepared(params)
    p, merged = prepared.params["mtp"]["layers"]["0"], prepared.mtp_merged
    x = fc_input(cfg, prepared, token[:, None], hidden[:, None, :], execution)
    rows = dcache.rows[:, None]
    mixer = paged_attention_mixer(cfg, p, pair_key[:, None] + 1, rows, dcache.kv.k[0], dcache.kv.v[0],
                                  dcache.block_tables, active[:, None], jnp.where(active, dcache.rows + 1, 0),
                                  execution, merged)
    x, (kp, vp) = decoder_layer(cfg, p, x, mixer, execution, merged)
    logits, chained = _head_out(cfg, prepared.params, x[:, 0], draft_vocab)
    step = active.astype(jnp.int32)
    dcache = dcache.replace(kv=dcache.kv.replace(k=(kp,), v=(vp,)), rows=dcache.rows + step,
                            last_pair_key=jnp.where(active, pair_key, dcache.last_pair_key))
    return dcache, logits, chained


def append_chunks(count: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """``(offset, width)`` of the `append_rows` calls that write ``count`` rows.

    Full chunks, then the last one in the smallest of `APPEND_BUCKETS` that holds
    it: a carry appends a turn's tail (tens of rows), which a full chunk would
    mostly spend on padding, and a handful of widths keeps the compiles few.
    """
    widths = sorted({c for c in APPEND_BUCKETS if c < chunk} | {chunk})
    plan, off = [], 0
    while off < count:
        width = next(c for c in widths if c >= min(count - off, chunk))
        plan.append((off, width))
        off += width
    return plan


__all__ = ["APPEND_BUCKETS", "DrafterCache", "PREFILL_CHUNK", "append_chunks", "append_rows", "draft_step",
           "draft_vocabulary", "fc_input",
           "forward_sequence", "quantize_head"]
