"""The MoE weight-streaming kernels (`mtp.ops.moe.triton`) in Pallas' interpreter, against an f64
oracle that rounds where they round, against the op's reference, and inside the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.execution import ExecutionConfig
from mtp.ops import fp8
from mtp.ops.moe import api, reference, triton
from mtp.ops.moe.reference import RouterLogits, SharedExpert
from mtp.ops.moe.triton import StreamConfig, moe_stream, routed_experts_stream, unsupported

BF16 = jnp.bfloat16


def _inputs(seed, n, k, e, h, i, shared_i=None, quant=(), repeat=False):
    """Random bf16 rows, routing and experts; ``quant`` names the weights stored block-scaled FP8
    (of ``gate``, ``up``, ``down``, ``shared``); ``repeat``: every token picks expert 0 first."""
    rng = np.random.default_rng(seed)
    w = lambda name, shape: _weight(rng, shape, name in quant)
    x = jnp.asarray(rng.standard_normal((n, h)), BF16)
    gate, up, down = w("gate", (e, i, h)), w("up", (e, i, h)), w("down", (e, h, i))
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    if repeat:
        ids[:, 0] = 0
        ids[:, 1:] = np.stack([rng.choice(np.arange(1, e), k - 1, replace=False) for _ in range(n)])
    weights = rng.random((n, k)).astype(np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    shared = None
    if shared_i is not None:
        shared = SharedExpert(w("shared", (shared_i, h)), w("shared", (shared_i, h)), w("shared", (h, shared_i)),
                              jnp.asarray(1 / (1 + np.exp(-rng.standard_normal(n))), jnp.float32))
    return x, jnp.asarray(ids, jnp.int32), jnp.asarray(weights), gate, up, down, shared


def _weight(rng, shape, quantized):
    w = jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-1]), jnp.float32)
    return fp8.quantize(w) if quantized else w.astype(BF16)


def _f64(w):
    """A weight's exact value: an FP8 weight dequantized in f64, a bf16 one widened."""
    if isinstance(w, fp8.BlockFp8Weight):
        return np.asarray(w.values.astype(jnp.float32), np.float64) * np.asarray(fp8.expand_scales(w.scale_inv, w.shape, w.block), np.float64)
    return np.asarray(w.astype(jnp.float32), np.float64)


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(BF16).astype(jnp.float32), np.float64)


def _expert(x, gate, up, down):
    """One expert on rows ``x`` with the kernels' roundings: g, u, silu(g) and h to bf16, then y."""
    g, u = _bf16(x @ gate.T), _bf16(x @ up.T)
    h = _bf16(_bf16(g / (1 + np.exp(-g))) * u)
    return _bf16(h @ down.T)


def oracle(x, ids, weights, gate, up, down, shared=None):
    x = np.asarray(x.astype(jnp.float32), np.float64)
    g, u, d = _f64(gate), _f64(up), _f64(down)
    ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[n, j]
            out[n] += weights[n, j] * _expert(x[n:n + 1], g[e], u[e], d[e])[0]
    if shared is not None:
        out += np.asarray(shared.weight, np.float64)[:, None] * _expert(x, *map(_f64, shared[:3]))
    return out


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


CASES = [  # (n, k, e, h, i, shared_i, quant, config)
    (1, 4, 16, 256, 128, 128, (), None),
    (3, 2, 8, 384, 128, None, (), StreamConfig(block_i=32, block_h=64, chunk=128)),
    (16, 3, 12, 256, 64, 128, (), StreamConfig(block_i=16, block_h=32, chunk=64, num_stages=1)),  # Is != I
    (2, 4, 16, 256, 128, 256, ("gate", "up", "down", "shared"), None),
    (5, 2, 8, 512, 256, 128, ("gate", "up", "down"), StreamConfig(block_i=64, block_h=128, chunk=256)),
    (4, 3, 8, 256, 128, 128, ("down", "shared"), StreamConfig(chunk=64)),  # a chunk under one scale block
]


@pytest.mark.parametrize("n,k,e,h,i,shared_i,quant,config", CASES)
def test_the_kernels_are_the_oracle(n, k, e, h, i, shared_i, quant, config):
    args = _inputs(n * 7 + k, n, k, e, h, i, shared_i, quant)
    got = routed_experts_stream(*args, impl="interpret", config=config)
    assert got.shape == (n, h) and got.dtype == jnp.float32
    want = oracle(*args)
    # The f32 sums may round a bf16 intermediate the other way from the f64 oracle's now and then.
    assert _rel_err(got, want) < 2e-3, _rel_err(got, want)
    # The reference rounds an FP8 weight to bf16 before its dot, the kernels do not: a looser bound.
    ref = reference.routed_experts(*args)
    assert _rel_err(got, ref) < (2e-2 if quant else 1e-2)


