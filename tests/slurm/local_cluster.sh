#!/usr/bin/env bash
# A throw-away Slurm cluster on this one machine, for the tests and for trying the kit's
# templates: 2 nodes (two slurmd, Debian's slurmd is built with MULTIPLE_SLURMD), 2 fake GPUs
# each (character devices as GRES), and real accounting: slurmdbd with its own MariaDB, whose
# data lives in CLUSTER_DIR/mysql, so `sacct` is the real one. Two partitions make real
# preemptions possible: `debug` (the default) and `urgent`, whose jobs preempt debug's (requeued,
# after SIGTERM and a grace time of PREEMPT_GRACE_TIME seconds). A third, `gpu`, not the default,
# is the one a site file names (tests/test_slurm.py: a site shaped unlike the templates).
#
#   tests/slurm/local_cluster.sh up      # installs the Debian packages if missing (root)
#   . /tmp/kit-slurm/env.sh              # SLURM_CONF
#   tests/slurm/local_cluster.sh down    # stops exactly what `up` started, by PID
#
# Settings (environment): CLUSTER_DIR (default /tmp/kit-slurm), NODES (2), GPUS_PER_NODE (2),
# SLURMCTLD_PORT (6817), SLURMDBD_PORT (6819), SLURMD_PORT (6818; node i listens on
# SLURMD_PORT+i-1), PREEMPT_GRACE_TIME (60), NODE_MEMORY_MB (4000).
# Everything runs as root without systemd: munged, mariadbd, slurmdbd, slurmctld, one slurmd
# per node, each started here and stopped by `down` by its PID. A failed `up` stops what it had
# started. Exit status 3 means "cannot run here" (not root, packages cannot be installed): the
# tests skip on it; any other failure is an error.
set -euo pipefail

