#!/usr/bin/env bash
# Stop the test cluster started by start.sh [STATE]: cancel jobs, then SIGTERM by PID file
# (slurmd + slurmctld together, then slurmdbd, MariaDB, and munged only if start.sh started it);
# SIGKILL whatever is left after 15 s. Idempotent.
set -uo pipefail
D="${1:-${NGRPO_SLURM_DIR:-/tmp/ngrpo-slurm}}"
[ -d "$D" ] || exit 0
export SLURM_CONF="$D/etc/slurm.conf"

pid_of() {  # pid_of PIDFILE NAME: the pid when it is alive and runs NAME (guards against reuse)
  local pid
  [ -f "$1" ] && pid="$(cat "$1")" && kill -0 "$pid" 2>/dev/null \
    && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2"* ]] && echo "$pid"
}
running() {  # a zombie (exited, not yet reaped by init) counts as stopped
  kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
stop() {  # stop "PIDFILE NAME" ...: SIGTERM all, wait up to 15 s, then SIGKILL
  local pids=() spec pid
  for spec in "$@"; do
    pid="$(pid_of $spec)" && pids+=("$pid")
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  for _ in $(seq 150); do
    local left=()
    for pid in "${pids[@]}"; do running "$pid" && left+=("$pid"); done
    [ ${#left[@]} -eq 0 ] && return 0
    sleep 0.1
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

if pid_of "$D/run/slurmctld.pid" slurmctld >/dev/null; then
  timeout 5 scancel --user="$(id -un)" 2>/dev/null
  for _ in $(seq 50); do [ -z "$(timeout 2 squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
fi
stop "$D/run/slurmd-n1.pid slurmd" "$D/run/slurmd-n2.pid slurmd" "$D/run/slurmd-n3.pid slurmd" \
  "$D/run/slurmctld.pid slurmctld"
stop "$D/run/slurmdbd.pid slurmdbd"
stop "$D/mysqld/mariadbd.pid mariadbd"
stop "$D/run/munged.pid munged" && rm -f "$D/run/munged.pid"
echo "stop.sh: cluster stopped ($D)"
