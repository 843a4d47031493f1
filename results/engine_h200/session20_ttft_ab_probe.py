"""Warm-turn TTFT, blind vs carry, of whichever mtp/ is first on sys.path (default model, eval sessions)."""
import json, sys, time
import jax, numpy as np
from experiments import harness
from configs import carry_ablation
import mtp.engine
from mtp.engine import EngineConfig
from mtp.speculative import SpecConfig

c = carry_ablation.get_config(); c.num_sessions = int(sys.argv[1]); c.dtype = sys.argv[2]
cfg, params, mesh, sessions, prompts = harness.load_experiment(c)
max_new = max(t.max_new_tokens for s in sessions for t in s.turns)
spec = SpecConfig(verify_width=3, max_new_tokens=max_new, eos_id=harness.eos_id(cfg))
out = {"engine": mtp.engine.__file__, "device": jax.devices()[0].device_kind, "dtype": c.dtype,
       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
for rnd in range(2):
    for policy in ("blind", "carry", "cold"):
        ecfg = EngineConfig(policy=policy, max_context=c.max_context, num_pages=c.num_pages, drafter_pages=c.num_pages)
        res = harness.run_policy(cfg, params, sessions, prompts, spec, ecfg, policy, 0)
        warm = [r.stats.ttft_s * 1e3 for r in res if r.stats.path != "cold"]
        cold = [r.stats.ttft_s * 1e3 for r in res if r.stats.path == "cold"]
        out[f"{policy}_{rnd}"] = dict(warm_p50=float(np.median(warm)) if warm else None,
                                      warm_mean=float(np.mean(warm)) if warm else None,
                                      cold_p50=float(np.median(cold)), turns=len(res),
                                      outputs=hash(tuple(tuple(r.output) for r in res)))
print(json.dumps(out))
