"""The target model: cached paths against the no-cache reference, state per position."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.cache.pages import PageAllocator, PagePoolExhausted
from mtp.config import ConfigError, ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model import target
from mtp.model import gated_deltanet as gdn
from mtp.model import gemm_layout
from mtp.ops.add_rms_norm import add_rows
from mtp.ops.conv_step.reference import grouped_conv_weight
from mtp.ops.gdn_step.reference import recurrent_delta_rule
from mtp.ops.norms import l2norm
from tests.conftest import GEMM_LAYOUTS, ROOT, paged_cache, random_params, tiny_config

def test_chunked_delta_rule_matches_recurrent():
    key = jax.random.key(3)
    ks = jax.random.split(key, 6)
    b, t, h, dk, dv = 2, 150, 3, 8, 5  # t spans several 64-token chunks, last one partial
    q = l2norm(jax.random.normal(ks[0], (b, t, h, dk)))
    k = l2norm(jax.random.normal(ks[1], (b, t, h, dk)))
    v = jax.random.normal(ks[2], (b, t, h, dv))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (b, t, h)))
    g = -jax.nn.softplus(jax.random.normal(ks[4], (b, t, h)))
    s0 = jax.random.normal(ks[5], (b, h, dk, dv))
    out_c, s_c = gdn.chunked_delta_rule(q, k, v, beta, g, s0)
    out_r, s_r, steps = recurrent_delta_rule(q, k, v, beta, g, s0)
    np.testing.assert_allclose(out_c, out_r, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s_c, s_r, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(steps[:, -1], s_r, rtol=1e-6)


@pytest.mark.parametrize("value_dim_factor", [1, 2])  # Dv = Dk (Qwen3-Next) and Dv != Dk
def test_grouped_conv_equals_the_checkpoint_order_conv(value_dim_factor):
    """The conv runs on key-head groups; Hugging Face runs it on ``[q | k | v]`` with the
    same weight. Regrouped, the two agree channel for channel, and so do q, k and v."""
    cfg = tiny_config("tiny_dense")
    cfg = cfg.replace(linear_value_head_dim=cfg.linear_key_head_dim * value_dim_factor)
    params = random_params(cfg)
    p = params["model"]["layers"][str(cfg.linear_layers[0])]["linear_attn"]
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r, kd, c = nv // nk, cfg.linear_key_dim, cfg.linear_conv_dim
    bsz, t, kern = 2, 5, cfg.linear_conv_kernel_dim
    x = jax.random.normal(jax.random.key(0), (bsz, t, cfg.hidden_size))
    state_hf = jax.random.normal(jax.random.key(1), (bsz, kern - 1, c))
    # Hugging Face's order, written out: q of all heads, then k, then v.
    qkvz = gemm_layout.dense(x, p["in_proj_qkvz"]["weight"]).reshape(bsz, t, nk, -1)
    mixed_hf = jnp.concatenate([qkvz[..., :dk].reshape(bsz, t, -1), qkvz[..., dk:2 * dk].reshape(bsz, t, -1),
                                qkvz[..., 2 * dk:2 * dk + r * dv].reshape(bsz, t, -1)], -1)
    full = jnp.concatenate([state_hf, mixed_hf], 1)
    w = p["conv1d"]["weight"][:, 0, :]
    out_hf = jax.nn.silu(sum(full[:, i:i + t] * w[:, i] for i in range(kern)))
    # The model's order; the regrouping of any channel axis is the weight's.
    regroup = lambda a: grouped_conv_weight(a.reshape(-1, c).T[:, None, :], cfg).T.reshape(a.shape)
    mixed, *_ = gdn.project(p, x, cfg, x.shape[:-1])
    np.testing.assert_array_equal(mixed, regroup(mixed_hf))
    out = gdn.conv_windows(p, cfg, regroup(state_hf), mixed)
    np.testing.assert_allclose(out, regroup(out_hf), rtol=1e-6, atol=1e-6)
    q, k, v, _, _ = gdn.split_heads(out, jnp.zeros((bsz, t, nv)), jnp.zeros((bsz, t, nv)), p, cfg)
    np.testing.assert_allclose(v, out_hf[..., 2 * kd:].reshape(bsz, t, nv, dv), rtol=1e-6, atol=1e-6)
    q_hf = out_hf[..., :kd].reshape(bsz, t, nk, dk)
    np.testing.assert_allclose(q, l2norm(jnp.repeat(q_hf, r, axis=-2)), rtol=1e-5, atol=1e-6)
    k_hf = out_hf[..., kd:2 * kd].reshape(bsz, t, nk, dk)
    np.testing.assert_allclose(k, l2norm(jnp.repeat(k_hf, r, axis=-2)), rtol=1e-5, atol=1e-6)


def test_dense_pads_one_row_products_of_large_weights():
    x = jax.random.normal(jax.random.key(0), (1, 1, 32))
    w = jax.random.normal(jax.random.key(1), (48, 32))
    padding = ExecutionConfig(pad_small_gemms=True, pad_min_weight=32 * 48 - 1)
    has_pad = lambda x, e=padding: "pad" in str(jax.make_jaxpr(lambda a: gemm_layout.dense(a, w, execution=e))(x))
    assert has_pad(x) and not has_pad(jnp.ones((2, 32)))
    out = gemm_layout.dense(x, w, execution=padding)
    assert out.shape == (1, 1, 48)
    np.testing.assert_allclose(out, jnp.einsum("...i,oi->...o", x, w), rtol=1e-5, atol=1e-5)
    assert not has_pad(x, dataclasses.replace(padding, pad_min_weight=32 * 48))  # a weight at the bound keeps its shape
    assert not has_pad(x, ExecutionConfig(pad_small_gemms=False, pad_min_weight=0))
    with pytest.raises(ValueError, match="MTP_PAD_SMALL_GEMMS='yes'"):
        ExecutionConfig.from_environ({"MTP_PAD_SMALL_GEMMS": "yes"})


def test_linear_writes_few_row_products_of_small_weights_as_reductions():
    w = jax.random.normal(jax.random.key(1), (48, 32)).astype(jnp.bfloat16)
    reducing = ExecutionConfig(small_gemms_as_reduce=True, reduce_max_weight=48 * 32)
    is_dot = lambda x, w=w, e=reducing: "dot_general" in str(
        jax.make_jaxpr(lambda a: gemm_layout.linear(a, w, execution=e))(x))
    for rows in (2, 3, gemm_layout.REDUCE_MAX_ROWS):
        x = jax.random.normal(jax.random.key(rows), (rows, 1, 32)).astype(jnp.bfloat16)
        assert not is_dot(x)
        out = gemm_layout.linear(x, w, execution=reducing)
        assert out.shape == (rows, 1, 48) and out.dtype == jnp.bfloat16
        want = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=1e-2, atol=2e-2)
    assert is_dot(jnp.ones((1, 32), jnp.bfloat16))  # one row: XLA's own GEMV already reduces
    assert is_dot(jnp.ones((gemm_layout.REDUCE_MAX_ROWS + 1, 32), jnp.bfloat16))
    assert is_dot(jnp.ones((2, 64), jnp.bfloat16), jnp.ones((48, 64), jnp.bfloat16))  # weight too large
    assert is_dot(jnp.ones((2, 32), jnp.bfloat16), e=dataclasses.replace(reducing, small_gemms_as_reduce=False))
    with pytest.raises(ValueError, match="MTP_SMALL_GEMMS_AS_REDUCE='on'"):
        ExecutionConfig.from_environ({"MTP_SMALL_GEMMS_AS_REDUCE": "on"})


def test_padded_stream_rows():
    """A one-row step carries its stream padded: large GEMMs take all rows with no pad of
    their own, small ones only the real rows, and the mixers' outputs add back per row."""
    padding = ExecutionConfig(pad_small_gemms=True, pad_min_weight=32 * 48 - 1)
    x = jax.random.normal(jax.random.key(0), (1, 1, 32))
    rows = gemm_layout.stream_rows(x, pad=True, execution=padding)
    assert rows.shape == (gemm_layout.PAD_ROWS, 32) and not rows[1:].any()
    assert gemm_layout.stream_rows(x, pad=False).shape == (1, 32)
    assert gemm_layout.stream_rows(jnp.ones((3, 1, 32)), pad=True).shape == (3, 32)  # enough rows
    big, small = (jax.random.normal(jax.random.key(i), (n, 32)) for i, n in ((1, 48), (2, 16)))
    for w in (big, small):
        np.testing.assert_allclose(gemm_layout.dense(rows, w, (1, 1), padding), gemm_layout.dense(x, w, execution=padding),
                                   rtol=1e-6)
    jaxpr = lambda w: str(jax.make_jaxpr(lambda r: gemm_layout.dense_rows(r, w, (1, 1), padding))(rows))
    assert "pad" not in jaxpr(big) and "slice" not in jaxpr(big)  # both rows, as they are
    assert "slice" in jaxpr(small)  # a small weight multiplies the real row only
    y = jax.random.normal(jax.random.key(3), (1, 1, 32))
    np.testing.assert_allclose(add_rows(rows, y)[:1], (x + y).reshape(1, 32))
    assert not add_rows(rows, y)[1:].any()


