#!/bin/bash
# Step 2 on a Slurm cluster: one GPU, one process, no torchrun.
#
#   sbatch slurm/singlegpu.sh                              # from the repository root: the demo
#   TOTAL_BATCH_SIZE=64 BATCH_SIZE_PER_DEVICE=2 sbatch slurm/singlegpu.sh --learning_rate 2e-5
#
# Arguments after the script name go to 02_singlegpu/train.py (--help lists them).
#
#SBATCH --job-name=singlegpu
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
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

# One GPU: the whole total batch goes through it by gradient accumulation, TOTAL_BATCH_SIZE /
# BATCH_SIZE_PER_DEVICE steps, which the training script works out.
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-0}
((SLURM_NNODES == 1 && GPUS_PER_NODE >= 1)) || { echo "error: step 2 uses one GPU on one node, this job has" \
  "$SLURM_NNODES node(s) × $GPUS_PER_NODE GPU(s): use slurm/ddp.sh or slurm/fsdp.sh" >&2; exit 2; }
if ((GPUS_PER_NODE > 1)); then  # the site's request is a whole node's GPUs; the one process takes cuda:0
  echo "step 2 uses the first of this job's $GPUS_PER_NODE GPUs (sbatch --gpus-per-node=1, or --gres=gpu:1, holds one)"
  GPUS_PER_NODE=1
fi
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

# shellcheck source=slurm/preemption.sh
source slurm/preemption.sh  # the USR2 and TERM traps, USR2_IGNORED, wait_for_training

# A plain python process on the one GPU. It ignores USR2 until the training has installed its handler.
srun --kill-on-bad-exit=1 --nodes=1 --ntasks=1 "${USR2_IGNORED[@]}" \
  python 02_singlegpu/train.py --model "$MODEL" --data_dir "$DATA_DIR" --output_dir "$OUTPUT_DIR" \
  --total_batch_size "$TOTAL_BATCH_SIZE" --batch_size_per_device "$BATCH_SIZE_PER_DEVICE" "$@" &
wait_for_training $!
