"""Numerical parity of our target model with Hugging Face transformers' causal LM for its config.

``AutoModelForCausalLM`` picks the class from the saved ``model_type``: ``Qwen3NextForCausalLM``
for ``qwen3_next``, ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` for ``qwen3_5_text`` /
``qwen3_5_moe_text`` (whose checkpoint layout `mtp.hf_layout` writes), so a pass also checks
that layout against transformers' own reading.

    /root/.pyenv/versions/3.11.7/bin/python3.11 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors absl-py numpy
    .venv/bin/python -m experiments.check_hf_parity [--hf_python=/tmp/hfvenv/bin/python]

For each model config it writes a random fp32 checkpoint with `save_pretrained`
(norm weights random too, so a ``w`` vs ``1 + w`` slip cannot hide behind zeros),
runs the same random tokens through our `forward` and through transformers, and
reports the logits difference together with the difference after every sub-block
(token mixer, FFN, layer output, final norm), so a disagreement names the op.

Two interpreters are involved because the project's JAX (0.11.2) needs Python
>= 3.12 while the only torch available offline here is a Python 3.11 wheel: this
file runs under the project venv as the driver and re-runs itself under
``--hf_python`` with ``--role=hf`` as the transformers worker. The worker imports
only numpy, torch and transformers (hence the driver's imports live in its
functions), and torch/transformers never become project dependencies.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

import numpy as np
from absl import app, flags, logging

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

_ROLE = flags.DEFINE_enum("role", "driver", ["driver", "hf"], "driver: our model + report; hf: transformers worker.")
_HF_PYTHON = flags.DEFINE_string("hf_python", "/tmp/hfvenv/bin/python",
                                 "Interpreter with torch + transformers (>= 4.57 for Qwen3-Next, >= 5.2 for Qwen3.5).")
_CONFIGS = flags.DEFINE_list("configs", ["configs/models/tiny_dense.json", "configs/models/tiny_moe.json",
                                         "configs/models/tiny_qwen35.json", "configs/models/tiny_qwen35_moe.json"],
                             "HF config.json files of the variants to check.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 150, "Tokens per sequence; > 64 crosses Gated DeltaNet chunks.",
                                lower_bound=2)
_BATCH = flags.DEFINE_integer("batch", 2, "Sequences per variant.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weights and tokens.")
_TOLERANCE = flags.DEFINE_float("tolerance", 1e-4, "Max abs logits error vs fp64 that always passes.",
                                 lower_bound=0.0)
_FP32_FACTOR = flags.DEFINE_float("fp32_factor", 4.0, "Also pass within this multiple of transformers' "
                                  "own fp32 error vs fp64 (fp32 rounding is the floor).", lower_bound=0.0)
_OUT = flags.DEFINE_string("out", "results/parity/hf_parity.md", "Markdown report (relative to the repo root).")
# Worker-only.
_CKPT = flags.DEFINE_string("ckpt", None, "(hf role) checkpoint directory.")
_TOKENS = flags.DEFINE_string("tokens", None, "(hf role) .npy of int32 tokens [B, T].")
_DUMP = flags.DEFINE_string("dump", None, "(hf role) .npz to write logits and per-block outputs to.")


# ====================================================================== HF worker
def run_hf() -> None:
    """Run transformers in fp32 and in fp64, keeping every sub-block's input and output.

    The fp64 run is the ground truth both fp32 implementations are measured against:
    the Gated DeltaNet recurrence amplifies fp32 rounding, so "ours vs HF fp32" alone
    cannot tell a rounding difference from a semantic one.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    tokens = torch.from_numpy(np.load(_TOKENS.value)).long()
    captured: dict[str, np.ndarray] = {}
    for tag, dtype in (("f64", torch.float64), ("f32", torch.float32)):
        # Eager experts: the grouped-matmul MoE path has no fp64 kernel.
        model, info = AutoModelForCausalLM.from_pretrained(
            _CKPT.value, dtype=dtype, attn_implementation="eager", experts_implementation="eager",
            output_loading_info=True)
        model.eval()
        unexpected = [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
        if info["missing_keys"] or unexpected or info.get("mismatched_keys"):
            raise SystemExit(f"transformers did not load every weight: missing={info['missing_keys']} "
                             f"unexpected={unexpected} mismatched={info.get('mismatched_keys')}")

        def keep(name, tag=tag):
            def hook(_module, args, kwargs, output):
                x = args[0] if args else kwargs["hidden_states"]
                out = output[0] if isinstance(output, tuple) else output
                captured[f"{tag}/{name}.in"] = x.detach().double().numpy()
                captured[f"{tag}/{name}"] = out.detach().double().numpy()
            return hook

        watched = {"embed": model.model.embed_tokens, "final_norm": model.model.norm}
        for i, layer in enumerate(model.model.layers):
            watched[f"layer{i}.mixer"] = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
            watched[f"layer{i}.ffn"] = layer.mlp
            watched[f"layer{i}.out"] = layer
        hooks = [m.register_forward_hook(keep(name), with_kwargs=True) for name, m in watched.items()]
        with torch.no_grad():
            captured[f"{tag}/logits"] = model(input_ids=tokens, use_cache=False).logits.double().numpy()
        for h in hooks:
            h.remove()
    # transformers' own fp32 blocks fed the fp64 inputs: the isolated-op baseline for ours. Attention
    # is left out (it needs the model's mask and rotary tables; its errors are ~1e-7 anyway).
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            blocks = {"ffn": layer.mlp}
            if hasattr(layer, "linear_attn"):
                blocks["mixer"] = layer.linear_attn
            for part, module in blocks.items():
                x = torch.from_numpy(captured[f"f64/layer{i}.{part}.in"]).float()
                captured[f"f32iso/layer{i}.{part}"] = module(x).double().numpy()
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "python": platform.python_version(),
            "hf_rope": json.dumps(getattr(model.config, "rope_parameters", None), default=str),
            "unexpected_mtp_keys": len(info["unexpected_keys"])}
    np.savez(_DUMP.value, meta=json.dumps(meta), **captured)


