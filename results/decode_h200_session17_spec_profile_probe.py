"""Probe: where the default model's plain and speculative (K) loops spend their time at batch 1, per
source line (CUPTI inside the loops' command buffers), beside the loops' wall time per iteration."""
import sys
import numpy as np
import jax
from experiments.bench_decode import _kernel_profile
from mtp.checkpoint import load_pretrained
from mtp.data.sessions import first_prompt_ids, load_preamble, load_sessions
from mtp.data.tokenizer import Tokenizer
from mtp.generation import generate, prepare_decode
from mtp.speculative import SpecConfig

ks = [int(k) for k in (sys.argv[1:] or ["2"])]
if jax.default_backend() == "gpu":  # CUPTI on before any CUDA graph exists, or the loops' kernels go untraced
    from experiments import cupti
    cupti.start()
ckpt = "assets/default_model"
cfg, params = load_pretrained(ckpt)
tok = Tokenizer.load(f"{ckpt}/tokenizer.json")
pre = load_preamble("assets/sessions/preamble.txt")
sessions = load_sessions("assets/sessions/eval_sessions.jsonl")
prompts = [first_prompt_ids(pre, sessions[0].turns[0].user, tok)]
new = 128
for k in [0] + ks:
    spec = SpecConfig(verify_width=k or 2, max_new_tokens=new)
    gen = lambda: generate(cfg, params, prompts, spec, speculative=k > 0)
    gen()
    res = [gen() for _ in range(5)]
    decode_s = float(np.median([r.decode_s for r in res]))
    iters = res[0].stats.as_dict().get("verify_steps", new) if k else new
    call = prepare_decode(cfg, params, prompts, spec, speculative=k > 0)
    prof, _ = _kernel_profile(call.loop, call.args, iters, top=12, by_source=True)
    name = f"spec K={k}" if k else "plain"
    print(f"== {name}: {len(res[0].tokens[0])} tokens, {iters} iterations, wall {decode_s / iters * 1e6:.1f} us an iteration "
          f"({len(res[0].tokens[0]) / decode_s:.0f} tok/s); kernels {prof.get('kernels')}, kernel sum "
          f"{prof.get('kernel_sum_ms', 0) * 1e3:.1f} us an iteration", flush=True)
    for src, n, us in prof.get("by_source", []):
        print(f"   {us:7.1f} us  {n:5.2f}x  {src[:150]}", flush=True)
    if "profile_error" in prof:
        print(prof["profile_error"])
