#!/bin/bash
# Step 5 on a Slurm cluster: LoRA adapters trained over a frozen model, sharded with FSDP as in step 4.
#
#   sbatch slurm/lora.sh                                   # from the repository root: the demo
#   MODEL=codellama/CodeLlama-7b-hf DATA_DIR=/scratch/$USER/chess/data sbatch slurm/lora.sh --gradient_checkpointing
#   MODEL=codellama/CodeLlama-7b-hf DATA_DIR=/scratch/$USER/chess/data sbatch slurm/lora.sh --qlora   # 4-bit base
#   TOTAL_BATCH_SIZE=32 BATCH_SIZE_PER_DEVICE=2 sbatch --gpus-per-node=2 slurm/lora.sh --lora_rank 8
#
# Arguments after the script name go to 05_lora/train.py (--help lists them). Before training, the
# plan check (tools/check_plan.py --step lora) stops a job that cannot fit in GPU memory, QLoRA's
# 4-bit model too: FORCE=1 skips it.
#
#SBATCH --job-name=lora
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1                  # LoRA trains few weights: one node fits CodeLlama-7b
#SBATCH --ntasks-per-node=1        # one torchrun per node; it starts one process per GPU
#SBATCH --time=01:00:00            # the site's SITE_TIME, then `sbatch --time=...`, beat it
# The site's settings (slurm/site.sh, loaded by `source slurm/use_site.sh` in the submitting shell)
# give the partition, account, QoS, reservation, the GPUs of a node, and each GPU's share of the
# node's CPUs and memory. `sbatch --gpus-per-node=2 ...` (or --gres=gpu:2) beats them.
# Preemption and time limits (slurm/preemption.sh): a warning 300 s before the time limit, a
# checkpoint, and the job requeued under the same id.
#SBATCH --signal=B:USR2@300
#SBATCH --requeue
#SBATCH --open-mode=append

set -euo pipefail
[[ -n ${SLURM_JOB_ID:-} ]] || { echo "error: submit this script with sbatch (it needs a Slurm allocation)" >&2; exit 2; }
cd "$SLURM_SUBMIT_DIR"  # sbatch runs a copy of this file: the kit is where sbatch was run
# shellcheck source=slurm/use_site.sh
source slurm/use_site.sh  # the site's modules, environment and HF_HOME (slurm/site.sh), if any

# The run. Paths are relative to the repository root; set any of these in the shell that runs sbatch.
MODEL=${MODEL:-demo/model}
DATA_DIR=${DATA_DIR:-demo/data}
OUTPUT_DIR=${OUTPUT_DIR:-runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}
TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-64}        # rows per optimiser step, the same at any GPU count
BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-4}
[[ $MODEL != demo/model || -d demo/model ]] || { echo "error: no demo/ in $PWD: build the demo model" \
  "and data on the login node first, python 01_download/download.py --demo --out demo (or set MODEL and" \
  "DATA_DIR)" >&2; exit 2; }

# The GPUs come from the allocation (`sbatch --gpus-per-node=2` beats the header). The training
# script works out the gradient accumulation, TOTAL_BATCH_SIZE / (BATCH_SIZE_PER_DEVICE × GPUs),
# and refuses a total that does not divide.
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-0}
((GPUS_PER_NODE > 0)) || { echo "error: this job has no GPUs: describe the site's" \
  "GPU nodes once in slurm/site.sh (see slurm/site.example.sh) and \`source slurm/use_site.sh\`, or sbatch --gpus-per-node=N" >&2; exit 2; }
(cd / && python -c 'import common') 2>/dev/null || { echo "error: the kit is not installed in the job's" \
  "Python: activate its environment before sbatch (or in site_environment of slurm/site.sh)" >&2; exit 2; }
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NNODES node(s) × $GPUS_PER_NODE GPU(s)" \
  "on $SLURM_JOB_NODELIST; output in $OUTPUT_DIR"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # compute nodes are offline: everything is on disk (01_download)
