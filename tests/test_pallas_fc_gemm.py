"""The drafter's fused norm + concat + fc GEMM against its reference and numpy."""

import numpy as np
import pytest

import jax.numpy as jnp

from mtp.pallas.fc_gemm import fc_gemm, fc_gemm_reference


def _inputs(seed, m, h):
    rng = np.random.default_rng(seed)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    embed = bf(rng.standard_normal((m, h)))
    hidden = bf(4.0 * rng.standard_normal((m, h)) + 0.5)  # different row norms than embed
    norm_e = bf(0.2 * rng.standard_normal(h))
    norm_h = bf(0.2 * rng.standard_normal(h))
    w = bf(rng.standard_normal((h, 2 * h)) / np.sqrt(2 * h))
    return embed, hidden, norm_e, norm_h, w


def _numpy_fc(embed, hidden, norm_e, norm_h, w, eps):
    def norm(x, wt):
        x = np.asarray(x, np.float32)
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return y * (1.0 + np.asarray(wt, np.float32))
    x = np.concatenate([norm(embed, norm_e), norm(hidden, norm_h)], axis=-1)
    return x @ np.asarray(w, np.float32).T


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("m,h", [(1, 256), (5, 128), (130, 128)])
def test_kernel_matches_reference(m, h):
    """M = 1, 5 take the split-K propose path; M = 130 the tiled prefill path (padded)."""
    args = _inputs(m + h, m, h)
    out = fc_gemm(*args, eps=1e-6, impl="interpret")
    ref = fc_gemm_reference(*args, eps=1e-6)
    assert out.shape == (m, h) and out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, ref) < 1e-2
    # Embedding first: swapping the halves must give a clearly different answer.
    swapped = fc_gemm_reference(args[1], args[0], args[3], args[2], args[4], eps=1e-6)
    assert _rel_err(out, swapped) > 0.3


def test_reference_matches_numpy():
    args = _inputs(3, 7, 96)
    ref = fc_gemm_reference(*args, eps=1e-5)
    want = _numpy_fc(*args, eps=1e-5)
    assert _rel_err(ref, want) < 1e-2


def test_bad_inputs_raise():
    e, h, ne, nh, w = _inputs(0, 4, 64)
    with pytest.raises(ValueError, match=r"\[H, 2H\]"):
        fc_gemm_reference(e, h, ne, nh, w.T, eps=1e-6)
    with pytest.raises(ValueError, match="embed and hidden"):
        fc_gemm_reference(e, h[:3], ne, nh, w, eps=1e-6)
    with pytest.raises(ValueError, match="norm weights"):
        fc_gemm(e, h, ne[:10], nh, w, eps=1e-6, impl="reference")
    with pytest.raises(ValueError, match="choose one of"):
        fc_gemm(e, h, ne, nh, w, eps=1e-6, impl="gpu")


@pytest.mark.parametrize("k_splits", [2, 4])
def test_split_k_path_matches_reference(k_splits):
    """The propose path splits the 2H reduction across programs; each split stays in one half."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from mtp.pallas.fc_gemm import _fc_gemm_pallas

    args = _inputs(k_splits, 3, 256)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        out = _fc_gemm_pallas(*args, eps=1e-6, k_splits=k_splits)
    assert _rel_err(out, fc_gemm_reference(*args, eps=1e-6)) < 1e-2