CLUSTER_DIR=${CLUSTER_DIR:-/tmp/kit-slurm}
NODES=${NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
SLURMCTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
SLURMDBD_PORT=${SLURMDBD_PORT:-6819}
PREEMPT_GRACE_TIME=${PREEMPT_GRACE_TIME:-60}
NODE_MEMORY_MB=${NODE_MEMORY_MB:-4000}
DB_DIR=$CLUSTER_DIR/mysql
DB_SOCKET=$DB_DIR/mysqld.sock
# Small and quiet: a throw-away database of a few test jobs. slurmdbd logs that it would like a
# larger buffer pool and redo log ("Database settings not recommended values"); that is for sites.
DB_OPTIONS=(--no-defaults --user=root "--datadir=$DB_DIR/data" --innodb-buffer-pool-size=32M
            --innodb-log-file-size=8M --innodb-lock-wait-timeout=900 --max-connections=50)
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
  command -v slurmdbd >/dev/null || missing+=(slurmdbd)
  # The server alone (mariadbd and its system tables' SQL): 8 packages with slurmdbd, where
  # mariadb-server would bring 20 (perl, galera, rsync, ...) that a throw-away database does not need.
  command -v mariadbd >/dev/null || missing+=(mariadb-server-core)
  ((${#missing[@]} == 0)) && return 0
  echo "installing ${missing[*]} (apt-get) ..."
  export DEBIAN_FRONTEND=noninteractive
  # The postinst scripts try to start the services; without systemd that is refused, harmlessly.
  # flock: one apt-get at a time (another test worker may be installing shellcheck; see slurm_cluster.py)
  flock "${TMPDIR:-/tmp}/kit-tests-apt.lock" \
    bash -c 'apt-get update -q && apt-get install -y -q --no-install-recommends "$@"' apt "${missing[@]}" \
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

start_database() {
  # A fresh MariaDB in CLUSTER_DIR/mysql (not /var/lib/mysql): its system tables, and the empty
  # database slurmdbd fills. `mariadbd --bootstrap` does what mariadb-install-db does, less the
  # help tables and the sys schema (5 s and 90 MB less), and needs no client package. No network:
  # slurmdbd connects as root through the socket, in a directory only root can enter.
  rm -rf "$DB_DIR"
  mkdir -p "$DB_DIR/data"
  chmod 700 "$DB_DIR"
  ((${#DB_SOCKET} < 108)) || fail "CLUSTER_DIR is too long for a Unix socket path: $DB_SOCKET"
  {
    printf '%s\n' "CREATE DATABASE IF NOT EXISTS mysql;" "USE mysql;" "SET @auth_root_socket=NULL;"
    cat /usr/share/mysql/mysql_system_tables.sql /usr/share/mysql/mysql_system_tables_data.sql
    printf '%s\n' "CREATE DATABASE slurm_acct_db;"
  } | mariadbd "${DB_OPTIONS[@]}" --bootstrap --log-warnings=0 "--log-error=$CLUSTER_DIR/log/mariadb-bootstrap.log" \
    >/dev/null 2>&1 || fail "could not create the accounting database (see $CLUSTER_DIR/log/mariadb-bootstrap.log)"
  # mariadbd stays in the foreground: started in the background, with no terminal or pipe of the
  # caller's left open, and its PID recorded at once.
  mariadbd "${DB_OPTIONS[@]}" --skip-networking "--socket=$DB_SOCKET" "--pid-file=$DB_DIR/mariadbd.pid" \
    "--log-error=$CLUSTER_DIR/log/mariadbd.log" </dev/null >/dev/null 2>&1 &
  echo $! >"$CLUSTER_DIR/mariadbd.pid"
  local _
  for _ in $(seq 120); do
    [[ -S $DB_SOCKET ]] && return 0
    pid_alive "$CLUSTER_DIR/mariadbd.pid" || break
    sleep 0.25
  done
  fail "MariaDB did not start (see $CLUSTER_DIR/log/mariadbd.log)"
}

start_slurmdbd() {
  # slurmdbd has no option for its configuration file: it reads slurmdbd.conf next to SLURM_CONF.
  # It must be private (mode 600), or slurmdbd refuses it.
  (umask 077 && cat >"$CLUSTER_DIR/slurmdbd.conf" <<DBD
# Accounting daemon of the test cluster (tests/slurm/local_cluster.sh)
AuthType=auth/munge
DbdHost=localhost
DbdPort=$SLURMDBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
PidFile=$CLUSTER_DIR/slurmdbd.pid
LogFile=$CLUSTER_DIR/log/slurmdbd.log
DebugLevel=info
DBD
  )
  # The client library finds the socket through MYSQL_UNIX_PORT (slurmdbd.conf has no setting for it).
  MYSQL_UNIX_PORT=$DB_SOCKET slurmdbd
  # Register the cluster before slurmctld starts (it would also do so itself, a moment later):
  # `sacct` shows a job from its submission on. The first success also says slurmdbd is serving.
  local deadline=$((SECONDS + 30))
  while ((SECONDS < deadline)); do
    timeout 5 sacctmgr --immediate add cluster kit >/dev/null 2>&1 && return 0
    # slurmdbd forks into the background and writes its PID file; gone again means it has failed
    [[ -s $CLUSTER_DIR/slurmdbd.pid ]] && ! pid_alive "$CLUSTER_DIR/slurmdbd.pid" && break
    sleep 0.25
  done
  fail "slurmdbd did not start (see $CLUSTER_DIR/log/slurmdbd.log)"
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
  # Small nodes, shaped unlike the templates' usual GPU node: NODE_MEMORY_MB each (default 4 GB,
  # at most three quarters of the machine's memory divided by the node count); only scheduling
  # uses it (no cgroups enforce it).
  mem_mb=$(($(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) * 3 / 4 / NODES))
  mem_mb=$((mem_mb < NODE_MEMORY_MB ? mem_mb : NODE_MEMORY_MB))
  for node in $(node_names); do
    node_lines+="NodeName=$node NodeHostname=localhost NodeAddr=127.0.0.1 Port=$port CPUs=$cpus"
    node_lines+=" RealMemory=$mem_mb Gres=gpu:$GPUS_PER_NODE State=UNKNOWN"$'\n'
    port=$((port + 1))
  done
  cat >"$CLUSTER_DIR/slurm.conf" <<CONF
# Throw-away test cluster (tests/slurm/local_cluster.sh): one machine, root daemons,
# no systemd, no cgroups; accounting in slurmdbd (slurmdbd.conf, its MariaDB in mysql/).
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
# Accounting: job records in slurmdbd (sacct), with the GPUs and the tasks' memory and CPU use.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$SLURMDBD_PORT
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
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
# Finished jobs stay visible to squeue for 10 minutes (the tests read their states there).
MinJobAge=600
KillWait=10
Waittime=0
# Preemption as most sites do it: a job of a higher partition that needs the nodes preempts the
# jobs of a lower one. At once, SIGTERM to the processes of their steps (not to the batch shell;
# no user signal, as without preempt_send_user_signal); GraceTime seconds later, SIGTERM to all
# of the job, which is requeued, and SIGKILL after KillWait. A job that ends within its grace
# time is not requeued by Slurm (it is COMPLETED or FAILED): it has to requeue itself.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
${node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$PREEMPT_GRACE_TIME
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
PartitionName=gpu Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$PREEMPT_GRACE_TIME
CONF
}

write_environment() {
  cat >"$CLUSTER_DIR/env.sh" <<ENV
# Source this to use the local test cluster: . $CLUSTER_DIR/env.sh
export SLURM_CONF=$CLUSTER_DIR/slurm.conf
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
  ((EUID == 0)) || cannot_run "needs root (daemons, fake GPU devices, /etc/hosts)"
  if pid_alive "$CLUSTER_DIR/slurmctld.pid"; then
    fail "a cluster is already running in $CLUSTER_DIR: run '$0 down' first"
  fi
  rm -rf "$CLUSTER_DIR/log"   # a fresh cluster: fresh logs (the daemons append)
  mkdir -p "$CLUSTER_DIR/log"
  # From here on, a failure stops whatever had been started (and keeps the exit status).
  trap 'status=$?; if ((status != 0)); then set +e; echo "cleaning up the half-started cluster" >&2; down >&2; fi' EXIT
  install_packages
  rm -rf "$CLUSTER_DIR/state" "$CLUSTER_DIR"/spool-*   # a fresh cluster: job ids start at 1
  mkdir -p "$CLUSTER_DIR/state"
  start_munge
  make_fake_gpus
  write_config
  write_environment
  add_host_names
  export SLURM_CONF=$CLUSTER_DIR/slurm.conf
  start_database
  start_slurmdbd
  # Both daemons fork into the background and write the PID files named in slurm.conf.
  slurmctld -f "$SLURM_CONF"
  local node
  for node in $(node_names); do slurmd -f "$SLURM_CONF" -N "$node"; done
  wait_until_idle
  trap - EXIT
  sinfo --Node --format="%N %P %T %c %m %G"
  echo "Slurm is up: . $CLUSTER_DIR/env.sh"
}

stop_daemons() {
  # NAME:PID_FILE ...: stop, all at once, the processes the files name if each is still NAME (a
  # PID can be reused); SIGKILL for any still there after 10 s.
  local entry name pid_file pid pids=() _
  for entry in "$@"; do
    name=${entry%%:*}
    pid_file=${entry#*:}
    [[ -s $pid_file ]] || { rm -f "$pid_file"; continue; }
    pid=$(cat "$pid_file")
    if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] && kill "$pid" 2>/dev/null; then
      pids+=("$pid")
      echo "stopping $(basename "$pid_file" .pid) ($pid)"
    fi
    rm -f "$pid_file"
  done
  ((${#pids[@]} > 0)) || return 0
  for _ in $(seq 100); do
    kill -0 "${pids[@]}" 2>/dev/null || return 0   # true while any of them is alive
    sleep 0.1
  done
  echo "still running after 10 s, killed: ${pids[*]}"
  kill -KILL "${pids[@]}" 2>/dev/null || true
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
  local pid_file daemons=()
  cancel_jobs
  for pid_file in "$CLUSTER_DIR"/slurmd-*.pid; do
    [[ -e $pid_file ]] && daemons+=("slurmd:$pid_file")
  done
  # All at once (3 s instead of 6 one after the other): `up` throws the state and the accounting
  # database away, so nothing needs to reach slurmdbd or the disk in order.
  stop_daemons "${daemons[@]}" "slurmctld:$CLUSTER_DIR/slurmctld.pid" "slurmdbd:$CLUSTER_DIR/slurmdbd.pid" \
    "mariadbd:$CLUSTER_DIR/mariadbd.pid" "munged:$CLUSTER_DIR/munged.pid"
  stop_leftover_job_processes
  remove_host_names
}

case ${1:-} in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down   (settings: CLUSTER_DIR NODES GPUS_PER_NODE SLURMCTLD_PORT SLURMDBD_PORT" \
       "SLURMD_PORT PREEMPT_GRACE_TIME)" >&2; exit 2 ;;
esac
