"""Session 21: does a prefill chunk's host dispatch depend on whether its inputs and outputs keep
their device addresses from call to call (XLA updating its CUDA graphs)?"""
import json, sys, time
import jax, numpy as np
import mtp.engine as E
from mtp.checkpoint import load_pretrained
from mtp.engine import Engine, EngineConfig
from mtp.speculative import SpecConfig

cfg, params = load_pretrained("assets/default_model")
eng = Engine(cfg, params, EngineConfig(max_context=2048, num_pages=2048, drafter_pages=2048),
             SpecConfig(verify_width=3, max_new_tokens=128))
eng.precompile()
row = np.zeros((eng.max_blocks,), np.int32); row[:40] = np.arange(1, 41)
eng.cache = E._set_slot_table(eng.cache, 1, row)
prompt = list(np.random.default_rng(0).integers(1, 1000, 400))
host_row = E._chunk_row(1, prompt[320:350], 320, 64, 320)
placed_row = jax.device_put(host_row)
fixed_key = jax.random.key(1)
out = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

def run(label, hold_outputs, chain_rng, placed, n=int(sys.argv[2])):
    rng, held, disp, tot = fixed_key, None, [], []
    for i in range(n + 3):
        jax.block_until_ready((eng.cache, eng.hiddens))
        t0 = time.perf_counter()
        eng.cache, eng.hiddens, _, rng_out, end = E._prefill_slot(
            cfg, eng.head_params, eng.cache, eng.hiddens, None, rng, placed_row if placed else np.array(host_row),
            width=64, temperature=0.0, impl=eng.spec.impl)
        t1 = time.perf_counter(); jax.block_until_ready(end.token); t2 = time.perf_counter()
        if i >= 3:
            disp.append(t1 - t0); tot.append(t2 - t0)
        rng = rng_out if chain_rng else fixed_key
        held = end if hold_outputs else None
        del end, rng_out
    out[label] = dict(dispatch_ms=round(float(np.median(disp)) * 1e3, 3), synced_ms=round(float(np.median(tot)) * 1e3, 3))
    print(label, out[label], flush=True)

for r in range(2):
    run(f"engine_like_r{r}", True, True, False)
    run(f"drop_outputs_r{r}", False, True, False)
    run(f"fixed_rng_drop_r{r}", False, False, False)
    run(f"fixed_rng_drop_placed_row_r{r}", False, False, True)
    run(f"hold_fixed_rng_placed_row_r{r}", True, False, True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
