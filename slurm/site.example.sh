# shellcheck shell=bash disable=SC2034  # (the settings are read by slurm/use_site.sh)
# The site's settings, written once (by the centre or the workshop's trainer) for every template
# and submit.py. Copy this file to slurm/site.sh (or name yours with KIT_SITE=/path/site.sh), set
# the values, and load it in the shell that submits, once in ~/.bashrc:
#
#   source /path/to/kit/slurm/use_site.sh
#
# `sbatch slurm/fsdp.sh` and `python submit.py --gpus 4` then ask for what fits these nodes. It
# works through Slurm's own SBATCH_* variables, so `sbatch --partition=...` on the command line, or
# an SBATCH_* variable you set yourself before loading it, still wins.

# Where jobs go. Empty: Slurm's default (often a partition without GPUs: name yours).
SITE_PARTITION=gpu
SITE_ACCOUNT=
SITE_QOS=
SITE_RESERVATION=          # a workshop's reservation
SITE_CONSTRAINT=           # node features, e.g. a100|h100
SITE_TIME=02:00:00         # the time limit when a job names none

# One GPU node: what a job may use of it (`scontrol show node`: CfgTRES, RealMemory less what the
# site keeps back), and how the site asks for GPUs: gpus-per-node (--gpus-per-node=N) or gres
# (--gres=gpu:N).
SITE_GPUS_PER_NODE=4
SITE_CPUS_PER_NODE=32
SITE_MEM_GB_PER_NODE=240
SITE_GPU_REQUEST=gpus-per-node
SITE_GPU_MEMORY_GIB=80     # one GPU's memory, for the plan check

# What every job runs before the kit: modules, the kit's environment, the shared Hugging Face cache
# that 01_download filled (read-only for participants is fine: jobs only read it).
site_environment() {
  # module load cuda/12.4
  source "$KIT_DIR/.venv/bin/activate"        # or: conda activate chess-fsdp
  # export HF_HOME=/scratch/shared/huggingface
}
