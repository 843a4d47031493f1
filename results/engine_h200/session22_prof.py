"""Session 22: cProfile of the served flow (blind and carry interleaved) after warm-up."""
import cProfile, pstats, sys
from absl import flags
flags.FLAGS(["x"])
from configs import carry_ablation as C
from experiments import harness
from mtp import engine as E
from mtp.engine import EngineConfig
from mtp.speculative import SpecConfig

c = C.get_config(); c.num_sessions = int(sys.argv[1])
cfg, params, mesh, sessions, prompts = harness.load_experiment(c)
spec = SpecConfig(verify_width=3, max_new_tokens=max(t.max_new_tokens for s in sessions for t in s.turns),
                  eos_id=harness.eos_id(cfg))
ecfgs = {n: EngineConfig(policy=n, max_context=c.max_context, num_pages=c.num_pages, drafter_pages=c.num_pages)
         for n in ("blind", "carry")}
engines = {n: harness._timed_engine(cfg, params, sessions, prompts, spec, e, mesh) for n, e in ecfgs.items()}
waves = {n: E.session_waves(eng, sessions, prompts) for n, eng in engines.items()}
prof = cProfile.Profile()
prof.enable()
while waves:
    for n in list(waves):
        if next(waves[n], None) is None:
            del waves[n]
prof.disable()
st = pstats.Stats(prof); st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_callees("_prefill_chunk")
