"""The residual add + RMSNorm kernel (interpret mode) against the model's own add and norm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.model import gemm_layout
from mtp.ops.add_rms_norm import add_rms_norm, add_rms_norm_reference
from mtp.ops.add_rms_norm.triton import kernel_unsupported, row_pieces

# The compiled Triton kernel on a GPU, the same kernel code in Pallas' interpreter elsewhere.
IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"


def _case(seed, x_shape, y_shape, dtype):
    ks = jax.random.split(jax.random.key(seed), 3)
    h = x_shape[-1]
    x = (3 * jax.random.normal(ks[0], x_shape)).astype(dtype)
    y = jax.random.normal(ks[1], y_shape).astype(dtype)
    w = (0.2 * jax.random.normal(ks[2], (h,))).astype(dtype)
    return x, y, w


@pytest.mark.parametrize("x_shape,y_shape,dtype,tol", [
    ((3, 4, 64), (3, 4, 64), jnp.float32, 1e-6),       # the stream as [B, T, H]
    ((2, 128), (1, 1, 128), jnp.float32, 1e-6),         # the padded one-row stream: row 1 is padding
    ((8, 128), (3, 1, 128), jnp.bfloat16, 1e-2),        # padding past a batch of 3, bf16
    ((2, 384), (1, 1, 384), jnp.bfloat16, 1e-2),        # the default model's width: 256 + 128
    ((3, 2, 112), (3, 2, 112), jnp.float32, 1e-6),      # 64 + 32 + 16
])
def test_kernel_matches_reference(x_shape, y_shape, dtype, tol):
    x, y, w = _case(sum(x_shape), x_shape, y_shape, dtype)
    assert kernel_unsupported(x, y, w) is None
    s, h = add_rms_norm(x, y, w, eps=1e-6, impl=IMPL)
    s_ref, h_ref = add_rms_norm_reference(x, y, w, eps=1e-6)
    assert s.shape == h.shape == x.shape and s.dtype == h.dtype == dtype
    f = lambda a: np.asarray(a, np.float32)
    np.testing.assert_array_equal(f(s), f(s_ref))  # one rounding of x + y either way
    np.testing.assert_allclose(f(h), f(h_ref), atol=tol, rtol=tol)
    real = y.size // x_shape[-1]
    x2 = f(x).reshape(-1, x_shape[-1])
    np.testing.assert_array_equal(f(s).reshape(x2.shape)[real:], x2[real:])  # padding rows: x + 0
    assert np.abs(f(s).reshape(x2.shape)[:real] - x2[:real]).max() > 0.1     # real rows moved


def test_row_pieces_cover_the_row():
    for h in (16, 48, 384, 2048, 4096 + 1024 + 16):
        pieces = row_pieces(h)
        assert sum(size for _, size in pieces) == h
        assert [off for off, _ in pieces] == [sum(size for _, size in pieces[:i]) for i in range(len(pieces))]
        assert all(size & (size - 1) == 0 for _, size in pieces)


def test_padding_rows_stay_zero_in_the_padded_stream():
    x = gemm_layout.stream_rows(jax.random.normal(jax.random.key(0), (1, 1, 64)), pad=True)
    y = jax.random.normal(jax.random.key(1), (1, 1, 64))
    s, h = add_rms_norm(x, y, jnp.zeros((64,)), eps=1e-6, impl=IMPL)
    assert not s[1:].any() and not h[1:].any() and s[0].any()


def test_unsupported_inputs_take_the_reference():
    x, y, w = _case(0, (2, 120), (2, 120), jnp.float32)  # 120 is no multiple of 16
    assert "power-of-two pieces" in kernel_unsupported(x, y, w)
    s, h = add_rms_norm(x, y, w, eps=1e-6, impl=IMPL)
    s_ref, h_ref = add_rms_norm_reference(x, y, w, eps=1e-6)
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_array_equal(h, h_ref)
    x, y, w = _case(0, (2, 64), (2, 64), jnp.float32)
    assert "dtype" in kernel_unsupported(x, y.astype(jnp.bfloat16), w)


@pytest.mark.parametrize("impl", ["reference", "interpret", "auto"])
def test_mismatched_inputs_are_named(impl):
    """Inputs no path can add: named, not an indexing error from deep inside the reference."""
    x, y, w = _case(0, (2, 64), (3, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"y \(3, 64\) has more rows than the stream x \(2, 64\)"):
        add_rms_norm(x, y, w, eps=1e-6, impl=impl)
    with pytest.raises(ValueError, match=r"y \(2, 48\).*x \(2, 64\)"):
        add_rms_norm(x, y[:2, :48], w, eps=1e-6, impl=impl)
    with pytest.raises(ValueError, match=r"w \(32,\).*x \(2, 64\)"):
        add_rms_norm(x, y[:2], w[:32], eps=1e-6, impl=impl)


def test_auto_takes_the_kernel_for_one_row_only(monkeypatch):
    """On a GPU ``auto`` takes the kernel when ``y`` is one row (``kernel_pays``), also inside the
    padded stream, and the reference above (XLA fuses its split-K GEMMs' reduction with the add and
    the norm); a named ``pallas`` (``MTP_KERNELS=add_rms_norm=pallas``) takes the kernel at any rows."""
    from mtp.execution import ExecutionConfig
    from mtp.ops import lowering
    from mtp.ops.add_rms_norm import triton

    calls = []
    monkeypatch.setattr(triton, "add_rms_norm_triton", lambda x, y, *a, **k: calls.append(y.shape) or ("s", "h"))
    monkeypatch.setattr(lowering, "on_gpu", lambda: True)
    run = lambda x_rows, y_rows, impl="auto": add_rms_norm(*_case(0, (x_rows, 64), (y_rows, 1, 64), jnp.float32),
                                                           eps=1e-6, impl=impl)
    assert run(gemm_layout.PAD_ROWS, 1)[0] == "s" and calls == [(1, 1, 64)]
    assert isinstance(run(2, 2)[0], jax.Array) and len(calls) == 1
    named = ExecutionConfig.from_environ({"MTP_KERNELS": "add_rms_norm=pallas"}).impl_for("add_rms_norm")
    assert run(2, 2, named)[0] == "s" and len(calls) == 2
