# Loads the site's settings (slurm/site.sh, or the file KIT_SITE names; slurm/site.example.sh shows
# them) into the shell that submits: `source slurm/use_site.sh`, once in ~/.bashrc. sbatch reads them
# as its SBATCH_* input variables, which beat a template's #SBATCH lines, while sbatch's command line
# beats them; an SBATCH_* variable already set is kept. Inside a job (the templates source this file
# too) it runs the site's site_environment: modules, the environment, HF_HOME.
# shellcheck shell=bash
site_dir=${BASH_SOURCE[0]%/*}  # this file's folder (no dirname: a bare PATH may lack it)
[[ $site_dir != "${BASH_SOURCE[0]}" ]] || site_dir=.
KIT_DIR=$(cd "$site_dir/.." && pwd)
unset site_dir
KIT_SITE=${KIT_SITE:-$KIT_DIR/slurm/site.sh}
if [[ -f $KIT_SITE ]]; then
  # shellcheck source=slurm/site.example.sh
  source "$KIT_SITE"
  SITE_GPU_MEMORY_GIB=${SITE_GPU_MEMORY_GIB:-80}
  export KIT_DIR KIT_SITE SITE_GPUS_PER_NODE SITE_CPUS_PER_NODE SITE_MEM_GB_PER_NODE SITE_GPU_REQUEST \
    SITE_GPU_MEMORY_GIB
  for setting in SITE_GPUS_PER_NODE SITE_CPUS_PER_NODE SITE_MEM_GB_PER_NODE; do
    [[ ${!setting:-} =~ ^[1-9][0-9]*$ ]] || { echo "error: $KIT_SITE: $setting=${!setting:-} must be a whole" \
      "number of at least 1: what one GPU node has" >&2; return 2; }
  done
  SITE_GPU_REQUEST=${SITE_GPU_REQUEST:-gpus-per-node}
  [[ $SITE_GPU_REQUEST == gres || $SITE_GPU_REQUEST == gpus-per-node ]] || { echo "error: $KIT_SITE:" \
    "SITE_GPU_REQUEST=$SITE_GPU_REQUEST must be gpus-per-node (--gpus-per-node=N) or gres (--gres=gpu:N)" >&2
    return 2; }
  # CPUs and memory follow the GPUs a job asks for: each GPU brings its share of the node.
  site_cpus_per_gpu=$((SITE_CPUS_PER_NODE / SITE_GPUS_PER_NODE))
  site_mem_mb_per_gpu=$((SITE_MEM_GB_PER_NODE * 1024 / SITE_GPUS_PER_NODE))
  if [[ $SITE_GPU_REQUEST == gres ]]; then
    export SBATCH_GRES=${SBATCH_GRES:-gpu:$SITE_GPUS_PER_NODE}
  else
    export SBATCH_GPUS_PER_NODE=${SBATCH_GPUS_PER_NODE:-$SITE_GPUS_PER_NODE}
  fi
  export SBATCH_CPUS_PER_GPU=${SBATCH_CPUS_PER_GPU:-$site_cpus_per_gpu}
  export SBATCH_MEM_PER_GPU=${SBATCH_MEM_PER_GPU:-${site_mem_mb_per_gpu}M}
  [[ -z ${SITE_PARTITION:-} ]] || export SBATCH_PARTITION=${SBATCH_PARTITION:-$SITE_PARTITION}
  [[ -z ${SITE_ACCOUNT:-} ]] || export SBATCH_ACCOUNT=${SBATCH_ACCOUNT:-$SITE_ACCOUNT}
  [[ -z ${SITE_QOS:-} ]] || export SBATCH_QOS=${SBATCH_QOS:-$SITE_QOS}
  [[ -z ${SITE_RESERVATION:-} ]] || export SBATCH_RESERVATION=${SBATCH_RESERVATION:-$SITE_RESERVATION}
  [[ -z ${SITE_CONSTRAINT:-} ]] || export SBATCH_CONSTRAINT=${SBATCH_CONSTRAINT:-$SITE_CONSTRAINT}
  [[ -z ${SITE_TIME:-} ]] || export SBATCH_TIMELIMIT=${SBATCH_TIMELIMIT:-$SITE_TIME}
  unset site_cpus_per_gpu site_mem_mb_per_gpu
  if [[ -n ${SLURM_JOB_ID:-} ]] && declare -F site_environment >/dev/null; then
    site_environment
  fi
fi
