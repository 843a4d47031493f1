"""The FP8 weight-streaming kernel (`mtp.ops.fp8.triton`) in Pallas' interpreter, against the dequantized product."""

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
    (7, (130, 260), k.Fp8GemvConfig(splits=2, num_stages=1)),
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
    c = k.default_config(2048, 4096)
    assert (c.block_out, c.splits) == (32, 4)  # 64 output blocks x 4 splits: about two programs per SM
    assert k.default_config(12288, 2048).splits == 1  # 384 output blocks already
    assert k.default_config(512, 2048).splits == 16  # as many splits as input tiles, no more
    assert k.default_config(512, 256).splits == 2
    with pytest.raises(ValueError, match="block_in=96"):
        k.Fp8GemvConfig(block_in=96).check()


def test_auto_takes_the_kernel_where_it_was_measured_faster():
    assert k.pays(4, 512) and k.pays(2, 2048) and k.pays(1, 12288)
    assert not k.pays(1, 2048) and not k.pays(1, 512)  # XLA's one-row GEMV fusion


def test_fp8_experts_run_the_reference_on_every_path():
    from mtp.ops.moe import api
    from mtp.ops.moe import reference as moe_ref

    kg, ku, kd, kx, ki = jax.random.split(jax.random.key(2), 5)
    gate, up, down = _weight(kg, (6, 96, 160)), _weight(ku, (6, 96, 160)), _weight(kd, (6, 160, 96))
    x = _rows(kx, (3, 160))
    ids = jax.random.randint(ki, (3, 2), 0, 6)
    weights = jnp.full((3, 2), 0.5, jnp.float32)
    want = np.asarray(moe_ref.routed_experts(x, ids, weights, gate, up, down))
    for impl in ("reference", "interpret", "auto"):
        np.testing.assert_array_equal(np.asarray(api.routed_experts(x, ids, weights, gate, up, down, impl=impl)), want)


def test_kernels_lower_to_triton_for_an_h200(monkeypatch):
    """The kernel through Pallas' Triton lowering for compute capability 9.0, on the CPU (no PTX).

    The interpreter runs any jaxpr; the lowering is where an fp8 convert, a masked load or an
    indexer Triton lacks would fail, so it is checked here too. Uses jax's private GPU-info hook.
    """
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)

    def lower(f, *args):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    w = jax.eval_shape(lambda: fp8.quantize(jnp.zeros((200, 300), jnp.bfloat16)))
    for rows in (1, 4, 16):
        x = jax.ShapeDtypeStruct((rows, 300), jnp.bfloat16)
        assert "custom_call" in lower(lambda x, w: k.w8a16(x, w, config=k.Fp8GemvConfig(splits=2)), x, w)
    w = jax.eval_shape(lambda: fp8.quantize(jnp.zeros((256, 2048), jnp.bfloat16)))
    x = jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16)
    assert "custom_call" in lower(lambda x, w: k.gemv(x, w, out_dtype=jnp.bfloat16), x, w)


@pytest.mark.parametrize("shape,config", [
    ((256, 384), None),                                          # chunk 128: the gcd of 384 and 512
    ((384, 1024), k.RowConfig(block_out=32, chunk=1024)),
    ((128, 512), k.RowConfig(block_out=128, chunk=64, num_stages=1)),  # a chunk under one scale block
])
def test_the_one_row_kernel_is_the_dequantized_product(shape, config):
    kw, kx = jax.random.split(jax.random.key(shape[0] + shape[1]))
    w, x = _weight(kw, shape), _rows(kx, (1, shape[1]))
    got = k.gemv(x, w, config=config, interpret=True)
    assert got.shape == (1, shape[0]) and got.dtype == jnp.float32
    _close(got, _exact(x, w))
    bf16 = k.gemv(x, w, out_dtype=jnp.bfloat16, config=config, interpret=True)
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(got.astype(jnp.bfloat16)))


def test_one_row_takes_the_row_kernel_and_its_switch_hands_it_back(monkeypatch):
    calls = []
    for name in ("gemv", "w8a16"):
        run = getattr(k, name)
        monkeypatch.setattr(k, name, lambda *a, _run=run, _name=name, **kw: calls.append(_name) or _run(*a, **kw))
    kw, kx = jax.random.split(jax.random.key(7))
    w, x = _weight(kw, (256, 384)), _rows(kx, (1, 1, 384))
    got = fp8.matmul(x, w, impl="interpret", gemv_impl="interpret")
    assert calls == ["gemv"] and got.shape == (1, 1, 256)
    _close(got.reshape(1, 256), _exact(x.reshape(1, 384), w))
    fp8.matmul(x, w, impl="interpret", gemv_impl="reference")  # the few-row kernel takes the row back
    assert calls == ["gemv", "w8a16"]
    fp8.matmul(_rows(kx, (2, 384)), w, impl="interpret", gemv_impl="interpret")  # two rows: not the row kernel
    assert calls == ["gemv", "w8a16", "w8a16"]


def test_the_row_kernel_names_what_it_declines():
    w = _weight(jax.random.key(0), (256, 384))
    x = _rows(jax.random.key(1), (1, 384))
    assert k.gemv_unsupported(x, w) is None
    assert "x [1, 384]" in k.gemv_unsupported(_rows(jax.random.key(1), (2, 384)), w)
    assert "bfloat16" in k.gemv_unsupported(x.astype(jnp.float32), w)
    assert "whole 128-blocks" in k.gemv_unsupported(_rows(jax.random.key(1), (1, 300)), _weight(jax.random.key(0), (256, 300)))
    assert "dividing 128" in k.gemv_unsupported(x, w, k.RowConfig(block_out=256))
    with pytest.raises(ValueError, match="fp8 gemv kernel"):
        k.gemv(x.astype(jnp.float32), w, interpret=True)


def test_auto_takes_the_row_kernel_for_wide_weights_only():
    """`gemv_pays`: the row kernel beat the dot kernel above 4096 outputs and lost to XLA's GEMV below."""
    assert k.gemv_pays(12288) and k.gemv_pays(8192) and not k.gemv_pays(4096) and not k.gemv_pays(2048)
