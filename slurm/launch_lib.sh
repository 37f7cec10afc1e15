# shellcheck shell=bash disable=SC2034  # sets variables for the scripts that source it
# What slurm/singlegpu.sh, ddp.sh and fsdp.sh share: settings, checks, the GPU count, the
# gradient accumulation and the rendezvous. Sourced by them, never run. The line that starts
# training stays in each script, because that line is the lesson of its step.
#
# A problem the user can fix ends the job with one line `error: ...` and exit status 2.

# Defaults, each overridable from the submitting shell (sbatch passes its environment on):
#   TOTAL_BATCH_SIZE=64 BATCH_SIZE_PER_DEVICE=2 sbatch slurm/fsdp.sh --learning_rate 2e-5
DEFAULT_TOTAL_BATCH_SIZE=64   # rows per optimiser step: the same in every step of the kit
DEFAULT_BATCH_SIZE_PER_DEVICE=4
DEMO_DOWNLOAD="python 01_download/download.py --demo --out demo"

die() {
  echo "error: $*" >&2
  exit 2
}

is_positive_integer() {
  [[ $1 =~ ^[1-9][0-9]*$ ]]
}

# gradient_accumulation_steps TOTAL PER_DEVICE GPUS_PER_NODE NODES
# Prints TOTAL / (PER_DEVICE × GPUS_PER_NODE × NODES), or dies when that is not a whole number.
gradient_accumulation_steps() {
  local total=$1 per_device=$2 gpus_per_node=$3 nodes=$4
  is_positive_integer "$total" || die "TOTAL_BATCH_SIZE must be a positive whole number (got '$total')"
  is_positive_integer "$per_device" || die "BATCH_SIZE_PER_DEVICE must be a positive whole number (got '$per_device')"
  is_positive_integer "$gpus_per_node" || die "GPUs per node must be a positive whole number (got '$gpus_per_node')"
  is_positive_integer "$nodes" || die "nodes must be a positive whole number (got '$nodes')"
  local rows_per_pass=$((per_device * gpus_per_node * nodes))
  if ((total % rows_per_pass != 0)); then
    die "TOTAL_BATCH_SIZE=$total is not a multiple of BATCH_SIZE_PER_DEVICE=$per_device" \
      "× $gpus_per_node GPUs per node × $nodes nodes = $rows_per_pass: change one of them"
  fi
  echo $((total / rows_per_pass))
}

# refuse_managed_arguments "$@": the script sets these itself (from the environment and the
# allocation); a second value in the pass-through arguments would silently win over it.
refuse_managed_arguments() {
  local argument name
  for argument in "$@"; do
    name=${argument%%=*}
    name=${name//-/_}
    case $name in
      __model | __data_dir | __output_dir | __batch_size_per_device)
        local variable=${name#__}
        die "set ${variable^^}=... in the environment instead of passing $argument"
        ;;
      __gradient_accumulation_steps)
        die "the script computes $argument from TOTAL_BATCH_SIZE and the allocation: set TOTAL_BATCH_SIZE instead"
        ;;
      __device)
        die "the script picks --device from the allocation; do not pass $argument"
        ;;
    esac
  done
}

