#!/usr/bin/env bash
# A single-node Slurm (munged + slurmctld + slurmd) for conveyor's Slurm tests, all of it under DIR.
#
#   scripts/slurm-single-node.sh start DIR   # prints SLURM_CONF=DIR/slurm.conf once the node is idle
#   scripts/slurm-single-node.sh stop DIR    # every daemon it started is gone when this returns
#
# Needs root and Debian's slurm-wlm and munge (apt-get install slurm-wlm munge). No systemd, no
# cgroups, no slurmdbd: proctrack/linuxproc, task/none, and the job completion log
# (jobcomp/filetxt, DIR/log/jobcomp.txt) as the record of how each job ended. Clients
# (sbatch, squeue, scontrol, scancel) find this cluster through SLURM_CONF=DIR/slurm.conf.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

write_conf() {
    local host cpus mem_mb
    host=$(hostname -s)
    cpus=$(getconf _NPROCESSORS_ONLN)  # not nproc: it honours OMP_NUM_THREADS (a Dask nanny sets it to 1)
    mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))  # half the machine's memory
    mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/munge"
    cat > "$dir/slurm.conf" <<CONF
ClusterName=conveyor-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
# a job past its time limit is killed at once (SIGTERM, then SIGKILL 2 s later)
OverTimeLimit=0
KillWait=2
MinJobAge=600
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
# a partition whose limit a job can exceed and still be queued (EnforcePartLimits=NO, the default)
PartitionName=short Nodes=$host MaxTime=1 State=UP
CONF
}

start() {
    [[ $(id -u) -eq 0 ]] || { echo "$0: needs root (slurmd runs jobs as their users)" >&2; exit 1; }
    for bin in munged slurmctld slurmd sbatch squeue scontrol scancel; do
        command -v "$bin" >/dev/null || { echo "$0: $bin not found: apt-get install slurm-wlm munge" >&2; exit 1; }
    done
    write_conf
    munged --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
        --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" --force
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF" -i
    slurmd -f "$SLURM_CONF" -N "$(hostname -s)"
    local i
    for i in $(seq 1 60); do  # the node registers within seconds; give it 30 s
        if [[ $(sinfo -h -N -p debug -o %t 2>/dev/null) == idle ]]; then
            echo "SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.5
    done
    echo "$0: the node did not come up idle in 30 s; see $dir/log/" >&2
    stop
    exit 1
}

stop_pid_file() {  # TERM the daemon named by a pid file, then KILL it if it is still there after 10 s
    local file=$1 pid i
    [[ -f $file ]] || return 0
    pid=$(cat "$file")
    kill -TERM "$pid" 2>/dev/null || { rm -f "$file"; return 0; }
    for i in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$file"; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$file"
}

stop() {
    if [[ -f $dir/slurm.conf && -f $dir/slurmctld.pid ]]; then  # no job outlives its cluster
        SLURM_CONF=$dir/slurm.conf scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    fi
    stop_pid_file "$dir/slurmd.pid"
    stop_pid_file "$dir/slurmctld.pid"
    stop_pid_file "$dir/munge/munged.pid"
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
