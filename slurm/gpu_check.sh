#!/bin/bash
# The GPU check (benchmark/gpu_check.py) as a Slurm job, on one node with all its GPUs. A site runs
# it once before the workshop: every step on the GPUs, preemption, the CodeLlama-7b shape's speed and
# memory (random weights: nothing is downloaded but the demo), QLoRA against LoRA. The job's output
# ends with the table and a verdict line; the job fails unless the node is ready.
#
#   python 01_download/download.py --demo --out demo       # once, on the login node
#   sbatch slurm/gpu_check.sh                              # from the repository root
#   sbatch --gpus-per-node=4 slurm/gpu_check.sh            # 4 GPUs, whatever the site's nodes have
#
# Arguments after the script name go to benchmark/gpu_check.py (--help lists them). The table is
# also written to WORK_DIR/gpu_check.md (default runs/gpu_check-JOBID).
#
#SBATCH --job-name=gpu_check
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:15:00            # the check stops itself after 8 minutes (--time_limit 480), then reports
# The site's settings (slurm/site.sh, loaded by `source slurm/use_site.sh` in the submitting shell)
# give the partition, account, QoS, reservation, all the GPUs of a node, and their share of the
# node's CPUs and memory: the whole node, where full fine-tuning may offload to its host RAM.

set -euo pipefail
[[ -n ${SLURM_JOB_ID:-} ]] || { echo "error: submit this script with sbatch (it needs a Slurm allocation)" >&2; exit 2; }
cd "$SLURM_SUBMIT_DIR"  # sbatch runs a copy of this file: the kit is where sbatch was run
# shellcheck source=slurm/use_site.sh
source slurm/use_site.sh  # the site's modules, environment and HF_HOME (slurm/site.sh), if any

WORK_DIR=${WORK_DIR:-runs/gpu_check-$SLURM_JOB_ID}
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-0}
((SLURM_NNODES == 1 && GPUS_PER_NODE > 0)) || { echo "error: the GPU check runs on one node with its GPUs, this" \
  "job has $SLURM_NNODES node(s) × $GPUS_PER_NODE GPU(s): keep '#SBATCH --nodes=1' and set the site's" \
  "SITE_GPUS_PER_NODE (slurm/site.example.sh), or sbatch --gpus-per-node=N" >&2; exit 2; }
(cd / && python -c 'import common') 2>/dev/null || { echo "error: the kit is not installed in the job's" \
  "Python: activate its environment before sbatch (or in site_environment of slurm/site.sh)" >&2; exit 2; }
echo "job $SLURM_JOB_ID: GPU check on $SLURM_JOB_NODELIST, $GPUS_PER_NODE GPU(s); table in $WORK_DIR"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # compute nodes are offline: everything is on disk (01_download)
# Memory freed in one size is reused for another (less fragmentation: fewer out-of-memory errors with
# free memory left, e.g. with FSDP's changing gather sizes); a value set before sbatch wins.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# On the node itself, in the batch step, which has all of the node's GPUs and CPUs: the check
# starts each run's processes itself (python, torchrun). Its exit status is the job's.
python benchmark/gpu_check.py --work_dir "$WORK_DIR" "$@"
