r"""Counts the GPU kernels of the decode step, compiled for an H200 on a machine without a GPU.

GPU time is scarce; a step's kernel count and its split into CUDA graphs are not.
XLA's GPU compiler runs without a device ("deviceless AOT"): the CUDA PJRT plugin builds
a compile-only topology from a ``GpuTargetConfig`` (here an H200: sm_90a, 132 SMs),
``jax_default_device`` points traces at it, and ``jit(...).lower(...).compile()`` runs the
whole pipeline (fusion, Triton GEMMs, Pallas-Triton, command buffers) on the CPU. Nothing
large is allocated: params and cache are ``ShapeDtypeStruct`` s. ``mtp.ops.lowering``
reads that target device, so ``impl="auto"``, the tile plans and the one-row GEMM padding
decide as they would on the H200.

What is compiled is `experiments/bench_decode.py` part A's step (``chained_verify_step``)
on its 1.38B Qwen3-Next-shaped model. Checked against the H200's own CUPTI counts
(results/decode/grouped_conv_bf16_flips_2026-11-29.json and fused_gdn_step_2026-11-29.json): 356 kernels at batch 1 with XLA's Gated
DeltaNet step (``MTP_KERNELS=gdn_step=reference``; the default before the kernel), 308 and then
284 with the fused step kernel (before and after it read z, b, a in place; the default now),
255 with the one-row residual stream padded once, 235 with merged projections and
219 with the residual add + norm kernel, all exact. Two limits: XLA cannot autotune
without a device, so GEMM tile choices (and where they add split-K reductions) may differ
from the GPU's; and Mosaic GPU kernels are lowered here but assembled only on the device.

``--count greedy_loop|speculative_loop`` compiles instead the decode loops of `mtp.speculative`
on the shipped default model, as `mtp.generation.generate` calls them, and counts one iteration
of their while body.

Needs the CUDA plugin (`scripts/setup_aot.sh` makes `.venv-aot`; BUILD.md):

    PYTHONPATH=. .venv-aot/bin/python experiments/count_kernels.py [--batches 1,8] [--tokens 4]
        [--loop] [--list] [--by_source] [--dump DIR]
    PYTHONPATH=. .venv-aot/bin/python experiments/count_kernels.py --count speculative_loop --spec_k 3
        [--refeed_accepted]
    MTP_KERNELS=reference PYTHONPATH=. .venv-aot/bin/python experiments/count_kernels.py

(``--batches``, ``--context`` and ``--steps_per_call`` are bench_decode's own flags.)

Prints, per compile: the kernel launches from XLA's thunk sequence (each kernel thunk and
each custom call launches one kernel, memory copies are counted apart), the launches by
name, and how many command buffers (CUDA graphs) they run in; ``--by_source`` groups them by the
model source line they come from.
"""

from __future__ import annotations

import collections
import functools
import glob
import os
import re
import tempfile
import time

from absl import app, flags

from experiments.bench_decode import (BIG, abstract, chained_verify_step, kernel_sources,  # and its flags
                                      random_cache, source_of)
from experiments.cli import refuse_flags_of
from mtp.execution import ExecutionConfig
from mtp.speculative import MAX_VERIFY_WIDTH

H200_TARGET = """\
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  driver_version: "13.0.0" runtime_version: "13.0.0" compile_time_toolkit_version: "13.0.0"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 }
device_description_str: "NVIDIA H200"
"""

# The versions matter: XLA's command-buffer pass drops custom calls, WHILE and CONDITIONAL from
# CUDA graphs where the driver or runtime is older than CUDA 12.3, and a target without them
# reads as such. Without them every count showed the Mosaic GPU calls (and each decode
# loop's while) outside the graphs; the H200 the counts were checked on has driver 580, CUDA 13.0.
flags.DEFINE_enum("count", "step", ["step", "greedy_loop", "speculative_loop"],
                  "step: part A's step on the 1.38B model; greedy_loop / speculative_loop: the decode loops "
                  "of `mtp.speculative` (their while body: one iteration) on --loop_model.")
flags.DEFINE_enum("loop_model", "default", ["default", "big"],
                  "--count greedy_loop / speculative_loop: the shipped default model, or part A's 1.38B "
                  "model (zero weights: only the shapes matter to a compile). The prompt has 5 tokens, so "
                  "paged attention plans fewer splits than at part A's 2048-token context.")
