"""Sharded-vs-single-device checks, run by tests/test_sharding.py in a fresh process.

The host platform's device count is fixed when jax initialises, so this script is
started with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` already in its
environment. Every check raises on failure (the process then exits non-zero with
the traceback); on success the last stdout line is a JSON summary the test reads.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/sharding_worker.py
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import (IdPrompts, agreeing_params, id_sessions, random_params, tiny_config,  # noqa: E402
                            turn_decisions)
from mtp import checkpoint, generation  # noqa: E402
from mtp import sharding as S  # noqa: E402
from mtp.cache.state import TargetCache  # noqa: E402
from mtp.serving import Engine, EngineConfig, run_sessions, steps  # noqa: E402
from mtp.speculative import SpecConfig  # noqa: E402

DEVICES = 4
SPEC = SpecConfig(verify_width=3, max_new_tokens=14)
PROMPT_LENGTHS = (11, 5, 17)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def prompts_for(cfg, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, cfg.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]


def expected_shard_shape(shape, spec: P, mesh) -> tuple[int, ...]:
    out = list(shape)
    for dim, axis in enumerate(spec):
        if axis is not None:
            out[dim] //= mesh.shape[axis]
    return tuple(out)


def check_layout(tree, shardings, host: dict[str, np.ndarray] | None, what: str) -> int:
    """Every leaf has its declared sharding, shard shapes, and (given ``host``) shard contents.

    Returns how many leaves are actually split (not replicated).
    """
    got = jax.tree_util.tree_flatten_with_path(tree)[0]
    want = jax.tree_util.tree_flatten_with_path(shardings)[0]
    check([p for p, _ in got] == [p for p, _ in want], f"{what}: tree structure differs from its shardings")
    split = 0
    for (path, leaf), (_, sharding) in zip(got, want):
        name = jax.tree_util.keystr(path)
        check(leaf.sharding.is_equivalent_to(sharding, leaf.ndim),
              f"{what}{name}: sharding {leaf.sharding} is not the declared {sharding.spec}")
        shard_shape = expected_shard_shape(leaf.shape, sharding.spec, sharding.mesh)
        split += shard_shape != tuple(leaf.shape)
        check(len(leaf.addressable_shards) == sharding.mesh.size, f"{what}{name}: not on every mesh device")
        for shard in leaf.addressable_shards:
            check(shard.data.shape == shard_shape,
                  f"{what}{name}: shard on {shard.device} is {shard.data.shape}, expected {shard_shape}")
            if host is not None:
                check(np.array_equal(np.asarray(shard.data), host[name][shard.index]),
                      f"{what}{name}: shard on {shard.device} holds the wrong slice {shard.index}")
    return split


def host_copy(tree) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(jax.device_get(v)) for p, v in flat}


@contextlib.contextmanager
def recording_loops(seen: dict):
    """Record the caches `generation.generate`'s decode loops hand back, so that their
    layouts can be checked."""
    orig = {n: getattr(generation, n) for n in ("greedy_loop", "speculative_loop")}

    def recording(loop, n_caches):
        def run(*args, **kwargs):
            out = loop(*args, **kwargs)
            seen[loop.__name__] = out[:n_caches]
            return out
        return run

    generation.greedy_loop = recording(orig["greedy_loop"], 1)
    generation.speculative_loop = recording(orig["speculative_loop"], 2)
    try:
        yield
    finally:
        for n, v in orig.items():
            setattr(generation, n, v)


def decode_case(name: str, tp: int, ep: int, seed: int, mixing: float = 0.01) -> dict:
    """Token identity of plain and speculative greedy decoding, sharded vs one device.

    The LM head is untied: with tied embeddings `agreeing_params`'s target would
    just repeat its last token.
    """
    cfg = tiny_config(name).replace(tie_word_embeddings=False)
    params = agreeing_params(cfg, seed, mixing)
    mesh = S.make_mesh(tp, ep)
    sharded = S.shard_params(params, cfg, mesh)
    split = check_layout(sharded, S.param_sharding(cfg, mesh), host_copy(params), f"{name} params")
    check(split > 0, f"{name}: no parameter is split over the mesh")
    prompts = prompts_for(cfg, seed)
    made = S.create_cache(TargetCache, cfg, mesh, 2, 9, 16, 4, jnp.float32)
    check(check_layout(made, S.cache_sharding(made, cfg, mesh), None, f"{name} create_cache") > 0,
          f"{name}: create_cache split nothing")
    result = {"config": name, "tp": tp, "ep": ep, "params_split": split}
    for speculative in (False, True):
        single = generation.generate(cfg, params, prompts, SPEC, speculative=speculative)
        seen: dict = {}
        with recording_loops(seen):
            multi = generation.generate(cfg, sharded, prompts, SPEC, speculative=speculative, mesh=mesh)
        kind = "speculative" if speculative else "greedy"
        check(multi.tokens == single.tokens,
              f"{name} tp={tp} ep={ep} {kind}: sharded tokens {multi.tokens} != single-device {single.tokens}")
        check(all(len(t) == SPEC.max_new_tokens and len(set(t)) > len(t) // 2 for t in single.tokens),
              f"{name}: degenerate outputs {single.tokens}; the check needs varied tokens")
        loop = "speculative_loop" if speculative else "greedy_loop"
        check(loop in seen, f"{name}: generate did not run {loop}")
        for cache in seen[loop]:
            check_layout(cache, S.cache_sharding(cache, cfg, mesh), None, f"{name} {loop} output cache")
        if speculative:
            s, m = single.stats, multi.stats
            check((s.steps, s.draft_tokens, s.accepted) == (m.steps, m.draft_tokens, m.accepted),
                  f"{name}: acceptance differs sharded {m} vs single {s}")
            check(0 < s.accepted < s.draft_tokens,
                  f"{name}: accepted {s.accepted} of {s.draft_tokens} drafts; the check needs both outcomes")
            result["accepted"], result["draft_tokens"] = int(s.accepted), int(s.draft_tokens)
        result[kind] = single.tokens
    return result


def engine_case(name: str, tp: int, ep: int, seed: int, mixing: float = 0.01) -> dict:
    """Multi-turn sessions through the engine on a mesh and on one device: the same tokens (equal
    to plain greedy decoding), the same per-turn path and carry decisions, the same
    acceptance, and caches that keep their layout through prefills, appends and decodes."""
    cfg = tiny_config(name).replace(tie_word_embeddings=False)
    params = agreeing_params(cfg, seed, mixing)
    mesh = S.make_mesh(tp, ep)
    sharded = S.shard_params(params, cfg, mesh)
    rng = np.random.default_rng(seed)
    prompts, sessions = IdPrompts(rng.integers(1, 97, 70).tolist()), id_sessions(3, 3, seed=seed)
    base = dict(max_context=256, num_pages=160, drafter_pages=160, marconi_min_tokens=64)
    spec = SpecConfig(verify_width=3, max_new_tokens=10)
    keyed = lambda results: {(r.request.session_id, r.request.prompt): r.output for r in results}
    plain = keyed(run_sessions(Engine(cfg, params, EngineConfig(policy="cold", speculative=False, **base), spec),
                               sessions, prompts))
    result = {"config": name, "tp": tp, "ep": ep, "variants": {}}
    for policy, slots, carry_slots in (("carry", 1, 1), ("carry", 2, 4), ("blind", 1, 1)):
        ecfg = EngineConfig(policy=policy, batch_slots=slots, carry_slots=carry_slots, **base)
        label = f"{name} {policy} B={slots} slots={carry_slots}"
        single = run_sessions(Engine(cfg, params, ecfg, spec), sessions, prompts)
        engine = Engine(cfg, sharded, ecfg, spec, mesh=mesh)
        engine.precompile()
        programs = (steps.prefill_slot, steps.append_slot, steps.begin_turn)
        compiled = [f._cache_size() for f in programs]
        multi = run_sessions(engine, sessions, prompts)
        check([f._cache_size() for f in programs] == compiled,
              f"{label}: serving compiled a turn-start program that precompile had not: "
              f"{compiled} -> {[f._cache_size() for f in programs]}")
        check(keyed(single) == plain, f"{label}: single-device speculative tokens differ from plain greedy")
        check([r.output for r in multi] == [r.output for r in single],
              f"{label}: sharded tokens {[r.output for r in multi]} != single-device {[r.output for r in single]}")
        for a, b in zip(single, multi):
            sa, sb = turn_decisions(a.stats), turn_decisions(b.stats)
            check(sa == sb, f"{label} {a.request.session_id}: turn stats differ sharded {sb} vs single {sa}")
            check(a.stats.acceptance.counts() == b.stats.acceptance.counts(),
                  f"{label} {a.request.session_id}: acceptance differs sharded {b.stats.acceptance} vs "
                  f"single {a.stats.acceptance}")
        device = engine.device
        check_layout(device.cache, S.cache_sharding(device.cache, cfg, mesh), None, f"{label} target cache")
        check_layout(device.dcache, S.cache_sharding(device.dcache, cfg, mesh), None, f"{label} drafter cache")
        check(device.hiddens.sharding.is_fully_replicated and len(device.hiddens.sharding.device_set) == tp * ep,
              f"{label}: the hidden store is {device.hiddens.sharding}, not whole on every device")
        accepted = sum(r.stats.acceptance.accepted for r in multi)
        drafted = sum(r.stats.acceptance.draft_tokens for r in multi)
        check(0 < accepted < drafted, f"{label}: accepted {accepted} of {drafted} drafts; the check needs both")
        result["variants"][label] = {
            "paths": sorted({r.stats.path for r in multi}),
            "carry_outcomes": sorted({r.stats.carry_outcome for r in multi}),
            "appended": sum(r.stats.drafter_appended for r in multi), "accepted": accepted, "drafted": drafted}
    return result


def load_case(name: str, tp: int, ep: int, seed: int) -> dict:
    """A checkpoint directory loads straight into the same shards that shard_params makes."""
    cfg = tiny_config(name)
    params = random_params(cfg, seed)
    mesh = S.make_mesh(tp, ep)
    with tempfile.TemporaryDirectory() as tmp:
        # Small shards, so one layer's experts span several files.
        checkpoint.save_pretrained(pathlib.Path(tmp) / "ckpt", cfg, params, max_shard_bytes=4096)
        files = len(list((pathlib.Path(tmp) / "ckpt").glob("*.safetensors")))
        check(files > 1, "the checkpoint was meant to be sharded over several files")
        loaded_cfg, loaded = S.load_sharded(pathlib.Path(tmp) / "ckpt", mesh)
    check(loaded_cfg == cfg, "load_sharded returned a different config")
    split = check_layout(loaded, S.param_sharding(cfg, mesh), host_copy(params), f"{name} loaded")
    check(split > 0, f"{name}: load_sharded split nothing")
    return {"config": name, "tp": tp, "ep": ep, "files": files, "params_split": split}


def kernel_case() -> dict:
    """Paged attention under a tp mesh runs its kernel per shard, on each device's own heads.

    The kernel body is swapped for the reference here (same signature), recording the
    shapes it is handed: the Pallas GPU interpreter races when several host devices
    run it at once (a barrier left allocated, now and then), and the kernel itself is
    checked against the reference in tests/test_ops_paged_attention.py. What this
    checks is the wrapper: each device gets its KV heads and their query groups, the
    output keeps the head split, the step has no collectives, and the values equal the
    reference's. With one KV head (which cannot split over tp=2) the op takes the
    reference on the whole arrays instead.
    """
    from jax.sharding import NamedSharding
    from mtp.ops.paged_attention import mosaic, paged_attention, paged_attention_reference

    mesh = S.make_mesh(2)
    heads, whole = NamedSharding(mesh, P(None, None, S.TP, None)), NamedSharding(mesh, P())
    seen = []

    def per_shard(q, k, v, tables, lengths, *, scale, gate):
        seen.append((q.shape[2], k.shape[2]))
        return paged_attention_reference(q, k, v, tables, lengths, scale=scale, gate=gate)

    kernel, mosaic.paged_attention_mosaic = mosaic.paged_attention_mosaic, per_shard
    out = {}
    try:
        for hkv in (2, 1):
            b, q_len, hq, d, page = 2, 3, 8, 64, 16
            ks = jax.random.split(jax.random.key(hkv), 4)
            q, gate = (jax.random.normal(k, (b, q_len, hq, d), jnp.bfloat16) for k in (ks[0], ks[3]))
            kp, vp = (jax.random.normal(k, (9, page, hkv, d), jnp.bfloat16) for k in ks[1:3])
            tables = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
            lengths = jnp.array([41, 23], jnp.int32)  # ragged, partial last pages
            want = paged_attention_reference(q, kp, vp, tables, lengths, gate=gate)
            kv_layout = heads if hkv % 2 == 0 else whole
            args = (jax.device_put(q, heads), jax.device_put(kp, kv_layout), jax.device_put(vp, kv_layout),
                    jax.device_put(tables, whole), jax.device_put(lengths, whole), jax.device_put(gate, heads))
            fn = jax.jit(lambda q, k, v, t, n, g: paged_attention(q, k, v, t, n, gate=g, impl="pallas"))
            seen.clear()
            with jax.set_mesh(mesh):
                got = fn(*args)
                hlo = fn.lower(*args).compile().as_text()
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            check(err < 1e-2, f"paged attention under the mesh, Hkv={hkv}: max error {err} against the reference")
            if hkv % 2 == 0:
                check(seen == [(hq // 2, hkv // 2)], f"the kernel saw (q heads, kv heads) {seen}, not one shard's")
                check(got.sharding.is_equivalent_to(heads, 4), f"kernel output laid out as {got.sharding}")
                check("all-gather" not in hlo and "all-reduce" not in hlo and "all-to-all" not in hlo,
                      "the sharded attention step has collectives")
            else:
                check(not seen, "one KV head over tp=2: the kernel ran, the reference was expected")
            out[f"hkv{hkv}_max_error"] = err
    finally:
        mosaic.paged_attention_mosaic = kernel
    out["gdn_step_under_mesh"] = gdn_step_case(mesh)
    return out


def gdn_step_case(mesh) -> dict:
    """The fused Gated DeltaNet step under a tp mesh: per shard on each device's key-head groups.

    The kernel's own code runs here (Pallas' generic interpreter, which needs no
    shared-memory model), against the reference on whole arrays. With one key head
    (which cannot split over tp=2) the op takes the reference instead.
    """
    from jax.sharding import NamedSharding
    from mtp.ops.gdn_step import gdn_step, gdn_step_reference
    from mtp.ops.gdn_step.triton import kernel_unsupported

    out = {}
    for nk in (2, 1):
        b, nv, d = 2, 4, 8
        ks = jax.random.split(jax.random.key(7 + nk), 7)
        args = (jax.random.normal(ks[0], (b, (2 * nk + nv) * d)), jax.random.normal(ks[1], (b, 2 * (nk + nv) * d)),
                jax.random.normal(ks[2], (b, 2 * nv)), jnp.array([True, False]),
                jax.random.normal(ks[4], (b, nv, d, d)), 0.5 * jax.random.normal(ks[5], (nv,)),
                0.5 * jax.random.normal(ks[6], (nv,)), jnp.linspace(0.5, 1.5, d))
        check(kernel_unsupported(*args[:3], args[4], nk) is None, "gdn_step_case: the kernel should take these inputs")
        want_y, want_s = gdn_step_reference(*args, num_k_heads=nk, eps=1e-6)
        split = nk % 2 == 0
        specs = [P(None, S.TP), P(None, S.TP), P(None, S.TP), P(),
                 P(None, S.TP, None, None), P(S.TP), P(S.TP), P()] if split else [P()] * 8
        placed = [jax.device_put(x, NamedSharding(mesh, sp)) for x, sp in zip(args, specs)]
        fn = jax.jit(lambda *a: gdn_step(*a, num_k_heads=nk, eps=1e-6, impl="interpret"))
        with jax.set_mesh(mesh):
            y, state = fn(*placed)
            hlo = fn.lower(*placed).compile().as_text()
        err = max(float(jnp.max(jnp.abs(y - want_y))), float(jnp.max(jnp.abs(state - want_s))))
        check(err < 1e-4, f"gdn_step under the mesh, nk={nk}: max error {err} against the reference")
        if split:
            check(state.sharding.is_equivalent_to(NamedSharding(mesh, specs[4]), 4),
                  f"gdn_step state laid out as {state.sharding}, not on value heads")
            check(not any(c in hlo for c in ("all-gather", "all-reduce", "all-to-all", "collective-permute")),
                  "the sharded gdn step has collectives")
        out[f"nk{nk}_max_error"] = err
    return out


def error_case() -> dict:
    cfg_dense, cfg_moe = tiny_config("tiny_tp"), tiny_config("tiny_moe")
    messages = {}
    for label, fn in (
        ("ep_without_experts", lambda: S.param_sharding(cfg_dense, S.make_mesh(2, 2))),
        ("experts_not_divisible", lambda: S.param_sharding(cfg_moe.replace(num_experts=6, num_experts_per_tok=2),
                                                           S.make_mesh(1, 4))),
        ("too_few_devices", lambda: S.make_mesh(4, 2)),
    ):
        try:
            fn()
        except ValueError as e:
            messages[label] = str(e)
        else:
            raise AssertionError(f"{label}: no error raised")
    check("num_experts=0" in messages["ep_without_experts"], messages["ep_without_experts"])
    check("num_experts=6" in messages["experts_not_divisible"], messages["experts_not_divisible"])
    check("needs 8 devices" in messages["too_few_devices"], messages["too_few_devices"])
    return messages


def prepared_case() -> dict:
    """Where `prepare_params` puts the tensors it derives from sharded params (merging and the fc
    fold forced on). Under a tensor-parallel mesh nothing is premerged (`dense_columns` merges
    nothing there), the folded fc weight is replicated as the fc weight is, and the embedding's
    mean squares are split as its rows are; on an expert-parallel mesh (tp = 1) each merged weight
    is replicated and equals its parts concatenated."""
    from mtp.execution import ExecutionConfig
    from mtp.model.gemm_layout import MERGED_GROUPS
    from mtp.model.prepared import prepare_params

    out = {}
    for name, tp, ep in (("tiny_tp", 2, 1), ("tiny_moe", 1, 2)):
        cfg = tiny_config(name)
        params = random_params(cfg, seed=8)
        mesh = S.make_mesh(tp, ep)
        with S.on_mesh(mesh):
            prepared = prepare_params(S.shard_params(params, cfg, mesh), ExecutionConfig(merge_projections=True),
                                      fold_fc=True)
        layers = [*(params["model"]["layers"][str(i)] for i in range(cfg.num_hidden_layers)),
                  params["mtp"]["layers"]["0"]]
        merged = 0
        for layer, m in zip(layers, (*prepared.merged, prepared.mtp_merged)):
            for key, names in MERGED_GROUPS.items():
                w = getattr(m, key)
                if w is None:
                    continue
                merged += 1
                check(w.sharding.is_fully_replicated, f"{name}: merged {key} is laid out {w.sharding}")
                parts = [np.asarray(layer[key][n]["weight"]) for n in names]
                check(np.array_equal(np.asarray(w), np.concatenate(parts)), f"{name}: merged {key} is not its parts")
        fc = prepared.fc
        embed_rows = S.spec_for("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), cfg, tp)[:1]
        check(fc.weight_folded.sharding.is_fully_replicated, f"{name}: folded fc laid out {fc.weight_folded.sharding}")
        check(fc.embed_mean_square.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P(*embed_rows)), 1),
              f"{name}: embed mean squares laid out {fc.embed_mean_square.sharding}, the embedding's rows {embed_rows}")
        out[f"{name} tp={tp} ep={ep}"] = {"merged": merged,
                                          "embed_mean_square": str(fc.embed_mean_square.sharding.spec)}
    check(out["tiny_tp tp=2 ep=1"]["merged"] == 0 and out["tiny_moe tp=1 ep=2"]["merged"] > 0, f"merged: {out}")
    return out


def main() -> None:
    check(jax.device_count() == DEVICES, f"expected {DEVICES} host devices, got {jax.device_count()} "
          f"(XLA_FLAGS must be set before jax is imported)")
    start = time.time()
    summary = {
        "devices": [str(d) for d in jax.devices()],
        "decode": [decode_case("tiny_tp", 2, 1, seed=1), decode_case("tiny_moe", 2, 2, seed=2)],
        "engine": [engine_case("tiny_tp", 2, 1, seed=6), engine_case("tiny_moe", 2, 2, seed=7)],
        "load": [load_case("tiny_tp", 2, 1, seed=3), load_case("tiny_tp", 4, 1, seed=5),
                 load_case("tiny_moe", 2, 2, seed=4)],
        "errors": error_case(),
        "kernel": kernel_case(),
        "prepared": prepared_case(),
    }
    summary["seconds"] = round(time.time() - start, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
