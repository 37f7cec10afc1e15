#!/bin/bash
# The GPU check (benchmark/gpu_check.py) as a Slurm job, on one node with all its GPUs. A site runs
# it once before the workshop: every step on the GPUs, preemption, the CodeLlama-7b shape's speed and
# memory (random weights: nothing is downloaded but the demo), QLoRA against LoRA. The job's output
# ends with the table and a verdict line; the job fails unless the node is ready.
#
#   python 01_download/download.py --demo --out demo       # once, on the login node
#   sbatch slurm/gpu_check.sh                              # from the repository root
#   sbatch --gpus-per-node=4 slurm/gpu_check.sh            # nodes with 4 GPUs
#
# Arguments after the script name go to benchmark/gpu_check.py (--help lists them). The table is
# also written to WORK_DIR/gpu_check.md (default runs/gpu_check-JOBID).
#
# ---- site setup: edit this block for your cluster ------------------------------------------
#SBATCH --job-name=gpu_check
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8          # all the GPUs of one node
#SBATCH --exclusive                # the whole node: full fine-tuning may offload to its host RAM
#SBATCH --mem=0                    # all of the node's memory
#SBATCH --time=00:15:00            # the check stops itself after 8 minutes (--time_limit)
##SBATCH --partition=gpu           # remove one '#' to use
##SBATCH --account=my_project
# Software: by default the job runs in the environment of the shell that ran sbatch (sbatch
# passes it on). To set it up here instead, uncomment and adapt:
# module load cuda/12.4
# source "$HOME/venvs/chess/bin/activate"      # or: conda activate chess-fsdp
# ---- end of site setup -----------------------------------------------------------------------

set -euo pipefail
[[ -n ${SLURM_JOB_ID:-} ]] || { echo "error: submit this script with sbatch (it needs a Slurm allocation)" >&2; exit 2; }
cd "$SLURM_SUBMIT_DIR"  # sbatch runs a copy of this file: the kit is where sbatch was run

WORK_DIR=${WORK_DIR:-runs/gpu_check-$SLURM_JOB_ID}
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-0}
((SLURM_NNODES == 1 && GPUS_PER_NODE > 0)) || { echo "error: the GPU check runs on one node with its GPUs, this" \
  "job has $SLURM_NNODES node(s) × $GPUS_PER_NODE GPU(s): keep '#SBATCH --nodes=1' and '--gpus-per-node'" >&2; exit 2; }
(cd / && python -c 'import common') 2>/dev/null || { echo "error: the kit is not installed in the job's" \
  "Python: activate its environment before sbatch (or in the site-setup block)" >&2; exit 2; }
echo "job $SLURM_JOB_ID: GPU check on $SLURM_JOB_NODELIST, $GPUS_PER_NODE GPU(s); table in $WORK_DIR"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # compute nodes are offline: everything is on disk (01_download)
# Memory freed in one size is reused for another (less fragmentation: fewer out-of-memory errors with
# free memory left, e.g. with FSDP's changing gather sizes); a value set before sbatch wins.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# On the node itself, in the batch step, which has all of the node's GPUs and CPUs: the check
# starts each run's processes itself (python, torchrun). Its exit status is the job's.
python benchmark/gpu_check.py --work_dir "$WORK_DIR" "$@"
