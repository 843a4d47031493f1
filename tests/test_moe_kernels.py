"""The routed-expert grouped-GEMM kernels (Mosaic GPU, in Pallas' GPU interpreter) against the
op's reference (`mtp.ops.moe.reference`) on fresh random inputs, and the api's dispatch to them."""

import numpy as np
import pytest

import jax.numpy as jnp

from mtp.ops import fp8
from mtp.ops.moe import api, mosaic, reference, triton, triton_grouped
from mtp.ops.moe.mosaic import GroupedGemmConfig, plan_rows, plan_slots, routed_experts_mosaic, unsupported
from mtp.ops.moe.triton_grouped import GroupedFp8Config


def _inputs(seed, n, k, e, h, i, dtype=jnp.bfloat16, skew=None):
    """Random x, weights and routing; ``skew``: this share of the pairs goes to expert 0."""
    rng = np.random.default_rng(seed)
    cast = lambda a: jnp.asarray(a, dtype)
    x = cast(rng.standard_normal((n, h)))
    gate = cast(rng.standard_normal((e, i, h)) / np.sqrt(h))
    up = cast(rng.standard_normal((e, i, h)) / np.sqrt(h) + 0.1)
    down = cast(rng.standard_normal((e, h, i)) / np.sqrt(i))
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    if skew:
        hot = rng.random(n) < skew
        ids[hot, 0] = 0
        ids[hot, 1:] = np.stack([rng.choice(np.arange(1, e), k - 1, replace=False)
                                 for _ in range(int(hot.sum()))]) if k > 1 and hot.any() else ids[hot, 1:]
    w = rng.random((n, k)).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    return x, jnp.asarray(ids, jnp.int32), jnp.asarray(w), gate, up, down


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _check(args, config=None):
    out = routed_experts_mosaic(*args, impl="interpret", config=config)
    x = args[0]
    assert out.shape == x.shape and out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all()
    ref = reference.routed_experts(*args)
    err = _rel_err(out, ref)
    # Both round to x's dtype after each GEMM; the f32 summation order and the activation's
    # internal precision differ (bf16 flips near ties).
    assert err < 1e-2, err
    # A kernel with gate and up swapped would not pass.
    x, ids, w, gate, up, down = args
    assert _rel_err(out, reference.routed_experts(x, ids, w, up, gate, down)) > 0.1


@pytest.mark.parametrize("n,k", [(1, 1), (1, 4), (2, 2), (3, 8), (4, 3), (5, 5), (6, 7), (7, 2), (8, 6)])
def test_few_rows_every_k(n, k):
    """Decode and verify sizes: N = 1..8 tokens, top-1..8 of 16 experts (repeats across tokens)."""
    _check(_inputs(100 * n + k, n, k, e=16, h=128, i=64))


def test_many_experts():
    """64 experts, top-8: most selected experts hold a single row."""
    _check(_inputs(7, 12, 8, e=64, h=128, i=64))


def test_expert_over_several_blocks():
    """A skewed routing: 70 of 80 tokens send slot 0 to expert 0 (two 64-row blocks of it)."""
    args = _inputs(11, 80, 2, e=6, h=64, i=64, skew=0.9)
    assert int(jnp.sum(args[1] == 0)) > 64
    _check(args)


@pytest.mark.parametrize("config,i", [
    (GroupedGemmConfig(block_rows=128, tile_i=32, tile_h=64, stages=2), 64),
    (GroupedGemmConfig(tile_i=32, tile_h=64, tile_k=32, stages=1), 64),
    (GroupedGemmConfig(tile_i=96, tile_h=192, tile_k=32, stages=3), 96),
    (GroupedGemmConfig(layout="tokens", tile_i=64, tile_h=64, tile_k=128, stages=2, columns_minor=True), 128),
])
def test_configs(config, i):
    """Other tiles, both layouts at the same N: 128-row blocks, a 32-wide k step without a
    ring, I = 96 in one tile, 128-wide k steps with the column tiles as the grid's fastest axis."""
    _check(_inputs(config.tile_i + config.stages, 9, 3, e=8, h=384 if i == 128 else 192, i=i), config)


