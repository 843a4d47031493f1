"""The fused Gated DeltaNet decode step: the kernel (interpret mode) against the model's own code."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.execution import ExecutionConfig
from mtp.model import target
from mtp.ops.gdn_step import MAX_STEPS, gdn_step, gdn_step_reference, gdn_steps, gdn_steps_reference
from mtp.ops.gdn_step.triton import default_chunks, gdn_steps_triton, kernel_unsupported
from tests.conftest import paged_cache, random_params, tiny_config


def _case(seed, bsz, nk, nv, d, dtype):
    """mixed (the conv output), qkvz and ba (the projections z, b and a come from), ..."""
    ks = jax.random.split(jax.random.key(seed), 8)
    mixed = jax.random.normal(ks[0], (bsz, (2 * nk + nv) * d)).astype(dtype)
    qkvz = jax.random.normal(ks[1], (bsz, 2 * (nk + nv) * d)).astype(dtype)
    ba = jax.random.normal(ks[2], (bsz, 2 * nv)).astype(dtype)
    valid = jnp.arange(bsz) % 3 != 1  # row 1 is padding: its state must not move
    state = 0.3 * jax.random.normal(ks[4], (bsz, nv, d, d), jnp.float32)
    a_log = jax.random.normal(ks[5], (nv,))
    dt_bias = jax.random.normal(ks[6], (nv,))
    norm_w = (1 + 0.1 * jax.random.normal(ks[7], (d,))).astype(dtype)
    return mixed, qkvz, ba, valid, state, a_log, dt_bias, norm_w


@pytest.mark.parametrize("bsz,nk,nv,d,dtype,y_tol", [
    (3, 2, 4, 16, jnp.float32, 1e-5),
    (2, 1, 2, 32, jnp.bfloat16, 2e-2),   # y rounds to bf16 where the reference does
])
def test_kernel_matches_reference(bsz, nk, nv, d, dtype, y_tol):
    args = _case(bsz + d, bsz, nk, nv, d, dtype)
    assert kernel_unsupported(*args[:3], args[4], nk) is None
    y, state = gdn_step(*args, num_k_heads=nk, eps=1e-6, impl="interpret")
    y_ref, state_ref = gdn_step_reference(*args, num_k_heads=nk, eps=1e-6)
    assert y.shape == (bsz, nv, d) and y.dtype == dtype and state.dtype == jnp.float32
    f = lambda x: np.asarray(x, np.float32)
    np.testing.assert_allclose(f(y), f(y_ref), atol=y_tol, rtol=y_tol)
    np.testing.assert_allclose(state, state_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(state[1], args[4][1])          # the padding row
    assert np.abs(f(state[0]) - f(args[4][0])).max() > 1e-2      # a live row moved


def test_qkvz_rows_past_the_batch_are_ignored():
    """The model passes a padded GEMM's whole output (``gemm_layout.dense_rows``): extra rows."""
    args = _case(5, 2, 2, 4, 16, jnp.float32)
    junk = 1e3 * jax.random.normal(jax.random.key(9), (3, args[1].shape[1]))
    padded = (args[0], jnp.concatenate([args[1], junk]), *args[2:])
    for impl in ("interpret", "reference"):
        y, s = gdn_step(*padded, num_k_heads=2, eps=1e-6, impl=impl)
        y_ref, s_ref = gdn_step_reference(*args, num_k_heads=2, eps=1e-6)
        np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)
    assert "rows for 2 tokens" in kernel_unsupported(args[0], args[1][:1], args[2], args[4], 2)


def test_unsupported_shapes_take_the_reference():
    args = _case(0, 2, 2, 4, 12, jnp.float32)
    assert "power of two" in kernel_unsupported(*args[:3], args[4], 2)
    ok = _case(0, 2, 2, 4, 16, jnp.float32)
    assert "mixed has" in kernel_unsupported(ok[0][:, :-16], *ok[1:3], ok[4], 2)
    assert "qkvz has" in kernel_unsupported(ok[0], ok[1][:, :-16], ok[2], ok[4], 2)
    assert "ba has" in kernel_unsupported(*ok[:2], ok[2][:, :-1], ok[4], 2)
    state = jnp.zeros((2, 4, 16, 8))
    assert "differ" in kernel_unsupported(jnp.zeros((2, 2 * 2 * 16 + 4 * 8)), *ok[1:3], state, 2)
    y, s = gdn_step(*args, num_k_heads=2, eps=1e-6, impl="interpret")
    y_ref, s_ref = gdn_step_reference(*args, num_k_heads=2, eps=1e-6)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(s, s_ref)


