"""One prefill chunk of a warm turn's tail (30 of 64 tokens), alone and with a fused drafter append of
40 and 99 rows, synced per call; of whichever mtp/ is first on sys.path."""
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
out = {"engine": E.__file__, "device": jax.devices()[0].device_kind,
       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
def call(rows):
    eng.dcache = E._install_drafter(eng.dcache, 1, row, 0, -1)
    ap = E._drafter_appends(prompt, 349 - rows, rows)[0] if rows else None
    jax.block_until_ready((eng.cache, eng.dcache))
    t0 = time.perf_counter()
    eng.cache, eng.hiddens, dc, lg = E._prefill_slot(cfg, eng.head_params, eng.cache, eng.hiddens,
                                                     E._chunk_row(1, prompt[320:350], 320, 64, 320),
                                                     eng.dcache if rows else None, ap, impl=eng.spec.impl)
    if rows:
        eng.dcache = dc
    jax.block_until_ready(lg)
    return time.perf_counter() - t0
seq = [0, 40, 0, 99]
for r in seq: call(r)
res = {r: [] for r in seq}
for i in range(int(sys.argv[2]) * len(seq)):
    r = seq[i % len(seq)]; res[r].append(call(r))
out["chunk_ms"] = {f"append{r}": round(float(np.median(v)) * 1e3, 3) for r, v in res.items()}
print(json.dumps(out), flush=True)
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(out) + "\n")
