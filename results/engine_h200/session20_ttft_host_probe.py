"""Host time per phase of a warm turn (no syncs added), carry vs blind; and the fused prefill call alone."""
import collections, json, sys, time
import jax, numpy as np
from experiments import harness
from configs import carry_ablation
from mtp import engine as E
from mtp.engine import Engine, EngineConfig, run_sessions
from mtp.speculative import SpecConfig

c = carry_ablation.get_config(); c.num_sessions = int(sys.argv[1])
cfg, params, mesh, sessions, prompts = harness.load_experiment(c)
max_new = max(t.max_new_tokens for s in sessions for t in s.turns)
spec = SpecConfig(verify_width=3, max_new_tokens=max_new, eos_id=harness.eos_id(cfg))
times = collections.defaultdict(list)
def timed(name, fn):
    def run(self, *a, **k):
        t = time.perf_counter(); out = fn(self, *a, **k); times[name].append(time.perf_counter() - t); return out
    return run
for n in ("_reserve_turn", "_reserve_drafter", "_start_turn", "_start_drafter", "_target_prefill", "_set_target_table"):
    setattr(Engine, n, timed(n, getattr(Engine, n)))
rep = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
for rnd in range(2):
    for policy in ("blind", "carry"):
        ecfg = EngineConfig(policy=policy, max_context=c.max_context, num_pages=c.num_pages, drafter_pages=c.num_pages)
        harness.run_policy(cfg, params, sessions, prompts, spec, ecfg, policy, 0)
        times.clear()
        res = harness.run_policy(cfg, params, sessions, prompts, spec, ecfg, policy, 0)
        n = len(res)
        rep[f"{policy}{rnd}"] = dict(ttft_p50=float(np.median([r.stats.ttft_s for r in res if r.stats.path != 'cold'])) * 1e3,
                                     host_ms={k: round(float(np.mean(v[-n:])) * 1e3, 3) for k, v in times.items()})
        print(policy, rep[f"{policy}{rnd}"], flush=True)
# the prefill chunk alone, steady state, with and without a fused append
eng = Engine(cfg, params, EngineConfig(max_context=c.max_context, num_pages=c.num_pages, drafter_pages=c.num_pages), spec)
eng.precompile_appends()
z = np.zeros((1,), np.int32); one = np.ones((1,), np.int32) * 64
chunk = np.ones((1, 64), np.int32)
for label, app in (("plain", None), ("fused64", (np.ones((1, 64), np.int32), z, one)), ("plain", None),
                   ("fused64", (np.ones((1, 64), np.int32), z, one))):
    ts = []
    for _ in range(30):
        t = time.perf_counter()
        eng.cache, eng.hiddens, d, lg = E._prefill_slot(cfg, eng.head_params, eng.cache, eng.hiddens, 0, chunk, z, one, z,
                                                     eng.dcache if app else None, app, impl=spec.impl)
        if app: eng.dcache = d
        jax.block_until_ready(lg)
        ts.append(time.perf_counter() - t)
    rep[f"call_{label}_ms"] = round(float(np.median(ts)) * 1e3, 3)
    print(label, rep[f"call_{label}_ms"], flush=True)
json.dump(rep, open(sys.argv[2], "w"), indent=1)
