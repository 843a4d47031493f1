"""Compact lines from carry_ablation results.json files: python3 runs/s22_summary.py FILE..."""
import json, sys
for f in sys.argv[1:]:
    r = json.load(open(f))
    print("==", f, "|", r["header"][-60:], "|", r["lossless"][:40])
    for n, v in r["variants"].items():
        w = v["warm"]
        print(f"  {n:16s} warm ttft p50 {w['ttft_ms_p50']:6.2f} wait {w.get('ttft_wait_ms_p50', float('nan')):5.2f} "
              f"calls {w.get('start_calls_mean', float('nan')):4.2f} acc {w['mean_acceptance_length']:.3f}")
    for k, c in r["comparisons"].items():
        for m in ("ttft_ms", "ttft_wait_ms"):
            if m in c:
                x = c[m]
                print(f"  {k:30s} {m:13s} {x['mean_diff']:+.3f} [{x['ci95'][0]:+.3f}, {x['ci95'][1]:+.3f}]")