def test_dense_columns_merges_projections_of_one_input():
    """One GEMM over the concatenated weights where merging is on, each product's columns
    equal to its own ``dense``; not for a prefill's many rows, nor for quantized weights."""
    ws = [jax.random.normal(jax.random.key(i), (n, 32)) for i, n in ((1, 48), (2, 8), (3, 16))]
    merging = ExecutionConfig(merge_projections=True)
    dots = lambda x, e=merging: str(jax.make_jaxpr(
        lambda a: [c.rows for c in gemm_layout.dense_columns(a, ws, execution=e)])(x)).count("dot_general")
    x = jax.random.normal(jax.random.key(0), (2, 3, 32))
    cols = gemm_layout.dense_columns(x, ws, execution=merging)
    assert dots(x) == 1 and [c.start for c in cols] == [0, 48, 56] and cols[0].rows is cols[2].rows
    for c, w in zip(cols, ws):
        np.testing.assert_allclose(c.view((2, 3)), gemm_layout.dense(x, w), rtol=1e-5, atol=1e-5)
    assert dots(jnp.ones((gemm_layout.MERGE_MAX_ROWS + 1, 32))) == 3
    assert dots(x, ExecutionConfig(merge_projections=False)) == 3
    with pytest.raises(ValueError, match="MTP_MERGE_PROJECTIONS='on'"):
        ExecutionConfig.from_environ({"MTP_MERGE_PROJECTIONS": "on"})


