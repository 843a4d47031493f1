"""The attention layer's norms, RoPE and page writes as one kernel (`mtp.ops.attn_prologue`):
the kernel (interpret mode) against the model's own functions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.model.gemm_layout import Columns
from mtp.ops.attn_prologue import AttentionShape, attn_prologue, attn_prologue_reference
from mtp.ops.attn_prologue import triton as ap
from mtp.ops.paged_kv import NULL_PAGE
from tests.conftest import decode_through_kernel, tiny_config


def _case(cfg, seed, b, t, dtype, merged, extra_rows=0, page=4, blocks=3):
    """The q/k/v GEMM output (merged or three arrays, padding rows), ragged slots that cross pages
    with one past the block table, a token that does not write, and random old pages.

    The first token always writes (a decode at batch 1 has no other); the last is past the table
    from two tokens on and the second masked from three, so neither takes the first's place."""
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    widths = (hq * 2 * d, hkv * d, hkv * d)
    ks = jax.random.split(jax.random.key(seed), 8)
    rows = b * t + extra_rows
    if merged:
        gemm = jax.random.normal(ks[0], (rows, sum(widths) + d)).astype(dtype)  # + a merged neighbour's columns
        starts = np.cumsum((0,) + widths[:-1])
        columns = [Columns(gemm, int(s), w) for s, w in zip(starts, widths)]
    else:
        columns = [Columns(jax.random.normal(k, (rows, w)).astype(dtype), 0, w) for k, w in zip(ks[:3], widths)]
    num_pages = b * blocks + 1
    tables = (1 + jnp.arange(b * blocks, dtype=jnp.int32)).reshape(b, blocks)[:, ::-1]  # pages out of order
    first = jax.random.randint(ks[3], (b, 1), 0, page * blocks - t)
    slots = first + jnp.arange(t)[None, :]
    slots, write = slots.reshape(-1), jnp.ones(b * t, bool)
    if b * t > 1:
        slots = slots.at[-1].set(page * blocks + 1)  # past the block table: writes nothing
    if b * t > 2:
        write = write.at[1].set(False)
    if b > 1:  # the last sequence's first block is the null page: its tokens there write nothing
        tables = tables.at[b - 1, first[b - 1, 0] // page].set(NULL_PAGE)
    slots, write = slots.reshape(b, t), write.reshape(b, t)
    positions = slots + 3  # RoPE's sequence positions need not be the cache slots (the drafter's are not)
    shape = (num_pages, page, hkv, d)
    k_pages = jax.random.normal(ks[4], shape).astype(dtype)
    v_pages = jax.random.normal(ks[5], shape).astype(dtype)
    q_norm = (0.3 * jax.random.normal(ks[6], (d,))).astype(dtype)
    k_norm = (0.3 * jax.random.normal(ks[7], (d,))).astype(dtype)
    return columns, q_norm, k_norm, positions, slots, k_pages, v_pages, tables, write


@pytest.mark.parametrize("name,b,t,dtype,merged,extra_rows", [
    ("tiny_dense", 1, 1, jnp.bfloat16, True, 1),    # the padded batch-1 decode stream, merged projections
    ("tiny_dense", 3, 4, jnp.bfloat16, False, 0),   # a verify of 4, three separate GEMMs
    ("tiny_moe", 2, 3, jnp.float32, True, 2),
])
def test_kernel_matches_reference(name, b, t, dtype, merged, extra_rows):
    cfg = tiny_config(name)
    args = _case(cfg, b * 10 + t, b, t, dtype, merged, extra_rows)
    heads = AttentionShape.of(cfg)
    assert ap.kernel_unsupported(args[0], args[5], args[3], heads) is None
    got = attn_prologue(*args, heads=heads, impl="interpret")
    want = attn_prologue_reference(*args, heads=heads)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == jnp.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), **tol)  # q
    np.testing.assert_array_equal(got[1], want[1])  # the gate, a view of the GEMM output
    for g, w in zip(got[2:], want[2:]):  # every page, the null page (written by neither) included
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)
    slots, page_size, tables = np.asarray(args[4]), args[5].shape[1], np.asarray(args[7])
    # every token writes but the one masked and the one past the table
    writes = np.asarray(args[8]) & (slots < page_size * tables.shape[1])
    assert writes.sum() == b * t - min(b * t - 1, 2) > 0
    lands = writes & (np.take_along_axis(tables, np.minimum(slots // page_size, tables.shape[1] - 1), 1) != NULL_PAGE)
    assert (lands.sum() < writes.sum()) == (b > 1)  # the null block took a write that lands nowhere
    changed = np.any(np.asarray(got[2], np.float32) != np.asarray(args[5], np.float32), axis=(2, 3))
    assert changed.sum() == lands.sum()


def test_unsupported_inputs_are_named():
    cfg = tiny_config("tiny_dense")
    columns, _, _, positions, _, k_pages, *_ = _case(cfg, 0, 2, 2, jnp.float32, True)
    heads = AttentionShape.of(cfg)
    odd = dataclasses.replace(heads, head_dim=12)
    assert "powers of two" in ap.kernel_unsupported(columns, k_pages, positions, odd)
    shifted = [Columns(c.rows, c.start + 1, c.width) for c in columns]
    assert "aligned" in ap.kernel_unsupported(shifted, k_pages, positions, heads)
    assert "up to 8" in ap.kernel_unsupported(columns, k_pages, jnp.zeros((2, 9), jnp.int32), heads)
    huge = jax.ShapeDtypeStruct((2**22, 64, 2, 8), k_pages.dtype)  # 2**31 elements, never allocated
    assert "int32" in ap.kernel_unsupported(columns, huge, positions, heads)


def test_auto_takes_the_kernel_on_a_gpu(monkeypatch):
    """Timed on the H200 (2026-11-30), so ``auto`` takes it on a GPU; a config (``MTP_KERNELS``) can name the
    reference."""
    from mtp.execution import ExecutionConfig
    from mtp.ops import lowering

    calls = []
    monkeypatch.setattr(ap, "attn_prologue_triton", lambda *a, **k: calls.append(1) or ("q", None, None))
    monkeypatch.setattr(lowering, "on_gpu", lambda: True)
    cfg = tiny_config("tiny_dense")
    args = _case(cfg, 0, 2, 1, jnp.float32, True)
    heads = AttentionShape.of(cfg)
    assert attn_prologue(*args, heads=heads)[0] == "q" and len(calls) == 1
    named = ExecutionConfig.from_environ({"MTP_KERNELS": "attn_prologue=reference"}).impl_for("attn_prologue")
    assert isinstance(attn_prologue(*args, heads=heads, impl=named)[0], jax.Array) and len(calls) == 1


@pytest.mark.parametrize("gemm_layout", ["plain", "padded_merged"], indirect=True)
def test_model_decode_and_verify_with_the_kernel_equal_the_reference(gemm_layout, monkeypatch):
    """Decode and a verify of 3 through the kernel alone (the other ops on their references) equal the same without it."""
    runs = decode_through_kernel(monkeypatch, ap, "attn_prologue_triton", "attn_prologue", decode_steps=2, verify=3,
                                 layout=gemm_layout)
    (want, ref_cache), (got, cache) = runs["reference"], runs["interpret"]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    for g, w in zip(cache.kv.k + cache.kv.v, ref_cache.kv.k + ref_cache.kv.v):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)