def test_a_token_gets_the_same_bits_alone_and_in_a_verify():
    """Each output element's sum runs in the same chunks at any token count, so a verify's rows equal
    the decode step's, bit for bit: greedy speculative decoding compares like with like."""
    x, ids, w, gate, up, down, shared = _inputs(3, 5, 4, 16, 256, 128, 128, repeat=True)
    together = routed_experts_stream(x, ids, w, gate, up, down, shared, impl="interpret")
    for n in range(5):
        one = SharedExpert(*shared[:3], shared.weight[n:n + 1])
        alone = routed_experts_stream(x[n:n + 1], ids[n:n + 1], w[n:n + 1], gate, up, down, one, impl="interpret")
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(together[n]))


def test_unsupported_names_why():
    x, ids, w, gate, up, down, shared = _inputs(0, 2, 2, 8, 256, 128, 128)
    assert unsupported(x, gate, up, down, shared) is None
    assert "float32" in unsupported(x.astype(jnp.float32), gate, up, down)
    many = jnp.zeros((triton.MAX_TOKENS + 1, 256), BF16)
    assert f"{triton.MAX_TOKENS + 1} tokens" in unsupported(many, gate, up, down)
    assert "multiple of the block" in unsupported(x, gate[:, :100], up[:, :100], down[:, :, :100])
    assert "shared expert's I" in unsupported(x, gate, up, down,
                                              SharedExpert(shared.gate[:8], shared.up[:8], shared.down[:, :8],
                                                           shared.weight))
    assert "blocks of rows dividing 128" in unsupported(x, gate, up, fp8.quantize(down.astype(jnp.float32)),
                                                        config=StreamConfig(block_h=256))
    assert "BlockFp8Weight" in unsupported(x, gate.astype(jnp.float32), up, down)
    with pytest.raises(ValueError, match="power of two"):
        routed_experts_stream(x, ids, w, gate, up, down, config=StreamConfig(block_i=24))


def _router(seed, n, e, k, normalize, padding=1, extra=1):
    """Router rows as a merged GEMM writes them: ``n`` tokens then ``padding`` zero rows, the ``e``
    logits then ``extra`` columns of another projection; bf16, as the model's GEMMs write."""
    rng = np.random.default_rng(seed)
    rows = np.zeros((n + padding, e + extra), np.float32)
    rows[:n] = rng.standard_normal((n, e + extra)) * 2
    return RouterLogits(jnp.asarray(rows, BF16), e, k, normalize)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("n,k,e,quant", [(1, 4, 16, ()), (5, 3, 8, ()), (2, 2, 16, ("gate", "up", "down", "shared"))])
def test_the_gate_up_kernel_routes_as_the_reference(n, k, e, quant, normalize):
    """`moe_stream` finds each pair's expert and weight from the router rows (their padding rows and
    trailing columns left alone) as `reference.route` does: the same experts, the same bf16 weights."""
    x, _, _, gate, up, down, shared = _inputs(n + e, n, k, e, 256, 128, 128, quant)
    router = _router(n * 3 + e, n, e, k, normalize)
    ids, weights = reference.route(router, n, BF16)
    got = moe_stream(x, router, gate, up, down, shared, impl="interpret")
    want = routed_experts_stream(x, ids, weights, gate, up, down, shared, impl="interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert _rel_err(got, oracle(x, ids, weights, gate, up, down, shared)) < 2e-3
    other = reference.route(_router(n * 3 + e + 1, n, e, k, normalize), n, BF16)  # the routing matters
    assert _rel_err(got, oracle(x, *other, gate, up, down, shared)) > 1e-2


def test_the_kernel_breaks_ties_as_the_reference():
    """Logits on a coarse grid tie often, and ``-0`` ties ``+0``: the lower id goes first, as
    ``lax.top_k`` takes it; f32 rows are left to the reference (the kernel orders bf16 keys)."""
    n, k, e = 4, 6, 16
    x, _, _, gate, up, down, shared = _inputs(7, n, k, e, 256, 128, 128)
    levels = np.random.default_rng(3).integers(-2, 3, size=(n + 1, e)).astype(np.float32)
    levels[levels == 0] = np.where(np.random.default_rng(4).random((levels == 0).sum()) < 0.5, -0.0, 0.0)
    levels[n] = 0
    for normalize in (True, False):
        router = RouterLogits(jnp.asarray(levels, BF16), e, k, normalize)
        ids, weights = reference.route(router, n, BF16)
        got = moe_stream(x, router, gate, up, down, shared, impl="interpret")
        want = routed_experts_stream(x, ids, weights, gate, up, down, shared, impl="interpret")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    f32_rows = RouterLogits(jnp.asarray(levels), e, k, True)
    assert "bfloat16 logits" in unsupported(x, gate, up, down, shared, f32_rows)


def test_moe_ffn_routes_in_the_kernel_or_by_the_reference(monkeypatch):
    calls = []
    run = triton.moe_stream
    monkeypatch.setattr(triton, "moe_stream", lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k))
    x, _, _, gate, up, down, shared = _inputs(9, 3, 4, 16, 256, 128, 128)
    router = _router(4, 3, 16, 4, True)
    got = api.moe_ffn(x, router, gate, up, down, shared=shared, impl="interpret")
    assert calls == [3]
    ids, weights = reference.route(router, 3, BF16)
    ref = api.moe_ffn(x, router, gate, up, down, shared=shared, impl="reference")
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(reference.routed_experts(x, ids, weights, gate, up,
                                                                                       down, shared)))
    assert _rel_err(got, ref) < 1e-2
    odd = RouterLogits(router.rows, 12, 4, True)  # not a power of two: the reference routes
    assert "power-of-two" in unsupported(x, gate, up, down, shared, odd)


