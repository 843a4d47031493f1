"""The weight-streaming GEMM for a few rows: the kernel (interpret mode) against its reference."""

import numpy as np
import pytest

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtp.pallas import stream_gemm as sg


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _case(seed, m, n, k, segments=1):
    rng = np.random.default_rng(seed)
    xs = tuple(jnp.asarray((1.0 + 3 * i) * rng.standard_normal((m, k)) + i, jnp.bfloat16)
               for i in range(segments))
    w = jnp.asarray(rng.standard_normal((n, segments * k)) / np.sqrt(segments * k), jnp.bfloat16)
    return xs, w


def _numpy(xs, w, eps):
    parts = []
    for x in xs:
        x = np.asarray(x, np.float32)
        if eps is not None:
            x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
        parts.append(x)
    return np.concatenate(parts, -1) @ np.asarray(w, np.float32).T


def _kernel(xs, w, **kw):
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        return sg.stream_gemm(xs, w, **kw)


@pytest.mark.parametrize("m,n,k,kw", [
    (1, 200, 256, {}),                            # N not a slab multiple: the last slab is clipped
    (7, 96, 384, dict(tile_k=64, stages=3)),      # the ring wraps several times
    (64, 64, 128, dict(tile_n=32, stages=2)),     # a full row tile
])
def test_linear_matches_numpy(m, n, k, kw):
    xs, w = _case(m + n, m, n, k)
    out = _kernel(xs, w, **kw)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert _rel_err(out, _numpy(xs, w, None)) < 1e-2
    assert _rel_err(sg.stream_gemm_reference(xs, w), _numpy(xs, w, None)) < 1e-2


@pytest.mark.parametrize("m,segments,kw", [(3, 2, {}), (5, 3, dict(tile_k=64, stages=4))])
def test_normalised_segments_match_numpy(m, segments, kw):
    """Each segment's rows scaled by their own RMS, computed inside the kernel."""
    xs, w = _case(m * segments, m, 48, 128, segments)
    out = _kernel(xs, w, eps=1e-6, **kw)
    want = _numpy(xs, w, 1e-6)
    assert _rel_err(out, want) < 1e-2
    assert _rel_err(out, _numpy(xs, w, None)) > 0.3  # the scales matter on these inputs


def test_plan():
    assert sg.plan(2048, 4096, 132) == (16, 128, 6)   # 128 programs
    assert sg.plan(12288, 2048, 132)[0] == 96          # 128 programs, not 192 of 64
    assert sg.plan(5632, 2048, 132)[0] == 48
    tn, tk, st = sg.plan(151936, 2048, 132)
    assert tn == 256 and sg._smem_bytes(tn, tk, st) <= sg.SMEM_LIMIT
    assert sg.plan(512, 320, 132)[1] == 64


def test_bad_inputs_raise():
    xs, w = _case(0, 4, 32, 128)
    with pytest.raises(ValueError, match=r"w must be \[N, 1 x K = 128\]"):
        sg.stream_gemm(xs, w[:, :64])
    with pytest.raises(ValueError, match="1..64 rows; got M=65"):
        sg.stream_gemm((jnp.zeros((65, 128), jnp.bfloat16),), w)
    with pytest.raises(ValueError, match="at least 2"):
        sg.stream_gemm(xs, w, stages=1)
    with pytest.raises(ValueError, match="tile_k=96"):
        sg.stream_gemm(xs, w, tile_k=96)
    with pytest.raises(ValueError, match="tile_n=24"):
        sg.stream_gemm(xs, w, tile_n=24)
    with pytest.raises(ValueError, match="16-bit float"):
        sg.stream_gemm((xs[0].astype(jnp.float32),), w)
    with pytest.raises(ValueError, match="one shape"):
        sg.stream_gemm((xs[0], xs[0][:2]), jnp.concatenate([w, w], 1))
    xs, w = _case(0, 4, 256, 1024)
    with pytest.raises(ValueError, match="shared memory"):
        sg.stream_gemm(xs, w, tile_n=256, tile_k=128, stages=6)
