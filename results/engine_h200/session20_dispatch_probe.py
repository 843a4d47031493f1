"""One prefill chunk on the GPU: host dispatch time vs synced time; numpy vs pre-placed arguments."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from mtp import engine as E
from mtp.checkpoint import load_pretrained
from mtp.engine import Engine, EngineConfig
from mtp.speculative import SpecConfig

cfg, params = load_pretrained("assets/default_model")
eng = Engine(cfg, params, EngineConfig(max_context=2048, num_pages=2048, drafter_pages=2048),
             SpecConfig(verify_width=3, max_new_tokens=128))
eng.precompile()
z = np.zeros((1,), np.int32); n64 = np.full((1,), 64, np.int32); chunk = np.ones((1, 64), np.int32)
dev = [jax.device_put(a) for a in (chunk, z, n64, z)]
out = {"device": jax.devices()[0].device_kind, "leaves": len(jax.tree.leaves((eng.head_params, eng.cache, eng.hiddens)))}
for label, args in (("numpy", (chunk, z, n64, z)), ("placed", dev), ("numpy", (chunk, z, n64, z)), ("placed", dev)):
    disp, total = [], []
    for _ in range(40):
        jax.block_until_ready(eng.cache)
        t0 = time.perf_counter()
        eng.cache, eng.hiddens, _, lg = E._prefill_slot(cfg, eng.head_params, eng.cache, eng.hiddens, 0, *args, None,
                                                        None, impl="auto")
        t1 = time.perf_counter()
        jax.block_until_ready(lg)
        t2 = time.perf_counter()
        disp.append(t1 - t0); total.append(t2 - t0)
    out[label] = dict(dispatch_ms=round(float(np.median(disp)) * 1e3, 3), total_ms=round(float(np.median(total)) * 1e3, 3))
    print(label, out[label], flush=True)
# an empty jitted call with the same pytrees, for the per-leaf dispatch cost
touch = jax.jit(lambda p, c, h: h[0, 0, 0])
for _ in range(3): jax.block_until_ready(touch(eng.head_params, eng.cache, eng.hiddens))
ts = []
for _ in range(40):
    t0 = time.perf_counter(); r = touch(eng.head_params, eng.cache, eng.hiddens); t1 = time.perf_counter(); jax.block_until_ready(r)
    ts.append(t1 - t0)
out["same_pytrees_trivial_dispatch_ms"] = round(float(np.median(ts)) * 1e3, 3)
print(json.dumps(out))
json.dump(out, open(sys.argv[1], "w"), indent=1)