# Memory freed in one size is reused for another (less fragmentation: fewer out-of-memory errors with
# free memory left, e.g. with FSDP's changing gather sizes); a value set before sbatch wins.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# The node's CPUs, split among its GPUs' processes; at least 1: OpenMP refuses 0 (2 CPUs, 4 GPUs)
# with a warning, and every process then runs a thread on each of the node's cores.
CPUS_PER_GPU=$(( ${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$GPUS_PER_NODE}} / GPUS_PER_NODE ))
export OMP_NUM_THREADS=$(( CPUS_PER_GPU > 0 ? CPUS_PER_GPU : 1 ))
# srun of Slurm 22.05-23.02 does not pass the job's CPUs on: the node's, to the one task of the node
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}

# All nodes' processes meet at a rendezvous on the first node, on a port derived from the job id
# (jobs sharing a node never collide); a requeued job keeps its id, so the restart count makes a
# fresh rendezvous for each attempt.
FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=$((20000 + SLURM_JOB_ID % 20000))
echo "rendezvous $FIRST_NODE:$RDZV_PORT id $SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
# shellcheck source=slurm/preemption.sh
source slurm/preemption.sh  # the USR2 and TERM traps, USR2_IGNORED, wait_for_training

TRAINING_ARGS=(--model "$MODEL" --data_dir "$DATA_DIR" --output_dir "$OUTPUT_DIR"
  --total_batch_size "$TOTAL_BATCH_SIZE" --batch_size_per_device "$BATCH_SIZE_PER_DEVICE" "$@")

# Will it fit? The plan check runs this job's step-5 code on fake tensors, on the CPU, in seconds
# (up to a minute for 7B on 64 GPUs), and stops a job that cannot fit, saying what to change,
# before any weights load. GPU_MEMORY_GIB=40 for another GPU than this node's; FORCE=1 skips it.
# It predicts the job's time too: a warning if the time left (squeue's %L) is shorter, and a
# stop if the job would end before its first checkpoint.
# On several nodes it also chooses the sharding, unless you gave --sharding_strategy: HYBRID_SHARD
# (each node a replica, sharded over its own GPUs: the all-gathers stay on the node's NVLink) where
# it fits, else FULL_SHARD; it says which, with both peaks, and does so again after a requeue.
if [[ -z ${FORCE:-} ]] && ((${SLURM_RESTART_COUNT:-0} == 0 || SLURM_NNODES > 1)); then
  TIME_LEFT=$(squeue -h -j "$SLURM_JOB_ID" -o %L) || TIME_LEFT=""  # e.g. 59:58; none: no time check
  SHARDING=$(python tools/check_plan.py --step lora --gpus_per_node "$GPUS_PER_NODE" --nodes "$SLURM_NNODES" \
    ${GPU_MEMORY_GIB:+--gpu_memory_gib "$GPU_MEMORY_GIB"} --override "FORCE=1 sbatch" --choose_sharding \
    --time_limit "$TIME_LEFT" -- "${TRAINING_ARGS[@]}")
  [[ -z $SHARDING ]] || TRAINING_ARGS+=(--sharding_strategy "$SHARDING")
fi

# One torchrun per node (srun starts them); each starts one process per GPU. A failure anywhere
# ends the whole step (--kill-on-bad-exit). torchrun ignores USR2 (its processes handle it).
# `python -m launch.torchrun` is torchrun itself, with a user's mistake reported as one line.
srun --kill-on-bad-exit=1 --nodes="$SLURM_NNODES" --ntasks-per-node=1 "${USR2_IGNORED[@]}" \
  python -m launch.torchrun --nnodes="$SLURM_NNODES" --nproc-per-node="$GPUS_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$FIRST_NODE:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}" \
  05_lora/train.py "${TRAINING_ARGS[@]}" &
wait_for_training $!
