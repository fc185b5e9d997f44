# fleetrl_reset WORKDIR: kill every process of the sandbox user but PID 1 (and this
# shell), wipe every writable dir, then check that nothing survived. Returns 0 when the
# sandbox is clean. A function, not a subshell: `kill -9 -1` spares only the calling
# process. Not run alone: reset.sh and final.sh are each run with this file before them.
fleetrl_reset() {
  wd="$1"
  i=0
  while :; do
    kill -9 -1 2>/dev/null
    n=0
    for d in /proc/[0-9]*; do
      p=${d#/proc/}
      [ "$p" = 1 ] && continue
      [ "$p" = $$ ] && continue
      read -r line < "$d/stat" 2>/dev/null || continue
      set -- $line
      [ "$4" = $$ ] && continue
      n=$((n+1))
    done
    [ "$n" = 0 ] && break
    i=$((i+1))
    [ "$i" -ge 50 ] && { echo "processes survive: $n" >&2; return 3; }
    sleep 0.02
  done
  # SysV IPC objects live in the container's IPC namespace, not in /dev/shm
  command -v ipcrm >/dev/null 2>&1 && ipcrm --all 2>/dev/null
  # every place the sandbox user can write (read-only root): work dir, /tmp, /dev/shm, /dev/mqueue
  set -- "$wd" /tmp /dev/shm /dev/mqueue
  for dir; do
    rm -rf "$dir"/* "$dir"/.[!.]* "$dir"/..?* 2>/dev/null || {
      chmod -R u+rwX "$dir" 2>/dev/null; rm -rf "$dir"/* "$dir"/.[!.]* "$dir"/..?* 2>/dev/null; }
  done
  for dir; do
    for f in "$dir"/* "$dir"/.[!.]* "$dir"/..?*; do
      if [ -e "$f" ] || [ -L "$f" ]; then echo "not wiped: $f" >&2; return 5; fi
    done
  done
  return 0
}
