"""Session 22: a 4-chunk prefill dispatched back to back, as the engine does, with the chunk row
(a) a fresh host array per call (the engine), (b) one device array reused (address never moves),
(c) written into a donated device mailbox by a tiny call first, (d) copied inside the program
behind an optimization barrier (so one kernel reads the argument). Plain chunks, and the last one
fused with a 99-row drafter append. python3 runs/s22_cmdbuf_probe.py OUT.json REPS"""
import functools, json, sys, time
import jax, jax.numpy as jnp, numpy as np
import mtp.engine as E
from mtp.checkpoint import load_pretrained
from mtp.engine import Engine, EngineConfig
from mtp.speculative import SpecConfig

cfg, params = load_pretrained("assets/default_model")
eng = Engine(cfg, params, EngineConfig(max_context=2048, num_pages=2048, drafter_pages=2048),
             SpecConfig(verify_width=3, max_new_tokens=128))
eng.precompile()
table = np.zeros((eng.max_blocks,), np.int32); table[:40] = np.arange(1, 41)
eng.cache = E._set_slot_table(eng.cache, 1, table)
eng.dcache = E._set_slot_table(eng.dcache, 1, table)
prompt = [int(t) for t in np.random.default_rng(0).integers(1, 1000, 400)]
W = E.SNAPSHOT_INTERVAL
append = E._drafter_appends(prompt, 100, 99)[0]
rows = [E._chunk_row(1, prompt[i * W:(i + 1) * W], i * W, W, 0, 7) for i in range(4)]
fused_row = E._chunk_row(1, prompt[3 * W:4 * W], 3 * W, W, 0, 7, append)
kw = dict(width=W, temperature=0.0, impl=eng.spec.impl)
STATIC, DONATE = ("cfg", "width", "temperature", "impl"), ("cache", "hiddens", "dcache", "starts")

def _materialized(cfg, params, cache, hiddens, dcache, starts, chunk, *, width, temperature, impl):
    chunk = jax.lax.optimization_barrier(jnp.where(chunk == jnp.iinfo(jnp.int32).min, 0, chunk))
    return E._prefill_slot.__wrapped__(cfg, params, cache, hiddens, dcache, starts, chunk, width=width,
                                       temperature=temperature, impl=impl)

prefill_mat = jax.jit(_materialized, static_argnames=STATIC, donate_argnames=DONATE)
put = jax.jit(lambda box, row: jax.lax.dynamic_update_slice(box, row, (0, 0)), donate_argnums=0)
boxes = {r.shape[1]: jnp.zeros(r.shape, jnp.int32) for r in (rows[0], fused_row)}
placed = [jax.device_put(r) for r in rows] + [jax.device_put(fused_row)]

def call(fn, row, fused):
    eng.cache, eng.hiddens, d, eng.starts = fn(cfg, eng.head_params, eng.cache, eng.hiddens,
                                               eng.dcache if fused else None, eng.starts, row, **kw)
    if fused:
        eng.dcache = d

def prefill(variant, fused):
    for i in range(4):
        last_fused = fused and i == 3
        host = fused_row if last_fused else rows[i]
        if variant == "host":
            call(E._prefill_slot, np.array(host), last_fused)
        elif variant == "same_device_row":
            call(E._prefill_slot, placed[4 if last_fused else 0], last_fused)
        elif variant == "mailbox":
            boxes[host.shape[1]] = put(boxes[host.shape[1]], np.array(host))
            call(E._prefill_slot, boxes[host.shape[1]], last_fused)
        elif variant == "barrier":
            call(prefill_mat, np.array(host), last_fused)

out = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
reps = int(sys.argv[2])
for variant in ("host", "same_device_row", "mailbox", "barrier"):
    for fused in (False, True):
        prefill(variant, fused)  # compile
jax.block_until_ready(eng.starts)
for r in range(2):
    for variant in ("host", "same_device_row", "mailbox", "barrier"):
        for fused in (False, True):
            disp, tot = [], []
            print(f"MARK {variant}{'_fused' if fused else ''}_r{r}", file=sys.stderr, flush=True)
            for _ in range(reps):
                jax.block_until_ready((eng.cache, eng.dcache, eng.starts))
                t0 = time.perf_counter(); prefill(variant, fused); t1 = time.perf_counter()
                jax.block_until_ready(eng.starts.token); t2 = time.perf_counter()
                disp.append(t1 - t0); tot.append(t2 - t0)
            key = f"{variant}{'_fused' if fused else ''}_r{r}"
            out[key] = dict(dispatch_ms=round(1e3 * float(np.median(disp)), 3), total_ms=round(1e3 * float(np.median(tot)), 3))
            print(key, out[key], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
