"""`experiments/profile_step.py`'s bookkeeping on the CPU: the groups' floors add up to the step's, kernels
land in the group their name or source says, variants parse."""

import pytest

from experiments import bench_real_shape as brs
from experiments import profile_step as ps


def test_group_floors_add_up_to_the_steps_floor():
    cfg = brs.load_model_config("qwen3_next_80b_a3b")
    for width, experts in ((1, [10] * 48), (4, [39] * 48)):
        floors = ps.group_floors(cfg, "fp8", experts, width, 2048)
        assert set(floors) == set(ps.GROUPS)
        step = (brs.target_dense_bytes(cfg, "fp8") + sum(experts) * brs.expert_bytes(cfg, "fp8")
                + brs.cache_bytes(cfg, 1, 2048, len(cfg.attention_layers), len(cfg.linear_layers), width))
        extra = width * cfg.hidden_size * 2 + width * cfg.vocab_size * 4  # the embedding rows and the f32 logits
        assert sum(floors.values()) == step + extra
        assert floors["LM head"] > 600e6 and floors["routed experts"] == sum(experts) * 3_146_496


@pytest.mark.parametrize("kernel,source,group", [
    ("fp8_w8a16_12288x2048__1", "(kernel) _w8a16:1 < w8a16:2 < matmul:3 < linear:4 < dense_columns:5",
     "projections (FP8 GEMMs)"),
    ("fp8_w8a16_512x2048", "(kernel) _w8a16:1 < linear:4 < dense:5 < mlp:341 < moe:382", "shared expert"),
    ("gdn_step", "?", "GDN step"),
    ("kernel_mosaic_gpu_kernel", "?", "attention"),
    ("loop_fusion_3", "expert_ffn:81 < routed_experts_gather:95 < moe:376", "routed experts"),
    ("input_reduce_fusion", "route:353 < moe:374", "routing"),
    ("gemm_fusion_dot_7", "lm_head:59 < _final:106 < verify:237", "LM head"),
    ("loop_fusion_9", "rms_norm:18 < _final:103", "norms"),
    ("loop_fusion_1", "linear:113 < dense_rows:152 < dense:165 < attention_out:320 < "
                      "paged_attention_mixer.<locals>.mixer:96", "projections (FP8 GEMMs)"),
    ("loop_fusion_2", "write_pages:1 < paged_attention_mixer.<locals>.mixer:87", "attention"),
    ("copy_4", "? copy_4", "other"),
])
def test_kernels_land_in_their_group(kernel, source, group):
    assert ps.group_of(kernel, source) == group


def test_variants_parse_and_refuse_other_variables():
    assert ps.parse_variant("base:") == ("base", {})
    assert ps.parse_variant("both:MTP_KERNELS=moe=reference;MTP_DECODE_LOOP_GRAPH=0") == (
        "both", {"MTP_KERNELS": "moe=reference", "MTP_DECODE_LOOP_GRAPH": "0"})
    with pytest.raises(SystemExit, match="XLA_FLAGS"):
        ps.parse_variant("x:XLA_FLAGS=--foo")
