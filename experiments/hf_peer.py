"""transformers' ``Qwen3NextForCausalLM`` on this codebase's weights: the real-shape benchmark's peer.

Imports only torch and transformers (and, where installed, flash-linear-attention, whose kernels
transformers' Qwen3-Next then runs), so that it also runs under an interpreter without JAX. The
weights come in as the model's flat tree (HF tensor names, routed experts stacked ``[E, ...]``), as
JAX arrays (taken zero-copy through DLPack) or NumPy arrays.
"""

from __future__ import annotations

import inspect
import re
import time
from typing import Any, Mapping

from experiments.timing import per_step_slope

# A stack of routed experts, `mtp.model.params.EXPERT_STACK` restated: this module imports no JAX.
_EXPERTS = re.compile(r"^(?P<stem>.*\.mlp\.experts\.)(?P<proj>gate|up|down)_proj\.weight$")


def state_dict(flat: Mapping[str, Any], tie_word_embeddings: bool, torch) -> dict[str, Any]:
    """Our target's tensors under transformers' names; the MTP head's are left out (transformers has
    none). Zero-copy where the layouts agree; a layer's routed gate and up stacks are concatenated
    into its ``experts.gate_up_proj`` ``[E, 2I, H]``, its down stack is ``experts.down_proj``."""
    out = {}
    for name, w in flat.items():
        m = _EXPERTS.match(name)
        if name.startswith("mtp.") or (m and m["proj"] == "up"):
            continue
        t = torch.from_dlpack(w)
        if m and m["proj"] == "gate":
            up = torch.from_dlpack(flat[f"{m['stem']}up_proj.weight"])
            out[f"{m['stem']}gate_up_proj"] = torch.cat([t, up], dim=1)
        elif m:
            out[f"{m['stem']}down_proj"] = t
        else:
            out[name] = t
    if tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def build_model(hf_config: Mapping[str, Any], flat: Mapping[str, Any], device: str, dtype: str):
    """The causal LM of ``hf_config`` (our `ModelConfig.to_hf()`) holding ``flat``'s weights."""
    import torch
    import transformers

    cfg = transformers.Qwen3NextConfig.from_dict(dict(hf_config))
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.Qwen3NextForCausalLM._from_config(cfg, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(state_dict(flat, cfg.tie_word_embeddings, torch), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"transformers' Qwen3NextForCausalLM does not read these weights: missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def gated_delta_rule_implementations() -> dict[str, str]:
    """The functions transformers' Qwen3-Next runs for its gated delta rule, chunked (prefill) and
    recurrent (decode): flash-linear-attention's kernels when that package imports, else
    transformers' own PyTorch references (its decorated ``torch_*`` functions)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    out = {}
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        fn, seen, found = getattr(m, name, None), set(), "unknown"
        while fn is not None and id(fn) not in seen:
            seen.add(id(fn))
            impl = inspect.getclosurevars(fn).nonlocals.get("implementation") if inspect.isfunction(fn) else None
            if impl is not None:
                found = f"{impl.__module__}.{impl.__name__}"
                break
            fn = getattr(fn, "__wrapped__", None)
        out[name.removeprefix("torch_")] = found
    return out


def decode_ms_per_token(model, vocab_size: int, prompt_len: int, tokens: int, reps: int, seed: int) -> dict[str, Any]:
    """ms a decoded token, greedy at batch 1 after a random prompt of ``prompt_len`` tokens:
    `experiments.timing.per_step_slope` between ``model.generate`` runs of
    ``tokens`` and twice as many new tokens, which drops the prompt's prefill."""
    import torch
    import transformers

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (1, prompt_len), generator=gen).to(device)

    def call_of(n):
        def call():
            sync()
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            sync()
            if out.shape[1] != prompt_len + n:
                raise RuntimeError(f"transformers generated {out.shape[1] - prompt_len} tokens, not {n}")
            return time.perf_counter() - t
        return call

    ms, ms_call = per_step_slope({tokens: call_of(tokens), 2 * tokens: call_of(2 * tokens)}, reps)
    try:
        import fla

        fla_version = getattr(fla, "__version__", "installed")
    except ImportError:
        fla_version = None
    return dict(ms_per_token=ms, ms_per_token_whole_call=ms_call, transformers=transformers.__version__,
                torch=torch.__version__, flash_linear_attention=fla_version,
                gated_delta_rule=gated_delta_rule_implementations())