@pytest.mark.parametrize("gemm_layout", ["plain", "padded_merged", "merged"], indirect=True)
def test_model_decode_with_the_kernel_equals_the_reference(gemm_layout):
    """With padding on, the kernel reads ``in_proj_qkvz``'s padded output in place."""
    cfg = tiny_config("tiny_dense")  # Dk = Dv = 8: the kernel takes its Gated DeltaNet layers
    params = random_params(cfg, seed=3)
    b, blocks = 2, 6
    toks = jax.random.randint(jax.random.key(1), (b, 12), 0, cfg.vocab_size)
    lens = jnp.asarray([7, 4], jnp.int32)
    logits = {}
    for impl in ("reference", "interpret"):
        execution = dataclasses.replace(gemm_layout, kernels=(("", impl),))
        cache = paged_cache(cfg, b, blocks)
        cache, _ = target.prefill(cfg, params, cache, toks[:, :8], jnp.zeros(b, jnp.int32), lens, execution=execution)
        out = []
        for step in range(3):
            cache, o = target.decode(cfg, params, cache, toks[np.arange(b), lens + step][:, None], execution=execution)
            out.append(o.logits)
        logits[impl] = np.stack(out)
    np.testing.assert_allclose(logits["interpret"], logits["reference"], atol=2e-5, rtol=1e-5)


def test_auto_takes_the_kernel_on_a_gpu_unless_the_reference_is_named(monkeypatch):
    """On a GPU ``auto`` resolves to Pallas and takes the kernel; ``gdn_step=reference`` opts out."""
    from mtp.ops import lowering
    from mtp.ops.gdn_step import triton

    calls = []
    fake = (jnp.full((2, 1, 4, 16), 7.0), jnp.zeros((2, 1, 4, 16, 16)))  # what "the kernel" returns here
    monkeypatch.setattr(triton, "gdn_steps_triton", lambda *a, **k: calls.append(1) or fake)
    monkeypatch.setattr(lowering, "on_gpu", lambda: True)
    args = _case(0, 2, 2, 4, 16, jnp.float32)
    kw = dict(num_k_heads=2, eps=1e-6)
    assert bool((gdn_step(*args, **kw)[0] == 7.0).all()) and len(calls) == 1
    named = ExecutionConfig.from_environ({"MTP_KERNELS": "gdn_step=reference"}).impl_for("gdn_step")
    assert isinstance(gdn_step(*args, **kw, impl=named)[0], jax.Array) and len(calls) == 1


def test_merged_projection_buffer_is_read_in_place():
    """qkvz and ba as one buffer (``gemm_layout.dense_columns``): ba at a column offset, padding rows."""
    args = _case(11, 2, 2, 4, 16, jnp.float32)
    qkvz, ba = args[1], args[2]
    junk = 1e3 * jax.random.normal(jax.random.key(4), (1, qkvz.shape[1] + ba.shape[1]))
    merged = jnp.concatenate([jnp.concatenate([qkvz, ba], axis=1), junk])
    y_ref, s_ref = gdn_step_reference(*args, num_k_heads=2, eps=1e-6)
    rest = (args[0], merged, merged, *args[3:])
    assert kernel_unsupported(args[0], merged, merged, args[4], 2, ba_col=qkvz.shape[1]) is None
    assert "ba has" in kernel_unsupported(args[0], merged, merged, args[4], 2, ba_col=qkvz.shape[1] + 1)
    for impl in ("interpret", "reference"):
        y, s = gdn_step(*rest, num_k_heads=2, eps=1e-6, ba_col=qkvz.shape[1], impl=impl)
        np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("steps", [3, 4])