def test_float16():
    _check(_inputs(3, 4, 2, e=8, h=64, i=64, dtype=jnp.float16))


def test_api_dispatches_to_the_kernels(monkeypatch):
    """``routed_experts(impl="interpret")`` runs the grouped-GEMM kernels above `triton.MAX_TOKENS`
    rows and the weight-streaming kernels up to it; inputs they cannot take (f32) and
    ``impl="reference"`` run the reference."""
    calls = []
    for module, name in ((mosaic, "routed_experts_mosaic"), (triton, "routed_experts_stream")):
        run = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _run=run, _name=name, **k: calls.append(_name) or _run(*a, **k))
    for n, kernel in ((triton.MAX_TOKENS + 1, "routed_experts_mosaic"), (6, "routed_experts_stream")):
        calls.clear()
        args = _inputs(21, n, 3, e=12, h=128, i=64)
        out = api.routed_experts(*args, impl="interpret")
        assert calls == [kernel]
        assert _rel_err(out, reference.routed_experts(*args)) < 1e-2
        np.testing.assert_array_equal(api.routed_experts(*args, impl="reference"), reference.routed_experts(*args))
        f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
        np.testing.assert_array_equal(api.routed_experts(*f32, impl="interpret"), reference.routed_experts(*f32))
        assert calls == [kernel]


def _fp8(args):
    x, ids, w, gate, up, down = args
    return (x, ids, w, *(fp8.quantize(t.astype(jnp.float32)) for t in (gate, up, down)))


@pytest.mark.parametrize("n,k,e,skew,config", [
    (20, 3, 8, None, None),
    (80, 2, 6, 0.9, None),  # expert 0 over two 64-row blocks, others nearly empty
    (24, 4, 16, None, GroupedFp8Config(tile_i=32, tile_h=64, num_warps=4, num_stages=2)),
])
def test_the_fp8_grouped_gemms_are_the_reference(n, k, e, skew, config):
    """`triton_grouped` (interpreted) on block-scaled FP8 experts against the reference on the same
    8-bit experts: uneven, empty and multi-block groups, and another tiling."""
    args = _fp8(_inputs(n + e, n, k, e=e, h=256, i=128, skew=skew))
    out = triton_grouped.routed_experts_fp8(*args, impl="interpret", config=config)
    ref = reference.routed_experts(*args)
    assert out.dtype == jnp.float32 and _rel_err(out, ref) < 1e-2
    x, ids, w, gate, up, down = args
    assert _rel_err(out, reference.routed_experts(x, ids, w, up, gate, down)) > 0.1  # gate and up matter


def test_the_fp8_grouped_gemms_lower_to_triton_for_an_h200(monkeypatch):
    """Both kernels through Pallas' Triton lowering for compute capability 9.0, on the CPU (no PTX)."""
    import jax
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)
    args = jax.eval_shape(lambda: _fp8(_inputs(0, 96, 10, e=64, h=2048, i=512)))
    text = jax.jit(lambda *a: triton_grouped.routed_experts_fp8(*a)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("moe_gate_up_fp8") >= 1 and text.count("moe_down_fp8") >= 1, text[:2000]


def test_fp8_experts_run_the_fp8_grouped_gemms(monkeypatch):
    """Above `triton.MAX_TOKENS` rows the api hands block-scaled FP8 experts to `triton_grouped`
    (``auto``: from `api.FP8_GROUPED_MIN_PAIRS` pairs), the shared expert added beside them; bf16
    inputs it cannot take (f32 activations) go to the reference."""
    calls = []
    run = triton_grouped.routed_experts_fp8
    monkeypatch.setattr(triton_grouped, "routed_experts_fp8", lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k))
    args = _fp8(_inputs(31, triton.MAX_TOKENS + 4, 3, e=8, h=256, i=128))
    out = api.routed_experts(*args, impl="interpret")
    assert calls == [triton.MAX_TOKENS + 4]
    ref = reference.routed_experts(*args)
    assert _rel_err(out, ref) < 1e-2
    x, ids, w, gate, up, down = args
    assert _rel_err(ref, reference.routed_experts(x, ids, w, *(t.dequantize() for t in (gate, up, down)))) < 1e-2
    np.testing.assert_array_equal(api.routed_experts(x.astype(jnp.float32), ids, w, gate, up, down, impl="interpret"),
                                  reference.routed_experts(x.astype(jnp.float32), ids, w, gate, up, down))
    assert calls == [triton.MAX_TOKENS + 4]
    assert "bfloat16" in triton_grouped.unsupported(x.astype(jnp.float32), gate, up, down)
    assert "BlockFp8Weight" in triton_grouped.unsupported(x, gate.dequantize(), up, down)
    assert api.fp8_grouped_pays(jnp.zeros((api.FP8_GROUPED_MIN_PAIRS,), jnp.int32))
    assert not api.fp8_grouped_pays(jnp.zeros((api.FP8_GROUPED_MIN_PAIRS - 1,), jnp.int32))