# ====================================================================== driver
def _mixer(cfg, p, kind: str, h):
    """A layer's token mixer on its normed input, as `forward_with_hiddens` runs it."""
    import jax.numpy as jnp

    from mtp.cache.state import LinearState
    from mtp.model import gated_deltanet as gdn
    from mtp.model.layers import attention_out, attention_qkv, causal_attention

    b, t = h.shape[:2]
    if kind == "full_attention":
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        q, k, v, gate = attention_qkv(p["self_attn"], h, positions, cfg)
        return attention_out(p["self_attn"], causal_attention(q, k, v, gate))
    zeros = LinearState.zeros(cfg, b, h.dtype)
    return gdn.gdn_layer(p["linear_attn"], h, cfg, zeros.conv[0], zeros.recurrent[0],
                         jnp.ones((b, t), bool), False)[0]


def _our_blocks(cfg, params, tokens) -> dict[str, np.ndarray]:
    """Our model's output after every sub-block, mirroring `forward_with_hiddens`'s loop."""
    from mtp.model.layers import ffn
    from mtp.ops.norms import rms_norm
    from mtp.model.target import embed

    x = embed(params, tokens)
    out = {"embed": x}
    for i, kind in enumerate(cfg.layer_types):
        p = params["model"]["layers"][str(i)]
        m = _mixer(cfg, p, kind, rms_norm(x, p["input_layernorm"]["weight"], cfg.rms_norm_eps))
        x = x + m
        f = ffn(p["mlp"], rms_norm(x, p["post_attention_layernorm"]["weight"], cfg.rms_norm_eps), cfg)
        x = x + f
        out.update({f"layer{i}.mixer": m, f"layer{i}.ffn": f, f"layer{i}.out": x})
    out["final_norm"] = rms_norm(x, params["model"]["norm"]["weight"], cfg.rms_norm_eps)
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def _isolated(cfg, params, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each of our sub-blocks fed transformers' own fp64 input (cast to fp32): no propagation."""
    import jax.numpy as jnp

    from mtp.model.layers import ffn

    out = {}
    for i, kind in enumerate(cfg.layer_types):
        p = params["model"]["layers"][str(i)]
        out[f"layer{i}.mixer"] = _mixer(cfg, p, kind, jnp.asarray(hf[f"f64/layer{i}.mixer.in"], jnp.float32))
        out[f"layer{i}.ffn"] = ffn(p["mlp"], jnp.asarray(hf[f"f64/layer{i}.ffn.in"], jnp.float32), cfg)
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {b.shape}")
    return float(np.max(np.abs(a - b)))


def check_variant(config_path: pathlib.Path, work: pathlib.Path, seed: int) -> dict:
    import jax
    import jax.numpy as jnp

    from mtp.checkpoint import save_pretrained
    from mtp.config import ModelConfig
    from mtp.model import forward_with_hiddens
    from mtp.model.params import init_params, perturb_norms

    cfg = ModelConfig.from_hf(config_path)
    key = jax.random.PRNGKey(seed)
    params = perturb_norms(init_params(cfg, key, jnp.float32), jax.random.fold_in(key, 1), scale=0.2)
    ckpt = save_pretrained(work / config_path.stem, cfg, params)
    tokens = np.asarray(jax.random.randint(jax.random.fold_in(key, 2), (_BATCH.value, _SEQ_LEN.value),
                                           0, cfg.vocab_size), np.int32)
    np.save(work / "tokens.npy", tokens)
    dump = work / f"{config_path.stem}.npz"
    logging.info("%s: running transformers worker (fp32 and fp64)", config_path.stem)
    subprocess.run([_HF_PYTHON.value, str(pathlib.Path(__file__).resolve()), "--role=hf",
                    f"--ckpt={ckpt}", f"--tokens={work / 'tokens.npy'}", f"--dump={dump}"], check=True)
    hf = dict(np.load(dump))
    meta = json.loads(str(hf.pop("meta")))

    ours = _our_blocks(cfg, params, jnp.asarray(tokens))
    # Eager like the mirror: jit's fusions reorder fp32 rounding, which the Gated DeltaNet amplifies.
    full = forward_with_hiddens(cfg, params, jnp.asarray(tokens))
    drift = _max_abs(ours["final_norm"], np.asarray(full.hidden_post, np.float64))
    if drift > 1e-6:  # the block-by-block mirror must be the model, or its per-block numbers mean nothing
        raise SystemExit(f"{config_path.stem}: block-by-block mirror drifted from forward_with_hiddens by {drift:.2e}")
    ours["logits"] = np.asarray(full.logits, np.float64)
    blocks = {name: {"ours_vs_hf32": _max_abs(v, hf[f"f32/{name}"]),
                     "ours_vs_hf64": _max_abs(v, hf[f"f64/{name}"]),
                     "hf32_vs_hf64": _max_abs(hf[f"f32/{name}"], hf[f"f64/{name}"]),
                     "scale": float(np.max(np.abs(hf[f"f64/{name}"])))}
              for name, v in ours.items()}
    isolated = {name: _max_abs(v, hf[f"f64/{name}"]) for name, v in _isolated(cfg, params, hf).items()}
    hf_isolated = {name: _max_abs(hf[f"f32iso/{name}"], hf[f"f64/{name}"]) for name in isolated
                   if f"f32iso/{name}" in hf}
    lg = blocks["logits"]
    # Our fp32 error against the fp64 truth, judged against transformers' own fp32 error.
    bound = max(_TOLERANCE.value, _FP32_FACTOR.value * lg["hf32_vs_hf64"])
    return {"variant": config_path.stem, "config": str(config_path), "moe": cfg.num_experts > 0,
            "tied": cfg.tie_word_embeddings, "layer_types": list(cfg.layer_types),
            "ffn_kinds": ["MoE FFN" if cfg.is_moe_layer(i) else "dense FFN" for i in range(cfg.num_hidden_layers)],
            "tokens_shape": list(tokens.shape), "logits": lg, "blocks": blocks, "isolated": isolated,
            "hf_isolated": hf_isolated, "mirror_drift": drift,
            "bound": bound, "passed": lg["ours_vs_hf64"] <= bound, "hf": meta}


def _report(results: list[dict], command: str) -> str:
    import jax

    hf = results[0]["hf"]
    lines = [
        "# Hugging Face numerics parity",
        "",
        "Our `mtp.model.forward` (fp32, run op by op) against transformers' causal LM for each config "
        "(`Qwen3NextForCausalLM`; `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM` for the Qwen3.5 "
        "variants, whose checkpoints `save_pretrained` writes in Qwen3.5's own tensor layout) (eager attention, "
        "eager experts, torch chunked Gated DeltaNet) run in fp32 and in fp64, on random checkpoints "
        "written by `mtp.checkpoint.save_pretrained` (fp32; norm weights random, `perturb_norms` scale "
        "0.2; transformers ignores the `mtp.*` tensors). The fp64 run is the reference: a pass means our "
        f"max abs logits error against it is <= max({_TOLERANCE.value:g}, {_FP32_FACTOR.value:g} x "
        "transformers' own fp32 error against it).",
        "",
        f"- Command: `{command}`",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Machine: {platform.machine()} CPU, {os.cpu_count()} cores",
        f"- Ours: Python {platform.python_version()}, jax {jax.__version__} (CPU)",
        f"- Reference: Python {hf['python']}, torch {hf['torch']}, transformers {hf['transformers']}",
        "",
        "Max abs logits difference:",
        "",
        "| variant | FFN | tokens [B, T] | logits scale | ours32 vs HF32 (rel) | ours32 vs HF64 | HF32 vs HF64 | pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lg = r["logits"]
        lines.append(
            f"| {r['variant']} | {'MoE' if r['moe'] else 'dense'} | {r['tokens_shape']} | {lg['scale']:.3g} | "
            f"{lg['ours_vs_hf32']:.2e} ({lg['ours_vs_hf32'] / lg['scale']:.1e}) | {lg['ours_vs_hf64']:.2e} | "
            f"{lg['hf32_vs_hf64']:.2e} | {'yes' if r['passed'] else '**no**'} |")
    gdn = max(v for r in results for k, v in r["isolated"].items() if _kind(r, k) == "Gated DeltaNet")
    other = max(v for r in results for k, v in r["isolated"].items() if _kind(r, k) != "Gated DeltaNet")
    hf_gdn = max(v for r in results for k, v in r["hf_isolated"].items() if _kind(r, k) == "Gated DeltaNet")
    passed = all(r["passed"] for r in results)
    lines += ["", ("All variants pass" if passed else "**Not all variants pass**")
              + f". Against the fp64 reference our fp32 logits are off by at most "
              f"{max(r['logits']['ours_vs_hf64'] for r in results):.1e} and transformers' own fp32 logits by "
              f"{max(r['logits']['hf32_vs_hf64'] for r in results):.1e}"
              + (": what separates the two fp32 implementations is rounding, not semantics." if passed else ".")
              + f" Op by op (isolated), the Gated DeltaNet's fp32 error is {gdn:.1e} for ours and "
              f"{hf_gdn:.1e} for transformers'; attention and FFNs agree to {other:.1e}. Downstream blocks "
              "amplify the Gated DeltaNet's rounding in both implementations (see the propagated columns)."]
    lines += ["", "Per sub-block, max abs difference from the fp64 reference. *Propagated*: our whole "
              "forward (errors accumulate through layers), beside transformers' fp32 run. *Isolated*: our "
              "block fed transformers' fp64 input to that very block, so it measures that op alone "
              "(mixer = Gated DeltaNet or gated attention output before the residual add).", ""]
    for r in results:
        by_kind: dict[str, list[float]] = {}
        for block, err in r["isolated"].items():
            worst = by_kind.setdefault(_kind(r, block), [0.0, 0.0])
            worst[0] = max(worst[0], err)
            worst[1] = max(worst[1], r["hf_isolated"].get(block, 0.0))
        lines += [f"**{r['variant']}** ({', '.join(r['layer_types'])}). Largest isolated error by op, "
                  "ours (HF fp32): " + ", ".join(
                      f"{k} {v[0]:.1e} ({v[1]:.1e})" if v[1] else f"{k} {v[0]:.1e}"
                      for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1][0])) + ".",
                  "",
                  "| block | scale | ours32 propagated | HF32 propagated | ours32 isolated | HF32 isolated |",
                  "|---|---|---|---|---|---|"]
        fmt = lambda v: "" if v is None else f"{v:.1e}"
        for name, d in r["blocks"].items():
            lines.append(f"| {name} | {d['scale']:.3g} | {d['ours_vs_hf64']:.1e} | {d['hf32_vs_hf64']:.1e} | "
                         f"{fmt(r['isolated'].get(name))} | {fmt(r['hf_isolated'].get(name))} |")
        lines.append("")
    lines += ["Raw results:", "", "```json", json.dumps(results, indent=1), "```", ""]
    return "\n".join(lines)


