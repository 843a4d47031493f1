"""The FP8 few-row GEMM benchmark's forms (`experiments/bench_fp8.py`), checked on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_fp8
from mtp.ops import fp8


def test_post_scale_is_the_dequantized_product_with_partial_blocks():
    kw, kx = jax.random.split(jax.random.key(3))
    w = fp8.quantize(jax.random.normal(kw, (200, 300), jnp.float32))  # partial edge blocks both ways
    x = jax.random.normal(kx, (3, 300), jnp.float32)
    exact = x @ fp8.dequantize(w).T
    np.testing.assert_allclose(bench_fp8.post_scale(x, w), exact, rtol=2e-5, atol=2e-4)
    assert not np.allclose(bench_fp8.convert_only(x, w), exact, rtol=0.1)  # the bound ignores the scales


def test_each_row_is_timed_against_its_floor_and_the_weights_forms_agree():
    rows = bench_fp8.bench_gemms(bench_fp8.SMALL_SHAPES[:1], [2], 1, 1e10, jax.random.key(0))
    assert [r["form"] for r in rows] == ["bf16", "w8a16", "post_scale", "convert_only", "pallas"]
    assert all(r["us"] > 0 and r["floor_us"] > 0 for r in rows)
    assert rows[1]["floor_us"] < 0.6 * rows[0]["floor_us"]  # 8-bit values and f32 block scales
    assert rows[1]["rel_err"] < 1e-2 and rows[2]["rel_err"] < 1e-2 and rows[3]["rel_err"] is None
    assert all(r["rel_err"] < 1e-5 for r in rows[4:])  # the kernel: f32 products of the E4M3 values
    assert rows[4]["auto_takes"] is True and rows[1]["auto_takes"] is None  # 2 rows: the model takes the kernel
    experts = bench_fp8.bench_experts(bench_fp8.SMALL_EXPERTS, [1], 1, 1e10, jax.random.key(1))
    assert [r["form"] for r in experts] == ["bf16", "fp8"]
    assert experts[0]["distinct_experts"] == bench_fp8.SMALL_EXPERTS["top_k"]  # one row picks top_k experts
    assert "| routed experts" in bench_fp8.markdown(dict(device="cpu", date="today", copy_bandwidth_TBps=0.01,
                                                         rows=rows + experts))


def test_the_tiling_sweep_times_each_candidate_once_beside_the_default():
    out, inp = 256, 512
    candidates = bench_fp8.tilings(out, inp)
    default = bench_fp8.fp8_triton.default_config(out, inp)
    assert candidates and default not in candidates and len(set(candidates)) == len(candidates)
    for c in candidates:  # whole scale blocks, a split never wider than the input tiles, 32-2048 programs
        assert c.block_in == 128 and c.splits <= inp // 128 and 32 <= -(-out // c.block_out) * c.splits <= 2048
    shape = [("s", out, inp)]
    rows = bench_fp8.bench_gemms(shape, [2], 1, 1e10, jax.random.key(0), {"pallas": bench_fp8.kernel}, sweep=True)
    forms = [r["form"] for r in rows]
    assert forms[:2] == ["bf16", "pallas"] and len(forms) == 2 + len(candidates)
    assert forms[2:] == [bench_fp8.tiling_name(c) for c in candidates]
    assert all(r["rel_err"] < 1e-5 and r["tiling"]["block_in"] == 128 for r in rows[1:])
    assert {r["tiling"]["block_out"] for r in rows[2:]} == {c.block_out for c in candidates}