def test_plan_rows_layout():
    """Every pair has its own row, in a block of its expert; blocks past the used ones are sentinels."""
    rng = np.random.default_rng(5)
    n, k, e, br = 200, 4, 12, 64
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    ids[:150, 0] = 3  # expert 3 spans several blocks
    pos, block_expert, row_token = map(np.asarray, plan_rows(jnp.asarray(ids, jnp.int32), e, br))
    assert len(set(pos.ravel())) == n * k
    assert block_expert.shape == (mosaic.num_blocks_bound(n * k, e, br),)
    np.testing.assert_array_equal(block_expert[pos // br], ids)
    np.testing.assert_array_equal(row_token[pos], np.broadcast_to(np.arange(n)[:, None], (n, k)))
    used = -(-np.bincount(ids.ravel(), minlength=e) // br).sum()
    assert (block_expert[used:] == e).all() and (block_expert[:used] < e).all()
    assert (np.diff(block_expert[:used]) >= 0).all()


def test_plan_slots_layout():
    """The tokens layout: slot s holds the s-th selected expert, pair (n, j) row slot * B + n."""
    rng = np.random.default_rng(6)
    n, k, e, br = 9, 3, 40, 64
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    rows, slot_expert = map(np.asarray, plan_slots(jnp.asarray(ids, jnp.int32), e, br))
    chosen = np.unique(ids)
    assert slot_expert.shape == (n * k,)
    np.testing.assert_array_equal(slot_expert[:chosen.size], chosen)
    assert (slot_expert[chosen.size:] == e).all()
    np.testing.assert_array_equal(rows % br, np.broadcast_to(np.arange(n)[:, None], (n, k)))
    np.testing.assert_array_equal(slot_expert[rows // br], ids)


def test_unsupported_names_the_reason():
    x, ids, w, gate, up, down = _inputs(1, 2, 2, e=4, h=64, i=64)
    assert unsupported(x, ids, w, gate, up, down) is None
    f32 = [a.astype(jnp.float32) for a in (x, gate, up, down)]
    why = unsupported(f32[0], ids, w, *f32[1:])
    assert "16-bit" in why and "float32" in why
    x2, ids2, w2, g2, u2, d2 = _inputs(1, 2, 2, e=4, h=96, i=64)
    assert "H=96" in unsupported(x2, ids2, w2, g2, u2, d2)
    x3, ids3, w3, g3, u3, d3 = _inputs(1, 65, 2, e=4, h=64, i=64)
    assert "'tokens' layout" in unsupported(x3, ids3, w3, g3, u3, d3, GroupedGemmConfig(layout="tokens"))
    with pytest.raises(ValueError, match="16-bit"):
        routed_experts_mosaic(f32[0], ids, w, *f32[1:], impl="interpret")


def test_bad_shapes_are_named():
    x, ids, w, gate, up, down = _inputs(2, 3, 2, e=4, h=64, i=64)
    with pytest.raises(ValueError, match="down must be"):
        routed_experts_mosaic(x, ids, w, gate, up, down[:, :32], impl="interpret")
    with pytest.raises(ValueError, match="expert_weights"):
        routed_experts_mosaic(x, ids, w[:, :1], gate, up, down, impl="interpret")
    with pytest.raises(ValueError, match="up must be"):
        routed_experts_mosaic(x, ids, w, gate, up[:2], down, impl="interpret")
