"""Sharded serving (mtp.sharding): layouts, and token identity with the single-device run.

The multi-device checks run in a subprocess (tests/sharding_worker.py) because the
number of host devices is fixed when jax initialises; this process keeps its one.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from tests.conftest import tiny_config
from mtp import sharding as S
from mtp.config import ModelConfig
from mtp.model.params import param_shapes

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "sharding_worker.py"
DEVICES = 4


@pytest.fixture(scope="module")
def worker_summary():
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={DEVICES}"]))
    proc = subprocess.run([sys.executable, str(WORKER)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"sharding worker failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}",
                    pytrace=False)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_worker_ran_on_four_host_devices(worker_summary):
    assert len(worker_summary["devices"]) == DEVICES


@pytest.mark.parametrize("index, config, tp, ep", [(0, "tiny_tp", 2, 1), (1, "tiny_moe", 2, 2)])
def test_sharded_decoding_is_token_identical(worker_summary, index, config, tp, ep):
    """The worker raised on any token, acceptance or cache-layout mismatch; this checks it ran them."""
    case = worker_summary["decode"][index]
    assert (case["config"], case["tp"], case["ep"]) == (config, tp, ep)
    assert case["greedy"] == case["speculative"]  # both equal the single-device run, and each other
    assert 0 < case["accepted"] < case["draft_tokens"]
    assert case["params_split"] > 0


@pytest.mark.parametrize("index, config, tp, ep", [(0, "tiny_tp", 2, 1), (1, "tiny_moe", 2, 2)])
def test_engine_on_a_mesh_serves_the_same_turns(worker_summary, index, config, tp, ep):
    """The worker raised on any token, turn-stat, acceptance or cache-layout mismatch between the
    sharded and the single-device engine; this checks which paths and carry decisions it covered."""
    case = worker_summary["engine"][index]
    assert (case["config"], case["tp"], case["ep"]) == (config, tp, ep)
    carry, multi, blind = case["variants"].values()
    for v in (carry, multi, blind):
        assert v["paths"] == ["cold", "restore"]
    assert "adopted" in carry["carry_outcomes"] and "adopted" in multi["carry_outcomes"]
    assert carry["appended"] > 0 and blind["carry_outcomes"] == ["disarmed"]

def test_sharded_load_places_every_tensor(worker_summary):
    loads = {(c["config"], c["tp"], c["ep"]): c for c in worker_summary["load"]}
    assert set(loads) == {("tiny_tp", 2, 1), ("tiny_tp", 4, 1), ("tiny_moe", 2, 2)}
    assert all(c["files"] > 1 and c["params_split"] > 0 for c in loads.values())


def test_paged_attention_kernel_runs_per_shard(worker_summary):
    """The worker checked the kernel under a tp mesh against the reference (and no collectives)."""
    assert set(worker_summary["kernel"]) == {"hkv2_max_error", "hkv1_max_error", "gdn_step_under_mesh"}
    assert set(worker_summary["kernel"]["gdn_step_under_mesh"]) == {"nk2_max_error", "nk1_max_error"}


def test_derived_tensors_are_laid_out_from_the_sharded_params(worker_summary):
    """The worker checked each derived tensor's layout and value; this checks which cases it covered."""
    assert worker_summary["prepared"] == {"tiny_tp tp=2 ep=1": {"merged": 0, "embed_mean_square": "P('tp',)"},
                                          "tiny_moe tp=1 ep=2": {"merged": 9, "embed_mean_square": "P()"}}


def test_bad_meshes_are_clear_errors(worker_summary):
    assert set(worker_summary["errors"]) == {"ep_without_experts", "experts_not_divisible", "too_few_devices"}


# ---------------------------------------------------------------- in-process: the rule table
def qwen3_next_80b_widths() -> ModelConfig:
    """Qwen3-Next-80B-A3B's widths on four layers: the tensor kinds and divisibilities that matter."""
    return ModelConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=4, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=256, intermediate_size=5120,
                       layer_types=("linear_attention",) * 3 + ("full_attention",),
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       num_nextn_predict_layers=1)


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe", "tiny_tp", "qwen3_next_80b"])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_every_tensor_has_exactly_one_rule_and_splits_evenly(name, tp):
    cfg = qwen3_next_80b_widths() if name == "qwen3_next_80b" else tiny_config(name)
    for tensor, shape in param_shapes(cfg).items():
        spec = S.spec_for(tensor, shape, cfg, tp)
        assert len(spec) <= len(shape), tensor
        for dim, axis in enumerate(spec):
            if axis == S.TP:
                assert shape[dim] % tp == 0, (tensor, shape, spec)


def test_head_projections_split_on_head_boundaries():
    cfg = tiny_config("tiny_tp")
    shapes = param_shapes(cfg)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert S.spec_for(q, shapes[q], cfg, 2) == P(S.TP, None)
    # each q_proj row block holds whole [query, gate] heads
    assert (shapes[q][0] // 2) % (2 * cfg.head_dim) == 0
    qkvz = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    group_rows = shapes[qkvz][0] // cfg.linear_num_key_heads
    assert (shapes[qkvz][0] // 4) % group_rows == 0
    assert S.spec_for(qkvz, shapes[qkvz], cfg, 4) == P(S.TP, None)
    # two KV heads cannot split four ways: replicated, never split mid-head
    k = "model.layers.1.self_attn.k_proj.weight"
    assert S.spec_for(k, shapes[k], cfg, 2) == P(S.TP, None)
    assert S.spec_for(k, shapes[k], cfg, 4) == P()


def test_unknown_tensor_is_a_clear_error():
    cfg = tiny_config("tiny_tp")
    with pytest.raises(ValueError, match="model.layers.0.linear_attn.new_thing.weight.*0 sharding rules"):
        S.spec_for("model.layers.0.linear_attn.new_thing.weight", (4, 4), cfg, 2)


def test_too_many_devices_for_this_process_is_a_clear_error():
    with pytest.raises(ValueError, match="needs .* devices"):
        S.make_mesh(jax.device_count() + 1)


