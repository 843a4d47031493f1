"""Per call type (MARK policy:name) in an XLA command-buffer VLOG of the served flow: CB executions,
updates (and how many allocations changed), update time, per call."""
import collections, re, sys
calls, stats, seg = collections.Counter(), collections.defaultdict(collections.Counter), "start"
for line in open(sys.argv[1], errors="replace"):
    if line.startswith("MARK "):
        seg = line.split()[1]; calls[seg] += 1; continue
    s = stats[seg]
    if "Execute command buffer" in line: s["exec"] += 1
    m = re.search(r"num_commands=(\d+); updated_allocs=(\d+); is_first_record=(\w+)", line)
    if m:
        s["updates"] += 1; s["allocs"] += int(m.group(2)); s["first"] += m.group(3) == "true"
        s["update_cmds"] += int(m.group(1))
    m = re.search(r"Updated command buffer in (\d+)", line) or re.search(r"[Rr]ecorded? .* in (\d+) .s", line)
    if m: s["update_us"] += int(m.group(1))
for seg, n in sorted(calls.items()):
    s = stats[seg]
    print(f"{seg:28s} calls {n:4d} | per call: CB exec {s['exec']/n:5.2f} updates {s['updates']/n:5.2f} "
          f"allocs {s['allocs']/n:5.2f} cmds updated {s['update_cmds']/n:6.1f} update_us {s['update_us']/n:7.1f} first {s['first']}")
