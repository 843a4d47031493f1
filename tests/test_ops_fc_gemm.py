"""The drafter's fused norm + concat + fc GEMM: the kernels (interpret mode) against the reference."""

import contextlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtp.execution import ExecutionConfig
from mtp.ops.fc_gemm import api, fc_gemm, fc_gemm_reference, fold_fc_weight, mosaic, normed_embed_rows, row_mean_squares
from mtp.ops.fc_gemm.mosaic import fc_gemm_folded


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


def _kernel(args, **kw):
    """The kernel in interpret mode (``acc="two"``: the interpreter has no accumulator stores)."""
    kw.setdefault("acc", "two")
    e, h, ne, nh, w = args
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        return fc_gemm_folded(e, h, fold_fc_weight(ne, nh, w), eps=1e-6, **kw)


def _check_against_reference(out, args, eps=1e-6):
    m, h = args[0].shape
    ref = fc_gemm_reference(*args, eps=eps)
    assert out.shape == (m, h) and out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    # bf16-level agreement: both round once per product term, at different places.
    assert _rel_err(out, ref) < 1e-2
    # Embedding first: swapping the halves must give a clearly different answer.
    swapped = fc_gemm_reference(args[1], args[0], args[3], args[2], args[4], eps=eps)
    assert _rel_err(out, swapped) > 0.3


@pytest.mark.parametrize("m,h", [(1, 256), (5, 128), (64, 128), (120, 128), (136, 128), (264, 256)])
def test_fc_gemm_interpret_matches_reference(m, h):
    """The public op: M <= 128 takes the split-K stream, larger M the warp-specialised GEMM."""
    args = _inputs(m + h, m, h)
    _check_against_reference(fc_gemm(*args, eps=1e-6, impl="interpret"), args)


@pytest.mark.parametrize("m,h,kw", [
    (3, 256, dict(k_splits=2)),
    (3, 256, dict(k_splits=4, stages=2)),
    (17, 128, dict(tile_n=64, stages=1)),
    (136, 128, dict(small_m=256, k_splits=2, stages=2)),  # three 64-row blocks in one program
    (256, 256, dict(small_m=256, tile_n=64, k_splits=4, stages=2)),
])
def test_split_k_path_matches_reference(m, h, kw):
    """The propose path, and above 64 rows a carry's tail append: rows past M are TMA
    zero-fill; each split stays in one half."""
    args = _inputs(m * 31 + h, m, h)
    _check_against_reference(_kernel(args, **kw), args)


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.parametrize("m,h,kw", [
    (1, 2048, {}), (8, 2048, dict(tile_n=64, k_splits=4)), (32, 4096, {}), (5, 256, dict(k_splits=2)),
    (128, 2048, {}), (96, 4096, {}),  # a carry's tail append: 128-row tiles
] if ON_GPU else [(5, 256, dict(k_splits=4)), (40, 128, dict(tile_n=32, k_splits=2, stages=2))])
def test_split_k_compiled_forms_match_reference(m, h, kw):
    """The propose path as the model runs it: compiled on a GPU, interpreted elsewhere."""
    args = _inputs(m * 13 + h, m, h)
    w_f = fold_fc_weight(*args[2:])
    ctx = (contextlib.nullcontext() if ON_GPU
           else plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()))
    with ctx:
        out = fc_gemm_folded(args[0], args[1], w_f, eps=1e-6, **kw)
    _check_against_reference(out, args)


def test_split_k_plan_above_64_rows():
    """Above 64 rows the columns narrow (accumulator <= 128 x 128) and the ring fits shared memory."""
    assert mosaic.plan_small(64, 2048, 132) == (128, 8, 6)  # the propose plan, unchanged
    for m in (128, 192, 256):
        tile_n, _, stages = mosaic.plan_small(m, 2048, 132)
        tile_m = mosaic.splitk_rows(m)
        assert tile_m * tile_n <= 128 * 128
        assert mosaic.splitk_smem(tile_m, tile_n, stages) <= mosaic.SMEM_LIMIT
        assert mosaic.splitk_smem(tile_m, tile_n, stages + 1) > mosaic.SMEM_LIMIT or stages == 6
    with pytest.raises(ValueError, match="at most 256 rows"):
        _kernel(_inputs(0, 8, 128), small_m=512)


