"""Checkpoint layouts (`mtp.hf_layout`): Qwen3.5's Gated DeltaNet projections regrouped into the
model's Qwen3-Next layout on load and split back on save; the image-text model's language model;
routed experts per expert or fused in the file, stacked in the tree."""

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from mtp.checkpoint import CheckpointError, load_pretrained, save_pretrained
from mtp.config import ARCHITECTURES
from mtp.hf_layout import Qwen35Layout, stores_fused_experts
from mtp.model.params import flatten
from tests.conftest import ROOT, random_params, tiny_config

GDN = "model.layers.0.linear_attn."


@pytest.fixture(scope="module", params=["tiny_qwen35", "tiny_qwen35_moe"])
def qwen35(request):
    """A dense and a MoE Qwen3.5 (the MoE one with tied embeddings and no dense FFN size)."""
    cfg = tiny_config(request.param)
    return cfg, random_params(cfg, seed=3), ROOT / "configs" / "models" / f"{request.param}.json"


def _saved(cfg, params, where):
    """``save_pretrained`` to ``where``; its tensors by name, to edit and write elsewhere."""
    save_pretrained(where, cfg, params)
    return load_file(str(where / "model.safetensors"))


def _loads_as(path, cfg, params):
    """``load_pretrained(path)`` gives ``cfg`` and exactly ``params``."""
    loaded_cfg, loaded = load_pretrained(path)
    assert loaded_cfg == cfg
    fa, fb = flatten(loaded), flatten(params)
    assert fa.keys() == fb.keys()
    for name in fa:
        np.testing.assert_array_equal(np.asarray(fa[name]), np.asarray(fb[name]), err_msg=name)


def test_rows_regroup_as_qwen3_next_reads_them(qwen35):
    """Each row of in_proj_qkvz / in_proj_ba lands where Qwen3-Next's own split looks for it.

    Rows are labelled by (which, head, index) in the Qwen3.5 tensors; the regrouped tensor is then
    read the way transformers' Qwen3-Next reads in_proj_qkvz: viewed as key-head groups of
    [q (dk), k (dk), v (r dv), z (r dv)] rows, and in_proj_ba as groups of [b (r), a (r)].
    """
    cfg = qwen35[0]
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r = nv // nk
    label = lambda which, head, i: 1000 * which + 100 * head + i
    rows = lambda which, heads, d: np.array([[label(which, h, i)] for h in range(heads) for i in range(d)], float)
    qkv = np.concatenate([rows(1, nk, dk), rows(2, nk, dk), rows(3, nv, dv)])
    z, b, a = rows(4, nv, dv), rows(5, nv, 1), rows(6, nv, 1)
    layout = Qwen35Layout(cfg)
    qkvz = layout.build(GDN + "in_proj_qkvz.weight", (qkv, z))[:, 0].reshape(nk, 2 * dk + 2 * r * dv)
    ba = layout.build(GDN + "in_proj_ba.weight", (b, a))[:, 0].reshape(nk, 2 * r)
    for g in range(nk):
        q_, k_, v_, z_ = np.split(qkvz[g], [dk, 2 * dk, 2 * dk + r * dv])
        assert list(q_) == [label(1, g, i) for i in range(dk)]
        assert list(k_) == [label(2, g, i) for i in range(dk)]
        heads = range(g * r, (g + 1) * r)  # the value heads that share key head g
        assert list(v_) == [label(3, h, i) for h in heads for i in range(dv)]
        assert list(z_) == [label(4, h, i) for h in heads for i in range(dv)]
        assert list(ba[g]) == [label(5, h, 0) for h in heads] + [label(6, h, 0) for h in heads]


def test_save_writes_qwen35_tensors_and_loads_back_exactly(qwen35, tmp_path):
    cfg, params, _ = qwen35
    save_pretrained(tmp_path / "ckpt", cfg, params)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == cfg.model_type and config["architectures"] == [ARCHITECTURES[cfg.model_type]]
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.get_slice(GDN + "in_proj_qkv.weight").get_shape() == [2 * 2 * 8 + 4 * 8, 32]
    for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        assert GDN + part + ".weight" in names
    assert not any("in_proj_qkvz" in n or "in_proj_ba" in n for n in names)
    _loads_as(tmp_path / "ckpt", cfg, params)


def test_the_image_text_model_loads_its_language_model(qwen35, tmp_path):
    """model.language_model.* names, a vision tower that is skipped, the config's text_config."""
    cfg, params, config_file = qwen35
    tensors = _saved(cfg, params, tmp_path / "text")
    nested = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): v
              for n, v in tensors.items()}
    nested["model.visual.blocks.0.attn.qkv.weight"] = np.ones((48, 16), np.float32)
    (tmp_path / "vl").mkdir()
    save_file(nested, str(tmp_path / "vl" / "model.safetensors"))
    (tmp_path / "vl" / "config.json").write_text(config_file.read_text())
    _loads_as(tmp_path / "vl", cfg, params)


