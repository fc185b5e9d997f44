# A lease's final command and the reset in one exec:
#   sh -c "$(cat fleetrl_reset.sh final.sh)" final WORKDIR CMD [ARG...]
# Run the command, then reset, then report both statuses as the last line of stderr.
# Only this shell's own exit status (0 after it printed the line, 137 if it was killed)
# says the line is genuine: when it prints, every other process is dead, so nothing can
# write after it. The host reads the line with programs.final_status.
wd="$1"; shift
"$@"
rc=$?
fleetrl_reset "$wd" 2>/dev/null
st=$?
printf '\nfleetrl-final %s %s\n' "$rc" "$st" >&2
exit 0
