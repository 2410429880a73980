#!/usr/bin/env bash
# A real one-node slurm (slurmctld + slurmd + munge) on this machine, so CI can run srun/sbatch.
#
#   bash launch/local_slurm.sh up      # install if needed, start munged/slurmctld/slurmd, wait for idle
#   bash launch/local_slurm.sh status  # exit 0 when the node answers idle/mixed/allocated
#   bash launch/local_slurm.sh down    # stop the daemons by their pid files
#
# Every slurm command needs SLURM_CONF=$SPMD_SLURM_DIR/slurm.conf (default /tmp/spmd-slurm/slurm.conf).
# Needs root (daemons, apt-get). Every wait is bounded; failures exit non-zero with one clear line.
set -euo pipefail

DIR=${SPMD_SLURM_DIR:-/tmp/spmd-slurm}
CONF=$DIR/slurm.conf
MUNGE_PID=/run/munge/munged.pid
START_TIMEOUT_S=${SPMD_SLURM_START_TIMEOUT_S:-60}
INSTALL_TIMEOUT_S=${SPMD_SLURM_INSTALL_TIMEOUT_S:-300}
export SLURM_CONF=$CONF

die() { echo "local_slurm: $*" >&2; exit 1; }
say() { echo "local_slurm: $*"; }

# The pid in file $1 runs and is not a zombie (a killed daemon can linger unreaped for a while).
alive() {
  [[ -f $1 ]] || return 1
  local pid state
  pid=$(cat "$1")
  kill -0 "$pid" 2>/dev/null || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || echo Z)
  [[ $state != Z ]]
}

node_name() { hostname -s; }

# Poll `cmd` every 0.5 s until it succeeds or `timeout_s` passes.
wait_for() {
  local timeout_s=$1; shift
  local deadline=$((SECONDS + timeout_s))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

install_packages() {
  local missing=()
  for bin in slurmctld slurmd srun sbatch munged; do
    command -v "$bin" >/dev/null 2>&1 || [[ -x /usr/sbin/$bin ]] || missing+=("$bin")
  done
  ((${#missing[@]} == 0)) && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install slurm"
  say "installing slurmd slurmctld slurm-client munge (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  timeout "$INSTALL_TIMEOUT_S" apt-get update -qq >"$DIR/apt.log" 2>&1 \
    || die "apt-get update failed or timed out (see $DIR/apt.log)"
  timeout "$INSTALL_TIMEOUT_S" apt-get install -y -qq slurmd slurmctld slurm-client munge >>"$DIR/apt.log" 2>&1 \
    || die "apt-get install slurmd slurmctld slurm-client munge failed or timed out (see $DIR/apt.log)"
}

munge_ok() { munge -n | unmunge; }

start_munge() {
  if munge_ok >/dev/null 2>&1; then return 0; fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile=/etc/munge/munge.key --force
    else
      dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 755 /run/munge
  if ! alive "$MUNGE_PID"; then
    su -s /bin/sh munge -c "/usr/sbin/munged --pid-file=$MUNGE_PID" || die "munged did not start"
  fi
  wait_for 10 munge_ok || die "munge -n | unmunge does not say Success after 10 s"
}

write_conf() {
  local node cpus
  node=$(node_name)
  cpus=$(nproc)
  ((cpus < 2)) && cpus=2  # the tests run 2 tasks; config_overrides accepts more CPUs than present
  mkdir -p "$DIR/state" "$DIR/spool"
  cat >"$CONF.tmp" <<EOF
# Written by launch/local_slurm.sh: a one-node test cluster, not a production config.
ClusterName=local
SlurmctldHost=$node
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
NodeName=$node CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  mv "$CONF.tmp" "$CONF"
}

node_state() { timeout 10 sinfo -h -N -n "$(node_name)" -o %T 2>/dev/null | head -1; }

node_ready() {
  case "$(node_state)" in
    idle* | mixed* | allocated* | completing*) return 0 ;;
    *) return 1 ;;
  esac
}

up() {
  [[ $(id -u) == 0 ]] || die "needs root (starts munged, slurmctld, slurmd)"
  mkdir -p "$DIR"
  install_packages
  start_munge
  local daemons_running=0
  alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && daemons_running=1
  if ((daemons_running)) && node_ready; then
    say "already up; export SLURM_CONF=$CONF"
    return 0
  fi
  ((daemons_running)) || write_conf
  if ! alive "$DIR/slurmctld.pid"; then
    /usr/sbin/slurmctld -f "$CONF" || die "slurmctld did not start (see $DIR/slurmctld.log)"
  fi
  wait_for 20 timeout 5 scontrol ping || die "slurmctld does not answer scontrol ping after 20 s (see $DIR/slurmctld.log)"
  if ! alive "$DIR/slurmd.pid"; then
    /usr/sbin/slurmd -f "$CONF" || die "slurmd did not start (see $DIR/slurmd.log)"
  fi
  if ! wait_for "$START_TIMEOUT_S" node_ready; then
    # a node left down/drained by an earlier run: ask once to resume, then wait again
    scontrol update nodename="$(node_name)" state=resume >/dev/null 2>&1 || true
    wait_for 10 node_ready || die "node $(node_name) is '$(node_state)' not idle after ${START_TIMEOUT_S}s (see $DIR/slurmd.log)"
  fi
  say "up: node $(node_name) $(node_state); export SLURM_CONF=$CONF"
}

stop_pidfile() {
  local name=$1 pidfile=$2
  alive "$pidfile" || { rm -f "$pidfile"; return 0; }
  local pid
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  if ! wait_for 15 bash -c "! kill -0 $pid"; then
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
  say "stopped $name (pid $pid)"
}

down() {
  stop_pidfile slurmd "$DIR/slurmd.pid"
  stop_pidfile slurmctld "$DIR/slurmctld.pid"
  stop_pidfile munged "$MUNGE_PID"
}

status() {
  echo "SLURM_CONF=$CONF"
  [[ -f $CONF ]] || die "not configured ($CONF missing): run 'bash launch/local_slurm.sh up'"
  for d in slurmctld slurmd; do
    if alive "$DIR/$d.pid"; then echo "$d: running (pid $(cat "$DIR/$d.pid"))"; else echo "$d: stopped"; fi
  done
  if alive "$MUNGE_PID"; then echo "munged: running (pid $(cat "$MUNGE_PID"))"; else echo "munged: stopped"; fi
  timeout 10 sinfo 2>&1 || true
  node_ready || die "node $(node_name) is not ready ('$(node_state)')"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
