"""Tests for mtp.quant and mtp.ops.quantized: grid rounding, packing, error bounds, linear, jit, param walking."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mtp import quant as q
from mtp.ops import quantized

F32_SLACK = 1e-6  # relative f32 rounding in the divide/multiply around the grid rounding


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


# ---------------------------------------------------------------- code points

E2M1_POSITIVE = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_grid_points_are_fixed_points():
    grid = np.array([0.0] + E2M1_POSITIVE + [-v for v in E2M1_POSITIVE], np.float32)
    assert len(set(grid.tolist())) == 15
    np.testing.assert_array_equal(np.asarray(quantized.e2m1_round(grid)), grid)


@pytest.mark.parametrize(
    "x, expected",
    [
        (0.25, 0.0),  # between 0 (even) and 0.5
        (0.75, 1.0),  # between 0.5 and 1.0 (even mantissa)
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        (0.26, 0.5),  # just past a midpoint rounds away from the even side
        (4.9, 4.0),
        (5.1, 6.0),
        (6.9, 6.0),  # saturates, never overflows
        (1e6, 6.0),
    ],
)
def test_e2m1_midpoints_round_to_even_and_saturate(x, expected):
    assert float(quantized.e2m1_round(jnp.float32(x))) == expected
    assert float(quantized.e2m1_round(jnp.float32(-x))) == -expected


@pytest.mark.parametrize(
    "x, expected",
    [
        (448.0, 448.0),  # largest finite E4M3FN
        (464.0, 448.0),  # midpoint to the (absent) 480 rounds to even 448
        (1e4, 448.0),  # saturates instead of becoming NaN
        (2.0**-9, 2.0**-9),  # smallest subnormal
        (2.0**-10, 0.0),  # half of it ties to even zero
        (1.5 * 2.0**-10, 2.0**-9),
        (3 * 2.0**-9, 3 * 2.0**-9),  # a subnormal with odd mantissa
        (2.0**-6, 2.0**-6),  # smallest normal
        (1.0625, 1.0),  # midpoint of 1.0 and 1.125 -> even
        (1.1875, 1.25),  # midpoint of 1.125 and 1.25 -> even
        (240.0, 240.0),
        (250.0, 256.0),
        (300.0, 288.0),
    ],
)
def test_e4m3_known_points(x, expected):
    assert float(quantized.e4m3_round(jnp.float32(x))) == expected
    assert float(quantized.e4m3_round(jnp.float32(-x))) == -expected


def test_e4m3_every_finite_value_is_a_fixed_point():
    all_values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = all_values[np.isfinite(all_values)]
    assert finite.size == 254  # 0x7F and 0xFF are the only NaNs
    np.testing.assert_array_equal(np.asarray(quantized.e4m3_round(finite)), finite)


def test_e4m3_agrees_with_dtype_cast_in_range():
    x = _normal(11, (4096,)) * jnp.exp(_normal(12, (4096,)) * 3.0)
    x = jnp.clip(x, -440.0, 440.0)
    cast = np.asarray(x).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(quantized.e4m3_round(x)), cast)


# ---------------------------------------------------------------- packing


def test_pack_unpack_all_16_codes():
    codes = jnp.arange(16, dtype=jnp.uint8)
    perm = jax.random.permutation(jax.random.key(5), codes)
    for c in (codes, perm):
        packed = quantized.pack_nibbles(c)
        assert packed.dtype == jnp.uint8 and packed.shape == (8,)
        np.testing.assert_array_equal(np.asarray(quantized.unpack_nibbles(packed)), np.asarray(c))


def test_nibble_order_low_then_high():
    packed = quantized.pack_nibbles(jnp.array([[0x3, 0xA]], jnp.uint8))
    assert int(packed[0, 0]) == 0xA3


def test_code_encode_decode_round_trip():
    codes = jnp.arange(16, dtype=jnp.uint8)
    values = quantized.e2m1_decode(codes)
    np.testing.assert_array_equal(np.asarray(quantized.e2m1_encode(values)), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(values[:8]), [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    np.testing.assert_array_equal(np.asarray(values[8:]), -np.asarray(values[:8]))


# ---------------------------------------------------------------- error bounds

SHAPES = [(32, 64), (48, 96), (128, 256)]


@pytest.mark.parametrize("seed, shape", list(enumerate(SHAPES)))
def test_fp8_round_trip_error(seed, shape):
    w = _normal(100 + seed, shape) * 0.05
    wq = q.quantize(w, "fp8")
    assert wq.values.dtype == jnp.float8_e4m3fn and wq.row_scale.shape == (shape[0],)
    d = quantized.dequantize(wq)
    rel = float(jnp.linalg.norm(w - d) / jnp.linalg.norm(w))
    assert rel < 0.04, rel
    # Per element: half an E4M3 ulp is <= 2^-4 of the value for normals and the
    # absolute 2^-10 (half the smallest subnormal) below, in units of the row scale.
    s = wq.row_scale[:, None]
    bound = 2.0**-4 * jnp.abs(w) + 2.0**-10 * s
    assert bool(jnp.all(jnp.abs(w - d) <= bound * (1 + F32_SLACK) + 1e-12))
    # The row maximum maps onto E4M3's largest value exactly.
    np.testing.assert_allclose(
        np.asarray(jnp.max(jnp.abs(wq.values.astype(jnp.float32)), axis=1)), 448.0
    )


@pytest.mark.parametrize("seed, shape", list(enumerate(SHAPES)))
def test_nvfp4_round_trip_error(seed, shape):
    w = _normal(200 + seed, shape) * 0.05
    wq = q.quantize(w, "nvfp4")
    out_f, in_f = shape
    assert wq.packed.dtype == jnp.uint8 and wq.packed.shape == (out_f, in_f // 2)
    assert wq.block_scale.dtype == jnp.float8_e4m3fn and wq.block_scale.shape == (out_f, in_f // 16)
    assert wq.tensor_scale.shape == () and wq.shape == shape
    d = quantized.dequantize(wq)
    rel = float(jnp.linalg.norm(w - d) / jnp.linalg.norm(w))
    assert rel < 0.15, rel
    # Per element, with S = block scale * tensor scale and y = w / S: E2M1's half
    # spacing is <= max(|y| / 4, 1/4), and a block scale that is a normal E4M3 value is
    # within 2^-4 of exact, so clipping at 6 costs at most 0.4 <= |y| / 4.
    block_scale = wq.block_scale.astype(jnp.float32)
    assert bool(jnp.all(block_scale >= 2.0**-6)), "bound below assumes normal block scales"
    step = jnp.repeat(block_scale, 16, axis=1) * wq.tensor_scale
    bound = 0.25 * jnp.abs(w) + 0.25 * step
    assert bool(jnp.all(jnp.abs(w - d) <= bound * (1 + F32_SLACK) + 1e-12))
    # The tensor's largest block gets the largest E4M3 block scale.
    assert float(jnp.max(block_scale)) == 448.0


def test_all_zero_row_and_block_stay_finite():
    w = _normal(7, (8, 32)).at[3].set(0.0).at[5, :16].set(0.0)
    for name in ("fp8", "nvfp4"):
        d = quantized.dequantize(q.quantize(w, name))
        assert bool(jnp.all(jnp.isfinite(d)))
        assert bool(jnp.all(d[3] == 0)) and bool(jnp.all(d[5, :16] == 0))


def test_bf16_is_unchanged():
    w = _normal(8, (16, 32), jnp.bfloat16)
    assert q.quantize(w, "bf16") is w


# ---------------------------------------------------------------- linear


@pytest.mark.parametrize("quant", q.QUANT_CHOICES)
def test_linear_matches_dequantized_matmul(quant):
    w = _normal(300, (48, 64), jnp.bfloat16)
    x = _normal(301, (2, 3, 64))
    wq = q.quantize(w, quant)
    # Full f32 matmuls on both sides: GPUs otherwise default to TF32 for f32 inputs.
    with jax.default_matmul_precision("highest"):
        ref = x @ quantized.dequantize(wq).T
        y = quantized.linear(x, wq)
    assert y.shape == (2, 3, 48) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # bf16 activations: the grid values are exact in bf16 and accumulation is f32, so
    # the only error is the bf16 rounding of x and of the output.
    xb = x.astype(jnp.bfloat16)
    yb = quantized.linear(xb, wq)
    assert yb.dtype == jnp.bfloat16
    ref_b = xb.astype(jnp.float32) @ quantized.dequantize(wq).T
    np.testing.assert_allclose(np.asarray(yb, np.float32), np.asarray(ref_b), rtol=1e-2, atol=1e-2)


def test_quantized_linear_tracks_bf16_linear():
    w = _normal(310, (64, 128), jnp.bfloat16)
    x = _normal(311, (4, 128))
    exact = quantized.linear(x, w)
    err = {
        name: float(jnp.linalg.norm(quantized.linear(x, q.quantize(w, name)) - exact) / jnp.linalg.norm(exact))
        for name in ("fp8", "nvfp4")
    }
    assert err["fp8"] < 0.04 and err["nvfp4"] < 0.15
    assert err["fp8"] < err["nvfp4"], err


# ---------------------------------------------------------------- jit


@pytest.mark.parametrize("quant", q.QUANT_CHOICES)
def test_jit_does_not_retrace(quant):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def apply(x, weight):
        return quantized.linear(x, weight)

    quantize = jax.jit(q.quantize, static_argnames=("quant", "name"))
    for seed in (400, 401):
        w = _normal(seed, (32, 64))
        x = _normal(seed + 10, (3, 64))
        wq = quantize(w, quant)
        np.testing.assert_allclose(
            np.asarray(apply(x, wq)), np.asarray(quantized.linear(x, q.quantize(w, quant))), rtol=1e-6, atol=1e-6
        )
    chex.clear_trace_counter()


# ---------------------------------------------------------------- names and errors


def test_parse_quant_aliases_and_case():
    assert q.parse_quant("BF16") == "bf16"
    assert q.parse_quant("Fp8") == "fp8"
    assert q.parse_quant("fp4") == "nvfp4"
    assert q.parse_quant("NVFP4") == "nvfp4"


@pytest.mark.parametrize("bad", ["int4", "fp16", ""])
def test_parse_quant_rejects_with_choices(bad):
    with pytest.raises(ValueError) as err:
        q.parse_quant(bad)
    msg = str(err.value)
    assert repr(bad) in msg and "bf16, fp8, nvfp4" in msg


def test_supports_drafter_prefill_only_bf16():
    assert q.supports_drafter_prefill("bf16")
    assert not q.supports_drafter_prefill("fp8")
    assert not q.supports_drafter_prefill("fp4")


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_a_quantized_head_can_prefill_the_drafter(quant):
    """Skipping the prefill for a quantized head is policy (`supports_drafter_prefill`):
    the batched prefill runs such a head and writes every row."""
    from mtp.execution import ExecutionConfig
    from mtp.mtp_head import DrafterCache, quantize_head
    from mtp.turn_start import append_from_hiddens, drafter_rows
    from mtp.model import target
    from tests.conftest import random_params, tiny_config

    cfg = tiny_config("tiny_dense")
    params = random_params(cfg, seed=0)
    toks = jax.random.randint(jax.random.key(0), (1, 9), 0, cfg.vocab_size)
    hid = target.forward_with_hiddens(cfg, params, toks).hidden_post
    dcache = DrafterCache.create(cfg, 1, 3, 4, 2, jnp.float32).replace(block_tables=jnp.array([[1, 2]], jnp.int32))
    (rows,) = drafter_rows(toks, [0], [8])
    out = append_from_hiddens(cfg, quantize_head(params, quant), dcache, rows, hid, execution=ExecutionConfig())
    assert out.rows.tolist() == [8]
    for kv in (out.kv.k[0], out.kv.v[0]):
        rows = np.asarray(kv[1:3]).reshape(8, -1)  # pages 1 and 2: keys 0..7
        assert np.isfinite(rows).all() and (np.abs(rows).sum(axis=1) > 0).all()


def test_nvfp4_rejects_in_dim_not_multiple_of_16():
    params = {"mtp": {"fc": {"weight": _normal(500, (16, 24))}}}
    with pytest.raises(ValueError, match=r"mtp\.fc\.weight.*\(16, 24\)"):
        q.quantize_params(params, "nvfp4", q.is_projection_weight)


def test_quantize_rejects_non_2d():
    with pytest.raises(ValueError, match=r"experts.*\(2, 16, 32\)"):
        q.quantize(_normal(501, (2, 16, 32)), "fp8", name="mlp.experts.gate_up_proj")


# ---------------------------------------------------------------- param walking


def _mtp_params():
    seeds = iter(range(600, 700))

    def n(*shape):
        return _normal(next(seeds), shape, jnp.bfloat16)

    return {
        "mtp": {
            "fc": {"weight": n(32, 64)},
            "pre_fc_norm_embedding": {"weight": n(32)},
            "pre_fc_norm_hidden": {"weight": n(32)},
            "norm": {"weight": n(32)},
            "layers": {
                "0": {
                    "input_layernorm": {"weight": n(32)},
                    "self_attn": {
                        "q_proj": {"weight": n(64, 32)},
                        "k_proj": {"weight": n(16, 32)},
                        "v_proj": {"weight": n(16, 32)},
                        "o_proj": {"weight": n(32, 32)},
                        "q_norm": {"weight": n(8)},
                        "k_norm": {"weight": n(8)},
                    },
                    "mlp": {
                        "gate": {"weight": n(4, 32)},
                        "shared_expert_gate": {"weight": n(1, 32)},
                        "experts": {
                            "gate_proj": {"weight": n(2, 16, 32)},
                            "up_proj": {"weight": n(2, 16, 32)},
                            "down_proj": {"weight": n(2, 32, 16)},
                        },
                    },
                }
            },
        }
    }


def test_is_projection_weight():
    assert q.is_projection_weight("mtp.fc.weight")
    assert q.is_projection_weight("mtp.layers.0.mlp.experts.down_proj.weight")
    assert q.is_projection_weight("mtp.layers.0.mlp.shared_expert.up_proj.weight")
    assert not q.is_projection_weight("mtp.layers.0.mlp.gate.weight")
    assert not q.is_projection_weight("mtp.layers.0.mlp.shared_expert_gate.weight")
    assert not q.is_projection_weight("mtp.layers.0.self_attn.q_proj.bias")
    assert not q.is_projection_weight("mtp.norm.weight")


@pytest.mark.parametrize("quant, kind", [("fp8", quantized.Fp8Weight), ("nvfp4", quantized.Nvfp4Weight)])
def test_quantize_params_selects_projections_only(quant, kind):
    params = _mtp_params()
    flat_in = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    out = q.quantize_params(params, quant, q.is_projection_weight)

    layer_in, layer_out = params["mtp"]["layers"]["0"], out["mtp"]["layers"]["0"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(layer_out["self_attn"][proj]["weight"], kind)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        stack = layer_out["mlp"]["experts"][proj]["weight"]
        assert isinstance(stack, kind)
        # Expert by expert: each expert of the stack is what quantizing it alone gives.
        for e in range(2):
            alone = q.quantize(layer_in["mlp"]["experts"][proj]["weight"][e], quant)
            for got, want in zip(jax.tree.leaves(stack), jax.tree.leaves(alone)):
                np.testing.assert_array_equal(np.asarray(got[e], np.float32), np.asarray(want, np.float32))
            np.testing.assert_array_equal(np.asarray(quantized.dequantize(stack)[e]), np.asarray(quantized.dequantize(alone)))
    assert isinstance(out["mtp"]["fc"]["weight"], kind)
    # Router, expert gate and every norm are the very same arrays.
    assert layer_out["mlp"]["gate"]["weight"] is layer_in["mlp"]["gate"]["weight"]
    assert layer_out["mlp"]["shared_expert_gate"]["weight"] is layer_in["mlp"]["shared_expert_gate"]["weight"]
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert out["mtp"][norm]["weight"] is params["mtp"][norm]["weight"]
    assert layer_out["input_layernorm"]["weight"] is layer_in["input_layernorm"]["weight"]
    assert layer_out["self_attn"]["q_norm"]["weight"] is layer_in["self_attn"]["q_norm"]["weight"]
    # The input is not mutated.
    assert dict(jax.tree_util.tree_flatten_with_path(params)[0]).keys() == flat_in.keys()
    assert isinstance(params["mtp"]["fc"]["weight"], jax.Array)


def test_quantize_params_never_touches_norms_even_if_selected():
    params = {"blk": {"post_norm": {"weight": _normal(700, (16, 32))}, "w": {"weight": _normal(701, (16,))}}}
    out = q.quantize_params(params, "fp8", lambda name: True)
    assert out["blk"]["post_norm"]["weight"] is params["blk"]["post_norm"]["weight"]
    assert out["blk"]["w"]["weight"] is params["blk"]["w"]["weight"]


def test_quantize_params_bf16_is_identity():
    params = _mtp_params()
    out = q.quantize_params(params, "bf16", q.is_projection_weight)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(out)):
        assert a is b
