"""Block-scaled FP8 weights: the op, the model on FP8 weights, and Qwen's FP8 checkpoint layout."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mtp.ops import fp8


def _numpy_dequantize(values, scale, block):
    rows, cols = values.shape[-2:]
    s = np.repeat(np.repeat(np.asarray(scale, np.float32), block[0], -2)[..., :rows, :], block[1], -1)[..., :cols]
    return np.asarray(values).astype(np.float32) * s


# ====================================================================== the op
@pytest.mark.parametrize("shape, block", [((200, 300), (128, 128)), ((3, 130, 129), (128, 128)),
                                          ((40, 20), (16, 8))])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_quantize_is_the_checkpoints_recipe_with_partial_edge_blocks(shape, block, scale_dtype):
    rng = np.random.default_rng(0)
    w = rng.normal(size=shape).astype(np.float32) * rng.uniform(0.1, 10.0, size=shape[:-2] + (shape[-2], 1))
    w[..., :block[0], :block[1]] = 0.0  # an all-zero block keeps a finite scale and exact zeros
    q = fp8.quantize(w, block, scale_dtype)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale_inv.dtype == jnp.float32
    assert q.scale_inv.shape == fp8.scale_shape(shape, block) == (*shape[:-2], -(-shape[-2] // block[0]),
                                                                 -(-shape[-1] // block[1]))
    # The scale of each block is its amax / 448 (rounded to the stored dtype), computed here in numpy.
    nbr, nbc = q.scale_inv.shape[-2:]
    padded = np.zeros((*shape[:-2], nbr * block[0], nbc * block[1]), np.float32)
    padded[..., :shape[-2], :shape[-1]] = w
    amax = np.abs(padded.reshape(*shape[:-2], nbr, block[0], nbc, block[1])).max(axis=(-3, -1))
    scale = np.asarray(q.scale_inv)
    stored = ml_dtypes.bfloat16 if scale_dtype == "bfloat16" else np.float32
    np.testing.assert_array_equal(scale.astype(stored).astype(np.float32), scale)  # a save stores it exactly
    # XLA may divide by 448 as a multiply by its reciprocal: one f32 ulp, before the rounding to bf16.
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / 448.0, 1.0), rtol=2e-7 if stored == np.float32 else 2**-8)
    s = np.repeat(np.repeat(scale, block[0], -2)[..., :shape[-2], :], block[1], -1)[..., :shape[-1]]
    want = np.clip(w / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), want.view(np.uint8))
    # dequantize is the definition, values times their block's scale; the error is E4M3's.
    deq = np.asarray(fp8.dequantize(q))
    np.testing.assert_array_equal(deq, _numpy_dequantize(q.values, q.scale_inv, block))
    assert np.all(deq[..., :block[0], :block[1]] == 0)
    assert np.all(np.abs(deq - w) <= np.abs(w) * 2.0**-4 + s * 2.0**-9)


def test_quantize_of_a_dequantized_weight_gives_it_back():
    w = fp8.quantize(np.random.default_rng(1).normal(size=(150, 260)).astype(np.float32))
    again = fp8.quantize(fp8.dequantize(w))
    np.testing.assert_array_equal(np.asarray(again.values).view(np.uint8), np.asarray(w.values).view(np.uint8))
    np.testing.assert_allclose(np.asarray(again.scale_inv), np.asarray(w.scale_inv), rtol=2e-7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w8a16_matmul_is_the_dequantized_product(dtype):
    rng = np.random.default_rng(2)
    w = fp8.quantize(rng.normal(size=(200, 300)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(2, 7, 300)), dtype)
    y = fp8.matmul(x, w)
    assert y.dtype == jnp.float32 and y.shape == (2, 7, 200)
    plain = jnp.einsum("...i,oi->...o", x, fp8.dequantize(w).astype(dtype), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain))
    exact = np.asarray(x, np.float64) @ _numpy_dequantize(w.values, w.scale_inv, w.block).astype(np.float64).T
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(y), exact, rtol=tol, atol=tol * np.abs(exact).max())


def test_w8a8_is_close_to_w8a16_and_its_activation_scales_are_per_token_and_128_columns():
    rng = np.random.default_rng(3)
    w = fp8.quantize(rng.normal(size=(96, 300)).astype(np.float32))
    x = rng.normal(size=(16, 300)).astype(np.float32) * rng.uniform(0.01, 100.0, size=(16, 1))
    xq, xs = fp8.quantize_activations(jnp.asarray(x), 128)
    assert xq.dtype == jnp.float8_e4m3fn and xs.shape == (16, 3)
    amax = np.stack([np.abs(x[:, i:i + 128]).max(axis=1) for i in range(0, 300, 128)], axis=1)
    np.testing.assert_allclose(np.asarray(xs), amax / 448.0, rtol=2e-7)
    a16 = np.asarray(fp8.matmul(jnp.asarray(x), w))
    a8 = np.asarray(fp8.matmul(jnp.asarray(x), w, mode="w8a8"))
    # E4M3 rounds each activation by at most 2^-4 of its magnitude (half a step of 3 mantissa
    # bits; subnormals below 2^-6 of a group's scale by at most 2^-10 of the scale): a bound on
    # every output. With random signs the errors add up like noise: each element's relative error
    # is at most uniform on +-2^-4 (RMS 2^-4 / sqrt(3) = 3.6%), so the output's RMS error stays under 4%.
    wd = np.abs(np.asarray(fp8.dequantize(w), np.float64))
    xs_cols = np.repeat(np.asarray(xs, np.float64), 128, axis=1)[:, :300]
    bound = (2.0**-4 * np.abs(x) + 2.0**-10 * 448 * xs_cols) @ wd.T
    assert np.all(np.abs(a8 - a16) <= bound * (1 + 1e-5))
    rms = lambda a: np.sqrt(np.mean(np.square(a, dtype=np.float64), axis=1))
    rel = rms(a8 - a16) / rms(a16)
    assert rel.max() < 0.04 and rel.min() > 0.005  # and the activations were really rounded
    with pytest.raises(ValueError, match="mode='w4a4'"):
        fp8.matmul(jnp.asarray(x), w, mode="w4a4")


def test_block_fp8_weight_is_a_pytree_that_jits_once():
    rng = np.random.default_rng(4)
    w = fp8.quantize(rng.normal(size=(3, 40, 70)).astype(np.float32), (16, 32), "bfloat16")
    leaves, tree = jax.tree.flatten(w)
    assert len(leaves) == 2 and jax.tree.unflatten(tree, leaves).block == (16, 32)
    traces = []

    @jax.jit
    def f(x, w):
        traces.append(1)
        return fp8.matmul(x, jax.tree.map(lambda a: a[0], w))

    x = jnp.asarray(rng.normal(size=(5, 70)), jnp.float32)
    w2 = fp8.quantize(rng.normal(size=(3, 40, 70)).astype(np.float32), (16, 32), "bfloat16")
    np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(fp8.matmul(x, jax.tree.map(lambda a: a[0], w))))
    f(x, w2)
    assert len(traces) == 1
    with pytest.raises(ValueError, match=r"2-D weight \[out, 70\].*\(3, 40, 70\)"):
        fp8.matmul(x, w)
