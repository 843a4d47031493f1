"""Session 21: what each small call of a turn's start costs on the GPU, and whether switching
between fused-append widths costs the prefill program more than repeating one (CUDA graph updates)."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from mtp import engine as E
from mtp.cache.state import LinearState
from mtp.checkpoint import load_pretrained
from mtp.engine import Engine, EngineConfig
from mtp.speculative import SpecConfig, pick_token

N = int(sys.argv[2]) if len(sys.argv) > 2 else 30
cfg, params = load_pretrained("assets/default_model")
eng = Engine(cfg, params, EngineConfig(max_context=2048, num_pages=2048, drafter_pages=2048),
             SpecConfig(verify_width=3, max_new_tokens=128))
eng.precompile()
out = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

def timed(label, fn, n=N):
    for _ in range(3):
        jax.block_until_ready(fn())
    disp, tot = [], []
    for _ in range(n):
        jax.block_until_ready((eng.cache, eng.dcache))
        t0 = time.perf_counter(); r = fn(); t1 = time.perf_counter(); jax.block_until_ready(r); t2 = time.perf_counter()
        disp.append(t1 - t0); tot.append(t2 - t0)
    out[label] = dict(dispatch_ms=round(float(np.median(disp)) * 1e3, 3), total_ms=round(float(np.median(tot)) * 1e3, 3))
    print(label, out[label], flush=True)

row = np.zeros((eng.max_blocks,), np.int32); row[:5] = np.arange(1, 6)
lin = E._linear_of_slot(eng.cache.linear, 1)
def set_table():
    eng.cache = E._set_slot_table(eng.cache, 1, row); return eng.cache.block_tables
def set_table_placed(dr=jax.device_put(row), ds=jax.device_put(np.int32(1))):
    eng.cache = E._set_slot_table(eng.cache, ds, dr); return eng.cache.block_tables
def set_linear():
    eng.cache = E._set_slot_linear(eng.cache, 1, LinearState(lin.conv, lin.recurrent)); return eng.cache.lengths
def install():
    eng.dcache = E._install_drafter(eng.dcache, 1, row, 0, -1); return eng.dcache.rows
def copy_page():
    eng.cache = E._copy_page(eng.cache, 7, 9); return eng.cache.lengths
def rng_pick():
    eng._rng, key = jax.random.split(eng._rng); return pick_token(jnp.zeros((1, 100)), 0.0, key)
logits = jnp.ones((cfg.vocab_size,))
def pick_only():
    return pick_token(logits[None], 0.0, None)
def hidden_at():
    return E._hidden_at(eng.hiddens, 1, 37)
def linear_of():
    return E._linear_of_slot(eng.cache.linear, 1)
def trivial(f=jax.jit(lambda c, d: c.lengths[0] + d.rows[0])):
    return f(eng.cache, eng.dcache)
for label, fn in (("trivial_jit_cache_dcache", trivial), ("set_slot_table", set_table),
                  ("set_slot_table_placed", set_table_placed), ("set_slot_linear", set_linear),
                  ("install_drafter", install), ("copy_page", copy_page), ("rng_split+pick", rng_pick),
                  ("pick_only", pick_only), ("hidden_at", hidden_at), ("linear_of_slot", linear_of)):
    timed(label, fn)

prompt = list(np.random.default_rng(0).integers(1, 1000, 400))
def chunk_call(width):
    ap = E._drafter_appends(prompt, 300, min(width, 99)) if width else [None]
    def f():
        eng.cache, eng.hiddens, dc, lg = E._prefill_slot(cfg, eng.head_params, eng.cache, eng.hiddens,
                                                         E._chunk_row(1, prompt[320:384], 320, 64, 0),
                                                         eng.dcache if width else None, ap[0], impl=eng.spec.impl)
        if width:
            eng.dcache = dc
        return lg
    return f
for w in (0, 64, 128, 256):
    timed(f"chunk_repeat_w{w}", chunk_call(w))
# alternate programs: each call switches executable
seq = [0, 64, 0, 128, 0, 256]
fns = {w: chunk_call(w) for w in set(seq)}
for round_ in range(2):
    res = {w: [] for w in fns}
    for i in range(N * len(seq)):
        w = seq[i % len(seq)]
        jax.block_until_ready((eng.cache, eng.dcache))
        t0 = time.perf_counter(); r = fns[w](); jax.block_until_ready(r); res[w].append(time.perf_counter() - t0)
    out[f"chunk_alternating_r{round_}"] = {f"w{w}": round(float(np.median(v)) * 1e3, 3) for w, v in res.items()}
    print("alternating", out[f"chunk_alternating_r{round_}"], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
