#!/bin/bash
# Step 3 on a Slurm cluster: DDP, a full copy of the model on every GPU of every node.
#
#   sbatch slurm/ddp.sh                                   # from the repository root
#   TOTAL_BATCH_SIZE=64 BATCH_SIZE_PER_DEVICE=2 sbatch slurm/ddp.sh --learning_rate 2e-5
#   sbatch --nodes=1 --gpus-per-node=2 slurm/ddp.sh      # sbatch options beat the header
#
# Environment: MODEL DATA_DIR OUTPUT_DIR TOTAL_BATCH_SIZE BATCH_SIZE_PER_DEVICE (defaults in
# slurm/launch_lib.sh); arguments after the script name go to 03_ddp/train.py.
#
# ---- site setup: edit this block for your cluster ------------------------------------------
#SBATCH --job-name=ddp
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1        # one torchrun per node; it starts one process per GPU
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32         # for the whole node: torchrun and all its processes
#SBATCH --mem=256G                 # per node
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

# One torchrun per node (srun starts them); each starts one process per GPU. The processes of
# all nodes meet at the rendezvous on the first node and number themselves 0..N-1; a failure
# anywhere ends the whole step (--kill-on-bad-exit). torchrun ignores USR2 (its processes handle it).
srun --kill-on-bad-exit=1 --nodes="$NODES" --ntasks-per-node=1 \
  "${USR2_IGNORED[@]}" torchrun --nnodes="$NODES" --nproc-per-node="$GPUS_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" \
  03_ddp/train.py \
  --model "$MODEL" --data_dir "$DATA_DIR" --output_dir "$OUTPUT_DIR" --device "$DEVICE" \
  --batch_size_per_device "$BATCH_SIZE_PER_DEVICE" \
  --gradient_accumulation_steps "$GRADIENT_ACCUMULATION_STEPS" \
  "${TRAINING_ARGS[@]}" &
wait_for_step $!