@pytest.mark.parametrize("m,h,kw", [
    (72, 128, dict(stages=2, small_m=64)),          # one tile, M not a tile multiple
    (200, 256, dict(num_programs=2, stages=3)),     # persistent: several tiles per program,
    (264, 256, dict(num_programs=3, tile_n=64, sumsq=(64, 4, 2))),  # the ring wraps across tiles
    (96, 256, dict(small_m=32)),                    # the big-M kernel below the default threshold
])
def test_warp_specialised_path_matches_reference(m, h, kw):
    args = _inputs(m * 7 + h, m, h)
    _check_against_reference(_kernel(args, **kw), args)


@pytest.mark.parametrize("split", ["m", "n"])
def test_warp_specialised_consumer_splits(split):
    """The consumers' tiles stacked or side by side; compiled with one rescaled accumulator on a
    GPU (the model's form), interpreted with two elsewhere. At 256 columns per consumer and 4
    stages the epilogue stores 128 columns at a time (the stage ring leaves no room for 256)."""
    m, h = 264, 512
    args = _inputs(m + len(split), m, h)
    if not ON_GPU:
        tile_n = 256 if split == "m" else 128
        _check_against_reference(_kernel(args, split=split, tile_n=tile_n, stages=4, num_programs=3),
                                 args)
        return
    w_f = fold_fc_weight(*args[2:])
    out = fc_gemm_folded(args[0], args[1], w_f, eps=1e-6, acc="rescale", split=split)
    _check_against_reference(out, args)


@pytest.mark.parametrize("m,h,splits,tile_c,inputs", [(72, 256, 1, 128, 2), (200, 256, 4, 64, 2),
                                                      (136, 256, 2, 64, 1)])
