#!/usr/bin/env bash
# Start a single-host Slurm test cluster (docs/ENVIRONMENT.md §5): munged, MariaDB, slurmdbd, slurmctld
# and three slurmd (n1, n2, n3) with 8 fake GPUs each. Everything lives under STATE (default
# /tmp/ngrpo-slurm); clients need `source STATE/env.sh` (SLURM_CONF). Idempotent: daemons that
# are already up are left alone, an already-running munged is reused (and not stopped by stop.sh).
#
#   scripts/slurm/start.sh [STATE]      exit 0 ready, 2 not root, 3 packages missing, 1 failed
# Ports: NGRPO_SLURM_PORT_BASE (16817) = slurmctld, +1 slurmdbd, +2/+3/+4 the three slurmd.
set -euo pipefail
trap 'echo "start.sh: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
HERE="$(cd "$(dirname "$0")" && pwd)"
D="$(mkdir -p "${1:-${NGRPO_SLURM_DIR:-/tmp/ngrpo-slurm}}" && cd "${1:-${NGRPO_SLURM_DIR:-/tmp/ngrpo-slurm}}" && pwd)"
BASE="${NGRPO_SLURM_PORT_BASE:-16817}"
NODES=(n1 n2 n3)  # three: a hetjob's components get distinct nodes (1 rollout + 2 training)

[ "$(id -u)" -eq 0 ] || { echo "start.sh: needs root (daemons run as root, fake GPUs need mknod)" >&2; exit 2; }
for bin in munged mungekey slurmctld slurmd slurmdbd sinfo sacctmgr mariadbd mariadb-install-db gcc; do
  command -v "$bin" >/dev/null || { echo "start.sh: '$bin' not installed (run scripts/setup.sh)" >&2; exit 3; }
done
[ -f /usr/include/slurm/spank.h ] || { echo "start.sh: slurm/spank.h missing (libslurm-dev)" >&2; exit 3; }

export SLURM_CONF="$D/etc/slurm.conf"
export MYSQL_UNIX_PORT="$D/mysqld/mysqld.sock"  # slurmdbd's MariaDB client honours it
mkdir -p "$D"/{etc,run,log,dev,lib,spool/ctld} "${NODES[@]/#/$D/spool/}"

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # wait_for SECONDS WHAT CMD...
  local t=$1 what=$2; shift 2
  for _ in $(seq $((t * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "start.sh: $what did not come up; logs in $D/log" >&2; tail -n 5 "$D"/log/* >&2 || true; exit 1
}

# Configuration (re-rendered every time; harmless for running daemons).
render() {
  sed -e "s|@STATE@|$D|g" -e "s|@HOST@|$(hostname -s)|g" -e "s|@CTLD_PORT@|$BASE|g" \
      -e "s|@DBD_PORT@|$((BASE + 1))|g" -e "s|@N1_PORT@|$((BASE + 2))|g" -e "s|@N2_PORT@|$((BASE + 3))|g" \
      -e "s|@N3_PORT@|$((BASE + 4))|g" \
      "$HERE/$1.in" > "$D/etc/$1"
}
render slurm.conf; render gres.conf; render slurmdbd.conf; chmod 600 "$D/etc/slurmdbd.conf"
for i in $(seq 0 7); do [ -c "$D/dev/gpu$i" ] || mknod "$D/dev/gpu$i" c 195 "$i"; done
for n in "${NODES[@]}"; do getent hosts "$n" >/dev/null || echo "127.0.0.1 $n" >> /etc/hosts; done
echo "export SLURM_CONF=$SLURM_CONF" > "$D/env.sh"

# The SPANK container stub (pyxis' --container-* options), rebuilt when its source changes.
if [ ! -f "$D/lib/container_stub.so" ] || [ "$HERE/spank_container.c" -nt "$D/lib/container_stub.so" ]; then
  gcc -O2 -Wall -shared -fPIC -o "$D/lib/container_stub.so" "$HERE/spank_container.c"
fi
echo "required $D/lib/container_stub.so" > "$D/etc/plugstack.conf"

# munge: reuse a running munged (ours or the system's).
if ! (munge -n | unmunge) >/dev/null 2>&1; then
  install -d -o munge -g munge -m 755 /run/munge
  if [ ! -f /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  fi
  runuser -u munge -- munged --force
  wait_for 10 munged sh -c 'munge -n | unmunge'
  cp /run/munge/munged.pid "$D/run/munged.pid"  # stop.sh stops only a munged we started
fi

# MariaDB: a private data directory and socket under $D, run as root (the state directory may
# sit in a root-only temporary directory).
mkdir -p "$D/mysqld" "$D/mysql"
if [ ! -d "$D/mysql/mysql" ]; then
  mariadb-install-db --no-defaults --user=root --datadir="$D/mysql" --skip-test-db \
    --auth-root-authentication-method=socket > "$D/log/mariadb-install.log" 2>&1 \
    || { echo "start.sh: mariadb-install-db failed:" >&2; tail -n 20 "$D/log/mariadb-install.log" >&2; exit 1; }
fi
if ! alive "$D/mysqld/mariadbd.pid"; then
  setsid mariadbd --no-defaults --user=root --datadir="$D/mysql" --socket="$MYSQL_UNIX_PORT" \
    --pid-file="$D/mysqld/mariadbd.pid" --skip-networking --innodb-buffer-pool-size=32M \
    --log-error="$D/log/mariadb.log" < /dev/null > /dev/null 2>&1 &
  wait_for 60 MariaDB mariadb --no-defaults --socket="$MYSQL_UNIX_PORT" -e 'select 1'
fi

alive "$D/run/slurmdbd.pid" || slurmdbd
wait_for 60 slurmdbd sacctmgr -n list cluster
alive "$D/run/slurmctld.pid" || slurmctld
wait_for 60 slurmctld scontrol ping
for n in "${NODES[@]}"; do alive "$D/run/slurmd-$n.pid" || slurmd -N "$n"; done

# Ready when every node is idle; a drained node (e.g. from an earlier GRES mismatch) is resumed.
for _ in $(seq 300); do
  idle=$(sinfo -h -t idle -o %D 2>/dev/null | awk '{s+=$1} END {print s+0}')
  [ "$idle" -eq "${#NODES[@]}" ] && { echo "start.sh: cluster up ($D)"; exit 0; }
  if sinfo -h -t drain,down -o %D 2>/dev/null | grep -q '[1-9]'; then
    scontrol update nodename="$(IFS=,; echo "${NODES[*]}")" state=resume 2>/dev/null || true
  fi
  sleep 0.2
done
echo "start.sh: nodes not idle after 60 s:" >&2; sinfo >&2 || true; tail -n 5 "$D"/log/slurm* >&2 || true
exit 1