def test_merged_weights_are_made_once_and_used():
    """`merged_layer` concatenates each small group's weights (not a large group's, nor quantized
    ones, nor with merging off), and `module_columns` multiplies by them: with the parts zeroed,
    the columns still equal the true products, and the trace has no concatenation."""
    names = gemm_layout.MERGED_GROUPS["linear_attn"]
    ws = [jax.random.normal(jax.random.key(i), (n, 32)) for i, n in ((1, 48), (2, 8))]
    big = jnp.zeros((gemm_layout.PREMERGE_MAX_WEIGHT // 32 + 1, 32))
    from mtp import quant

    qkv = gemm_layout.MERGED_GROUPS["self_attn"]
    small = {"linear_attn": {n: {"weight": w} for n, w in zip(names, ws)}}
    large = {"linear_attn": {names[0]: {"weight": big}, names[1]: {"weight": ws[1]}}}
    quantized = {"self_attn": {n: {"weight": quant.quantize(ws[1], "fp8")} for n in qkv}}
    x = jax.random.normal(jax.random.key(0), (2, 32))
    merging = ExecutionConfig(merge_projections=True)
    assert gemm_layout.merged_layer(small, ExecutionConfig(merge_projections=False)) == gemm_layout.MergedLayer()
    assert gemm_layout.merged_layer(large, merging) == gemm_layout.MergedLayer()  # its concatenation stays fused
    assert gemm_layout.merged_layer(quantized, merging) == gemm_layout.MergedLayer()  # `dense_columns` merges none
    merged = gemm_layout.merged_layer(small, merging)
    assert merged.self_attn is None and merged.mlp is None
    np.testing.assert_array_equal(merged.linear_attn, jnp.concatenate(ws))
    module = small["linear_attn"]
    zeroed = {n: {"weight": jnp.zeros_like(w)} for n, w in zip(names, ws)}
    for c, w in zip(gemm_layout.module_columns(zeroed, x, names, execution=merging, merged=merged.linear_attn), ws):
        np.testing.assert_allclose(c.view((2,)), gemm_layout.dense(x, w), rtol=1e-5, atol=1e-5)
    assert "concatenate" not in str(jax.make_jaxpr(lambda a: [
        c.rows for c in gemm_layout.module_columns(module, a, names, execution=merging, merged=merged.linear_attn)])(x))
    with pytest.raises(ValueError, match="merged weight has 56 rows"):
        gemm_layout.module_columns(module, x, names[:1], execution=merging, merged=merged.linear_attn)


def test_prepared_params_hold_the_derived_tensors_beside_an_untouched_checkpoint():
    """`prepare_params` leaves the checkpoint dict as the checkpoint names it and puts each layer's
    merged groups, the MTP head's included, in typed fields, equal to the concatenated parts; with
    merging off, or as a bare dict is read, there are none, and for plain decoding (``drafting=False``)
    none of the head's."""
    from mtp.model.params import flatten, param_shapes
    from mtp.model.prepared import as_prepared, prepare_params

    cfg = tiny_config("tiny_moe")
    params = random_params(cfg)
    merging = ExecutionConfig(merge_projections=True)
    prepared = prepare_params(params, merging, fold_fc=False)
    assert prepared.params is params and flatten(prepared.params).keys() == param_shapes(cfg).keys()
    assert len(prepared.merged) == cfg.num_hidden_layers and prepared.fc is None
    layers = [*(params["model"]["layers"][str(i)] for i in range(cfg.num_hidden_layers)), params["mtp"]["layers"]["0"]]
    for layer, merged in zip(layers, (*prepared.merged, prepared.mtp_merged), strict=True):
        for key, names in gemm_layout.MERGED_GROUPS.items():
            parts = [layer[key][n]["weight"] for n in names if key in layer and n in layer[key]]
            got = getattr(merged, key)
            assert (got is None) == (len(parts) < 2), (key, layer.keys())
            if got is not None:
                np.testing.assert_array_equal(got, jnp.concatenate(parts))
    assert {k for m in prepared.merged for k in gemm_layout.MERGED_GROUPS if getattr(m, k) is not None} == \
        set(gemm_layout.MERGED_GROUPS)  # the tiny MoE model has every group
    for bare in (prepare_params(params, ExecutionConfig(merge_projections=False), fold_fc=False), as_prepared(params)):
        assert bare.params is params and not jax.tree.leaves((bare.merged, bare.mtp_merged, bare.fc))
    assert as_prepared(prepared) is prepared
    plain = prepare_params(params, merging, drafting=False, fold_fc=True)
    assert plain.mtp_merged == gemm_layout.MergedLayer() and plain.fc is None
    jax.tree.map(np.testing.assert_array_equal, plain.merged, prepared.merged)


def test_cached_paths_on_prepared_params_compute_what_the_bare_dict_does():
    """A prefill, a verify and an MTP draft step on `prepare_params`' merged weights equal, bit for
    bit, those on the bare dict (whose steps concatenate each group themselves), and the verify's
    trace has one concatenation fewer for each group merged at load."""
    from mtp.model.prepared import prepare_params
    from mtp.mtp_head import DrafterCache, draft_step
    from tests.conftest import gemm_layout_config

    cfg = tiny_config("tiny_moe")
    params = random_params(cfg)
    merging = gemm_layout_config("merged")
    prepared = prepare_params(params, merging)
    toks = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    hidden = jax.random.normal(jax.random.key(2), (2, cfg.hidden_size))
    step = jax.jit(draft_step, static_argnames=("cfg", "execution"))
    outs, concatenations = [], []
    for p in (prepared, params):
        cache, _ = target.prefill(cfg, p, paged_cache(cfg, 2, 4), toks[:, :6], jnp.zeros(2, jnp.int32),
                                  jnp.full(2, 6, jnp.int32), execution=merging)
        verify = lambda c, t, p=p: target.verify.__wrapped__(cfg, p, c, t, execution=merging)
        concatenations.append(str(jax.make_jaxpr(verify)(cache, toks[:, 6:])).count("concatenate"))
        cache, vout = target.verify(cfg, p, cache, toks[:, 6:], execution=merging)
        _, logits, chained = step(cfg, p, paged_cache(cfg, 2, 4, cls=DrafterCache), toks[:, 0], hidden,
                                  jnp.zeros(2, jnp.int32), jnp.ones(2, bool), execution=merging)
        outs.append([vout.logits, vout.hidden_pre, cache.kv.k, cache.linear.recurrent, logits, chained])
    jax.tree.map(np.testing.assert_array_equal, outs[0], outs[1])
    merged = sum(leaf is not None for m in prepared.merged for leaf in (m.linear_attn, m.self_attn, m.mlp))
    assert merged > 0 and concatenations[1] - concatenations[0] == merged


def test_a_one_row_step_pads_its_stream_once(tiny, monkeypatch):
    """With padding on, decode has one pad (the stream's), not one per large GEMM."""
    cfg, params = tiny
    padding = ExecutionConfig(pad_small_gemms=True, pad_min_weight=0)
    cache = paged_cache(cfg, 1, blocks=4)

    def pads():  # verify's own body, traced afresh (the jitted verify would keep its first trace)
        text = str(jax.make_jaxpr(lambda c, t: target.verify.__wrapped__(cfg, params, c, t, execution=padding))(
            cache, jnp.ones((1, 1), jnp.int32)))
        return text.count("jit[name=_pad ")  # jnp.pad's (jitted) row pads, [1, H] -> [2, H]

    now = pads()
    monkeypatch.setattr(target, "_pads_stream", lambda params, execution: False)  # as before: a pad per GEMM
    before = pads()
    assert before > 3 * cfg.num_hidden_layers
    # The stream's own, and per layer at most two at the mixer's output (its one-row out
    # projection, padded here as every weight is "large", and the residual add).
    assert now <= 2 * cfg.num_hidden_layers + 1


@pytest.mark.parametrize("gemm_layout", GEMM_LAYOUTS, indirect=True)
def test_prefill_then_decode_equals_forward(tiny, gemm_layout):
    cfg, params = tiny
    b, total = 3, 23
    toks = jax.random.randint(jax.random.key(5), (b, total), 0, cfg.vocab_size)
    ref = target.forward(cfg, params, toks, gemm_layout)
    ref_rec = target.forward_with_hiddens(cfg, params, toks, gdn_mode="recurrent", execution=gemm_layout).logits
    np.testing.assert_allclose(ref, ref_rec, atol=2e-5)
    lens = np.array([13, 6, 9], np.int32)  # ragged; pages of 4 so all cross page boundaries
    cache = paged_cache(cfg, b, blocks=8)
    cache, out = target.prefill(cfg, params, cache, toks[:, :16], jnp.zeros(b, jnp.int32), jnp.asarray(lens),
                                execution=gemm_layout)
    for i in range(b):
        np.testing.assert_allclose(out.logits[i, : lens[i]], ref[i, : lens[i]], atol=2e-5)
    np.testing.assert_array_equal(cache.lengths, lens)
    for step in range(7):
        nxt = toks[np.arange(b), lens + step][:, None]
        cache, o = target.decode(cfg, params, cache, nxt, execution=gemm_layout)
        np.testing.assert_allclose(o.logits[:, 0], ref[np.arange(b), lens + step], atol=3e-5)


def test_prefill_continues_from_cached_prefix(tiny):
    """A warm slot (start > 0) reuses KV pages and the Gated DeltaNet state left in the cache."""
    cfg, params = tiny
    toks = jax.random.randint(jax.random.key(6), (2, 20), 0, cfg.vocab_size)
    ref = target.forward(cfg, params, toks)
    cache = paged_cache(cfg, 2, blocks=6)
    cache, _ = target.prefill(cfg, params, cache, toks[:, :8], jnp.zeros(2, jnp.int32), jnp.array([8, 5]))
    tail = np.zeros((2, 12), np.int32)
    tail[0, :12] = toks[0, 8:20]
    tail[1, :10] = toks[1, 5:15]
    cache, out = target.prefill(cfg, params, cache, jnp.asarray(tail), jnp.array([8, 5]), jnp.array([12, 10]))
    np.testing.assert_allclose(out.logits[0], ref[0, 8:20], atol=3e-5)
    np.testing.assert_allclose(out.logits[1, :10], ref[1, 5:15], atol=3e-5)


def test_prefill_leaves_idle_slots_untouched(tiny):
    cfg, params = tiny
    toks = jax.random.randint(jax.random.key(7), (2, 8), 0, cfg.vocab_size)
    cache = paged_cache(cfg, 2, blocks=4)
    cache, _ = target.prefill(cfg, params, cache, toks, jnp.zeros(2, jnp.int32), jnp.array([8, 8]))
    before = jax.tree.map(np.asarray, cache)
    other = jax.random.randint(jax.random.key(8), (2, 8), 0, cfg.vocab_size)
    cache, _ = target.prefill(cfg, params, cache, other, jnp.array([8, 0]), jnp.array([3, 0]))
    np.testing.assert_array_equal(cache.lengths, [11, 8])
    for a, b in zip(before.linear.recurrent, cache.linear.recurrent):
        np.testing.assert_array_equal(a[1], b[1])
        assert not np.allclose(a[0], b[0])


def test_verify_states_equal_single_decodes(tiny):
    cfg, params = tiny
    b, k = 2, 4
    toks = jax.random.randint(jax.random.key(9), (b, 10 + k), 0, cfg.vocab_size)
    cache = paged_cache(cfg, b, blocks=6)
    cache, _ = target.prefill(cfg, params, cache, toks[:, :10], jnp.zeros(b, jnp.int32), jnp.array([10, 7]))
    snapshot = jax.tree.map(jnp.copy, cache)
    lens = np.array([10, 7])
    block = toks[np.arange(b)[:, None], lens[:, None] + np.arange(k)]
    _, vout = target.verify(cfg, params, cache, block)
    single = snapshot
    for i in range(k):
        single, o = target.decode(cfg, params, single, block[:, i : i + 1])
        np.testing.assert_allclose(vout.logits[:, i], o.logits[:, 0], atol=3e-5)
        for layer, (c, r) in enumerate(zip(single.linear.conv, single.linear.recurrent)):
            np.testing.assert_allclose(vout.conv_steps[layer][:, i], c, atol=1e-5)
            np.testing.assert_allclose(vout.rec_steps[layer][:, i], r, atol=1e-5)


def test_commit_selects_the_state_at_the_kept_position(tiny):
    cfg, params = tiny
    toks = jax.random.randint(jax.random.key(10), (2, 12), 0, cfg.vocab_size)
    ref = target.forward(cfg, params, toks)
    cache = paged_cache(cfg, 2, blocks=6)
    cache, _ = target.prefill(cfg, params, cache, toks[:, :6], jnp.zeros(2, jnp.int32), jnp.array([6, 6]))
    cache, vout = target.verify(cfg, params, cache, toks[:, 6:10])
    cache = target.commit(cache, vout, jnp.array([1, 3]))  # keep 1 and 3 of the 4 verified
    np.testing.assert_array_equal(cache.lengths, [7, 9])
    cache, o = target.decode(cfg, params, cache, jnp.stack([toks[0, 7:8], toks[1, 9:10]]))
    np.testing.assert_allclose(o.logits[0, 0], ref[0, 7], atol=3e-5)
    np.testing.assert_allclose(o.logits[1, 0], ref[1, 9], atol=3e-5)


def test_jitted_entry_points_do_not_retrace():
    cfg = tiny_config("tiny_dense")
    params = random_params(cfg, seed=4)
    traces = {"n": 0}

    @jax.jit
    def counted(cache, toks):
        traces["n"] += 1
        return target.decode(cfg, params, cache, toks)

    cache = paged_cache(cfg, 2, blocks=4)
    for i in range(3):
        toks = jax.random.randint(jax.random.key(i), (2, 1), 0, cfg.vocab_size)
        cache, _ = counted(cache, toks)
    assert traces["n"] == 1
    # The module-level jits: a warm-up round compiles each entry point at most once (earlier tests
    # may have compiled these shapes already); further rounds with fresh values of the same shapes,
    # each fed the caches the others return, reuse every compile.
    entry_points = {"prefill": target.prefill, "verify": target.verify, "decode": target.decode}
    before = {name: fn._cache_size() for name, fn in entry_points.items()}
    cache = paged_cache(cfg, 2, blocks=4)  # 64 positions a slot; 4 rounds write at most 4 * 11
    sizes = None
    for r in range(4):
        ks = jax.random.split(jax.random.key(100 + r), 5)
        for c in range(2):  # two prefill chunks, the second continuing from the first's cache
            start = jnp.copy(cache.lengths)  # not the donated cache's own buffer
            num_new = jax.random.randint(ks[c], (2,), 1, 5, jnp.int32)
            toks = jax.random.randint(ks[2 + c], (2, 4), 0, cfg.vocab_size)
            cache, _ = target.prefill(cfg, params, cache, toks, start, num_new)
        cache, vout = target.verify(cfg, params, cache, jax.random.randint(ks[4], (2, 2), 0, cfg.vocab_size))
        cache = target.commit(cache, vout, jnp.array([r % 3, 2 - r % 2], jnp.int32))
        cache, _ = target.decode(cfg, params, cache, jax.random.randint(ks[4], (2, 1), 0, cfg.vocab_size))
        now = {name: fn._cache_size() for name, fn in entry_points.items()}
        if sizes is None:
            sizes = now
            assert all(now[name] - before[name] <= 1 for name in now), f"warm-up: {before} -> {now}"
        assert now == sizes, f"round {r} retraced: {sizes} -> {now}"
    np.testing.assert_array_less(0, cache.lengths)  # the rounds did advance the cache


def test_page_pool_exhaustion_is_a_clear_error():
    pool = PageAllocator(5, 16)
    pages = pool.allocate(4)
    with pytest.raises(PagePoolExhausted, match="exhausted: asked for 1 pages"):
        pool.allocate(1)
    pool.release(pages[:1])
    assert pool.allocate(1) == pages[:1]
    with pytest.raises(ValueError, match="released more often"):
        pool.release([pages[0], pages[0]])


@pytest.mark.parametrize("change, match", [
    ({"model_type": "llama"}, "model_type"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"layer_types": ["mamba"] * 4}, "unknown layer type"),
    ({"num_key_value_heads": 3}, "num_attention_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
])
def test_bad_config_is_a_clear_error(change, match):
    raw = tiny_config("tiny_dense").to_hf()
    raw.update(change)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("change, drop, match", [
    ({"vocab_size": "abc"}, (), "vocab_size='abc': expected int"),
    ({"num_hidden_layers": None}, (), "num_hidden_layers=None: expected int"),
    ({"bos_token_id": [1, 2]}, (), r"bos_token_id=\[1, 2\]: expected int \| None"),
    ({"tie_word_embeddings": "false"}, (), "tie_word_embeddings='false': expected bool"),
    ({"mlp_only_layers": ["x"]}, (), r"mlp_only_layers=\['x'\]: expected a list of int"),
    ({"layer_types": "full_attention"}, (), "layer_types='full_attention': expected a list of str"),
    # With head_dim given nothing divides by the head count, but it must still be positive.
    ({"num_attention_heads": 0}, (), "num_attention_heads=0: must be positive"),
    ({"num_attention_heads": 0}, ("head_dim",), "num_attention_heads=0: must be positive"),
    ({"full_attention_interval": 0}, (), "full_attention_interval=0: must be positive"),
    ({"num_hidden_layers": -1}, (), "num_hidden_layers=-1: must be positive"),
    ({"linear_num_key_heads": 0}, (), "linear_num_key_heads=0: must be positive"),
])
def test_malformed_config_json_names_file_field_and_value(tmp_path, change, drop, match):
    raw = json.loads((ROOT / "configs" / "models" / "tiny_dense.json").read_text()) | change
    for key in drop:
        del raw[key]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "config.json")) + ": config field " + match):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="<dict>: config field " + match):
        ModelConfig.from_hf(raw)


def test_null_layer_types_and_head_dim_are_derived():
    raw = json.loads((ROOT / "configs" / "models" / "tiny_dense.json").read_text())
    assert ModelConfig.from_hf(raw | {"layer_types": None, "head_dim": None}) == ModelConfig.from_hf(raw)


def test_config_round_trip():
    for name in ("tiny_dense", "tiny_moe"):
        cfg = tiny_config(name)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        assert hash(cfg) == hash(ModelConfig.from_hf(cfg.to_hf()))


def test_transformers5_rope_parameters_are_read():
    raw = tiny_config("tiny_moe").to_hf()
    theta, factor = raw.pop("rope_theta"), raw.pop("partial_rotary_factor")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
    assert ModelConfig.from_hf(raw) == tiny_config("tiny_moe")
    raw["rope_parameters"]["rope_type"] = "yarn"
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        ModelConfig.from_hf(raw)
