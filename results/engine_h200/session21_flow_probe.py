"""Session 21: each prefill chunk call of a warm turn, timed in the real interleaved flow (blind, carry,
cold engines alive together): host dispatch and synced time, plain vs fused; then with the carry's
append run as a call of its own after a plain last chunk."""
import collections, json, sys, time
import jax, numpy as np
from configs import carry_ablation
from experiments import harness
import mtp.engine as E
from mtp.engine import EngineConfig
from mtp.speculative import SpecConfig

c = carry_ablation.get_config(); c.num_sessions = int(sys.argv[2]); c.dtype = "float32"
cfg, params, mesh, sessions, prompts = harness.load_experiment(c)
spec = SpecConfig(verify_width=3, max_new_tokens=max(t.max_new_tokens for s in sessions for t in s.turns),
                  eos_id=harness.eos_id(cfg))
total = sum(len(s.turns) for s in sessions)
rec, cur = [], {}
real_prefill, real_append, real_start = E._prefill_slot, E._append_slot, E.Engine._start_turn

def prefill(*a, **k):
    t0 = time.perf_counter(); out = real_prefill(*a, **k); t1 = time.perf_counter()
    jax.block_until_ready(out[4].token); t2 = time.perf_counter()
    rec.append(dict(policy=cur["policy"], mode=cur["mode"], warm=cur["warm"], call="fused" if a[4] is not None else "plain",
                    cols=int(a[6].shape[1]), dispatch=t1 - t0, synced=t2 - t0))
    return out

def append(*a, **k):
    t0 = time.perf_counter(); out = real_append(*a, **k); t1 = time.perf_counter()
    jax.block_until_ready(out.rows); t2 = time.perf_counter()
    rec.append(dict(policy=cur["policy"], mode=cur["mode"], warm=cur["warm"], call="append", cols=int(a[5].shape[1]),
                    dispatch=t1 - t0, synced=t2 - t0))
    return out

def split_prefill(cfg, params, cache, hiddens, dcache, rng, chunk, *, width, temperature, impl):
    cache, hiddens, _, rng, end = prefill(cfg, params, cache, hiddens, None, rng, chunk[:, :width + 4], width=width,
                                          temperature=temperature, impl=impl)
    if dcache is not None:
        dcache = E._append_slot(cfg, params, dcache, hiddens, int(chunk[0, width]), chunk[:, width + 4:], impl=impl)
    return cache, hiddens, dcache, rng, end

def start(self, lv):
    cur.update(policy=self.ecfg.policy, warm=lv.stats.path != "cold")
    try:
        return real_start(self, lv)
    finally:
        cur["warm"] = False  # calls outside a turn (precompile, warm-up compiles) are not counted

E.Engine._start_turn = start
E._append_slot = append
out = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
for mode in ("fused", "split", "fused"):
    cur.update(mode=mode, warm=False, policy=None)
    E._prefill_slot = prefill if mode == "fused" else split_prefill
    ecfgs = {p: EngineConfig(policy=p, max_context=c.max_context, num_pages=c.num_pages, drafter_pages=c.num_pages)
             for p in ("blind", "carry", "cold")}
    res = harness.run_policies_interleaved(cfg, params, sessions, prompts, spec, ecfgs, total)
    ttft = {p: float(np.median([r.stats.ttft_s * 1e3 for r in rs if r.stats.path != "cold"]))
            for p, rs in res.items() if p != "cold"}
    out.setdefault("ttft_p50_synced_chunks", []).append(dict(mode=mode, **ttft))
    print(mode, ttft, flush=True)
groups = collections.defaultdict(list)
for r in rec:
    if r["warm"]:
        groups[(r["mode"], r["policy"], r["call"], r["cols"])].append((r["dispatch"], r["synced"]))
out["calls"] = [dict(mode=k[0], policy=k[1], call=k[2], cols=k[3], n=len(v),
                     dispatch_ms=round(float(np.median([x[0] for x in v])) * 1e3, 3),
                     synced_ms=round(float(np.median([x[1] for x in v])) * 1e3, 3)) for k, v in sorted(groups.items())]
for x in out["calls"]:
    print(x)
json.dump(out, open(sys.argv[1], "w"), indent=1)
