# Sandbox.reset: `sh -c "$(cat fleetrl_reset.sh reset.sh)" reset WORKDIR`; exits 0 when
# the sandbox is clean (see fleetrl_reset.sh).
fleetrl_reset "$1"
