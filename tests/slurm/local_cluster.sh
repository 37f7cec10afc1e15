#!/usr/bin/env bash
# A throw-away Slurm cluster on this one machine, for the tests and for trying the kit's
# templates: 2 nodes (two slurmd, Debian's slurmd is built with MULTIPLE_SLURMD), 2 fake GPUs
# each (character devices as GRES), a sacct stand-in (no accounting database).
#
#   tests/slurm/local_cluster.sh up      # installs the Debian packages if missing (root)
#   . /tmp/kit-slurm/env.sh              # SLURM_CONF + the sacct stand-in on PATH
#   tests/slurm/local_cluster.sh down    # stops exactly what `up` started, by PID
#
# Settings (environment): CLUSTER_DIR (default /tmp/kit-slurm), NODES (2), GPUS_PER_NODE (2),
# SLURMCTLD_PORT (6817), SLURMD_PORT (6818; node i listens on SLURMD_PORT+i-1).
# Exit status 3 means "cannot run here" (not root, packages cannot be installed): the tests
# skip on it; any other failure is an error.
set -euo pipefail

CLUSTER_DIR=${CLUSTER_DIR:-/tmp/kit-slurm}
NODES=${NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
SLURMCTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
HOSTS_MARK="# kit-slurm $CLUSTER_DIR"   # tags the /etc/hosts lines this cluster added

cannot_run() { echo "local Slurm cluster unavailable: $*" >&2; exit 3; }
fail() { echo "error: $*" >&2; exit 1; }

node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "node$i"; done; }

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  ((${#missing[@]} == 0)) && return 0
  echo "installing ${missing[*]} (apt-get) ..."
  export DEBIAN_FRONTEND=noninteractive
  # The postinst scripts try to start the services; without systemd that is refused, harmlessly.
  { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
    >"$CLUSTER_DIR/log/apt-get.log" 2>&1 \
    || cannot_run "apt-get install ${missing[*]} failed (see $CLUSTER_DIR/log/apt-get.log)"
}

start_munge() {
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if munge -n >/dev/null 2>&1; then
    return 0   # a munged is already running (ours from before, or the system's): share it
  fi
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
  cp /run/munge/munged.pid "$CLUSTER_DIR/munged.pid"   # ours: `down` stops it
  local _
  for _ in $(seq 40); do munge -n >/dev/null 2>&1 && return 0; sleep 0.25; done
  fail "munged did not start (see /var/log/munge/munged.log)"
}

make_fake_gpus() {
  local node gpu
  echo "AutoDetect=off" >"$CLUSTER_DIR/gres.conf"
  ((GPUS_PER_NODE > 0)) || return 0
  for node in $(node_names); do
    mkdir -p "$CLUSTER_DIR/fakegpu/$node"
    for ((gpu = 0; gpu < GPUS_PER_NODE; gpu++)); do
      # gres/gpu wants character devices (regular files leave CUDA_VISIBLE_DEVICES empty);
      # 1,3 are /dev/null's numbers, so nothing can be harmed through them.
      [[ -c $CLUSTER_DIR/fakegpu/$node/nvidia$gpu ]] || mknod "$CLUSTER_DIR/fakegpu/$node/nvidia$gpu" c 1 3
    done
    echo "NodeName=$node Name=gpu File=$CLUSTER_DIR/fakegpu/$node/nvidia[0-$((GPUS_PER_NODE - 1))]" \
      >>"$CLUSTER_DIR/gres.conf"
  done
}

add_host_names() {
  # The templates put the rendezvous on the first node by name (scontrol show hostnames), so
  # node1.. must resolve; all of them are this machine. Always add our own tagged lines, so that
  # `down` removes exactly those and leaves anyone else's alone.
  local node
  for node in $(node_names); do echo "127.0.0.1 $node $HOSTS_MARK"; done >>/etc/hosts
  for node in $(node_names); do
    [[ $(getent hosts "$node" | awk '{print $1; exit}') == 127.0.0.1 ]] \
      || fail "$node resolves to another address in /etc/hosts; remove that line or change NODES"
  done
}

remove_host_names() {
  [[ -w /etc/hosts ]] || return 0
  local kept
  kept=$(grep -vF -- "$HOSTS_MARK" /etc/hosts || true)
  # Rewrite in place: in containers /etc/hosts is a bind mount that cannot be replaced (sed -i).
  printf '%s\n' "$kept" >/etc/hosts
}

write_config() {
  local node port=$SLURMD_PORT cpus mem_mb node_lines=""
  cpus=$(nproc)
  # Each fake node gets three quarters of the memory divided by the node count; only
  # scheduling uses it (no cgroups enforce it).
  mem_mb=$(($(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) * 3 / 4 / NODES))
  for node in $(node_names); do
    node_lines+="NodeName=$node NodeHostname=localhost NodeAddr=127.0.0.1 Port=$port CPUs=$cpus"
    node_lines+=" RealMemory=$mem_mb Gres=gpu:$GPUS_PER_NODE State=UNKNOWN"$'\n'
    port=$((port + 1))
  done
  cat >"$CLUSTER_DIR/slurm.conf" <<CONF
# Throw-away test cluster (tests/slurm/local_cluster.sh): one machine, root daemons,
# no systemd, no cgroups, no accounting database.
ClusterName=kit
SlurmctldHost=localhost
SlurmctldPort=$SLURMCTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation=$CLUSTER_DIR/state
SlurmdSpoolDir=$CLUSTER_DIR/spool-%n
SlurmctldPidFile=$CLUSTER_DIR/slurmctld.pid
SlurmdPidFile=$CLUSTER_DIR/slurmd-%n.pid
SlurmctldLogFile=$CLUSTER_DIR/log/slurmctld.log
SlurmdLogFile=$CLUSTER_DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in containers: track processes by parent id (jobs must not leave orphans).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Try waiting jobs every 2 s (default 60): a requeued job then starts again right after its
# cred_expire wait, not up to a minute later.
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# The fake nodes share this machine's cores and memory; trust the numbers below.
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
# Finished jobs stay visible to squeue (and so to the sacct stand-in) for 10 minutes.
MinJobAge=600
KillWait=10
Waittime=0
${node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

write_sacct_standin() {
  # submitit polls `sacct -o JobID,State,NodeList --parsable2 -j ID`; without slurmdbd the real
  # sacct fails and a job that died early would look unfinished forever. This one answers from
  # slurmctld's memory of recent jobs (MinJobAge).
  cat >"$CLUSTER_DIR/bin/sacct" <<'SACCT'
#!/usr/bin/env bash
# sacct stand-in for the local test cluster (no accounting database): JobID|State|NodeList
# of the jobs given with -j/--jobs, from `squeue --states=all`.
job_ids=()
while (($# > 0)); do
  case $1 in
    -j | --jobs) job_ids+=("$2"); shift 2 ;;
    -j* ) job_ids+=("${1#-j}"); shift ;;
    --jobs=*) job_ids+=("${1#--jobs=}"); shift ;;
    *) shift ;;
  esac
done
echo "JobID|State|NodeList"
((${#job_ids[@]} > 0)) || exit 0
squeue --noheader --states=all --jobs="$(IFS=,; echo "${job_ids[*]}")" --format="%i|%T|%N" 2>/dev/null
exit 0
SACCT
  chmod +x "$CLUSTER_DIR/bin/sacct"
  cat >"$CLUSTER_DIR/env.sh" <<ENV
# Source this to use the local test cluster: . $CLUSTER_DIR/env.sh
export SLURM_CONF=$CLUSTER_DIR/slurm.conf
export PATH=$CLUSTER_DIR/bin:\$PATH
ENV
}

wait_until_idle() {
  local _ states=""
  for _ in $(seq 60); do
    states=$(sinfo --noheader --Node --format=%T 2>/dev/null | sort -u | tr '\n' ' ')
    [[ $states == "idle " ]] && return 0
    sleep 0.5
  done
  tail -n 20 "$CLUSTER_DIR"/log/*.log >&2 || true
  fail "the nodes did not become idle (states: ${states:-none}); logs in $CLUSTER_DIR/log"
}

up() {
  [[ $(id -u) == 0 ]] || cannot_run "needs root (daemons, fake GPU devices, /etc/hosts)"
  mkdir -p "$CLUSTER_DIR/log" "$CLUSTER_DIR/bin"
  if pid_alive "$CLUSTER_DIR/slurmctld.pid"; then
    fail "a cluster is already running in $CLUSTER_DIR: run '$0 down' first"
  fi
  install_packages
  rm -rf "$CLUSTER_DIR/state" "$CLUSTER_DIR"/spool-*   # a fresh cluster: job ids start at 1
  mkdir -p "$CLUSTER_DIR/state"
  start_munge
  make_fake_gpus
  write_config
  write_sacct_standin
  add_host_names
  export SLURM_CONF=$CLUSTER_DIR/slurm.conf
  # Both daemons fork into the background and write the PID files named in slurm.conf.
  slurmctld -f "$SLURM_CONF"
  local node
  for node in $(node_names); do slurmd -f "$SLURM_CONF" -N "$node"; done
  wait_until_idle
  sinfo --Node --format="%N %T %c %m %G"
  echo "Slurm is up: . $CLUSTER_DIR/env.sh"
}

stop_pid_file() {
  local pid_file=$1 pid _
  [[ -s $pid_file ]] || return 0
  pid=$(cat "$pid_file")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    echo "stopped $(basename "$pid_file" .pid) ($pid)"
  fi
  rm -f "$pid_file"
}

stop_leftover_job_processes() {
  # proctrack/linuxproc loses processes that were re-parented to init (an orphaned torchrun
  # would keep its rendezvous port). Every job process carries SLURM_CONF of this cluster in
  # its environment; stop exactly those.
  local environ pid variables pids=()
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    [[ $pid == "$$" ]] && continue
    # stderr first: processes vanish, and kernel threads have no readable environment
    variables=$(tr '\0' '\n' 2>/dev/null <"$environ") || continue
    # job processes, and the slurmstepd of a job that outlived its slurmd
    if grep -qxF "SLURM_CONF=$CLUSTER_DIR/slurm.conf" <<<"$variables" \
      && { grep -q '^SLURM_JOB_ID=' <<<"$variables" || [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurmstepd ]]; }; then
      pids+=("$pid")
    fi
  done
  ((${#pids[@]} > 0)) || return 0
  echo "stopping leftover job processes: ${pids[*]}"
  kill "${pids[@]}" 2>/dev/null || true
  sleep 2
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

cancel_jobs() {
  # Jobs still running (a test that failed half-way) are cancelled while the daemons are up:
  # stopping slurmd under a running job leaves its slurmstepd processes behind.
  pid_alive "$CLUSTER_DIR/slurmctld.pid" || return 0
  export SLURM_CONF=$CLUSTER_DIR/slurm.conf
  [[ -n $(squeue --noheader --format=%i 2>/dev/null) ]] || return 0
  scancel --user="$(id -un)" 2>/dev/null || true
  local _
  for _ in $(seq 40); do
    [[ -z $(squeue --noheader --format=%i 2>/dev/null) ]] && return 0
    sleep 0.5
  done
}

down() {
  local pid_file
  cancel_jobs
  for pid_file in "$CLUSTER_DIR"/slurmd-*.pid "$CLUSTER_DIR/slurmctld.pid"; do
    [[ -e $pid_file ]] && stop_pid_file "$pid_file"
  done
  stop_leftover_job_processes
  stop_pid_file "$CLUSTER_DIR/munged.pid"
  remove_host_names
}

case ${1:-} in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down   (settings: CLUSTER_DIR NODES GPUS_PER_NODE SLURMCTLD_PORT SLURMD_PORT)" >&2; exit 2 ;;
esac
