"""Paged attention: the Mosaic GPU kernel and the Triton-lowered form (interpret mode) against
the reference, and the reference against a plain dense attention written in numpy."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from mtp.execution import ExecutionConfig
from mtp.model import gemm_layout
from mtp.ops import dispatch, lowering
from mtp.ops.paged_attention import api, mosaic, paged_attention, paged_attention_reference, triton
from mtp.ops.paged_attention.reference import merge_splits_reference
from tests.conftest import decode_through_kernel


def _inputs(seed, b, nq, hq, hkv, d, page, lengths, max_blocks, num_pages, gate=False):
    """Random q/pages and a random, non-contiguous block table (a page may repeat)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, nq, hq, d), np.float32)
    k = rng.standard_normal((num_pages, page, hkv, d), np.float32)
    v = rng.standard_normal((num_pages, page, hkv, d), np.float32)
    bt = rng.integers(0, num_pages, (b, max_blocks), dtype=np.int32)
    g = rng.standard_normal((b, nq, hq, d), np.float32) if gate else None
    cast = lambda x: None if x is None else jnp.asarray(x, jnp.bfloat16)
    return (cast(q), cast(k), cast(v), jnp.asarray(bt), jnp.asarray(lengths, jnp.int32)), cast(g)


def _dense_numpy(q, k_pages, v_pages, bt, lengths, scale, gate):
    q, kp, vp = (np.asarray(x, np.float32) for x in (q, k_pages, v_pages))
    b, nq, hq, d = q.shape
    hkv = kp.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        k = kp[np.asarray(bt)[bi]].reshape(-1, hkv, d)
        v = vp[np.asarray(bt)[bi]].reshape(-1, hkv, d)
        for i in range(nq):
            pos = int(lengths[bi]) - nq + i
            if pos < 0:
                continue
            for h in range(hq):
                kh = h // (hq // hkv)
                s = k[: pos + 1, kh] @ q[bi, i, h] * scale
                p = np.exp(s - s.max())
                out[bi, i, h] = (p / p.sum()) @ v[: pos + 1, kh]
    if gate is not None:
        out = out / (1.0 + np.exp(-np.asarray(gate, np.float32)))
    return out


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize(
    "b,nq,hq,hkv,d,page,lengths,max_blocks,num_pages,gate",
    [
        # Analogue of (32, 8, 128): G = 4. Ragged lengths, partial last pages, Q = 1.
        (3, 1, 8, 2, 64, 16, [37, 130, 5], 9, 24, False),
        # Same heads, verify width Q = 3 (causal inside the block), gated output.
        (2, 3, 8, 2, 64, 16, [150, 19], 10, 24, True),
        # Analogue of (16, 2, 256): G = 8, Q = 2; one sequence spans several kernel splits.
        (2, 2, 8, 1, 128, 16, [260, 33], 17, 40, False),
        # Pages larger than a KV tile (several tiles read from one page), D = 256.
        (1, 2, 4, 1, 256, 128, [201], 2, 5, True),
    ],
)
def test_kernel_matches_reference(b, nq, hq, hkv, d, page, lengths, max_blocks, num_pages, gate):
    args, g = _inputs(len(lengths) * 7 + nq, b, nq, hq, hkv, d, page, lengths, max_blocks,
                      num_pages, gate)
    out = paged_attention(*args, gate=g, impl="interpret")
    ref = paged_attention_reference(*args, gate=g)
    assert out.shape == ref.shape == (b, nq, hq, d) and out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, ref) < 1e-2


def test_head_dim_192_takes_the_reference():
    """The Mosaic kernel's P @ V runs in whole 128-column chunks, so D = 192 would leave columns
    128-191 uncomputed; neither form claims it, and the public op equals the reference."""
    args, g = _inputs(5, 2, 2, 4, 2, 192, 16, [40, 9], 3, 6, gate=True)
    assert "64, 128 or 256" in mosaic.kernel_unsupported(args[0], args[1])
    assert "powers of two" in triton.triton_unsupported(args[0], args[1])
    out = paged_attention(*args, gate=g, impl="interpret")
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(api._reference_jit(*args, gate=g), np.float32))


