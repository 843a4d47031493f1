"""The conv of decode and verify tokens and the states after them (`mtp.ops.conv_step`): the kernel (interpret mode) against the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.ops.conv_step import conv_steps, conv_steps_reference
from mtp.ops.conv_step import triton as cs
from mtp.ops.gdn_step import HeadShape
from mtp.ops.gdn_step.reference import qkvz_groups
from tests.conftest import decode_through_kernel


def _case(seed, bsz, heads, dtype, steps=1, extra_rows=0, extra_cols=0):
    """qkvz as a GEMM's whole output (padding rows, a merged projection's columns; token t of
    sequence b in row b T + t), ragged valid prefixes (row 1 fully masked, row 2 after its first
    token), and the conv input the model slices from it (`gated_deltanet.project`)."""
    ks = jax.random.split(jax.random.key(seed), 3)
    qkvz = jax.random.normal(ks[0], (bsz * steps + extra_rows, heads.qkvz_width + extra_cols)).astype(dtype)
    counts = jnp.asarray([steps, 0, 1, steps - 1][:bsz] + [steps] * max(bsz - 4, 0))
    valid = jnp.arange(steps)[None, :] < counts[:, None]
    groups, qkv_width = qkvz_groups(qkvz[:bsz * steps, :heads.qkvz_width], heads)
    mixed = jnp.where(valid[..., None], groups[..., :qkv_width].reshape(bsz, steps, -1), 0)
    state = jax.random.normal(ks[1], (bsz, 3, heads.conv_dim)).astype(dtype)
    w = (0.5 * jax.random.normal(ks[2], (heads.conv_dim, 1, 4))).astype(dtype)
    return mixed, qkvz, valid, state, w


@pytest.mark.parametrize("bsz,heads,dtype,steps,extra_rows,extra_cols", [
    (1, HeadShape(2, 4, 16, 16), jnp.bfloat16, 1, 1, 0),   # decode: the padded batch-1 stream
    (3, HeadShape(2, 4, 16, 16), jnp.bfloat16, 1, 0, 8),   # qkvz merged with in_proj_ba
    (2, HeadShape(1, 3, 8, 8), jnp.float32, 1, 2, 4),
    (4, HeadShape(2, 4, 16, 16), jnp.bfloat16, 2, 0, 8),   # verify
    (3, HeadShape(1, 3, 8, 8), jnp.float32, 3, 2, 0),
    (4, HeadShape(2, 2, 16, 16), jnp.bfloat16, 8, 0, 0),
])
def test_kernel_matches_reference(bsz, heads, dtype, steps, extra_rows, extra_cols):
    args = _case(bsz, bsz, heads, dtype, steps, extra_rows, extra_cols)
    assert cs.kernel_unsupported(*args[1:], heads) is None
    out, states = conv_steps(*args, heads=heads, impl="interpret")
    out_ref, states_ref = conv_steps_reference(*args, heads=heads)
    assert out.shape == (bsz, steps, heads.conv_dim) and out.dtype == dtype
    assert states.shape == (bsz, steps) + args[3].shape[1:]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32), atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(states, states_ref)
    mixed, state, counts = args[0], args[3], np.asarray(args[2]).sum(1)
    for b in range(bsz):  # the state after token t holds the last 3 inputs up to it; masked: as it was
        full = np.concatenate([np.asarray(state[b], np.float32), np.asarray(mixed[b], np.float32)])
        for t in range(steps):
            kept = min(t + 1, counts[b])
            np.testing.assert_array_equal(np.asarray(states[b, t], np.float32), full[kept:kept + 3])


def test_unsupported_inputs_are_named():
    heads = HeadShape(2, 4, 16, 16)
    _, qkvz, valid, state, w = _case(0, 2, heads, jnp.float32)
    assert "power of two" in cs.kernel_unsupported(qkvz, valid, state, w, HeadShape(2, 4, 12, 12))
    assert "fewer than 2 rows" in cs.kernel_unsupported(qkvz[:1], valid, state, w, heads)
    assert "channels" in cs.kernel_unsupported(qkvz[:, :-1], valid, state, w, heads)
    _, qkvz, valid, state, w = _case(0, 2, heads, jnp.float32, steps=9)
    assert "at most 8" in cs.kernel_unsupported(qkvz, valid, state, w, heads)


@pytest.mark.parametrize("impl", ["reference", "interpret", "auto"])
def test_mismatched_conv_shapes_are_named(impl):
    """Shapes no path can take raise, naming the tensors, rather than a silently empty output."""
    heads = HeadShape(2, 4, 16, 16)
    mixed, qkvz, valid, state, w = _case(0, 2, heads, jnp.float32)
    c = heads.conv_dim
    w5 = jnp.zeros((c, 1, 5), w.dtype)  # K = 5 against a 3-row state
    with pytest.raises(ValueError, match=rf"conv_state \(2, 3, {c}\).*conv_w \({c}, 1, 5\)"):
        conv_steps(mixed, qkvz, valid, state, w5, heads=heads, impl=impl)
    with pytest.raises(ValueError, match=rf"conv_w \({c}, 4\)"):
        conv_steps(mixed, qkvz, valid, state, w[:, 0], heads=heads, impl=impl)
    with pytest.raises(ValueError, match=rf"conv_state \(2, 3, {c - 16}\)"):
        conv_steps(mixed, qkvz, valid, state[..., :-16], w, heads=heads, impl=impl)
    with pytest.raises(ValueError, match=rf"mixed \(2, 1, {c - 16}\)"):
        conv_steps(mixed[..., :-16], qkvz, valid, state, w, heads=heads, impl=impl)


def test_auto_takes_the_kernel_on_a_gpu_unless_opt_in(monkeypatch):
    """Timed faster in the step (2026-11-30), so ``auto`` takes it on a GPU; an op listed in
    ``dispatch.OPT_IN`` stays on its reference there until a path is named for it
    (``ExecutionConfig.kernels``' own entry: ``MTP_KERNELS=conv_step=pallas``)."""
    from mtp.execution import ExecutionConfig
    from mtp.ops import dispatch, lowering

    calls = []
    monkeypatch.setattr(cs, "conv_steps_triton", lambda *a, **k: calls.append(1) or ("kernel", None))
    monkeypatch.setattr(lowering, "on_gpu", lambda: True)
    heads = HeadShape(2, 4, 16, 16)
    args = _case(0, 2, heads, jnp.float32)
    assert conv_steps(*args, heads=heads)[0] == "kernel" and len(calls) == 1
    monkeypatch.setitem(dispatch.OPT_IN, "conv_step", "a test")
    assert isinstance(conv_steps(*args, heads=heads)[0], jax.Array) and len(calls) == 1
    assert ExecutionConfig.everywhere("pallas").impl_for("conv_step") == "auto"  # a global value is no entry of its own
    named = ExecutionConfig.from_environ({"MTP_KERNELS": "conv_step=pallas"}).impl_for("conv_step")
    assert conv_steps(*args, heads=heads, impl=named)[0] == "kernel" and len(calls) == 2


@pytest.mark.parametrize("gemm_layout", ["plain", "padded_merged"], indirect=True)
def test_model_decode_with_the_kernel_equals_the_reference(gemm_layout, monkeypatch):
    """Decode and a verify of 3 tokens through the kernel alone (the other ops on their references) equals decode without it."""
    runs = decode_through_kernel(monkeypatch, cs, "conv_steps_triton", "conv_step", verify=3, layout=gemm_layout)
    (want, ref_cache), (got, cache) = runs["reference"], runs["interpret"]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    for g, w in zip(cache.linear.conv, ref_cache.linear.conv):  # later layers' inputs carry the rounding
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5)