# The model is a local directory, or a Hugging Face id that 01_download put into the cache.
require_model() {
  if [[ -d $MODEL ]]; then
    [[ -f $MODEL/config.json ]] \
      || die "$MODEL has no config.json: re-run the download step on the login node ($DEMO_DOWNLOAD for the demo)"
    return 0
  fi
  local hub_cache=${HF_HUB_CACHE:-${HF_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/huggingface}/hub}
  local snapshot
  for snapshot in "$hub_cache/models--${MODEL//\//--}"/snapshots/*/config.json; do
    [[ -f $snapshot ]] && return 0
  done
  if [[ $MODEL == "$PWD/demo/model" ]]; then
    die "no demo model in $MODEL: run \`$DEMO_DOWNLOAD\` on the login node first"
  fi
  die "model $MODEL is neither a directory nor in the Hugging Face cache ($hub_cache), and compute" \
    "nodes are offline: run \`python 01_download/download.py --model $MODEL --out DIR\` on the login" \
    "node first, with the same HF_HOME"
}

require_data() {
  local file
  for file in train.jsonl validation.jsonl; do
    if [[ ! -f $DATA_DIR/$file ]]; then
      if [[ $DATA_DIR == "$PWD/demo/data" ]]; then
        die "no $file in $DATA_DIR: run \`$DEMO_DOWNLOAD\` on the login node first"
      fi
      die "no $file in $DATA_DIR: run \`python 01_download/download.py --out $(dirname "$DATA_DIR")\`" \
        "on the login node first (or set DATA_DIR)"
    fi
  done
}

# Sets DEVICE (cuda|cpu). The test cluster's GPUs are fake (Slurm hands out /dev/null-like
# devices): CUDA_VISIBLE_DEVICES is set but torch sees none. Then run one CPU process per
# allocated GPU with gloo, so that the very same script is what the tests run.
# The batch shell runs on the first node; the nodes of one job are assumed to be alike.
pick_device() {
  local usable
  usable=$(python -c 'import torch; print(torch.cuda.device_count())') \
    || die "python with torch is not available in the job: activate the environment in the site-setup block"
  if ((usable >= GPUS_PER_NODE)); then
    DEVICE=cuda
  elif ((usable == 0)); then
    DEVICE=cpu
    echo "note: the GPUs that Slurm allocated (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}) are not" \
      "usable by CUDA here: running one CPU process per allocated GPU instead (--device cpu, gloo)"
  else
    die "Slurm allocated $GPUS_PER_NODE GPUs per node but CUDA sees only $usable (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-})"
  fi
}

# training_arguments "$@": sets TRAINING_ARGS, the arguments after the script name, for the
# training script. A requeued job (same job id, SLURM_RESTART_COUNT > 0) continues its run from
# the newest checkpoint: --resume, and an --overwrite meant for the first start is dropped (it
# would delete that checkpoint).
training_arguments() {
  TRAINING_ARGS=("$@")
  ((${SLURM_RESTART_COUNT:-0} > 0)) || return 0
  local argument
  TRAINING_ARGS=()
  for argument in "$@"; do
    [[ $argument == --overwrite ]] || TRAINING_ARGS+=("$argument")
  done
  TRAINING_ARGS+=(--resume)
}

# setup_training_job "$@": everything before the launch line. Sets MODEL DATA_DIR OUTPUT_DIR
# BATCH_SIZE_PER_DEVICE NODES GPUS_PER_NODE DEVICE GRADIENT_ACCUMULATION_STEPS
# RDZV_ENDPOINT RDZV_ID TRAINING_ARGS.
setup_training_job() {
  [[ -n ${SLURM_JOB_ID:-} ]] || die "submit this script with sbatch (it needs a Slurm allocation)"
  cd "$SLURM_SUBMIT_DIR" || die "cannot enter the submit directory $SLURM_SUBMIT_DIR"
  refuse_managed_arguments "$@"

  # Paths are taken relative to the directory sbatch was run from: the repository root.
  MODEL=${MODEL:-$PWD/demo/model}
  DATA_DIR=${DATA_DIR:-$PWD/demo/data}
  OUTPUT_DIR=${OUTPUT_DIR:-$PWD/runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}
  TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-$DEFAULT_TOTAL_BATCH_SIZE}
  BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-$DEFAULT_BATCH_SIZE_PER_DEVICE}

  # Compute nodes have no internet: everything must come from disk (01_download, login node).
  # Read by huggingface_hub/datasets at import time, so exported before python starts.
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
  require_model
  require_data

  # The allocation, not the #SBATCH header: `sbatch --gpus-per-node=2 --nodes=1 ...` wins over it.
  NODES=$SLURM_NNODES
  GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-0}
  ((GPUS_PER_NODE > 0)) || die "this job has no GPUs: keep '#SBATCH --gpus-per-node=N' (or pass --gpus-per-node=N to sbatch)"
  pick_device
  GRADIENT_ACCUMULATION_STEPS=$(gradient_accumulation_steps \
    "$TOTAL_BATCH_SIZE" "$BATCH_SIZE_PER_DEVICE" "$GPUS_PER_NODE" "$NODES")

  # c10d rendezvous on the first node. The port is derived from the job id, so jobs sharing a
  # node cannot collide; the id changes after a requeue (same SLURM_JOB_ID, next restart count),
  # so a new attempt never joins the stale rendezvous of the previous one.
  local first_node
  first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  RDZV_ENDPOINT=$first_node:$((20000 + SLURM_JOB_ID % 20000))
  RDZV_ID=$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}

  # Split the task's CPUs among the processes of a node (torchrun would set 1 and warn).
  local cpus=${SLURM_CPUS_PER_TASK:-1}
  export OMP_NUM_THREADS=$((cpus / GPUS_PER_NODE > 0 ? cpus / GPUS_PER_NODE : 1))
  # srun of Slurm 22.05 to 23.02 does not take --cpus-per-task from the batch job; without this,
  # CPU binding could put each node's torchrun and all its workers on one core.
  export SRUN_CPUS_PER_TASK=$cpus

  training_arguments "$@"
  FINAL_MODEL_BEFORE=$(final_model_time)

  echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $NODES node(s) × $GPUS_PER_NODE GPU(s) on $SLURM_JOB_NODELIST;" \
    "total batch $TOTAL_BATCH_SIZE = $BATCH_SIZE_PER_DEVICE per device × $((GPUS_PER_NODE * NODES)) devices ×" \
    "$GRADIENT_ACCUMULATION_STEPS accumulation steps; rendezvous $RDZV_ENDPOINT id $RDZV_ID; output in $OUTPUT_DIR"
}

# ---- preemption and time limits ------------------------------------------------------------
# `#SBATCH --signal=B:USR2@300` makes Slurm send USR2 to the batch shell, and only to it, 300 s
# before the time limit (and at a preemption, where the site enables that). The shell forwards
# it to every training process on every node; they finish the optimiser step they are in, save
# a checkpoint and exit 0; the shell then requeues the job, which continues from the checkpoint.
# USR2 is the signal submitit uses too: one signal for the whole kit.

PREEMPTION_WARNED=0

# The trap for USR2 in the batch shell (the templates install it first thing).
forward_preemption_warning() {
  PREEMPTION_WARNED=1
  echo "$(date +%T) preemption warning (USR2): forwarding it to the training processes; the job" \
    "will be requeued once they have saved a checkpoint"
  # No --batch/--full: every process of the job's steps on every node, not this shell.
  scancel --signal=USR2 "$SLURM_JOB_ID" \
    || echo "warning: could not forward USR2 to the training (not started yet?)" >&2
}

# Runs the command after it with USR2 ignored: torchrun's agent would die of the forwarded
# warning (the default action) and take the training down with it. An ignored signal stays
# ignored across exec; the training processes install their own handler.
# shellcheck disable=SC2016  # "$@" is expanded by that inner bash, not here
USR2_IGNORED=(bash -c 'trap "" USR2 && exec "$@"' usr2-ignored)

# The modification time of the final model, or "none": tells whether this attempt finished.
final_model_time() {
  stat --format=%Y "$OUTPUT_DIR/final/model.safetensors" 2>/dev/null || echo none
}

# wait_for_step PID: wait for the srun started in the background and return its exit status;
# after a preemption warning, requeue the job if the training stopped early with a checkpoint.
# srun runs in the background because bash runs a signal trap only between commands: a
# foreground srun would hold back the trap until training had ended. `wait` also returns when
# a trapped signal arrives, hence the loop.
wait_for_step() {
  local step_pid=$1 status=0
  while :; do
    wait "$step_pid" && status=0 || status=$?
    kill -0 "$step_pid" 2>/dev/null || break
  done
  ((PREEMPTION_WARNED)) || return "$status"
  if ((status != 0)); then
    echo "the training failed (exit status $status) after the preemption warning: not requeued." \
      "To continue from its last complete checkpoint, submit again with OUTPUT_DIR=$OUTPUT_DIR and --resume" >&2
  elif [[ $(final_model_time) != "$FINAL_MODEL_BEFORE" ]]; then
    echo "the training finished before it could stop early: nothing to requeue"
  else
    echo "$(date +%T) the training saved a checkpoint and stopped: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$status"
}
