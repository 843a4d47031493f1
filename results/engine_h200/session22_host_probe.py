"""Session 22: host-side cost of a warm turn's start, by engine method, blind vs carry (CPU or GPU)."""
import collections, functools, sys, time
import numpy as np
from absl import flags
flags.FLAGS(["x"])
from configs import carry_ablation as C
from experiments import harness
from mtp import engine as E, carry as carry_lib
from mtp.engine import EngineConfig
from mtp.speculative import SpecConfig

c = C.get_config(); c.num_sessions = int(sys.argv[1]) if len(sys.argv) > 1 else 4
cfg, params, mesh, sessions, prompts = harness.load_experiment(c)
spec = SpecConfig(verify_width=3, max_new_tokens=max(t.max_new_tokens for s in sessions for t in s.turns),
                  eos_id=harness.eos_id(cfg))
times = collections.defaultdict(list)
MARKS = len(sys.argv) > 2
current = {"policy": None}

def timed(owner, name, label=None):
    real = getattr(owner, name)
    @functools.wraps(real)
    def wrapper(*a, **k):
        if MARKS and current["policy"]:
            print(f"MARK {current['policy']}:{label or name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter(); r = real(*a, **k)
        times[(current["policy"], label or name)].append(time.perf_counter() - t0); return r
    setattr(owner, name, wrapper)

for name in ("_reserve_turn", "_reserve_drafter", "_drafter_start", "_prefill_chunk", "_start_turn", "_decode",
             "_finish_turn"):
    timed(E.Engine, name)
timed(carry_lib, "adopt"); E.carry_lib = carry_lib
timed(E, "_begin_turn"); timed(E, "chain_hashes")
ecfgs = {n: EngineConfig(policy=n, max_context=c.max_context, num_pages=c.num_pages, drafter_pages=c.num_pages)
         for n in ("blind", "carry")}
engines = {n: harness._timed_engine(cfg, params, sessions, prompts, spec, e, mesh) for n, e in ecfgs.items()}
times.clear()
waves = {n: E.session_waves(eng, sessions, prompts) for n, eng in engines.items()}
ttft = collections.defaultdict(list)
while waves:
    for n in list(waves):
        current["policy"] = n
        w = next(waves[n], None)
        if w is None:
            del waves[n]; continue
        ttft[n] += [r.stats.ttft_s for r in w]
for n in engines:
    print(n, "ttft p50 %.3f ms over %d turns" % (1e3 * np.median(ttft[n]), len(ttft[n])))
for (p, name), v in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"{name:18s} {p:6s} n={len(v):4d} p50 {1e3*np.median(v):7.3f} ms  mean {1e3*np.mean(v):7.3f} ms")
