# The cgroup's OOM kill counter (v1, else v2); the host reads the `oom_kill N` line.
cat /sys/fs/cgroup/memory/memory.oom_control 2>/dev/null || cat /sys/fs/cgroup/memory.events 2>/dev/null
