"""Per MARK segment of an XLA VLOG (command_buffer_thunk=3): command-buffer executions, updates, update time."""
import collections, re, sys
seg, stats = "start", collections.OrderedDict()
for line in open(sys.argv[1], errors="replace"):
    if line.startswith("MARK "):
        seg = line.split()[1]; continue
    s = stats.setdefault(seg, collections.Counter())
    if "Execute command buffer on device" in line:
        s["executions"] += 1
    m = re.search(r"Update command buffer .* num_commands=(\d+); updated_allocs=(\d+)", line)
    if m:
        s["updates"] += 1; s["updated_allocs"] += int(m.group(2)); s[f"upd_cmds_{m.group(1)}"] += 1
    m = re.search(r"Updated command buffer in (\d+) .s; num_commands=(\d+)", line)
    if m:
        s["update_us"] += int(m.group(1))
for k, v in stats.items():
    print(k, dict(v))