def test_kernel_custom_scale_and_idle_slots():
    """An idle slot (length 0) and a query before position 0 return zeros, not NaN."""
    args, _ = _inputs(3, 3, 2, 8, 2, 64, 16, [0, 1, 40], 4, 8)
    out = np.asarray(paged_attention(*args, scale=0.3, impl="interpret"), np.float32)
    ref = np.asarray(paged_attention_reference(*args, scale=0.3), np.float32)
    assert np.isfinite(out).all()
    assert np.all(out[0] == 0) and np.all(out[1, 0] == 0)
    assert np.any(out[1, 1] != 0)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("nq,gate", [(1, False), (4, True)])
def test_reference_matches_dense_numpy(nq, gate):
    args, g = _inputs(11, 3, nq, 6, 2, 32, 8, [29, 3, 0], 5, 12, gate)
    ref = paged_attention_reference(*args, scale=0.2, gate=g)
    want = _dense_numpy(*args, 0.2, g)
    assert np.isfinite(np.asarray(ref, np.float32)).all()
    np.testing.assert_allclose(np.asarray(ref, np.float32), want, atol=3e-2, rtol=3e-2)
    assert np.all(np.asarray(ref, np.float32)[2] == 0)


def test_bad_impl_flag_names_the_choices():
    args, _ = _inputs(0, 1, 1, 2, 1, 64, 16, [4], 1, 2)
    with pytest.raises(ValueError, match="auto, reference, pallas, interpret"):
        paged_attention(*args, impl="triton")
    environ = lambda kernels: ExecutionConfig.from_environ({"MTP_KERNELS": kernels})
    with pytest.raises(ValueError, match="MTP_KERNELS"):
        environ("fast")
    assert dispatch.resolve_impl(environ("reference").impl_for("paged_attention")) == "reference"
    assert dispatch.resolve_impl("interpret") == "interpret"
    both = environ("interpret,gdn_step=reference")  # all, then one op
    assert dispatch.resolve_impl(both.impl_for("gdn_step"), op="gdn_step") == "reference"
    assert dispatch.resolve_impl(both.impl_for("paged_attention"), op="paged_attention") == "interpret"
    assert dispatch.resolve_impl("pallas", op="gdn_step") == "pallas"  # an explicit choice wins
    with pytest.raises(ValueError, match="no op named 'gdn-step'; the ops are paged_attention"):
        environ("gdn-step=pallas")
    with pytest.raises(ValueError, match="MTP_KERNELS entry gdn_step='fast'"):
        environ("gdn_step=fast")
    with pytest.raises(ValueError, match="no op named 'gdn-step'"):
        ExecutionConfig(kernels=(("gdn-step", "pallas"),))
    with pytest.raises(ValueError, match="ExecutionConfig.everywhere='fast'"):
        ExecutionConfig.everywhere("fast")
    expected = "pallas" if jax.default_backend() == "gpu" else "reference"
    assert dispatch.resolve_impl(ExecutionConfig.from_environ({}).impl_for("paged_attention")) == expected


def test_shape_errors_are_named():
    args, _ = _inputs(0, 2, 1, 6, 4, 64, 16, [4, 4], 1, 2)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention_reference(*args)
    args, _ = _inputs(0, 2, 1, 4, 2, 64, 16, [4, 4], 1, 2)
    with pytest.raises(ValueError, match="lengths"):
        paged_attention_reference(*args[:4], jnp.zeros((3,), jnp.int32))
    # Checked before either form's support is asked (which reads q as [B, Q, Hq, D]).
    for impl in ("auto", "interpret"):
        with pytest.raises(ValueError, match=r"q must be \[B, Q, Hq, D\], got shape \(2, 4, 64\)"):
            paged_attention(args[0][:, 0], *args[1:], impl=impl)
    with pytest.raises(ValueError, match="q must be"):
        triton.paged_attention_triton(args[0][:, 0], *args[1:], interpret=True)