def _kind(result: dict, block: str) -> str:
    layer = int(block.split(".")[0].removeprefix("layer"))
    if block.endswith(".ffn"):
        return result["ffn_kinds"][layer]
    return "Gated DeltaNet" if result["layer_types"][layer] == "linear_attention" else "gated attention"


def run_driver() -> None:
    results = []
    with tempfile.TemporaryDirectory(prefix="hf_parity_") as tmp:
        for i, path in enumerate(_CONFIGS.value):
            p = pathlib.Path(path)
            r = check_variant(p if p.is_absolute() else REPO_ROOT / p, pathlib.Path(tmp), _SEED.value + i)
            lg = r["logits"]
            logging.info("%s: max abs logits diff ours32-HF32 %.2e, ours32-HF64 %.2e, HF32-HF64 %.2e -> %s",
                         r["variant"], lg["ours_vs_hf32"], lg["ours_vs_hf64"], lg["hf32_vs_hf64"],
                         "pass" if r["passed"] else "FAIL")
            results.append(r)
    command = "python -m experiments.check_hf_parity " + " ".join(sys.argv[1:])
    out = pathlib.Path(_OUT.value)
    out = out if out.is_absolute() else REPO_ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    from experiments.results_io import write_atomic

    write_atomic(out, _report(results, command.strip()))
    logging.info("wrote %s", out)
    failed = [r for r in results if not r["passed"]]
    if failed:
        worst = {r["variant"]: max(r["isolated"], key=r["isolated"].get) for r in failed}
        raise SystemExit(f"parity check failed; worst isolated block per variant: {worst}")


def main(argv):
    del argv
    if _ROLE.value == "hf":
        run_hf()
    else:
        run_driver()


if __name__ == "__main__":
    app.run(main)
