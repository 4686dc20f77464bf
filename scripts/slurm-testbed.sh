#!/usr/bin/env bash
# gpuflow's Slurm test cluster, on 127.0.0.1 only: munge with its own key and socket, one
# slurmctld and three slurmd on this host, each a node of its own with GPUs declared as
# gres (placeholder device files: nothing here is a GPU).
#
#   node g1, g2   4 x gpu:h100 each, partition gpu (the default)
#   node l1       2 x gpu:l4, partition l4
#   partition urgent   every node, a higher priority tier: its jobs preempt the others',
#                      which Slurm requeues (PreemptMode=REQUEUE)
#
#   scripts/slurm-testbed.sh up --dir DIR [--h100-per-node N]
#                                             start it; DIR/slurm.conf is what a client needs
#                                             (SLURM_CONF), DIR/env sets it for a shell;
#                                             N: the H100s g1 and g2 declare (default 4)
#   scripts/slurm-testbed.sh down --dir DIR   stop what `up` started, by PID
#
# Needs Debian's slurmctld, slurmd, slurm-client and munge (the test set-up installs them)
# and root: slurmd starts every job step as its user.
set -euo pipefail

START=$SECONDS
say() { printf '[slurm-testbed] %s (%ds)\n' "$*" $((SECONDS - START)) >&2; }
die() { printf 'slurm-testbed: %s\n' "$*" >&2; exit 1; }
FREE_PORT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/testbed/free_port.py
free_port() { python3 "$FREE_PORT"; } # below the ephemeral range: see the script

# name, gres type, gres count, partition (set once the arguments are read)
nodes() { NODES=("g1 h100 $H100 gpu" "g2 h100 $H100 gpu" "l1 l4 2 l4"); }

start() { # name, then the command: run in the background, its PID kept in DIR/pids/name
  local name=$1
  shift
  "$@" >>"$DIR/logs/$name.out" 2>&1 &
  echo $! >"$DIR/pids/$name"
}

wait_for() { # what, seconds, then a command that succeeds once it is so
  local what=$1 limit=$2
  shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "$what did not happen within ${limit} s; see $DIR/logs"
    sleep 0.2
  done
}

write_config() {
  local host ctld_port=$1
  host=$(hostname -s)
  mkdir -p "$DIR"/{state,spool,dev}
  {
    echo "# gpuflow's Slurm test cluster ($DIR); written by scripts/slurm-testbed.sh"
    echo "ClusterName=gpuflow-test"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=$ctld_port"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    # a requeued job may start again after cred_expire (default 120 s): the test cluster waits 10
    echo "AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/pids/slurmctld.pidfile"
    echo "SlurmdPidFile=$DIR/pids/slurmd-%n.pidfile"
    echo "SlurmctldLogFile=$DIR/logs/slurmctld.log"
    echo "SlurmdLogFile=$DIR/logs/slurmd-%n.log"
    # this host's cgroup v1 layout: no cgroup plugins
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "MpiDefault=none"
    echo "SchedulerType=sched/backfill"
    # the scheduler looks at pending jobs every 5 s (default 60 and 30): a requeued job restarts soon
    echo "SchedulerParameters=sched_interval=5,bf_interval=5"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "GresTypes=gpu"
    # the nodes share this host: they declare what the tests need, not what the host has
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "SlurmdTimeout=30"
    echo "InactiveLimit=0"
    echo "KillWait=5"
    echo "MinJobAge=30"
    echo "PreemptType=preempt/partition_prio"
    echo "PreemptMode=REQUEUE"
    local entry name type count partition port
    for entry in "${NODES[@]}"; do
      read -r name type count partition <<<"$entry"
      port=$(free_port)
      echo "NodeName=$name NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=$((count > 8 ? count : 8)) RealMemory=8000 Gres=gpu:$type:$count State=UNKNOWN"
    done
    echo "PartitionName=gpu Nodes=g1,g2 Default=YES MaxTime=60 State=UP PriorityTier=1 GraceTime=10"
    echo "PartitionName=l4 Nodes=l1 MaxTime=60 State=UP PriorityTier=1 GraceTime=10"
    echo "PartitionName=urgent Nodes=g1,g2,l1 MaxTime=60 State=UP PriorityTier=10 PreemptMode=OFF"
  } >"$DIR/slurm.conf"
  # Slurm's OCI containers (srun --container=BUNDLE): slurmstepd reads oci.conf beside
  # slurm.conf at each step; runc runs the bundle (a job in its image: image:)
  local oci=$DIR/oci-state id='%n.%u.%j.%s.%t'
  mkdir -p "$oci"
  {
    echo "RunTimeQuery=\"runc --root=$oci state $id\""
    echo "RunTimeKill=\"runc --root=$oci kill -a $id\""
    echo "RunTimeDelete=\"runc --root=$oci delete --force $id\""
    echo "RunTimeRun=\"runc --root=$oci run $id -b %b\""
  } >"$DIR/oci.conf"
  : >"$DIR/gres.conf"
  for entry in "${NODES[@]}"; do
    read -r name type count partition <<<"$entry"
    mkdir -p "$DIR/dev/$name"
    # Slurm hands a job its GPUs (CUDA_VISIBLE_DEVICES) only for a character device
    for ((i = 0; i < count; i++)); do ln -sfn /dev/null "$DIR/dev/$name/nvidia$i"; done
    echo "NodeName=$name Name=gpu Type=$type File=$DIR/dev/$name/nvidia[0-$((count - 1))]" >>"$DIR/gres.conf"
  done
  printf 'export SLURM_CONF=%q\n' "$DIR/slurm.conf" >"$DIR/env"
}