def test_kernel_modes_send_what_the_kernel_cannot_take_to_the_reference(monkeypatch):
    """A prefill chunk (Q*G > 64) or f32 caches never reach the kernel, so one switch
    can turn the kernels on for the whole model; the kernel entry itself says why."""
    calls = []
    monkeypatch.setattr(mosaic, "paged_attention_mosaic", lambda *a, **k: calls.append(a[0].shape) or "kernel")
    ok, _ = _inputs(1, 2, 4, 8, 2, 64, 16, [9, 30], 2, 4)  # Q*G = 16 rows, bf16: the kernel's
    assert paged_attention(*ok, impl="pallas") == "kernel" and calls == [(2, 4, 8, 64)]
    long_chunk, _ = _inputs(2, 1, 17, 8, 2, 64, 16, [40], 3, 4)  # Q*G = 68 rows
    f32 = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in ok)
    for args in (long_chunk, f32):
        assert mosaic.kernel_unsupported(args[0], args[1])
        # Against the reference jitted, as the fallback runs it: on a GPU, op-by-op execution
        # rounds differently (and runs f32 dots in TF32).
        np.testing.assert_allclose(np.asarray(paged_attention(*args, impl="pallas"), np.float32),
                                   np.asarray(jax.jit(paged_attention_reference)(*args), np.float32), rtol=1e-6)
    assert len(calls) == 1  # neither went to the kernel
    monkeypatch.undo()
    with pytest.raises(ValueError, match="16-bit dtype"):
        mosaic.paged_attention_mosaic(*f32, scale=None, gate=None)
    with pytest.raises(ValueError, match="query rows"):
        mosaic.paged_attention_mosaic(*long_chunk, scale=None, gate=None)