flags.DEFINE_integer("spec_k", 3, "--count speculative_loop: the verify width K (K - 1 drafts per iteration).",
                     lower_bound=2, upper_bound=MAX_VERIFY_WIDTH)
flags.DEFINE_bool("refeed_accepted", False, "--count speculative_loop: the loop that refeeds accepted rows "
                  "(SpecConfig.refeed_accepted), whose drafter append runs in every iteration.")
flags.DEFINE_integer("tokens", 1, "Tokens per step: 1 is decode, K a verify of K tokens.", lower_bound=1,
                     upper_bound=MAX_VERIFY_WIDTH)
flags.DEFINE_bool("loop", False, "Also compile part A's timed fori_loop and count its body (its "
                  "cache is donated, as in the decode loops: the single step's copies of the "
                  "state it updates in place are not there).")
flags.DEFINE_string("target_config", None, "A GpuTargetConfig text proto file (default: an H200).")
flags.DEFINE_integer("top", 15, "How many kernel names to list.", lower_bound=1)
flags.DEFINE_bool("list", False, "Print every launch in order, with its grid.")
flags.DEFINE_bool("by_source", False, "Also group the launches by the model source line (and output "
                  "shape) each comes from, as bench_decode.py groups its CUPTI kernel times.")
flags.DEFINE_string("dump", None, "Keep XLA's dumps here (default: a temporary folder).")
FLAGS = flags.FLAGS

# ------------------------------------------------------------------ reading XLA's thunk dumps

_THUNK = re.compile(r"^(\s*)\d+: (k\w+)\s*\[[^\]]*\]\s*(\S*)(.*)$")
KERNEL_KINDS = ("kKernel", "kCustomKernel", "kCustomCall")  # one launch each (a Mosaic call is one)
LIBRARY_KINDS = ("kGemm", "kCublasLtMatmul", "kConvolution", "kCuDnn", "kFft")
MEMORY_KINDS = ("kCopy", "kMemset32BitValue", "kMemzero")


def read_thunks(text: str, while_body: bool = False) -> list[tuple[str, str, str, int]]:
    """``(kind, name, launch dims, indent)`` per thunk of a ``*.thunk_sequence*.txt`` dump.

    ``while_body`` keeps only the body of the (first) while loop, as a loop's steps run it.
    """
    lines = text.splitlines()
    if while_body:
        start = next(i for i, line in enumerate(lines) if line.strip() == "body:")
        indent = len(lines[start]) - len(lines[start].lstrip())
        body = []
        for line in lines[start + 1:]:
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                break
            body.append(line)
        lines = body
    out = []
    for line in lines:
        m = _THUNK.match(line)
        if m:
            kind, name = m.group(2), m.group(3)
            out.append((kind, name if name and name != kind else "", m.group(4).strip(), len(m.group(1))))
    return out