def test_verify_steps_match_one_step_at_a_time(steps):
    """T tokens per sequence (verify) in one call: every step's state and output equal T
    decode steps in a row, a masked token leaves the state, and the projections come as one
    merged buffer with padding rows."""
    bsz, nk, nv, d = 2, 2, 4, 16
    ks = jax.random.split(jax.random.key(steps), 6)
    mixed = jax.random.normal(ks[0], (bsz, steps, (2 * nk + nv) * d))
    qkvz = jax.random.normal(ks[1], (bsz * steps, 2 * (nk + nv) * d))
    ba = jax.random.normal(ks[2], (bsz * steps, 2 * nv))
    merged = jnp.concatenate([jnp.concatenate([qkvz, ba], 1), 1e3 * jnp.ones((2, qkvz.shape[1] + 2 * nv))])
    valid = jnp.ones((bsz, steps), bool).at[1, 1].set(False)
    state = 0.3 * jax.random.normal(ks[3], (bsz, nv, d, d))
    rest = (jax.random.normal(ks[4], (nv,)), jax.random.normal(ks[5], (nv,)), jnp.linspace(0.5, 1.5, d))
    kw = dict(num_k_heads=nk, eps=1e-6)
    s, ys, states = state, [], []
    for t in range(steps):  # the definition: one decode step after another
        rows = jnp.arange(bsz) * steps + t
        y, s = gdn_step_reference(mixed[:, t], qkvz[rows], ba[rows], valid[:, t], s, *rest, **kw)
        ys.append(y)
        states.append(s)
    want_y, want_s = jnp.stack(ys, 1), jnp.stack(states, 1)
    np.testing.assert_array_equal(want_s[1, 1], want_s[1, 0])  # the masked token
    for impl in ("interpret", "reference"):
        y, st = gdn_steps(mixed, merged, merged, valid, state, *rest, ba_col=qkvz.shape[1], impl=impl, **kw)
        assert y.shape == (bsz, steps, nv, d) and st.shape == (bsz, steps, nv, d, d)
        np.testing.assert_allclose(y, want_y, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(st, want_s, atol=1e-5, rtol=1e-5)
    too_many = jnp.zeros((bsz, MAX_STEPS + 1, mixed.shape[-1]))
    assert "at most" in kernel_unsupported(too_many, merged, merged, state, nk)


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("steps", [1, 3])
def test_value_columns_split_over_programs(chunks, steps):
    """A head's state columns over several programs (the norm after the kernel, from the
    chunks' sums of squares) gives the one-program-per-head results: decode and verify, a
    masked token, merged projections with padding rows, bf16 activations."""
    bsz, nk, nv, d = 2, 2, 4, 32
    ks = jax.random.split(jax.random.key(10 + steps), 6)
    bf = lambda x: x.astype(jnp.bfloat16)
    mixed = bf(jax.random.normal(ks[0], (bsz, steps, (2 * nk + nv) * d)))
    qkvz = jax.random.normal(ks[1], (bsz * steps, 2 * (nk + nv) * d))
    ba = jax.random.normal(ks[2], (bsz * steps, 2 * nv))
    merged = bf(jnp.concatenate([jnp.concatenate([qkvz, ba], 1), 1e3 * jnp.ones((2, qkvz.shape[1] + 2 * nv))]))
    valid = jnp.ones((bsz, steps), bool).at[1, steps - 1].set(False)
    state = 0.3 * jax.random.normal(ks[3], (bsz, nv, d, d))
    rest = (jax.random.normal(ks[4], (nv,)), jax.random.normal(ks[5], (nv,)), bf(jnp.linspace(0.5, 1.5, d)))
    kw = dict(num_k_heads=nk, eps=1e-6, ba_col=qkvz.shape[1])
    want_y, want_s = gdn_steps_reference(mixed, merged, merged, valid, state, *rest, **kw)
    y, st = gdn_steps_triton(mixed, merged, merged, valid, state, *rest, chunks=chunks, interpret=True, **kw)
    assert y.shape == want_y.shape and y.dtype == jnp.bfloat16
    f = lambda x: np.asarray(x, np.float32)
    np.testing.assert_allclose(f(y), f(want_y), atol=2e-2, rtol=2e-2)  # one bf16 rounding apart at most
    np.testing.assert_allclose(st, want_s, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(st[1, -1], (st[1, -2] if steps > 1 else state[1]))  # the masked token
    with pytest.raises(ValueError, match="does not divide"):
        gdn_steps_triton(mixed, merged, merged, valid, state, *rest, chunks=3, interpret=True, **kw)


def test_default_chunks_split_only_grids_that_leave_sms_idle(monkeypatch):
    from mtp.ops.gdn_step import triton

    monkeypatch.setattr(triton, "num_sms", lambda: 132)
    assert default_chunks(32, 128) == 8      # the 1.38B model at batch 1: ~2 programs per SM
    assert default_chunks(128, 128) == 2     # batch 4
    assert default_chunks(256, 128) == 1     # batch 8: whole heads
    assert default_chunks(8, 64) == 4        # at least 16 columns per program
    assert default_chunks(8, 16) == 1
