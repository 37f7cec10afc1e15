#!/bin/bash
# Step 2 on a Slurm cluster: one GPU, one process, no torchrun.
#
#   sbatch slurm/singlegpu.sh                              # from the repository root
#   TOTAL_BATCH_SIZE=64 BATCH_SIZE_PER_DEVICE=2 sbatch slurm/singlegpu.sh --learning_rate 2e-5
#
# Environment: MODEL DATA_DIR OUTPUT_DIR TOTAL_BATCH_SIZE BATCH_SIZE_PER_DEVICE (defaults in
# slurm/launch_lib.sh); arguments after the script name go to 02_singlegpu/train.py.
#
# ---- site setup: edit this block for your cluster ------------------------------------------
#SBATCH --job-name=singlegpu
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=02:00:00
##SBATCH --partition=gpu           # remove one '#' to use
##SBATCH --account=my_project
# Software: by default the job runs in the environment of the shell that ran sbatch (sbatch
# passes it on). To set it up here instead, uncomment and adapt:
# module load cuda/12.4
# source "$HOME/venvs/chess/bin/activate"      # or: conda activate chess-fsdp
# export HF_HOME=/scratch/$USER/huggingface    # the cache that 01_download filled
# ---- end of site setup -----------------------------------------------------------------------
# Preemption and time limits (slurm/README.md): 300 s before the time limit Slurm sends USR2 to
# this script (B:), which forwards it to the training; that saves a checkpoint and stops, and
# the script requeues the job, which continues from the checkpoint. One log for all attempts.
#SBATCH --signal=B:USR2@300
#SBATCH --requeue
#SBATCH --open-mode=append

set -euo pipefail
# sbatch runs a copy of this file from its spool directory, so the kit is found from the
# directory sbatch was run in.
# shellcheck source=slurm/launch_lib.sh
source "${SLURM_SUBMIT_DIR:-.}/slurm/launch_lib.sh" \
  || { echo "error: run sbatch from the repository root (no slurm/launch_lib.sh in ${SLURM_SUBMIT_DIR:-.})" >&2; exit 2; }
trap forward_preemption_warning USR2
setup_training_job "$@"
((NODES == 1 && GPUS_PER_NODE == 1)) \
  || die "step 2 uses one GPU on one node, this job has $NODES node(s) × $GPUS_PER_NODE GPU(s): use slurm/ddp.sh or slurm/fsdp.sh"

# A plain python process on the one GPU; the whole total batch goes through it by gradient
# accumulation. It ignores USR2 until the training has installed its handler.
srun --kill-on-bad-exit=1 --nodes=1 --ntasks=1 \
  "${USR2_IGNORED[@]}" python 02_singlegpu/train.py \
  --model "$MODEL" --data_dir "$DATA_DIR" --output_dir "$OUTPUT_DIR" --device "$DEVICE" \
  --batch_size_per_device "$BATCH_SIZE_PER_DEVICE" \
  --gradient_accumulation_steps "$GRADIENT_ACCUMULATION_STEPS" \
  "${TRAINING_ARGS[@]}" &
wait_for_step $!