_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{$")
_COPY = re.compile(r"=\s*(\w+\[[^\]]*\])\S*\s+copy\(%([\w.\-]+)")


def hlo_copies(text: str, while_body: bool = False) -> collections.Counter:
    """What the ``kCopy`` thunks copy: ``(shape, source)`` counts of the ``copy`` ops XLA kept.

    ``text``: the optimized HLO dump (``*after_optimizations.txt``); its entry computation,
    or with ``while_body`` the body of the entry's first while loop. Each copy is a device
    memcpy, which inside a CUDA graph can cost several µs however small
    (results/decode/decode_h200.md, 2026-11-29), so the source says what to change.
    """
    computations, name, entry = {}, None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = m.group(2)
            computations[name] = []
            entry = name if m.group(1) else entry
        elif name is not None:
            if line.strip() == "}":
                name = None
            else:
                computations[name].append(line)
    target = entry
    if while_body:
        target = next(re.search(r"body=%([\w.\-]+)", line).group(1)
                      for line in computations[entry] if " while(" in line)
    source = lambda name: re.sub(r"\d+", "*", re.sub(r"\.\d+$", "", name))  # one row per kind
    return collections.Counter((m.group(1), source(m.group(2)))
                               for line in computations[target] if (m := _COPY.search(line)))


def by_source(thunks, compiled_text: str) -> collections.Counter:
    """Launches per model source line and output shape (`bench_decode.kernel_sources`, `source_of`)."""
    where = kernel_sources(compiled_text)
    return collections.Counter(source_of(where, name or kind)
                               for kind, name, _, _ in thunks if kind in KERNEL_KINDS + LIBRARY_KINDS)


def summarize(thunks, graphs=None) -> dict:
    """Launch counts of a thunk list; ``graphs``: the same list after XLA's thunk passes."""
    kinds = collections.Counter(t[0] for t in thunks)
    names = collections.Counter(re.sub(r"(_\d+)+$", "", t[1]) or t[0] for t in thunks
                                if t[0] in KERNEL_KINDS + LIBRARY_KINDS)
    out = {"launches": sum(kinds[k] for k in KERNEL_KINDS + LIBRARY_KINDS),
           "custom_calls": kinds["kCustomCall"], "library_calls": sum(kinds[k] for k in LIBRARY_KINDS),
           "memory_ops": sum(kinds[k] for k in MEMORY_KINDS), "by_name": names}
    if graphs is not None:
        top_level = min(t[3] for t in graphs)
        outer = collections.Counter(t[0] for t in graphs if t[3] == top_level)
        out["command_buffers"] = outer["kCommandBuffer"]
        out["outside_graphs"] = {k: v for k, v in outer.items() if k != "kCommandBuffer"}
    return out


def loop_in_graph(graph_text: str) -> bool:
    """Whether the first while loop of a thunk dump after XLA's passes sits inside a command buffer.

    Then the whole loop is one CUDA graph whose predicate stays on the device; otherwise the
    host reads the predicate back every iteration and launches the body's graphs itself.
    """
    thunks = read_thunks(graph_text)
    i = next(i for i, t in enumerate(thunks) if t[0] == "kWhile")
    parent = next((t for t in reversed(thunks[:i]) if t[3] < thunks[i][3]), None)
    return parent is not None and parent[0] == "kCommandBuffer"


# ------------------------------------------------------------------ compiling


def compile_only_device(target_config: str):
    """A compile-only GPU from a target config; traces are pointed at it."""
    import jax
    from jax.experimental import topologies

    jax.config.update("jax_platforms", "cpu")  # the process never opens a CUDA client
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                            topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - say what is missing, not a plugin stack trace
        raise SystemExit(f"no compile-only CUDA topology ({type(e).__name__}: {e}); this needs the "
                         "CUDA plugin: run it with .venv-aot (scripts/setup_aot.sh, BUILD.md)") from e
    device = topo.devices[0]
    jax.config.update("jax_default_device", device)
    return device


def loop_call(program: str, batch: int, device, execution: ExecutionConfig):
    """``(jitted loop, args)`` of a decode loop as `mtp.generation.generate` calls it, on ``--loop_model``.

    `generation.prepare_decode` runs on the CPU (pages, caches, prefill); the loop's array
    arguments become ``ShapeDtypeStruct`` s on ``device`` (static ones, the config and
    ``SpecConfig``, stay).
    """
    import jax

    from mtp import generation
    from mtp.checkpoint import load_pretrained
    from mtp.speculative import SpecConfig

    spec = SpecConfig(verify_width=FLAGS.spec_k, max_new_tokens=128, refeed_accepted=FLAGS.refeed_accepted,
                      execution=execution)
    with jax.default_device(jax.devices("cpu")[0]):
        if FLAGS.loop_model == "big":
            import jax.numpy as jnp

            from mtp.config import ModelConfig
            from mtp.model.params import init_params

            cfg = ModelConfig.from_hf(dict(BIG))
            shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(1), jnp.bfloat16))
            params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        else:
            cfg, params = load_pretrained("assets/default_model")
        call = generation.prepare_decode(cfg, params, [[1, 2, 3, 4, 5]] * batch, spec,
                                         speculative=program == "speculative_loop")
    return call.loop, abstract(call.args, jax.sharding.SingleDeviceSharding(device))


def count_loop(device, execution: ExecutionConfig):
    """Prints the launches of one iteration of ``--count``'s while loop, per batch."""
    import jax

    for batch in (int(b) for b in FLAGS.batches):
        loop, args = loop_call(FLAGS.count, batch, device, execution)
        where = os.path.join(FLAGS.dump or tempfile.mkdtemp(prefix="count_kernels_"), f"{FLAGS.count}_b{batch}")
        t0 = time.time()
        with jax.default_device(device):
            compiled = loop.lower(*args).compile(compiler_options={"xla_dump_to": where})
        what = f"K = {FLAGS.spec_k}" if FLAGS.count == "speculative_loop" else "plain"
        report(f"{FLAGS.count} ({what}), batch {batch}, one iteration", where, compiled, True, time.time() - t0)


