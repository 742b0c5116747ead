#!/usr/bin/env bash
# A one-host Slurm cluster of its own, for the tests and for trying hangwatch under Slurm by hand:
#
#   scripts/slurm-cluster.sh start DIR     munged, slurmctld and slurmd with a private configuration under DIR
#   scripts/slurm-cluster.sh stop DIR      stop them (by the pid files under DIR); DIR is left as it is
#   scripts/slurm-cluster.sh env DIR       print the line to source for the client commands
#
# After `start`, use the client commands with the cluster's configuration:
#
#   export SLURM_CONF=DIR/slurm.conf       (what `start` and `env` print)
#   sbatch job.sh; squeue; scontrol show job 1; sacct -c -j 1; scancel 1
#
# It installs nothing: slurm-wlm and munge must be there (Debian: `apt-get install slurm-wlm munge`; the
# test set-up, scripts/test.sh → scripts/setup.sh --with-slurm, installs them when it runs as root).  It runs as root (slurmd starts jobs
# as their users).  Everything lives under DIR: slurm.conf, the munge key and socket, the controller's state,
# slurmd's spool, the logs and the job completion log.  Nothing in /etc, /run or /var is read or written;
# the ports are free ones picked at start, so several clusters (several checkouts) can run on one machine.
#
# The configuration, and why:
#   * the node is this host under its real name (`hostname -s`), with the CPUs `slurmd -C` finds;
#   * ProctrackType=proctrack/linuxproc: a step's processes are its task's descendants (read from /proc), so a
#     signal to the step reaches every process of it as under proctrack/cgroup on a real cluster, without
#     needing cgroups; TaskPlugin=task/none;
#   * SelectType=select/cons_tres with CR_Core: jobs get cores, several can share the node;
#   * KillWait=30: scancel and the time limit send SIGTERM to every process of the job's steps, then SIGKILL
#     30 seconds later; hangwatch checkpoints and ends its tree well within that;
#   * job state: AccountingStorageType=accounting_storage/none (slurmdbd would need a MySQL server) with
#     JobCompType=jobcomp/filetxt, the job completion log: `sacct -c` (`--completion`) reads it and gives each
#     ended job's state (COMPLETED, CANCELLED, TIMEOUT, FAILED; a requeue leaves a REQUEUED record); `scontrol
#     show job` gives a job's live state, restarts included, for MinJobAge=600 seconds after its end.
#     JobAcctGatherType=jobacct_gather/none: no per-step usage is gathered;
#   * JobRequeue=1: a batch job may be requeued (`scontrol requeue`) unless it says --no-requeue.
set -euo pipefail

usage() {
  echo "usage: $0 start|stop|env DIR" >&2
  exit 64
}
[ $# -eq 2 ] || usage
cmd=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'
}

stop_pidfile() {
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

case "$cmd" in
env)
  echo "export SLURM_CONF=$dir/slurm.conf"
  ;;
stop)
  # slurmd first: it ends the jobs' steps it still runs (their slurmstepd), then the controller, then munge
  if [ -f "$dir/slurm.conf" ] && [ -f "$dir/slurmctld.pid" ]; then
    SLURM_CONF=$dir/slurm.conf timeout 10 scancel --state=RUNNING --full --user="$(id -un)" >/dev/null 2>&1 || true
    SLURM_CONF=$dir/slurm.conf timeout 10 scancel --state=PENDING --user="$(id -un)" >/dev/null 2>&1 || true
  fi
  stop_pidfile "$dir/slurmd.pid"
  stop_pidfile "$dir/slurmctld.pid"
  stop_pidfile "$dir/munge/munged.pid"
  ;;
start)
  missing=()
  for exe in munged slurmctld slurmd sbatch srun scontrol sacct scancel; do
    command -v "$exe" >/dev/null 2>&1 || missing+=("$exe")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "slurm-cluster: not installed: ${missing[*]} (apt-get install slurm-wlm munge)" >&2
    exit 69
  fi
  if [ "$(id -u)" -ne 0 ]; then
    echo "slurm-cluster: must run as root (slurmd starts jobs as their users)" >&2
    exit 77
  fi
  host=$(hostname -s)
  mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log"
  chmod 700 "$dir/munge"
  if [ ! -f "$dir/munge/munge.key" ]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
  fi
  # --force: the key and socket live under a temporary directory whose parents munged would otherwise refuse
  munged --force --socket="$dir/munge/munge.socket.2" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
  for _ in $(seq 50); do
    [ -S "$dir/munge/munge.socket.2" ] && break
    sleep 0.1
  done
  # CPUs, sockets, cores and threads as slurmd sees them (a mismatch would drain the node); memory left out
  hw=$(slurmd -C | head -1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ')
  cat >"$dir/slurm.conf" <<EOF
# A one-host test cluster, written by scripts/slurm-cluster.sh (see there for why each setting)
ClusterName=hangwatch
SlurmctldHost=$host
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket.2,cred_expire=15
CryptoType=crypto/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
LaunchParameters=use_interactive_step
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
JobRequeue=1
KillWait=30
MinJobAge=600
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
NodeName=$host $hw State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$dir/slurm.conf"
  slurmd -f "$dir/slurm.conf"
  # ready: the node answers and is idle
  for _ in $(seq 150); do
    state=$(scontrol show node "$host" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^State=//p' || true)
    case "$state" in
    IDLE* | MIXED* | ALLOCATED*) break ;;
    esac
    sleep 0.2
  done
  case "$state" in
  IDLE* | MIXED* | ALLOCATED*) ;;
  *)
    echo "slurm-cluster: node $host is not ready (state '${state:-none}'); logs under $dir/log:" >&2
    tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" "$dir/log/munged.log" >&2 2>/dev/null || true
    exit 1
    ;;
  esac
  echo "export SLURM_CONF=$dir/slurm.conf"
  ;;
*)
  usage
  ;;
esac