def test_row_sumsq_kernel(m, h, splits, tile_c, inputs):
    """Each split's share of the row sums of squares, per input (both halves, or the hidden
    alone when the embed rows arrive normalised); rows past M (to m_pad) sum to 0."""
    xs = _inputs(m + splits, m, h)[2 - inputs:2]
    m_pad = -(-m // 128) * 128
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        parts = mosaic.row_sumsq(*xs, m_pad=m_pad, tile_c=tile_c, splits=splits, stages=2)
    parts = np.asarray(parts)
    assert parts.shape == (splits, inputs, m_pad)
    cols = h // splits
    for s in range(splits):
        for j, x in enumerate(xs):
            x = np.asarray(x, np.float32)[:, s * cols:(s + 1) * cols]
            np.testing.assert_allclose(parts[s, j, :m], (x * x).sum(-1), rtol=1e-5)
    assert (parts[:, :, m:] == 0).all()


# The warp-specialised GEMM's normalised-embed form runs in `tests/test_bench_kernels.py` (M = 200, a
# fresh interpreter process): interpreted here after this file's other kernels it deadlocked twice
# in the interpreter's threads (2026-12-01, 2-core CPU), so this file keeps to the split-K stream.
@pytest.mark.parametrize("m,h,kw", [(5, 256, dict(k_splits=4)), (40, 128, dict(tile_n=32, k_splits=2, stages=2))])
def test_embed_normed_kernels_scale_only_the_hidden_half(m, h, kw):
    """``embed_normed=True``: the embed half is taken as it comes (no row scale at all), the
    hidden half normalised. Checked on embed rows that are *not* normalised (3x and 0.5x),
    so a kernel that still applied an embed row scale could not pass."""
    e, hd, ne, nh, w = _inputs(m * 5 + h, m, h)
    x = (e.astype(jnp.float32) * jnp.where(jnp.arange(m) % 2 == 0, 3.0, 0.5)[:, None]).astype(jnp.bfloat16)
    wf = np.asarray(fold_fc_weight(ne, nh, w), np.float32)
    hf = np.asarray(hd, np.float32)
    want = (np.asarray(x, np.float32) @ wf[:, :h].T
            + (hf / np.sqrt(np.mean(hf * hf, -1, keepdims=True) + 1e-6)) @ wf[:, h:].T)
    out = _kernel((x, hd, ne, nh, w), embed_normed=True, **kw)
    assert _rel_err(out, want) < 1e-2
    # The same function as the raw form on rows that are normalised (up to their bf16 rounding).
    args = (e, hd, ne, nh, w)
    ms = row_mean_squares(e)
    _check_against_reference(_kernel((normed_embed_rows(e, ms, 1e-6), hd, ne, nh, w),
                                     embed_normed=True, **kw), args)


@pytest.mark.parametrize("m", [6, 72])
def test_fc_gemm_takes_the_embed_norms_from_their_mean_squares(m):
    """The public op given each embed row's mean square (the model's per-token table): the
    reference's answer; a wrong mean square changes the kernel path's output (it is used)
    and not the reference's (it recomputes every norm)."""
    args = _inputs(m + 3, m, 128)
    ms = row_mean_squares(args[0])
    out = fc_gemm(*args, eps=1e-6, impl="interpret", embed_mean_square=ms)
    _check_against_reference(out, args)
    wrong = fc_gemm(*args, eps=1e-6, impl="interpret", embed_mean_square=4.0 * ms)
    assert _rel_err(wrong, out) > 0.1
    np.testing.assert_array_equal(
        np.asarray(fc_gemm(*args, eps=1e-6, impl="reference", embed_mean_square=4.0 * ms), np.float32),
        np.asarray(fc_gemm(*args, eps=1e-6, impl="reference"), np.float32))
    with pytest.raises(ValueError, match=r"embed_mean_square must be \[M=%d\].*\(%d,\)" % (m, m - 1)):
        fc_gemm(*args, eps=1e-6, impl="interpret", embed_mean_square=ms[1:])


def test_reference_matches_numpy():
    args = _inputs(3, 7, 96)
    ref = fc_gemm_reference(*args, eps=1e-5)
    want = _numpy_fc(*args, eps=1e-5)
    assert _rel_err(ref, want) < 1e-2


def test_fold_fc_weight():
    e, h, ne, nh, w = _inputs(4, 2, 64)
    wf = fold_fc_weight(ne, nh, w)
    assert wf.shape == w.shape and wf.dtype == w.dtype
    col = 1.0 + np.concatenate([np.asarray(ne, np.float32), np.asarray(nh, np.float32)])
    want = np.asarray(w, np.float32) * col[None, :]
    np.testing.assert_allclose(np.asarray(wf, np.float32), want, rtol=2 ** -8, atol=0)
    # Folded weights and per-row scales reproduce the unfolded reference.
    r = lambda x: 1.0 / np.sqrt(np.mean(np.asarray(x, np.float32) ** 2, -1) + 1e-6)
    wfn = np.asarray(wf, np.float32)
    out = (r(e)[:, None] * (np.asarray(e, np.float32) @ wfn[:, :64].T)
           + r(h)[:, None] * (np.asarray(h, np.float32) @ wfn[:, 64:].T))
    assert _rel_err(out, _numpy_fc(e, h, ne, nh, w, 1e-6)) < 1e-2
    with pytest.raises(ValueError, match=r"\[H, 2H\]"):
        fold_fc_weight(ne, nh, w.T)
    with pytest.raises(ValueError, match="norm weights"):
        fold_fc_weight(ne[:3], nh, w)


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
    wf = fold_fc_weight(ne, nh, w)
    with pytest.raises(ValueError, match=r"w_folded must be \[H, 2H\].*\(64, 64\)"):
        fc_gemm_folded(e, h, wf[:, :64], eps=1e-6)
    with pytest.raises(ValueError, match="float32"):
        fc_gemm_folded(e.astype(jnp.float32), h, wf, eps=1e-6)
    with pytest.raises(ValueError, match="embed and hidden"):
        fc_gemm_folded(e, h[:, :32], wf, eps=1e-6)
    with pytest.raises(ValueError, match="multiple of 64"):
        e2, h2, ne2, nh2, w2 = _inputs(0, 4, 96)
        fc_gemm_folded(e2, h2, fold_fc_weight(ne2, nh2, w2), eps=1e-6)
    with pytest.raises(ValueError, match="M=130 rows.*multiple of 8"):
        e3, h3 = (jnp.concatenate([x] * 33)[:130] for x in (e, h))
        fc_gemm_folded(e3, h3, wf, eps=1e-6)
    with pytest.raises(ValueError, match="k_splits=3"):
        fc_gemm_folded(e, h, wf, eps=1e-6, k_splits=3)
    big = [jnp.concatenate([x] * 40) for x in (e, h)]  # 160 rows: the warp-specialised GEMM
    with pytest.raises(ValueError, match="split='k'"):
        fc_gemm_folded(*big, wf, eps=1e-6, split="k")
    with pytest.raises(ValueError, match="acc='one'"):
        fc_gemm_folded(*big, wf, eps=1e-6, acc="one")


def test_inputs_the_kernels_cannot_take_go_to_the_reference():
    """f32 inputs, or a large M that is not a multiple of 8: the reference, bit for bit."""
    e, h, ne, nh, w = _inputs(6, 72, 64)
    e2, h2 = (jnp.concatenate([x, x])[:138] for x in (e, h))
    cases = [tuple(x.astype(jnp.float32) for x in (e, h, ne, nh, w)),  # not a 16-bit dtype
             (e2, h2, ne, nh, w)]                                       # M = 138 > 128, not 8k
    for args in cases:
        assert mosaic.kernel_unsupported(args[0], args[1], args[4])
        out = fc_gemm(*args, eps=1e-6, impl="interpret")
        want = fc_gemm(*args, eps=1e-6, impl="reference")
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    assert mosaic.kernel_unsupported(e, h, w) is None
    assert mosaic.kernel_unsupported(e[:5], h[:5], w) is None  # the split-K path takes any M <= 128
    assert mosaic.kernel_unsupported(e[:70], h[:70], w) is None


def test_auto_on_cpu_is_the_reference():
    args = _inputs(5, 6, 64)
    out = fc_gemm(*args, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(fc_gemm_reference(*args, eps=1e-6), np.float32))


def test_prepare_params_folds_fc_weight_and_fc_input_uses_it():
    """The load-time preparation makes the fc kernel's inputs beside the checkpoint dict, which it
    leaves as it was; fc_input's kernel path then uses them."""
    from mtp.model.prepared import prepare_params
    from mtp.mtp_head import fc_input

    h, vocab = 128, 11
    e, hid, ne, nh, w = _inputs(9, 5, h)
    table = jnp.asarray(np.random.default_rng(1).standard_normal((vocab, h)), jnp.bfloat16)
    params = {"model": {"embed_tokens": {"weight": table}},
              "mtp": {"fc": {"weight": w}, "pre_fc_norm_embedding": {"weight": ne},
                      "pre_fc_norm_hidden": {"weight": nh}}}
    # By default it folds where the kernel path is active: a GPU, not a CPU, or where the config names it.
    assert (prepare_params(params).fc is None) == (jax.default_backend() != "gpu")
    assert prepare_params(params, ExecutionConfig.everywhere("reference")).fc is None
    assert prepare_params(params, ExecutionConfig.everywhere("interpret")).fc is not None
    folded = prepare_params(params, fold_fc=True)
    np.testing.assert_array_equal(np.asarray(folded.fc.weight_folded, np.float32),
                                  np.asarray(fold_fc_weight(ne, nh, w), np.float32))
    tf = np.asarray(table, np.float32)
    np.testing.assert_allclose(np.asarray(folded.fc.embed_mean_square), (tf * tf).mean(-1), rtol=1e-6)
    assert folded.params is params and params["mtp"]["fc"].keys() == {"weight"}

    class Cfg:
        rms_norm_eps = 1e-6

    tokens = jnp.asarray([[1, 4, 7, 2, 9]], jnp.int32)
    hidden = hid[None]
    ref = fc_input(Cfg, params, tokens, hidden, ExecutionConfig.everywhere("reference"))
    # A poisoned raw weight: the kernel path must read the folded one.
    poisoned = folded.replace(params={**params, "mtp": {**params["mtp"], "fc": {"weight": jnp.zeros_like(w)}}})
    out = fc_input(Cfg, poisoned, tokens, hidden, ExecutionConfig.everywhere("interpret"))
    assert out.shape == ref.shape
    assert _rel_err(out, ref) < 1e-2
    # ... and the embed rows' norms from the per-token table, gathered by token.
    swapped = poisoned.replace(fc=poisoned.fc.replace(embed_mean_square=poisoned.fc.embed_mean_square[::-1]))
    assert _rel_err(fc_input(Cfg, swapped, tokens, hidden, ExecutionConfig.everywhere("interpret")), ref) > 0.05


def test_named_kernel_skips_the_auto_rule(monkeypatch):
    """``kernel_pays`` is ``auto``'s rule only: ``MTP_KERNELS=fc_gemm=pallas`` (or a global ``pallas``)
    takes the kernel at the propose step's rows too, so an A/B of reference vs pallas compares two paths."""
    from mtp.ops import lowering

    calls = []
    monkeypatch.setattr(mosaic, "fc_gemm_folded", lambda e, *a, **k: calls.append(e.shape) or "kernel")
    monkeypatch.setattr(lowering, "on_gpu", lambda: True)
    args = _inputs(0, 8, 64)  # 8 rows at H = 64: auto's rule keeps the reference
    assert not api.kernel_pays(8, 64) and mosaic.kernel_unsupported(args[0], args[1], args[4]) is None
    assert isinstance(fc_gemm(*args, eps=1e-6), jax.Array) and not calls
    for named in ("fc_gemm=pallas", "pallas"):
        impl = ExecutionConfig.from_environ({"MTP_KERNELS": named}).impl_for("fc_gemm")
        assert fc_gemm(*args, eps=1e-6, impl=impl) == "kernel"
    assert fc_gemm(*args, eps=1e-6, impl="pallas") == "kernel" and len(calls) == 3


def test_plans():
    assert mosaic.plan_small(1, 4096, 132) == mosaic.plan_small(32, 4096, 132) == (128, 4, 6)
    assert mosaic.plan_small(8, 4096, 132) == (256, 8, 3)  # the measured bucket
    assert mosaic.plan_small(8, 4096, 132, stages=4) == (128, 4, 4)  # an explicit plan is kept
    assert mosaic.plan_small(8, 2048, 132)[1] == 8
    wm, tn, st, npg, split = mosaic.plan_large(12288, 4096, 132)
    assert (wm, tn, split) == (64, 128, "m") and npg == 132
    assert mosaic.plan_large(12288, 4096, 132, acc="rescale") == (64, 256, 4, 132, "m")
    assert mosaic.plan_large(12288, 4096, 132, acc="rescale", split="n")[:2] == (128, 128)
    assert mosaic.plan_large(2048, 2048, 132, acc="rescale", split="m")[3] == 128  # 16 x 8 tiles
    # A drafter-prefill chunk: narrower tiles (with deeper rings) until they about fill 132 SMs.
    assert mosaic.plan_large(512, 2048, 132, acc="rescale")[:4] == (64, 64, 8, 128)
    assert mosaic.plan_large(1024, 2048, 132, acc="rescale")[:4] == (64, 128, 6, 128)
    assert mosaic.plan_large(512, 4096, 132, acc="rescale")[:4] == (64, 128, 6, 128)
    assert mosaic.plan_large(1024, 4096, 132, acc="rescale")[:4] == (64, 256, 4, 128)
    assert mosaic.plan_large(128, 256, 132, acc="rescale")[:2] == (64, 64)  # never below 64 columns
    assert mosaic.plan_large(2048, 2048, 132, acc="rescale", split="n")[2] == 4  # explicit: as before
    # The row sums' pre-pass: 8 splits of 128 columns over a chunk's few row blocks, else 4 of 256.
    assert mosaic.plan_sumsq(512, 2048, 132) == mosaic.plan_sumsq(1024, 4096, 132) == (128, 8, 2)
    assert mosaic.plan_sumsq(2048, 2048, 132) == (256, 4, 2)
    assert mosaic.plan_sumsq(512, 2048, 132, splits=2) == (256, 2, 2)  # an explicit plan is kept
    assert mosaic.plan_large(130, 128, 132)[3] == 2


def test_auto_rule():
    assert api.kernel_pays(2048, 4096) and api.kernel_pays(12288, 2048)
    assert api.kernel_pays(512, 2048)  # a drafter-prefill chunk at batch 1
    assert api.kernel_pays(64, 2048) and api.kernel_pays(256, 4096)  # a carry's tail appends
    assert not api.kernel_pays(32, 4096) and not api.kernel_pays(8, 2048)  # the propose step
    assert not api.kernel_pays(2048, 384)  # the shipped default's width: never measured
    # Rows the kernel cannot take go to the reference whatever the rule says.
    x = jax.ShapeDtypeStruct((2052, 4096), jnp.bfloat16)
    assert "multiple of 8" in mosaic.kernel_unsupported(x, x, jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16))
