"""The session engine on a tp=2 mesh against one device, on the default model and its eval sessions."""
import json, os, sys, time, dataclasses
import jax, jax.numpy as jnp, numpy as np
from experiments import harness
from configs import carry_ablation
from mtp import sharding
from mtp.checkpoint import load_pretrained
from mtp.engine import Engine, EngineConfig, run_sessions
from mtp.speculative import SpecConfig

dtype_name = sys.argv[1]; n_sessions = int(sys.argv[2]); out = sys.argv[3]
c = carry_ablation.get_config(); c.dtype = dtype_name; c.num_sessions = n_sessions
cfg, params, _, sessions, prompts = harness.load_experiment(c)
mesh = sharding.make_mesh(2, 1)
_, sharded = sharding.load_sharded(c.checkpoint, mesh, dtype=jnp.dtype(dtype_name))
max_new = max(t.max_new_tokens for s in sessions for t in s.turns)
spec = SpecConfig(verify_width=3, max_new_tokens=max_new, eos_id=harness.eos_id(cfg))
total = sum(len(s.turns) for s in sessions)
report = {"dtype": dtype_name, "sessions": len(sessions), "turns": total, "device": jax.devices()[0].device_kind,
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variants": {}}
KEYS = ("path", "cached_tokens", "prefilled_tokens", "drafter_prefilled", "drafter_adopted", "drafter_appended",
        "carry_outcome", "output_len")
ref = {}
for m, p in ((None, params), (mesh, sharded)):
    ref[m is not None] = harness.greedy_reference(cfg, p, sessions, prompts, c, max_new, "greedy", total, m)
for name, (policy, slots, cs) in {"carry": ("carry", 1, 1), "carry_multi_B2": ("carry", 2, 8),
                                  "blind": ("blind", 1, 1)}.items():
    ecfg = EngineConfig(policy=policy, batch_slots=slots, carry_slots=cs, max_context=c.max_context,
                        num_pages=c.num_pages, drafter_pages=c.num_pages)
    runs = {}
    for label, m, p in (("single", None, params), ("tp2", mesh, sharded)):
        t0 = time.time()
        runs[label] = harness.index_turns(harness.run_policy(cfg, p, sessions, prompts, spec, ecfg, name, total, m))
        runs[label + "_s"] = time.time() - t0
    a, b = runs["single"], runs["tp2"]
    same_tokens = sum(a[k].output == b[k].output for k in a)
    same_stats = sum({x: getattr(a[k].stats, x) for x in KEYS} == {x: getattr(b[k].stats, x) for x in KEYS}
                     and a[k].stats.acceptance.counts() == b[k].stats.acceptance.counts() for k in a)
    ttft = lambda t: float(np.median([r.stats.ttft_s for r in t.values()]) * 1e3)
    tps = lambda t: sum(r.stats.output_len for r in t.values()) / sum(r.stats.decode_s for r in t.values())
    acc = lambda t: (sum(r.stats.acceptance.accepted for r in t.values()),
                     sum(r.stats.acceptance.draft_tokens for r in t.values()))
    report["variants"][name] = dict(
        turns=len(a), tokens_identical=same_tokens, stats_identical=same_stats,
        lossless_single=harness.lossless(a, ref[False]), lossless_tp2=harness.lossless(b, ref[True]),
        ttft_ms_p50=dict(single=ttft(a), tp2=ttft(b)), decode_tok_s=dict(single=tps(a), tp2=tps(b)),
        accepted_of_drafted=dict(single=acc(a), tp2=acc(b)),
        stat_diffs=[(k, x, getattr(a[k].stats, x), getattr(b[k].stats, x)) for k in sorted(a) for x in KEYS
                    if getattr(a[k].stats, x) != getattr(b[k].stats, x)]
                   + [(k, "acceptance", a[k].stats.acceptance.as_dict(), b[k].stats.acceptance.as_dict())
                      for k in sorted(a) if a[k].stats.acceptance.counts() != b[k].stats.acceptance.counts()],
        first_diff=next(((k, a[k].output, b[k].output) for k in sorted(a) if a[k].output != b[k].output), None))
    print(name, json.dumps(report["variants"][name], default=str), flush=True)
report["greedy_single_vs_tp2_identical"] = sum(ref[False][k].output == ref[True][k].output for k in ref[False])
os.makedirs(os.path.dirname(out), exist_ok=True)
open(out, "w").write(json.dumps(report, indent=1, default=str))
print(json.dumps({k: v for k, v in report.items() if k != "variants"}))