def test_the_op_streams_few_tokens_and_adds_the_shared_expert_elsewhere(monkeypatch):
    """``routed_experts`` hands up to ``MAX_TOKENS`` rows with the shared expert to the kernels; on the
    reference path (or for f32 rows) the shared expert joins the reference's sum."""
    calls = []
    run = triton.routed_experts_stream
    monkeypatch.setattr(triton, "routed_experts_stream", lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k))
    args = _inputs(5, 3, 2, 8, 256, 128, 128)
    got = api.routed_experts(*args[:6], shared=args[6], impl="interpret")
    assert calls == [3]
    assert _rel_err(got, oracle(*args)) < 2e-3
    ref = api.routed_experts(*args[:6], shared=args[6], impl="reference")
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(reference.routed_experts(*args)))
    routed = reference.routed_experts(*args[:6])
    np.testing.assert_allclose(np.asarray(ref), np.asarray(routed + reference.shared_expert(args[0], args[6])))
    assert _rel_err(ref - routed, oracle(*args) - oracle(*args[:6])) < 1e-2  # the shared expert is in the sum
    with pytest.raises(ValueError, match="shared expert's weight"):
        api.routed_experts(*args[:6], shared=args[6]._replace(weight=args[6].weight[:2]))


def test_the_kernels_lower_to_triton_for_an_h200(monkeypatch):
    """Both kernels through Pallas' Triton lowering for compute capability 9.0, on the CPU (no PTX):
    the interpreter runs any jaxpr, the lowering is where an indexer or a reshape Triton lacks fails."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)
    for quant in ((), ("gate", "up", "down", "shared")):
        args = jax.eval_shape(lambda: _inputs(0, 4, 8, 32, 2048, 512, 512, quant))
        f = lambda *a: routed_experts_stream(*a, impl="pallas")
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call") >= 2, text[:2000]
        x, _, _, gate, up, down, shared = args
        router = RouterLogits(jax.ShapeDtypeStruct((4, 33), BF16), 32, 8, True)
        routed = lambda x, rows, *w: moe_stream(x, RouterLogits(rows, 32, 8, True), *w, impl="pallas")
        text = jax.jit(routed).trace(x, router.rows, gate, up, down, shared).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call") >= 2, text[:2000]


def test_greedy_speculative_decoding_through_the_kernels_is_token_identical(monkeypatch):
    """The tiny MoE model (routed experts of 16 rows, a shared expert of 32) in bf16, its MoE layers
    on the kernels (interpreted) in both loops: every call a decode, verify or propose step makes."""
    from mtp.generation import generate
    from mtp.speculative import SpecConfig
    from tests.conftest import agreeing_params, tiny_config

    cfg = tiny_config("tiny_moe")
    params = jax.tree.map(lambda a: a.astype(BF16), agreeing_params(cfg, 11, 0.01))
    spec = SpecConfig(max_new_tokens=8, verify_width=3, plain_width=3,
                      execution=ExecutionConfig().with_kernels(moe="interpret"))
    calls = []
    run = triton.moe_stream
    monkeypatch.setattr(triton, "moe_stream", lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k))
    prompts = [[5, 9, 2, 7, 3], [11, 4, 8]]
    plain = generate(cfg, params, prompts, spec, speculative=False).tokens
    res = generate(cfg, params, prompts, spec)
    assert calls and max(calls) <= triton.MAX_TOKENS, calls
    assert res.tokens == plain
    assert res.stats.accepted > 0, res.stats
