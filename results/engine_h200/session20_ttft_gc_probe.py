"""Warm-turn TTFT phases, blind vs carry interleaved, with Python's GC on and then frozen+off."""
import collections, gc, json, sys, time
import jax, numpy as np
from experiments import harness
from configs import carry_ablation
from mtp.engine import Engine, EngineConfig
from mtp.speculative import SpecConfig

c = carry_ablation.get_config(); c.num_sessions = int(sys.argv[1])
cfg, params, mesh, sessions, prompts = harness.load_experiment(c)
max_new = max(t.max_new_tokens for s in sessions for t in s.turns)
spec = SpecConfig(verify_width=3, max_new_tokens=max_new, eos_id=harness.eos_id(cfg))
rep = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
base = dict(max_context=c.max_context, num_pages=c.num_pages, drafter_pages=c.num_pages)
for mode in ("gc_on", "gc_frozen_off", "gc_on"):
    if mode == "gc_frozen_off":
        gc.collect(); gc.freeze(); gc.disable()
    else:
        gc.enable()
    res = harness.run_policies_interleaved(cfg, params, sessions, prompts, spec,
                                           {"blind": EngineConfig(policy="blind", **base),
                                            "carry": EngineConfig(policy="carry", **base)}, 0)
    out = {}
    for name, turns in res.items():
        warm = [i for i, r in enumerate(turns) if r.stats.path != "cold"]
        ttft = np.array([turns[i].stats.ttft_s for i in range(len(turns))])
        out[name] = dict(ttft_warm_p50=float(np.median(ttft[warm]) * 1e3), ttft_warm_mean=float(np.mean(ttft[warm]) * 1e3))
    # paired difference
    a = {(r.request.session_id, r.request.prompt): r.stats.ttft_s for r in res["carry"] if r.stats.path != "cold"}
    b = {(r.request.session_id, r.request.prompt): r.stats.ttft_s for r in res["blind"] if r.stats.path != "cold"}
    d = [1e3 * (a[k] - b[k]) for k in a if k in b]
    out["carry_minus_blind_ms"] = dict(mean=float(np.mean(d)), median=float(np.median(d)), pairs=len(d))
    rep[mode + ("_2" if mode in rep else "")] = out
    print(mode, json.dumps(out), flush=True)
json.dump(rep, open(sys.argv[2], "w"), indent=1)
