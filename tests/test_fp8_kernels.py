"""The FP8 weight-streaming kernels (`mtp.ops.fp8.triton`) in Pallas' interpreter, against the dequantized product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.ops import fp8
from mtp.ops.fp8 import triton as k


def _weight(key, shape):
    return fp8.quantize(jax.random.normal(key, shape, jnp.float32) * 0.05)


def _rows(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def _exact(x, w):
    return x.astype(jnp.float32) @ fp8.dequantize(w).T


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("rows,shape,config", [
    (1, (200, 300), None),                                      # partial edge blocks both ways
    (2, (200, 300), k.Fp8GemvConfig(block_out=64, block_in=64, splits=3)),
    (7, (130, 260), k.Fp8GemvConfig(splits=2, dot=False)),
    (16, (256, 384), k.Fp8GemvConfig(block_out=32, splits=2)),
    (16, (72, 136), k.Fp8GemvConfig(splits=4)),                 # more splits than tiles: empty chunks
])
def test_dense_kernel_is_the_dequantized_product(rows, shape, config):
    kw, kx = jax.random.split(jax.random.key(rows * 31 + shape[0]))
    w, x = _weight(kw, shape), _rows(kx, (rows, shape[1]))
    got = k.w8a16(x, w, config=config, interpret=True)
    assert got.shape == (rows, shape[0]) and got.dtype == jnp.float32
    _close(got, _exact(x, w))


def test_matmul_takes_the_kernel_under_interpret_and_keeps_the_reference_elsewhere():
    kw, kx = jax.random.split(jax.random.key(5))
    w, x = _weight(kw, (200, 300)), _rows(kx, (2, 3, 300))
    got = fp8.matmul(x, w, impl="interpret")
    _close(got, _exact(x.reshape(6, 300), w).reshape(2, 3, 200))
    ref = fp8.matmul(x, w)  # CPU "auto": the reference, bit for bit
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(fp8.reference.w8a16(x, w)))
    many = _rows(kx, (17, 300))  # declined: the reference
    np.testing.assert_array_equal(np.asarray(fp8.matmul(many, w, impl="interpret")),
                                  np.asarray(fp8.reference.w8a16(many, w)))


def test_unsupported_names_why():
    w = _weight(jax.random.key(0), (200, 300))
    x = _rows(jax.random.key(1), (4, 300))
    assert fp8.api.unsupported(x, w) is None
    assert "17 rows" in fp8.api.unsupported(jnp.zeros((17, 300), jnp.bfloat16), w)
    assert "float32" in fp8.api.unsupported(x.astype(jnp.float32), w)
    assert "2-D weight" in fp8.api.unsupported(x, jax.tree.map(lambda a: a[None], w))
    odd = fp8.quantize(jnp.ones((200, 300)), block=(64, 64))
    assert "scale block (64, 64)" in fp8.api.unsupported(x, odd)
    with pytest.raises(ValueError, match="17 rows"):
        k.w8a16(jnp.zeros((17, 300), jnp.bfloat16), w, interpret=True)


def test_default_config_spreads_the_weight_over_the_sms():
    c = k.default_config(1, 2048, 4096)
    assert (c.block_out, c.splits, c.dot) == (128, 8, False)  # 16 output blocks x 8 splits
    assert k.default_config(4, 12288, 2048).splits == 2 and k.default_config(4, 12288, 2048).dot
    assert k.default_config(1, 512, 2048).block_out == 64
    with pytest.raises(ValueError, match="block_in=96"):
        k.Fp8GemvConfig(block_in=96).check()


@pytest.mark.parametrize("config", [None, k.Fp8GemvConfig(block_out=64, block_in=64, splits=3)])
def test_grouped_kernel_is_each_pairs_expert_product(config):
    kw, kx, ki = jax.random.split(jax.random.key(11), 3)
    w = _weight(kw, (5, 200, 300))  # partial edge blocks both ways
    x = _rows(kx, (7, 300))
    ids = jnp.concatenate([jnp.array([4, 4]), jax.random.randint(ki, (5,), 0, 5)])  # repeats included
    got = k.grouped_w8a16(x, ids, w, config=config, interpret=True)
    want = jnp.einsum("pi,poi->po", x.astype(jnp.float32), fp8.dequantize(w)[ids])
    assert got.shape == (7, 200)
    _close(got, want)
    assert "stacked weight" in k.grouped_unsupported(x, ids, jax.tree.map(lambda a: a[0], w))


def _experts(key, e=6, inter=96, hidden=160):
    kg, ku, kd = jax.random.split(key, 3)
    return (_weight(kg, (e, inter, hidden)), _weight(ku, (e, inter, hidden)), _weight(kd, (e, hidden, inter)))


def test_fp8_gather_ffn_and_routed_experts_follow_the_reference():
    from mtp.ops.moe import api, fp8_triton
    from mtp.ops.moe import reference as moe_ref

    gate, up, down = _experts(jax.random.key(2))
    kx, ki, kp = jax.random.split(jax.random.key(3), 3)
    x = _rows(kx, (3, 160))
    ids = jax.random.randint(ki, (3, 2), 0, 6).at[0].set(jnp.array([1, 1]))  # a token routed twice to one expert
    weights = jax.nn.softmax(jax.random.normal(kp, (3, 2)), axis=-1)
    want = moe_ref.routed_experts_gather(x, ids, weights, gate, up, down)
    got = fp8_triton.routed_experts_gather(x, ids, weights, gate, up, down, interpret=True)
    # The kernel multiplies by the exact dequantized weights, the reference by them rounded to
    # bf16: the two differ by bf16 roundings of the hidden activations.
    tol = 2e-2 * float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol)
    np.testing.assert_array_equal(np.asarray(api.routed_experts(x, ids, weights, gate, up, down, impl="interpret")),
                                  np.asarray(got))
    np.testing.assert_array_equal(np.asarray(api.routed_experts(x, ids, weights, gate, up, down, impl="reference")),
                                  np.asarray(moe_ref.routed_experts(x, ids, weights, gate, up, down)))
    assert fp8_triton.unsupported(x.astype(jnp.float32), ids, gate, up, down).startswith("x is float32")


def test_kernels_lower_to_triton_for_an_h200(monkeypatch):
    """Both kernels through Pallas' Triton lowering for compute capability 9.0, on the CPU (no PTX).

    The interpreter runs any jaxpr; the lowering is where an fp8 convert, a masked load or an
    indexer Triton lacks would fail, so it is checked here too. Uses jax's private GPU-info hook.
    """
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)

    def lower(f, *args):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    w = jax.eval_shape(lambda: fp8.quantize(jnp.zeros((200, 300), jnp.bfloat16)))
    for rows, dot in ((1, False), (4, True), (16, True)):
        x = jax.ShapeDtypeStruct((rows, 300), jnp.bfloat16)
        cfg = k.Fp8GemvConfig(splits=2, dot=dot)
        assert "custom_call" in lower(lambda x, w: k.w8a16(x, w, config=cfg), x, w)
    we = jax.eval_shape(lambda: fp8.quantize(jnp.zeros((4, 200, 300), jnp.bfloat16)))
    x, ids = jax.ShapeDtypeStruct((6, 300), jnp.bfloat16), jax.ShapeDtypeStruct((6,), jnp.int32)
    assert "custom_call" in lower(lambda x, i, w: k.grouped_w8a16(x, i, w), x, ids, we)