def test_auto_follows_the_target_device(monkeypatch):
    """``impl="auto"``, the tile plans and the GEMM padding ask the device traces compile for:
    ``jax_default_device`` when set (a deviceless compile sets a compile-only GPU there)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        assert lowering.target_device() == cpu and not lowering.on_gpu()
        assert dispatch.resolve_impl("auto", op="paged_attention") == "reference"
    with jax.default_device("cpu"):
        assert lowering.target_device().platform == "cpu"

    class CompileOnlyGpu:
        platform, core_count = "gpu", 99

    class Config:
        jax_default_device = CompileOnlyGpu()

    monkeypatch.setattr(lowering.jax, "config", Config())
    assert lowering.on_gpu() and lowering.num_sms() == 99 and gemm_layout.pad_small_gemms(ExecutionConfig())
    assert dispatch.resolve_impl("auto", op="paged_attention") == "pallas"


@pytest.mark.parametrize(
    "b,nq,hq,hkv,d,page,lengths,max_blocks,num_pages,gate,splits",
    [
        # The default model's heads (6, 2, 64), ragged lengths and partial last pages, Q = 1.
        (3, 1, 6, 2, 64, 16, [37, 130, 5], 9, 24, False, None),
        # Verify width Q = 3 (causal inside the block), gated, the sequence over 4 splits.
        (2, 3, 6, 2, 64, 16, [150, 19], 10, 24, True, 4),
        # (16, 2, 256)'s grouping, G = 8, Q = 2: 16 query rows, one split; an idle slot (length 0).
        (2, 2, 16, 2, 256, 16, [260, 0], 17, 40, False, 1),
        # 32-token pages, G = 1.
        (1, 4, 2, 2, 32, 32, [45], 3, 5, True, 2),
    ],
)
def test_triton_form_matches_reference(b, nq, hq, hkv, d, page, lengths, max_blocks, num_pages, gate, splits):
    args, g = _inputs(len(lengths) * 5 + nq, b, nq, hq, hkv, d, page, lengths, max_blocks, num_pages, gate)
    out = triton.paged_attention_triton(*args, gate=g, splits=splits, interpret=jax.default_backend() != "gpu")
    ref = paged_attention_reference(*args, gate=g)
    assert out.shape == ref.shape == (b, nq, hq, d) and out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, ref) < 1e-2
    idle = np.asarray(args[4]) == 0
    assert not np.asarray(out, np.float32)[idle].any()  # no position: zeros, as the reference


def test_triton_form_is_taken_only_where_named(monkeypatch):
    """Opt-in (``dispatch.OPT_IN``): ``auto`` keeps the Mosaic kernel / reference; a per-op entry
    (``MTP_KERNELS=paged_attention_triton=...``) names the Triton form, a global value
    (``MTP_KERNELS=pallas``, measured slower there) does not; shapes it cannot take (a page of 4
    tokens) fall through to the usual path."""
    calls = []
    monkeypatch.setattr(triton, "paged_attention_triton", lambda *a, **k: calls.append(k["interpret"]) or "triton")
    args, _ = _inputs(0, 1, 1, 4, 2, 32, 16, [20], 2, 3)

    def attend(inputs, kernels=None):  # as the model calls it, under MTP_KERNELS=kernels
        execution = ExecutionConfig.from_environ({} if kernels is None else {"MTP_KERNELS": kernels})
        return paged_attention(*inputs, impl=execution.impl_for("paged_attention"),
                               triton_impl=execution.impl_for("paged_attention_triton"))

    assert isinstance(attend(args), jax.Array) and not calls
    assert attend(args, "paged_attention_triton=interpret") == "triton" and calls == [True]
    assert isinstance(paged_attention(*args, impl="reference"), jax.Array)  # an explicit impl is kept
    small, _ = _inputs(0, 1, 1, 4, 2, 32, 4, [7], 2, 3)
    assert "page size 4" in triton.triton_unsupported(small[0], small[1])
    huge = jax.ShapeDtypeStruct((2**22, 16, 2, 32), jnp.bfloat16)  # 2**32 elements, never allocated
    assert "int32" in triton.triton_unsupported(args[0], huge)
    assert isinstance(attend(small, "paged_attention_triton=interpret"), jax.Array) and len(calls) == 1
    for everything in ("pallas", "interpret"):  # a global value is no per-op entry
        triton_impl = ExecutionConfig.everywhere(everything).impl_for("paged_attention_triton")
        assert dispatch.resolve_impl(triton_impl, op="paged_attention_triton") == "reference"
        assert isinstance(attend(args, everything), jax.Array) and len(calls) == 1  # D = 32: the reference
    monkeypatch.setattr(lowering, "on_gpu", lambda: True)
    resolved = lambda execution, op: dispatch.resolve_impl(execution.impl_for(op), op=op)
    on_pallas = ExecutionConfig.everywhere("pallas")
    assert resolved(on_pallas, "paged_attention_triton") == "reference"
    assert resolved(on_pallas, "paged_attention") == "pallas"
    named = ExecutionConfig.from_environ({"MTP_KERNELS": "interpret,paged_attention_triton=pallas"})
    assert resolved(named, "paged_attention_triton") == "pallas"


def test_model_decode_and_verify_through_the_triton_form(monkeypatch):
    """The default model's shapes (random weights): decode and a verify of 3 with the Triton form
    equal the same with the reference attention. Full f32 dots on both sides: a GPU would run the
    interpreted kernel's f32 dots in TF32 otherwise (1.4e-3 apart, measured)."""
    with jax.default_matmul_precision("highest"):
        runs = decode_through_kernel(monkeypatch, triton, "paged_attention_triton", "paged_attention_triton",
                                     decode_steps=2, verify=3, model="default", page=16)
    (want, _), (got, _) = runs["reference"], runs["interpret"]
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("nq,splits,gated,d", [(1, 34, True, 128), (3, 5, False, 32), (4, 1, True, 192)])
def test_merge_kernel_matches_its_reference(nq, splits, gated, d):
    """The splits' merge as one kernel (Triton; interpreted off a GPU) against the XLA definition: empty
    splits (-inf) and padding rows past Q G ignored, the gate, the [B, Q, Hq, D] layout."""
    b, hq, hkv, rows = 2, 8, 2, 16
    ks = jax.random.split(jax.random.key(nq + splits), 4)
    o_part = jax.random.normal(ks[0], (b, hkv, splits, rows, d)).astype(jnp.bfloat16)
    lse = 3 * jax.random.normal(ks[1], (b, hkv, splits, rows))
    lse = jnp.where(jax.random.uniform(ks[2], lse.shape) < 0.2, -jnp.inf, lse)  # empty splits
    lse = lse.at[0, 1, :, 0].set(-jnp.inf)  # a row no split saw: zeros out
    q = jnp.zeros((b, nq, hq, d), jnp.bfloat16)
    gate = jax.random.normal(ks[3], q.shape).astype(jnp.bfloat16) if gated else None
    got = triton.merge_splits(o_part, lse, q, gate, interpret=jax.default_backend() != "gpu")  # compiled on a GPU
    want = merge_splits_reference(o_part, lse, q, gate)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_array_equal(np.asarray(got[0, 0, hq // hkv]), 0)  # row 0 of KV head 1
    assert float(jnp.abs(want.astype(jnp.float32)).mean()) > 0.05
    with pytest.raises(ValueError, match="head dim 96"):
        triton.merge_splits(jnp.zeros((b, hkv, splits, rows, 96)), lse, jnp.zeros((b, nq, hq, 96)), None, interpret=True)