up() {
  for program in munged slurmctld slurmd sinfo; do
    command -v "$program" >/dev/null ||
      die "$program is not installed; apt-get install munge slurmctld slurmd slurm-client"
  done
  ((EUID == 0)) || die "the Slurm test cluster needs root (slurmd starts each job as its user)"
  [[ ! -f $DIR/pids/slurmctld ]] || die "$DIR holds a running Slurm test cluster; run down --dir $DIR first"
  mkdir -p "$DIR"/{logs,pids,munge}
  DIR=$(cd "$DIR" && pwd)
  trap up_failed EXIT
  chmod 700 "$DIR/munge"
  head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
  chmod 400 "$DIR/munge/munge.key"
  start munged munged --foreground --force --key-file="$DIR/munge/munge.key" \
    --socket="$DIR/munge/munge.socket" --pid-file="$DIR/munge/munged.pid" \
    --seed-file="$DIR/munge/munged.seed" --log-file="$DIR/logs/munged.log"
  wait_for "munged's socket" 20 test -S "$DIR/munge/munge.socket"
  write_config "$(free_port)"
  export SLURM_CONF=$DIR/slurm.conf
  start slurmctld slurmctld -D -i -f "$SLURM_CONF"
  wait_for "slurmctld answering" 60 scontrol ping
  local entry name
  for entry in "${NODES[@]}"; do
    read -r name _ <<<"$entry"
    start "slurmd-$name" slurmd -D -N "$name" -f "$SLURM_CONF"
  done
  wait_for "every node idle" 90 all_idle
  say "up: $(sinfo -h -o '%P %D %G' | tr '\n' ';') SLURM_CONF=$SLURM_CONF"
  trap - EXIT
}

up_failed() { # EXIT trap while up runs: what it started before failing goes with it
  local rc=$?
  trap - EXIT
  ((rc)) || return 0
  say "up failed part-way: stopping what it started"
  down || true
  exit "$rc"
}

all_idle() {
  local states
  states=$(sinfo -h -N -o '%N %t' | sort -u)
  [[ $(grep -c ' idle$' <<<"$states") -eq ${#NODES[@]} ]]
}

down() {
  [[ -d $DIR/pids ]] || { say "nothing runs in $DIR"; return; }
  DIR=$(cd "$DIR" && pwd)
  export SLURM_CONF=$DIR/slurm.conf
  local jobs group
  # jobs still there: cancelled while slurmctld runs, so their steps end by Slurm's hand
  if [[ -f $DIR/pids/slurmctld ]] && jobs=$(squeue -h -o %i 2>/dev/null) && [[ -n $jobs ]]; then
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 50); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.2; done
  fi
  for group in "slurmd-g1 slurmd-g2 slurmd-l1" slurmctld munged; do
    stop_all $group
  done
  sweep
}

sweep() { # what this cluster's daemons started and left: slurmstepd, slurmscriptd, job steps
  local environ pid vars found=()
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    ((pid != $$)) || continue
    vars=$(tr '\0' '\n' 2>/dev/null <"$environ") || continue
    grep -qxF "SLURM_CONF=$SLURM_CONF" <<<"$vars" || continue
    # a daemon's helper, or a process of a job step (never a shell that exported SLURM_CONF)
    if grep -qaE '^(slurmstepd|: slurmscriptd)' "/proc/$pid/cmdline" 2>/dev/null ||
      grep -q '^SLURMD_NODENAME=' <<<"$vars"; then
      found+=("$pid")
    fi
  done
  ((${#found[@]})) || return 0
  kill -KILL "${found[@]}" 2>/dev/null || true
  say "stopped what the cluster's daemons left: pids ${found[*]}"
}

any_alive() {
  local pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

stop_all() { # names: TERM to each, then KILL to those still there after 10 s
  local name pid pids=() names=()
  for name in "$@"; do
    [[ -f $DIR/pids/$name ]] || continue
    pid=$(cat "$DIR/pids/$name")
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid") && names+=("$name")
    rm -f "$DIR/pids/$name"
  done
  ((${#pids[@]})) || return 0
  for _ in $(seq 50); do any_alive "${pids[@]}" || break; sleep 0.2; done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  say "stopped ${names[*]} (pids ${pids[*]})"
}

command=${1:-}
shift || true
DIR=
H100=4
while (($#)); do
  case $1 in
  --dir) DIR=$2; shift 2 ;;
  --h100-per-node) H100=$2; shift 2 ;;
  *) die "unknown argument $1 (up|down --dir DIR)" ;;
  esac
done
[[ -n $DIR ]] || die "--dir DIR is required"
[[ $H100 =~ ^[1-9][0-9]*$ ]] || die "--h100-per-node: give a whole number of GPUs, e.g. 32"
nodes
case $command in
up) up ;;
down) down ;;
*) die "usage: slurm-testbed.sh up|down --dir DIR" ;;
esac
