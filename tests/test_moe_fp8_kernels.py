"""The FP8 routed experts' weight-streaming kernels (`mtp.ops.moe.fp8_triton`) in Pallas' interpreter,
against the reference on fresh random inputs, through the op's switch, and lowered for an H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.ops import fp8
from mtp.ops.moe import api
from mtp.ops.moe import fp8_triton as k
from mtp.ops.moe import reference as moe_ref


def _experts(key, e, i, h):
    kg, ku, kd = jax.random.split(key, 3)
    q = lambda kk, shape: fp8.quantize(jax.random.normal(kk, shape, jnp.float32) * 0.05)
    return q(kg, (e, i, h)), q(ku, (e, i, h)), q(kd, (e, h, i))


def _inputs(key, n, kk, e, h):
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (n, h), jnp.float32).astype(jnp.bfloat16)
    ids = jnp.stack([jax.random.permutation(jax.random.fold_in(ki, r), e)[:kk] for r in range(n)]).astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(kw, (n, kk)), axis=-1).astype(jnp.bfloat16).astype(jnp.float32)
    return x, ids, w


def _exact(x, ids, w, gate, up, down):
    """The routed experts in float64 on the dequantized weights, no rounding anywhere (numpy)."""
    g, u, d = (np.asarray(t.dequantize(jnp.float32), np.float64) for t in (gate, up, down))
    xs, ids, w = np.asarray(x, np.float64), np.asarray(ids), np.asarray(w, np.float64)
    out = np.zeros(xs.shape)
    for n in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[n, j]
            a, b = g[e] @ xs[n], u[e] @ xs[n]
            out[n] += w[n, j] * (d[e] @ (a / (1 + np.exp(-a)) * b))
    return out


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("n,kk,e,i,h,config", [
    (1, 2, 6, 256, 384, None),
    (1, 10, 24, 128, 256, k.Fp8ExpertsConfig(block_i=16, block_h=16)),
    (3, 2, 6, 256, 128, k.Fp8ExpertsConfig(block_i=128, block_h=128, num_stages=1)),
    (4, 10, 48, 128, 256, k.Fp8ExpertsConfig(block_i=32, block_h=64)),  # 40 pairs: three 16-row blocks of h
    (16, 2, 8, 128, 128, None),                                          # the most tokens the kernels take
])
def test_kernels_equal_the_reference(n, kk, e, i, h, config):
    key = jax.random.key(n * 1009 + kk * 31 + e)
    gate, up, down = _experts(jax.random.fold_in(key, 1), e, i, h)
    x, ids, w = _inputs(jax.random.fold_in(key, 2), n, kk, e, h)
    got = k.routed_experts_fp8(x, ids, w, gate, up, down, config=config, interpret=True)
    want = moe_ref.routed_experts(x, ids, w, gate, up, down)
    exact = _exact(x, ids, w, gate, up, down)
    assert got.shape == (n, h) and got.dtype == jnp.float32
    assert np.isfinite(np.asarray(got)).all()
    # Both round g, u, h and y to bf16 as an HF expert does; the reference also rounds each
    # dequantized weight to bf16 before its dot, the kernels scale exact E4M3 products per block.
    # So against float64 the kernels' error is bf16 rounding's, no larger than the reference's.
    assert _rel(got, exact) < 1e-2
    assert _rel(got, exact) < 1.25 * _rel(want, exact)
    assert _rel(got, want) < 1e-2
    # Every pair contributes: dropping token 0's heaviest pair changes its row far more than rounding does.
    drop = moe_ref.routed_experts(x, ids, w.at[0, int(jnp.argmax(w[0]))].set(0.0), gate, up, down)
    assert _rel(drop[0], want[0]) > 10 * _rel(got[0], want[0])


def test_the_op_takes_the_kernels_only_where_named(monkeypatch):
    gate, up, down = _experts(jax.random.key(3), 8, 128, 256)
    x, ids, w = _inputs(jax.random.key(4), 2, 3, 8, 256)
    want = np.asarray(moe_ref.routed_experts(x, ids, w, gate, up, down))
    kernel = np.asarray(k.routed_experts_fp8(x, ids, w, gate, up, down, interpret=True))
    assert not np.array_equal(kernel, want)  # the two are told apart by their roundings
    np.testing.assert_array_equal(np.asarray(api.routed_experts(x, ids, w, gate, up, down, impl="interpret")), kernel)
    # "auto": the reference (a CPU, and an opt-in op on a GPU) unless MTP_KERNELS names the op
    np.testing.assert_array_equal(np.asarray(api.routed_experts(x, ids, w, gate, up, down)), want)
    monkeypatch.setenv("MTP_KERNELS", "moe=interpret")  # the bf16 op's entry does not take it
    np.testing.assert_array_equal(np.asarray(api.routed_experts(x, ids, w, gate, up, down)), want)
    monkeypatch.setenv("MTP_KERNELS", "moe_fp8=interpret")
    np.testing.assert_array_equal(np.asarray(api.routed_experts(x, ids, w, gate, up, down)), kernel)
    monkeypatch.setenv("MTP_KERNELS", "moe_fp8=reference")
    np.testing.assert_array_equal(np.asarray(api.routed_experts(x, ids, w, gate, up, down, impl="interpret")), kernel)


def test_unsupported_names_why():
    gate, up, down = _experts(jax.random.key(5), 4, 128, 256)
    x, ids, _ = _inputs(jax.random.key(6), 2, 2, 4, 256)
    assert k.unsupported(x, ids, gate, up, down) is None
    many = jnp.zeros((17, 256), jnp.bfloat16)
    assert "17 tokens" in k.unsupported(many, ids, gate, up, down)
    assert "bfloat16" in k.unsupported(x.astype(jnp.float32), ids, gate, up, down)
    g, u, d = _experts(jax.random.key(7), 4, 96, 256)
    assert "multiples of 128" in k.unsupported(x, ids, g, u, d)
    assert "BlockFp8Weight" in k.unsupported(x, ids, g.dequantize(), u, d)
    with pytest.raises(ValueError, match="17 tokens"):
        k.routed_experts_fp8(many, jnp.zeros((17, 2), jnp.int32), jnp.ones((17, 2)), gate, up, down, interpret=True)
    # declined inputs (I = 96) run the reference on every path
    ones = jnp.ones((2, 2), jnp.float32)
    want = np.asarray(moe_ref.routed_experts(x, ids, ones, g, u, d))
    np.testing.assert_array_equal(np.asarray(api.routed_experts(x, ids, ones, g, u, d, impl="interpret")), want)


def test_default_config_spreads_the_pairs_over_the_sms():
    one = k.default_config(1, 10, 512, 2048)  # a decode token of Qwen3-Next-80B-A3B
    assert (one.block_i, one.block_h) == (16, 16)  # 320 gate/up programs; 128 down programs of 10 experts
    four = k.default_config(4, 10, 512, 2048)  # a verify of K = 4
    assert (four.block_i, four.block_h) == (64, 32)  # 320 and 256 programs
    assert k.default_config(1, 1, 128, 128).block_i == 16  # never under Triton's smallest dot N
    with pytest.raises(ValueError, match="block_i=8"):
        k.Fp8ExpertsConfig(block_i=8).check()


def test_kernels_lower_to_triton_for_an_h200(monkeypatch):
    """Through Pallas' Triton lowering for compute capability 9.0 on the CPU (no PTX): where a scalar
    index, an fp8 convert or a dot shape Triton lacks would fail. Uses jax's private GPU-info hook."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)
    experts = jax.eval_shape(lambda: _experts(jax.random.key(0), 512, 512, 2048))  # Qwen3-Next-80B-A3B's
    shared = jax.eval_shape(lambda: _shared(jax.random.key(0), 512, 2048))

    def fused(x, ids, w, gate, up, down, sg, su, sd, sw):
        return k.routed_experts_fp8(x, ids, w, gate, up, down, shared=(sg, su, sd, sw))

    for n, kk in ((1, 10), (4, 10)):
        args = (jax.ShapeDtypeStruct((n, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((n, kk), jnp.int32),
                jax.ShapeDtypeStruct((n, kk), jnp.float32), *experts)
        for f, more in ((k.routed_experts_fp8, ()), (fused, (*shared, jax.ShapeDtypeStruct((n,), jnp.float32)))):
            text = jax.jit(f).trace(*args, *more).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("__gpu$xla.gpu.triton") == 2


def _shared(key, i, h):
    kg, ku, kd = jax.random.split(key, 3)
    q = lambda kk, shape: fp8.quantize(jax.random.normal(kk, shape, jnp.float32) * 0.05)
    return q(kg, (i, h)), q(ku, (i, h)), q(kd, (h, i))


@pytest.mark.parametrize("n,kk", [(1, 4), (3, 2), (4, 10)])
def test_the_shared_expert_as_each_tokens_last_pair(n, kk):
    from mtp.model import layers

    e, i, h = 48, 128, 256
    key = jax.random.key(7 * n + kk)
    gate, up, down = _experts(jax.random.fold_in(key, 1), e, i, h)
    sg, su, sd = _shared(jax.random.fold_in(key, 2), i, h)
    x, ids, w = _inputs(jax.random.fold_in(key, 3), n, kk, e, h)
    sw = jax.nn.sigmoid(jax.random.normal(jax.random.fold_in(key, 4), (n,)))
    got = k.routed_experts_fp8(x, ids, w, gate, up, down, shared=(sg, su, sd, sw), interpret=True)
    mlp = {"gate_proj": {"weight": sg}, "up_proj": {"weight": su}, "down_proj": {"weight": sd}}
    want = moe_ref.routed_experts(x, ids, w, gate, up, down) + sw[:, None] * layers.mlp(mlp, x).astype(jnp.float32)
    assert got.shape == (n, h) and np.isfinite(np.asarray(got)).all()
    assert _rel(got, want) < 1e-2
    alone = k.routed_experts_fp8(x, ids, w, gate, up, down, interpret=True)
    assert _rel(alone, want) > 10 * _rel(got, want)  # the shared expert's share is in it
    assert "shared expert" in k.unsupported(x, ids, gate, up, down, (sg, su, _shared(key, i, h)[0]))


def test_the_moe_layer_takes_the_fused_op_only_where_named(monkeypatch):
    """`layers.moe` with FP8 experts and shared expert: the same output through the fused kernels
    (``MTP_KERNELS=moe_fp8=interpret``) as through the reference path, which "auto" keeps."""
    from mtp.model import layers

    e, i, h, kk = 16, 128, 256, 4
    key = jax.random.key(11)
    gate, up, down = _experts(jax.random.fold_in(key, 1), e, i, h)
    sg, su, sd = _shared(jax.random.fold_in(key, 2), i, h)
    small = lambda i, shape: (0.1 * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(jnp.bfloat16)
    p = {"gate": {"weight": small(3, (e, h))}, "shared_expert_gate": {"weight": small(4, (1, h))},
         "experts": {"gate_proj": {"weight": gate}, "up_proj": {"weight": up}, "down_proj": {"weight": down}},
         "shared_expert": {"gate_proj": {"weight": sg}, "up_proj": {"weight": su}, "down_proj": {"weight": sd}}}
    cfg = type("Cfg", (), {"num_experts_per_tok": kk, "norm_topk_prob": True})()
    x = jax.random.normal(jax.random.fold_in(key, 5), (1, 3, h)).astype(jnp.bfloat16)
    monkeypatch.delenv("MTP_KERNELS", raising=False)
    ref = layers.moe(p, x, cfg)
    text = str(jax.make_jaxpr(lambda x: layers.moe(p, x, cfg))(x))
    assert "pallas_call" not in text
    monkeypatch.setenv("MTP_KERNELS", "moe_fp8=interpret")
    got = layers.moe(p, x, cfg)
    assert "pallas_call" in str(jax.make_jaxpr(lambda x: layers.moe(p, x, cfg))(x))
    assert got.shape == ref.shape == x.shape and got.dtype == x.dtype
    assert _rel(got.astype(jnp.float32), ref.astype(jnp.float32)) < 1e-2
