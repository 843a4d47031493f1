"""Session 22: the prefill chunk's thunks and command buffers, plain and fused with an append, compiled for an H200 on the CPU."""
import os, sys, tempfile
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
from absl import flags
flags.FLAGS(["x"])
from experiments import count_kernels as ck
import jax, jax.numpy as jnp
from experiments.bench_decode import abstract
from mtp.checkpoint import load_pretrained
from mtp import engine as E
from mtp.engine import Engine, EngineConfig
from mtp.speculative import SpecConfig

device = ck.compile_only_device(ck.H200_TARGET)
with jax.default_device(jax.devices("cpu")[0]):
    cfg, params = load_pretrained("assets/default_model")
    eng = Engine(cfg, params, EngineConfig(max_context=2048, num_pages=2048, drafter_pages=2048),
                 SpecConfig(verify_width=3, max_new_tokens=128))
sh = jax.sharding.SingleDeviceSharding(device)
i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sh)
base = (cfg, abstract(eng.head_params, sh), abstract(eng.cache, sh), abstract(eng.hiddens, sh))
calls = {"plain": base + (None, abstract(eng.starts, sh), i32(1, 69)),
         "fused128": base + (abstract(eng.dcache, sh), abstract(eng.starts, sh), i32(1, 69 + 130))}
for name, args in calls.items():
    where = tempfile.mkdtemp(prefix=name)
    with jax.default_device(device):
        compiled = E._prefill_slot.lower(*args, impl="auto", width=64, temperature=0.0).compile(
            compiler_options={"xla_dump_to": where})
    flags.FLAGS.top = 10
    ck.report(name, where, compiled, False, 0.0); print("DUMP", where)
