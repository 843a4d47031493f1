"""The real-shape benchmark's measuring code, end to end on tiny models of the same kinds (CPU)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.bench_real_shape import get_config
from experiments import bench_real_shape as brs
from mtp.execution import ExecutionConfig
from mtp.model import layers
from mtp.model import params as P
from mtp.model.params import flatten
from mtp.ops import fp8


def _tiny_conf(tmp_path, **changes):
    conf = get_config()
    conf.update(dict(model="tiny", models="tiny_qwen35_moe,tiny_qwen35", peer_model="", batches=(1,),
                     verify_widths=(2,), spec_k=2, alphas=(0.0, 0.8, 1.0), loop_tokens=128, context=32, prefill_chunk=32,
                     reps=5, steps_per_call=256, compile_workers=2, deadline_s=3600.0, out_dir=str(tmp_path),
                     draft_vocab=40))
    conf.update(changes)
    return conf


def test_tiny_run_measures_every_row_against_its_floor(tmp_path):
    data = brs.run(_tiny_conf(tmp_path))
    assert data["errors"] == [] and data["skipped"] == []
    rows = {(r.get("model"), r["what"]): r for r in data["rows"]}
    moe, dense = "tiny_qwen35_moe", "tiny_qwen35"
    cfg = brs.load_model_config(moe)
    k = cfg.num_experts_per_tok
    # One token selects k distinct experts in each of the 4 MoE layers: the routing read from the timed step.
    assert rows[(moe, "decode b=1")]["distinct_experts"] == [k] * cfg.num_hidden_layers
    verify = rows[(moe, "verify K=2")]
    assert len(verify["distinct_experts"]) == cfg.num_hidden_layers
    assert all(k <= e <= min(2 * k, cfg.num_experts) for e in verify["distinct_experts"])
    assert rows[(moe, "propose (1 draft)")]["distinct_experts"] == [k]  # the MTP layer's own routing
    assert "distinct_experts" not in rows[(dense, "decode b=1")]
    for key in [(moe, "decode b=1"), (moe, "verify K=2"), (moe, "propose (1 draft)"), (dense, "decode b=1"),
                (moe, "prefill chunk"), (dense, "prefill chunk")]:
        r = rows[key]
        assert r["ms"] > 0 and r["floor_ms"] > 0 and math.isclose(r["ratio_to_floor"], r["ms"] / r["floor_ms"])
    assert math.isclose(verify["ratio_to_decode"], verify["ms"] / rows[(moe, "decode b=1")]["ms"])
    plain = rows[(moe, "plain greedy loop")]
    assert plain["ms_per_token"] > 0 and plain["compile_s"] > 0
    # The forced acceptance at its ends: nothing accepted, or every draft (K = 2: one a step).
    assert rows[(moe, "speculative loop K=2 alpha=0.0")]["mean_acceptance_length"] == 1.0
    every = rows[(moe, "speculative loop K=2 alpha=1.0")]
    assert every["mean_acceptance_length"] == every["window_acceptance_length"] == 2.0
    assert math.isclose(every["speedup_at_expected_acceptance"], every["speedup_vs_plain"])  # no sampling at 1.0
    assert math.isclose(every["ms_per_step"], 2 * every["ms_per_token"])
    # Again with a 40-id draft vocabulary: its own rows, the forced acceptance as exact.
    reduced = rows[(moe, "speculative loop K=2 alpha=1.0, draft vocab 40")]
    assert reduced["mean_acceptance_length"] == 2.0 and reduced["draft_vocab"] == 40
    assert rows[(moe, "speculative loop K=2 alpha=0.8")]["draft_vocab"] == cfg.vocab_size
    assert [v["verdict"] in ("met", "missed") for v in data["verdicts"]] == [True] * 5
    prov = data["provenance"]
    assert prov["config"]["draft_vocab"] == 40 and prov["packages"]["jax"] == jax.__version__ and prov["command"]
    md = (tmp_path / "results.md").read_text()
    assert "## Goals" in md and "verify K=2" in md and "speculative loop K=2 alpha=1.0" in md


def test_routing_of_returns_each_top_k_a_step_selects():
    cfg = brs.load_model_config("tiny_qwen35_moe")
    p = brs.device_params(cfg, 1, jnp.float32)["model"]["layers"]["0"]["mlp"]
    x = jax.random.normal(jax.random.key(2), (3, cfg.hidden_size))
    out, routing = jax.jit(brs.routing_of(lambda h: layers.moe(p, h, cfg), cfg.num_experts_per_tok))(x)
    np.testing.assert_allclose(out, layers.moe(p, x, cfg), rtol=1e-6)
    probs = jax.nn.softmax(x @ p["gate"]["weight"].T, axis=-1)
    np.testing.assert_array_equal(routing[0], jax.lax.top_k(probs, cfg.num_experts_per_tok)[1])


def test_device_params_make_the_model_tree_with_stacked_experts():
    cfg = brs.load_model_config("tiny_qwen35_moe")
    flat = flatten(brs.device_params(cfg, 0))
    assert {n: tuple(w.shape) for n, w in flat.items()} == P.param_shapes(cfg)
    assert flat["model.layers.0.mlp.experts.gate_proj.weight"].shape[0] == cfg.num_experts
    again = flatten(brs.device_params(cfg, 0))
    other = flatten(brs.device_params(cfg, 1))
    name = "model.layers.1.linear_attn.out_proj.weight"
    assert jnp.array_equal(flat[name], again[name]) and not jnp.array_equal(flat[name], other[name])
    assert float(jnp.std(flat[name].astype(jnp.float32))) > 0


def test_floors_split_the_weights_exactly():
    cfg = brs.load_model_config("qwen3_5_35b_a3b")
    shapes = P.param_shapes(cfg)
    stack = sum(2 * math.prod(s) for n, s in shapes.items() if n.startswith("model.layers.") or n == "model.norm.weight")
    routed = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) * cfg.num_experts * brs.expert_bytes(cfg)
    assert brs.target_dense_bytes(cfg) + routed == stack + brs.lm_head_bytes(cfg)
    # Qwen3.5-35B-A3B: about 3B parameters active a token (its name's A3B), the LM head included.
    assert 2.7e9 < brs.active_flops_per_token(cfg) / 2 + brs.lm_head_bytes(cfg) / 2 < 3.3e9


def test_the_80b_runs_at_the_depth_that_fits():
    cfg = brs.load_model_config("qwen3_next_80b_a3b")
    depth = brs.fitting_depth(cfg, 116.0)
    assert depth % 4 == 0 and 24 <= depth < cfg.num_hidden_layers
    assert brs.fitting_depth(brs.load_model_config("qwen3_5_35b_a3b"), 116.0) == 40
    with pytest.raises(ValueError, match="fit_memory_gib"):
        brs.fitting_depth(cfg, 1.0)


@pytest.mark.parametrize("changes, message", [(dict(alphas=(0.8, 1.5)), "alphas"),
                                              (dict(model="huge"), "config.model"),
                                              (dict(verify_widths=(2, 9)), "verify_widths"),
                                              (dict(models="tiny_qwen35_moe,nope"), "config.models"),
                                              (dict(draft_vocab=-1), "config.draft_vocab")])
def test_bad_config_stops_before_anything_runs(tmp_path, changes, message):
    with pytest.raises(SystemExit, match=message):
        brs.run(_tiny_conf(tmp_path, **changes))


def test_the_report_renders_a_peer_row_and_unmeasured_goals():
    conf = get_config()
    data = {"device": "H200", "backend": "gpu", "date": "2026-12-02 05:00 UTC", "skipped": ["x prefill"],
            "errors": [], "rows": [
                dict(what="ceilings", copy_bandwidth_TBps=4.2, gemm_TFLOPps=700.0, gemm_n=8192),
                dict(what="peer", model="qwen3_next_80b_a3b (peer shape)", layers=4, prompt=512, ms_per_token=30.0,
                     ours_ms_per_token=1.5, transformers="5.17.0", flash_linear_attention="0.5.2",
                     gated_delta_rule={"chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk_gated_delta_rule"})]}
    data["verdicts"] = brs.verdicts(data, "qwen3_5_35b_a3b", conf)
    assert [v["verdict"] for v in data["verdicts"]] == ["n/a (not measured)"] * 5  # four goals and the reduced-vocabulary loop
    md = brs.markdown(data)
    assert "30.00 ms/token" in md and "20.0x" in md and "fla.ops.gated_delta_rule" in md
    assert "Skipped (deadline): x prefill" in md


def test_a_padded_one_row_step_counts_its_real_row_only():
    """A GPU pads a one-row step's stream (`gemm_layout.stream_rows`). The router's GEMM runs on every
    row, but only the real row is routed and its experts read (`layers.moe`), so the floor counts those."""
    from experiments.bench_decode import chained_verify_step, random_cache

    padding = ExecutionConfig(kernels=(("", "reference"),), pad_small_gemms=True, pad_min_weight=0, pad_rows=8)
    cfg = brs.load_model_config("tiny_qwen35_moe")
    k = cfg.num_experts_per_tok
    params = brs.device_params(cfg, 0, jnp.float32)
    state = (random_cache(cfg, 1, 16, 16, jnp.float32, jax.random.key(1)), jnp.ones((1, 1), jnp.int32))
    _, routing = jax.jit(brs.routing_of(chained_verify_step(cfg, padding), k))(state, params)
    assert len(routing) == cfg.num_hidden_layers and np.shape(routing[0]) == (1, k)  # the real row alone
    assert brs.distinct_experts(routing, 1) == brs.distinct_experts(routing) == [k] * cfg.num_hidden_layers


def test_fp8_weights_are_the_bf16_draws_quantized_and_floors_count_their_bytes():
    cfg = brs.load_model_config("tiny_qwen35_moe")
    bf16, q = flatten(brs.device_params(cfg, 0)), flatten(brs.device_params(cfg, 0, weights="fp8"))
    experts = "model.layers.0.mlp.experts.gate_proj.weight"
    assert isinstance(q[experts], fp8.BlockFp8Weight) and q[experts].values.dtype == jnp.float8_e4m3fn
    assert isinstance(q["model.layers.0.mlp.gate.weight"], jax.Array)  # the router stays bf16
    assert isinstance(q["model.embed_tokens.weight"], jax.Array)
    # The same draws: FP8's rounding (3 mantissa bits) is the only difference.
    w = bf16[experts].astype(jnp.float32)
    err = jnp.abs(q[experts].dequantize() - w) / (jnp.abs(w) + 1e-3)
    assert float(jnp.median(err)) < 0.07 and not jnp.array_equal(q[experts].dequantize(), w)
    nbytes = brs.param_bytes(cfg, "fp8")
    assert nbytes[experts] == sum(leaf.nbytes for leaf in jax.tree.leaves(q[experts]))
    assert brs.expert_bytes(cfg, "fp8") < 0.6 * brs.expert_bytes(cfg)
    assert brs.target_dense_bytes(cfg, "fp8") < brs.target_dense_bytes(cfg)
    assert brs.head_dense_bytes(cfg, "fp8") < brs.head_dense_bytes(cfg)
    assert brs.fitting_depth(brs.load_model_config("qwen3_next_80b_a3b"), 116.0, "fp8") == 48


def test_model_entries_name_their_format_and_depth():
    spec = brs.ModelSpec.parse("qwen3_next_80b_a3b:fp8@bf16-depth")
    assert (spec.name, spec.weights, spec.bf16_depth) == ("qwen3_next_80b_a3b", "fp8", True)
    assert spec.label == "qwen3_next_80b_a3b:fp8@bf16-depth" and brs.ModelSpec.parse("x").label == "x"
    with pytest.raises(SystemExit, match="int4"):
        brs.ModelSpec.parse("x:int4")


def test_tiny_fp8_run_sets_fp8_beside_bf16_at_one_depth(tmp_path):
    ref, q = "tiny_qwen35_moe", "tiny_qwen35_moe:fp8@bf16-depth"  # the set's two "decode" suites
    data = brs.run(_tiny_conf(tmp_path, model="tiny_fp8", models=f"{ref},{q}"))
    assert data["errors"] == [] and data["skipped"] == []
    rows = {(r.get("model"), r["what"]): r for r in data["rows"]}
    for name in (q, ref):
        assert rows[(name, "decode b=1")]["ms"] > 0 and rows[(name, "prefill chunk")]["ms"] > 0
    assert rows[(q, "decode b=1")]["weights"] == "fp8" and rows[(ref, "decode b=1")]["weights"] == "bf16"
    assert rows[(q, "decode b=1")]["floor_ms"] < rows[(ref, "decode b=1")]["floor_ms"]
    assert rows[(q, "model")]["weight_gib"] < rows[(ref, "model")]["weight_gib"]
    assert rows[(q, "model")]["layers"] == rows[(ref, "model")]["layers"]
    fmt = [v for v in data["verdicts"] if "FP8 decode step" in v["goal"]]
    assert len(fmt) == 1 and fmt[0]["verdict"] in ("met", "missed")
    assert "fp8" in (tmp_path / "results.md").read_text()


def test_the_memory_pool_grows_on_demand_unless_the_caller_chose():
    environ = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    brs.grow_memory_pool_on_demand(environ)
    assert environ == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}


def test_routing_of_reads_the_ids_of_a_kernel_that_routes():
    """On the weight-streaming kernels (interpreted here) the gate/up kernel routes by itself: its
    pairs' expert ids are the routing, the reference's top-k experts."""
    from mtp.execution import ExecutionConfig
    from mtp.ops.moe import reference

    cfg = brs.load_model_config("tiny_qwen35_moe")
    k = cfg.num_experts_per_tok
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), brs.device_params(cfg, 1, jnp.float32)["model"]["layers"]["0"]["mlp"])
    x = jax.random.normal(jax.random.key(2), (3, cfg.hidden_size)).astype(jnp.bfloat16)
    kernels = ExecutionConfig().with_kernels(moe="interpret")
    out, routing = brs.routing_of(lambda h: layers.moe(p, h, cfg, execution=kernels), k)(x)
    ids, _ = reference.route(layers.router(p, x, cfg)[0], 3, jnp.bfloat16)
    assert len(routing) == 1 and routing[0].shape == (1, 3 * k)
    np.testing.assert_array_equal(np.asarray(routing[0]).reshape(3, k), np.asarray(ids))
    assert brs.distinct_experts(routing) == [len(np.unique(np.asarray(ids)))]