def report(title: str, where: str, compiled, while_body: bool, seconds: float):
    """Prints one compile's launches (from its XLA dump in ``where``), by name, its copies, and per flags more."""
    seq = sorted(glob.glob(os.path.join(where, "*.thunk_sequence.txt")))[-1]
    thunks = read_thunks(open(seq).read(), while_body)
    graph_text = open(seq.replace(".thunk_sequence.", ".thunk_sequence_after_thunk_passes.")).read()
    s = summarize(thunks, read_thunks(graph_text, while_body))
    if while_body and loop_in_graph(graph_text):
        graphs = "the whole loop, its while included, in one command buffer"
    else:
        graphs = (f"in {s['command_buffers']} command buffers (outside them: {s['outside_graphs'] or 'nothing'})"
                  + ("; the host drives the while" if while_body else ""))
    print(f"\n{title}: {s['launches']} kernel launches "
          f"({s['custom_calls']} custom calls, {s['library_calls']} library calls; "
          f"+{s['memory_ops']} memory copies), {graphs}; compiled in {seconds:.1f} s")
    print("  by name: " + ", ".join(f"{k} {v}" for k, v in s["by_name"].most_common(FLAGS.top)))
    print_copies(open(sorted(glob.glob(os.path.join(where, "*after_optimizations.txt")))[-1]).read(), while_body)
    if FLAGS.by_source:
        print_sources(thunks, compiled.as_text())
    if FLAGS.list:
        print_launches(thunks)


def print_launches(thunks):
    for i, (kind, name, dims, _) in enumerate(thunks):
        print(f"  {i:4d} {kind:14s} {name} {dims}")


def print_sources(thunks, compiled_text: str):
    print("  by source: " + "; ".join(f"{n} x {src}" for src, n in by_source(thunks, compiled_text).most_common()))


def print_copies(hlo_text: str, while_body: bool):
    copies = hlo_copies(hlo_text, while_body)
    print("  memory copies: " + (", ".join(f"{n} x {shape} of {src}" for (shape, src), n
                                           in copies.most_common()) or "none"))


def main(argv):
    del argv
    refuse_flags_of("experiments.bench_decode", {"batches", "context", "steps_per_call"})
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    target_config = open(FLAGS.target_config).read() if FLAGS.target_config else H200_TARGET
    device = compile_only_device(target_config)
    execution = ExecutionConfig.from_environ(os.environ)
    if FLAGS.count != "step":
        return count_loop(device, execution)

    import jax
    import jax.numpy as jnp

    from mtp.config import ModelConfig
    from mtp.model.params import count_params, init_params

    on = jax.sharding.SingleDeviceSharding(device)
    place = functools.partial(abstract, sharding=on)
    cfg = ModelConfig.from_hf(dict(BIG))
    params = place(jax.eval_shape(lambda: init_params(cfg, jax.random.key(1), jnp.bfloat16)))
    print(f"target {device.device_kind} ({device.core_count} SMs), jax {jax.__version__}, "
          f"{count_params(params, include_mtp=False) / 1e9:.2f}B target params, context {FLAGS.context}, "
          f"{FLAGS.tokens} token(s) per step, MTP_KERNELS={os.environ.get('MTP_KERNELS', '')!r}")
    step = chained_verify_step(cfg, execution)
    dump_root = FLAGS.dump or tempfile.mkdtemp(prefix="count_kernels_")
    for batch in (int(b) for b in FLAGS.batches):
        cache = jax.eval_shape(lambda: random_cache(cfg, batch, FLAGS.context, 16, jnp.bfloat16,
                                                    jax.random.key(2)))
        state = (place(cache), jax.ShapeDtypeStruct((batch, FLAGS.tokens), jnp.int32, sharding=on))
        runs = [("step", jax.jit(step), False)]
        if FLAGS.loop:
            n = FLAGS.steps_per_call
            runs.append((f"fori_loop of {n}", jax.jit(lambda c, p: jax.lax.fori_loop(
                0, n, lambda _, c: step(c, p), c), donate_argnums=0), True))
        for what, fn, loop in runs:
            where = os.path.join(dump_root, f"b{batch}_{what.split()[0]}")
            t0 = time.time()
            compiled = fn.lower(state, params).compile(compiler_options={"xla_dump_to": where})
            report(f"batch {batch}, {what}{' (its body)' if loop else ''}", where, compiled, loop, time.time() - t0)
    if FLAGS.dump:
        print(f"\nXLA dumps: {dump_root}")


if __name__ == "__main__":
    FLAGS.set_default("batches", ["1"])
    app.run(main)