def test_a_missing_projection_is_named(qwen35, tmp_path):
    cfg, params, _ = qwen35
    tensors = _saved(cfg, params, tmp_path / "ckpt")
    del tensors[GDN + "in_proj_z.weight"]
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.linear_attn\.in_proj_z\.weight' \(shape \(32, 32\)\)"):
        load_pretrained(tmp_path / "ckpt")


def test_malformed_qwen35_configs_are_refused_by_name():
    from mtp.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="needs a text_config"):
        ModelConfig.from_hf({"model_type": "qwen3_5"})
    with pytest.raises(ConfigError, match="text_config.model_type 'qwen3_next'"):
        ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_next"}})
    # A dense FFN with no size: the MoE family may omit intermediate_size, the dense one may not.
    dense = json.loads((ROOT / "configs" / "models" / "tiny_qwen35.json").read_text())
    del dense["text_config"]["intermediate_size"]
    with pytest.raises(ConfigError, match=r"intermediate_size=0: must be positive: the FFNs of layers \[0, 1, 2, 3\]"):
        ModelConfig.from_hf(dense)


def test_a_model_loaded_from_qwen35_computes_what_it_was_saved_from(qwen35, tmp_path):
    """The same logits through the forward pass, as a guard on the params tree as a whole."""
    from mtp.model import forward

    cfg, params, _ = qwen35
    save_pretrained(tmp_path / "ckpt", cfg, params)
    _, loaded = load_pretrained(tmp_path / "ckpt")
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(forward(cfg, loaded, tokens)), np.asarray(forward(cfg, params, tokens)))


def _fused(tensors, cfg):
    """A per-expert checkpoint's tensors with each layer's experts fused, as vLLM's Qwen3.5 loaders
    read them: gate_up_proj [E, 2I, H] (gate first) and down_proj [E, H, I]."""
    tensors = dict(tensors)
    stems = sorted({n.split("experts.")[0] + "experts." for n in tensors if ".experts." in n})
    assert len(stems) == sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers))) + 1  # and the MTP layer's
    for stem in stems:
        take = lambda kind: [tensors.pop(f"{stem}{e}.{kind}_proj.weight") for e in range(cfg.num_experts)]
        gate, up, down = take("gate"), take("up"), take("down")
        tensors[stem + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        tensors[stem + "down_proj"] = np.stack(down)
    return tensors


def _write(where, tensors, config_text):
    where.mkdir()
    save_file(tensors, str(where / "model.safetensors"))
    (where / "config.json").write_text(config_text)
    return where


@pytest.mark.parametrize("name", ["tiny_moe", "tiny_qwen35_moe"])
def test_fused_experts_load_as_the_per_expert_ones(tmp_path, name):
    """Experts stored fused per layer load as the same stacked experts, in either family."""
    cfg = tiny_config(name)
    params = random_params(cfg, seed=5)
    tensors = _saved(cfg, params, tmp_path / "per_expert")
    fused = _fused(tensors, cfg)
    _write(tmp_path / "fused", fused, (tmp_path / "per_expert" / "config.json").read_text())
    _loads_as(tmp_path / "fused", cfg, params)
    stem = "model.layers.0.mlp.experts."
    del fused[stem + "down_proj"]
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    with pytest.raises(CheckpointError, match=rf"'{re.escape(stem)}down_proj' \(shape \({e}, {h}, {i}\)\)"):
        load_pretrained(tmp_path / "fused")


@pytest.mark.parametrize("name", ["tiny_moe", "tiny_qwen35_moe"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_load_and_save_writes_the_files_own_tensors(tmp_path, name, fused):
    """A checkpoint written by hand (per expert, as transformers writes one, or fused; the experts
    in bf16 beside f32 tensors) loads into stacked experts and saves back to the same names,
    dtypes and values: per expert by default, fused where the file was."""
    cfg = tiny_config(name)
    params = random_params(cfg, seed=9)
    tensors = {n: (v.astype(ml_dtypes.bfloat16) if ".experts." in n else v)
               for n, v in _saved(cfg, params, tmp_path / "ours").items()}
    if fused:
        tensors = _fused(tensors, cfg)
    src = _write(tmp_path / "src", tensors, (tmp_path / "ours" / "config.json").read_text())
    loaded_cfg, loaded = load_pretrained(src)
    stack = flatten(loaded)["model.layers.0.mlp.experts.gate_proj.weight"]
    assert stack.shape == (cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    assert stack.dtype == jnp.bfloat16
    with safe_open(str(src / "model.safetensors"), "np") as f:
        assert stores_fused_experts(f.keys()) == fused
    save_pretrained(tmp_path / "back", loaded_cfg, loaded, fused_experts=fused)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == tensors.keys()
    for n in tensors:
        assert back[n].dtype == tensors[n].dtype, n
        np.testing.assert_array_equal(back[n], tensors[n], err_msg=n)
