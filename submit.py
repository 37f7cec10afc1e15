"""Submit a training step to Slurm from Python (submitit), instead of `sbatch slurm/<step>.sh`.

    python submit.py --step fsdp --gpus 4 --nodes 2
    python submit.py --step ddp --gpus 2 --total_batch_size 32 -- --learning_rate 2e-5 --max_steps 200
    python submit.py --step fsdp --gpus 4 --nodes 2 --dry-run     # print the plan and the sbatch script
    python submit.py --step fsdp --gpus 8 --model codellama/CodeLlama-7b-hf -- --gradient_checkpointing
    python submit.py --step tp --tp_size 4 --gpus 4 --nodes 2     # step 6: tensor parallel in each node

One Slurm task per node runs torchrun, which starts one process per GPU; the training script
works out the gradient accumulation that keeps the total batch the same at any GPU count, and
submit.py prints it first, with the same function. Arguments after `--` go to the training
script; its own parser checks them before anything is queued. For the FSDP steps (fsdp, lora, tp) the
plan check (tools/check_plan.py) then runs the job's code on fake tensors, in seconds on the
login node's CPU, and a job that cannot fit in --gpu_memory_gib is refused with what to change; it also
predicts the job's time (tools/job_time.py), which is the --time asked for when neither --time nor the
site gives one.
Run it on the login node, after the download step (compute nodes are offline). The site's settings
(slurm/site.sh, see slurm/site.example.sh) give the defaults: partition, account, QoS, reservation,
constraint, time limit, how GPUs are asked for, and each GPU's share of a node's CPUs and memory.
"""
import argparse
import io
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

import submitit

from common.arguments import Parser
from common.batch import describe, gradient_accumulation_steps
from common.errors import UserError, exit_on_user_error, first_line
from common.model import load_config
from common.tensor_parallel import tp_size_for
from launch.steps import REPO, TRAINING_STEPS, check_training_arguments
from tools import check_plan, job_time
from launch.step_launcher import PREEMPTION_SIGNAL, PREEMPTION_WARNING_S, StepLauncher

# Training arguments that submit.py sets itself, from its own options of the same name.
MANAGED_ARGUMENTS = ("model", "data_dir", "output_dir", "total_batch_size", "batch_size_per_device", "tp_size")
MAX_REQUEUES_AFTER_TIME_LIMIT = 20
GPU_REQUESTS = ("gpus-per-node", "gres")
DEFAULT_TIME = "02:00:00"  # steps 2 and 3, and a job the plan check cannot time: no --time, no site's
SITE_LOADER = REPO / "slurm/use_site.sh"  # reads the site's file (slurm/site.sh, or KIT_SITE)
# sbatch's input variables that would beat the job script's own #SBATCH lines: submit.py writes each
# of these requests itself (from its options, whose defaults are the site's), so sbatch must not see them.
SBATCH_VARIABLES_WRITTEN = ("SBATCH_PARTITION", "SBATCH_ACCOUNT", "SBATCH_QOS", "SBATCH_RESERVATION",
                            "SBATCH_CONSTRAINT", "SBATCH_TIMELIMIT", "SBATCH_GPUS_PER_NODE", "SBATCH_GRES",
                            "SBATCH_CPUS_PER_GPU", "SBATCH_MEM_PER_GPU", "SBATCH_MEM_PER_NODE")


def site_settings():
    """The site's settings (slurm/use_site.sh reads slurm/site.sh, or KIT_SITE), as the submitting shell
    has them: SITE_* and the SBATCH_* that sbatch would read; {} where the site has no file."""
    print_settings = 'for name in "${!SITE_@}" "${!SBATCH_@}" KIT_SITE; do printf "%s=%s\\0" "$name" "${!name}"; done'
    result = subprocess.run([shutil.which("bash") or "/bin/bash", "-c", f'source "$1" >&2 && {print_settings}',
                             "use_site", str(SITE_LOADER)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(first_line(result.stderr.removeprefix("error: ")))
    pairs = (item.split("=", 1) for item in result.stdout.split("\0") if "=" in item)
    return dict(pairs)


def parse_arguments(argv, site=None):
    """submit.py's own options, and the training arguments after the first `--`; the site's settings
    are the defaults."""
    site = {} if site is None else site
    own, training_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.usage = "%(prog)s --step {singlegpu,ddp,fsdp,lora,tp} [options] [-- training arguments]"
    parser.add("step", required=True, choices=sorted(TRAINING_STEPS), help="which step to run")
    parser.add("job_name", help="the job's name in squeue (default: the step)")
    parser.add("gpus", type=int, default=int(site.get("SITE_GPUS_PER_NODE", 1)),
               help="GPUs per node (default: the site's SITE_GPUS_PER_NODE, else 1)")
    parser.add("nodes", type=int, default=1, help="nodes")
    parser.add("tp_size", type=int, help="--step tp: GPUs of a node that split each layer (default: all of them, "
               "lowered to what the model's heads and MLP divide by, as the training script chooses)")
    parser.add("total_batch_size", type=int, default=64, help="rows per optimiser step, over all GPUs")
    parser.add("batch_size_per_device", type=int, default=4, help="rows per forward pass on each GPU")
    parser.add("partition", default=site.get("SBATCH_PARTITION"),
               help="Slurm partition (default: the site's, else the cluster's default)")
    parser.add("account", default=site.get("SBATCH_ACCOUNT"), help="Slurm account to charge (default: the site's)")
    parser.add("qos", default=site.get("SBATCH_QOS"), help="Slurm quality of service (default: the site's)")
    parser.add("reservation", default=site.get("SBATCH_RESERVATION"),
               help="Slurm reservation, e.g. a workshop's (default: the site's)")
    parser.add("constraint", default=site.get("SBATCH_CONSTRAINT"),
               help="node features the job needs, e.g. 'a100|h100' (default: the site's)")
    parser.add("gpu_request", default=site.get("SITE_GPU_REQUEST", "gpus-per-node"), choices=GPU_REQUESTS,
               help="how the site wants GPUs asked for: --gpus-per-node=N or --gres=gpu:N")
    parser.add("sbatch", action="append", default=[], metavar="OPTION=VALUE",
               help="any other sbatch option, as #SBATCH --OPTION=VALUE (repeat it), e.g. --sbatch mail-type=END")
    parser.add("time", default=site.get("SBATCH_TIMELIMIT"),
               help="time limit: minutes, HH:MM:SS or D-HH:MM:SS (default: the site's, else the plan check's "
                    f"--time for fsdp, lora and tp, else {DEFAULT_TIME})")
    parser.add("cpus_per_task", type=int,
               help="CPUs per node, for torchrun and its processes (default: the site's share per GPU, else 8 per GPU)")
    parser.add("mem_gb", type=int, help="memory per node in GB (default: the site's share per GPU, and at least what "
               "rank 0 needs to load the model; else the cluster's default)")
    parser.add("model", default=str(REPO / "demo/model"), help="model directory or downloaded Hugging Face id")
    parser.add("data_dir", default=str(REPO / "demo/data"), help="directory with the games (see 01_download)")
    parser.add("output_dir", help="where the run writes; %%j becomes the job id (default: runs/STEP-%%j)")
    parser.add("log_dir", default="logs", help="submitit's logs go to LOG_DIR/JOBID/")
    parser.add("gpu_memory_gib", type=float, default=float(site.get("SITE_GPU_MEMORY_GIB", 80)),
               help="memory of one GPU of the partition, for the plan check (default: the site's, else 80)")
    parser.add("force", action="store_true", help="submit without the plan check (a job it says cannot fit)")
    parser.add("dry_run", action="store_true", help="print the plan and the sbatch script; submit nothing")
    args = parser.parse_args(own)
    args.training_args = training_args
    return args


def time_limit_minutes(text):
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) → whole minutes."""
    seconds = job_time.slurm_seconds(text, "--time")
    if seconds < 60:
        raise UserError(f"--time {text!r} is shorter than a minute")
    return math.ceil(seconds / 60)


def check_sbatch_values(args):
    """Values that land in `#SBATCH` lines of the job script. submitit quotes them, but a line
    break would end the `#SBATCH` comment and run the rest as a command."""
    for name in ("job_name", "partition", "account", "qos", "reservation", "constraint", "log_dir"):
        value = getattr(args, name, None)  # benchmark/sweep.py's jobs have no qos, reservation, constraint
        if value is not None and not value.isprintable():
            raise UserError(f"--{name} {value!r} contains a line break or another control character: "
                            "use one line of printable characters")
    for setting in getattr(args, "sbatch", []):  # benchmark/sweep.py's jobs have none
        if not re.fullmatch(r"[a-z][a-z-]*=\S.*", setting) or not setting.isprintable():
            raise UserError(f"--sbatch {setting!r}: give one sbatch option as OPTION=VALUE, e.g. "
                            "--sbatch mail-type=END")
    if "%" in args.log_dir:
        raise UserError(f"--log_dir {args.log_dir!r}: Slurm would expand the % in it (%j, %x, ...); "
                        "choose a directory without %")


def check_request(args):
    for name in ("gpus", "nodes", "total_batch_size", "batch_size_per_device"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.step == "singlegpu" and (args.gpus != 1 or args.nodes != 1):
        raise UserError(f"--step singlegpu runs on one GPU of one node (got --gpus {args.gpus} --nodes {args.nodes}): "
                        "use --step ddp or --step fsdp for more")
    if getattr(args, "tp_size", None) is not None and args.step != "tp":  # benchmark/sweep.py's jobs have none
        raise UserError(f"--tp_size is step 6's (--step tp), not --step {args.step}'s")
    for argument in args.training_args:
        name = argument.split("=", 1)[0].removeprefix("--").replace("-", "_")
        if name in MANAGED_ARGUMENTS:
            raise UserError(f"{argument} after `--`: use submit.py's --{name} instead")
    for name in ("cpus_per_task", "mem_gb"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    site = getattr(args, "site", {})  # benchmark/sweep.py's jobs have none
    node = {"gpus": "SITE_GPUS_PER_NODE", "cpus_per_task": "SITE_CPUS_PER_NODE", "mem_gb": "SITE_MEM_GB_PER_NODE"}
    for name, setting in node.items():
        if setting in site and getattr(args, name) is not None and getattr(args, name) > int(site[setting]):
            raise UserError(f"--{name} {getattr(args, name)} is more than a node of this site has: {setting}="
                            f"{site[setting]} in {site.get('KIT_SITE', 'slurm/site.sh')}"
                            + (": use more --nodes" if name == "gpus" else ""))
    gpu_memory_gib = getattr(args, "gpu_memory_gib", 80)  # benchmark/sweep.py's jobs have none
    if not (math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        raise UserError(f"--gpu_memory_gib must be a positive number of GiB, the memory of one GPU of the partition "
                        f"(got {gpu_memory_gib:g}; an A100 or H100 has 80)")


def tensor_parallel_size(args, model):
    """Step 6's tensor-parallel group size (1 for the other steps): --tp_size, or as the training
    script chooses it on the nodes' GPUs (common/tensor_parallel.py), from the model's config."""
    if args.step != "tp":
        return 1
    config = load_config(model, local_files_only=True)  # compute nodes are offline: it is on disk already
    trust_remote_code = check_plan.names_option(args.training_args, "--trust_remote_code")
    return tp_size_for(argparse.Namespace(tp_size=args.tp_size, model=model, trust_remote_code=trust_remote_code),
                       config, args.gpus * args.nodes, args.gpus, on_gpu=True)


def absolute(path):
    """Relative paths mean relative to where submit.py runs, as for sbatch; the job runs elsewhere."""
    return str(Path(path).expanduser().resolve())


def model_path(model):
    """A model directory as an absolute path; a Hugging Face id as it is."""
    return absolute(model) if Path(model).exists() else model


def preemption_warning_s(timeout_min):
    """When Slurm sends the USR2 warning: 5 minutes before the time limit, or halfway through a
    shorter job. submitit must be using USR2 too, the signal the training scripts stop on."""
    if submitit.JobEnvironment._usr_sig() != PREEMPTION_SIGNAL:  # SUBMITIT_PREEMPT_SIGNAL=USR1 in the environment
        raise UserError(f"SUBMITIT_PREEMPT_SIGNAL={os.environ.get('SUBMITIT_PREEMPT_SIGNAL')}: the training scripts "
                        "stop on USR2, submitit's default: unset SUBMITIT_PREEMPT_SIGNAL")
    return min(PREEMPTION_WARNING_S, timeout_min * 60 // 2)


class PlanOnlyExecutor(submitit.SlurmExecutor):
    """The real SlurmExecutor, for --dry-run where no Slurm may be installed: it renders the
    very sbatch script that a submission writes, and never calls sbatch."""

    @classmethod
    def affinity(cls):
        return 1


@contextmanager
def slurm_refusal_is_one_line():
    """sbatch's own refusal (`sbatch: error: ...`: a partition or account that does not exist, a
    request over the site's limits) as one error line, not submitit's traceback."""
    try:
        with redirect_stderr(io.StringIO()):  # submitit prints sbatch's message, then raises it
            yield
    except submitit.core.utils.FailedJobError as err:
        raise UserError(f"Slurm refused the job: {first_line(err)} (check --partition, --account, --time and "
                        "the GPUs asked for against `sinfo` and your site's limits)") from None


def site_share(args, setting):
    """Of a node's SITE_CPUS_PER_NODE or SITE_MEM_GB_PER_NODE, the share of the job's GPUs; None without a site."""
    site = getattr(args, "site", {})
    if setting not in site:
        return None
    return int(site[setting]) * args.gpus // int(site["SITE_GPUS_PER_NODE"])


def memory_request_gb(args, parameters):
    """--mem_gb, else the GPUs' share of a site's node, raised to what rank 0 needs to load the model
    (tools/check_plan.py); a node that cannot hold that is refused, naming the setting."""
    if args.mem_gb is not None:
        return args.mem_gb
    share = site_share(args, "SITE_MEM_GB_PER_NODE")
    if share is None or parameters is None:
        return share
    loading = math.ceil(check_plan.loading_host_bytes(parameters) / 1e9)
    site = args.site
    if loading > int(site["SITE_MEM_GB_PER_NODE"]):
        raise UserError(f"rank 0 needs {loading} GB of host memory to load the model, more than a node's "
                        f"SITE_MEM_GB_PER_NODE={site['SITE_MEM_GB_PER_NODE']} in {site.get('KIT_SITE')}: "
                        "use nodes with more memory (--partition, --constraint)")
    return max(share, loading)


def make_executor(args, timeout_min, warning_s, mem_gb=None):
    folder = Path(absolute(args.log_dir)) / "%j"
    cpus_per_task = args.cpus_per_task or site_share(args, "SITE_CPUS_PER_NODE") or 8 * args.gpus
    mem_gb = args.mem_gb if mem_gb is None else mem_gb
    gpus = ({"gres": f"gpu:{args.gpus}"} if getattr(args, "gpu_request", "gpus-per-node") == "gres"
            else {"gpus_per_node": args.gpus})
    extra = {name: getattr(args, name) for name in ("qos", "reservation", "constraint")
             if getattr(args, name, None) is not None}
    extra.update(setting.split("=", 1) for setting in getattr(args, "sbatch", []))
    executor_class = PlanOnlyExecutor if args.dry_run else submitit.SlurmExecutor
    # Requeues after a time limit: each one resumes from a checkpoint, so allow plenty.
    executor = executor_class(folder=folder, max_num_timeout=MAX_REQUEUES_AFTER_TIME_LIMIT)
    executor.update_parameters(
        job_name=args.job_name or args.step, nodes=args.nodes, ntasks_per_node=1, **gpus,
        cpus_per_task=cpus_per_task, time=timeout_min, stderr_to_stdout=True,
        # Preemption and time limits: USR2 (submitit's signal) warning_s before the end, to
        # every process of the job; the training saves and stops, StepLauncher.checkpoint
        # requeues (--requeue also lets Slurm requeue it after a node failure).
        signal_delay_s=warning_s, additional_parameters={"requeue": True, **extra},
        **({"mem": f"{mem_gb}GB"} if mem_gb is not None else {}),
        **({"partition": args.partition} if args.partition is not None else {}),
        **({"account": args.account} if args.account is not None else {}),
        # Compute nodes have no internet; huggingface_hub and datasets read these at import time.
        # Less fragmentation of GPU memory (as in the templates); a value set before submitting wins.
        setup=["export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1",
               "export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"],
        # --cpus-per-task again: srun of Slurm 22.05 to 23.02 does not take it from the batch job.
        srun_args=["--kill-on-bad-exit=1", f"--cpus-per-task={cpus_per_task}"],
    )
    return executor, cpus_per_task


def main(argv):
    site = site_settings()
    args = parse_arguments(argv, site)
    args.site = site
    for name in SBATCH_VARIABLES_WRITTEN:  # they would beat the job script's lines (see above)
        os.environ.pop(name, None)
    check_sbatch_values(args)
    check_request(args)
    devices = args.gpus * args.nodes
    if args.model == str(REPO / "demo/model") and not Path(args.model).is_dir():
        raise UserError(f"no demo/ in {REPO}: build the demo model and data first, python 01_download/download.py "
                        "--demo --out demo (or give --model and --data_dir)")
    model = model_path(args.model)
    tp_size = tensor_parallel_size(args, model)
    groups = devices // tp_size  # the devices, or step 6's tensor-parallel groups: they share out the batch
    accumulation = gradient_accumulation_steps(args.total_batch_size, args.batch_size_per_device, groups,
                                               ranks="ranks" if args.step != "tp" else "data-parallel groups")
    given_minutes = None if args.time is None else time_limit_minutes(args.time)
    preemption_warning_s(given_minutes or 60)  # submitit's signal, before the plan check's seconds
    data_dir, output_dir = absolute(args.data_dir), absolute(args.output_dir or f"runs/{args.step}-%j")
    training_args = ["--model", model, "--data_dir", data_dir, "--output_dir", output_dir,
                     "--total_batch_size", str(args.total_batch_size),
                     "--batch_size_per_device", str(args.batch_size_per_device), *args.training_args,
                     *(["--tp_size", str(tp_size)] if args.step == "tp" else [])]
    job = check_training_arguments(args.step, training_args)
    if not args.dry_run and shutil.which("sbatch") is None:
        raise UserError("no Slurm here (sbatch not found): run this on the cluster's login node, or add --dry-run")
    plan = None
    if args.step in ("fsdp", "lora", "tp") and not args.force:
        # On several nodes, unless --sharding_strategy is given: HYBRID_SHARD where it fits, else FULL_SHARD.
        choose = check_plan.chooses_sharding(args.step, args.nodes, training_args)
        plan = check_plan.check_job(args.step, job, args.gpus, args.nodes, args.gpu_memory_gib, override="--force",
                                    choose_sharding=choose, time_limit_s=given_minutes and given_minutes * 60)
        if choose:
            training_args += ["--sharding_strategy", job.sharding_strategy]
    # No --time and none from the site: the plan check's prediction with its margin, else the default.
    time_source = "the site's" if args.time is not None and args.time == site.get("SBATCH_TIMELIMIT") else "--time"
    if args.time is None:
        args.time, time_source = ((plan["time"]["request"], "the plan check's prediction and margin") if plan
                                  else (DEFAULT_TIME, "the default"))
    timeout_min = time_limit_minutes(args.time)
    warning_s = preemption_warning_s(timeout_min)

    mem_gb = memory_request_gb(args, plan["parameters"] if plan else None)
    executor, cpus_per_task = make_executor(args, timeout_min, warning_s, mem_gb)
    launcher = StepLauncher(args.step, args.gpus, cpus_per_task, training_args, warning_s)
    memory = f"{mem_gb} GB" if mem_gb else "the cluster's default memory"
    print(f"step {args.step}: {args.nodes} node(s) × {args.gpus} GPU(s) = {devices} process(es), {cpus_per_task} CPUs "
          f"and {memory} per node, time limit {args.time} ({time_source})")
    if args.step == "tp":
        print(describe(args.total_batch_size, args.batch_size_per_device, groups, accumulation,
                       devices="data-parallel groups") + f"; tensor parallel over {tp_size} GPUs of each node")
    else:
        print(describe(args.total_batch_size, args.batch_size_per_device, devices, accumulation))
    example = launcher.command(args.nodes, first_node="FIRST_NODE", port="PORT", job_id="JOBID", restarts="RESTARTS")
    print(f"on each node: {shlex.join(example)}")
    print("  (FIRST_NODE: first node of the allocation, PORT: 20000 + job id % 20000)")
    print(f"preemption: {warning_s} s before the time limit Slurm sends USR2; the training saves a checkpoint and "
          "stops, the job is requeued and continues the run")

    if args.dry_run:
        # The two (private) calls with which submitit writes the script when it submits.
        script = executor._make_submission_file_text(executor._submitit_command_str, uid="dry-run")
        print("\n---- sbatch script (dry run: nothing submitted) ----")
        print(script.rstrip())
        return 0

    with slurm_refusal_is_one_line():
        job = executor.submit(launcher)

    def log(node):
        return shlex.quote(str(job.paths.folder / f"{job.job_id}_{node}_log.out"))
    print(f"\nsubmitted job {job.job_id}")
    print(f"  output:  {output_dir.replace('%j', job.job_id)}")
    print(f"  logs:    {', '.join(log(node) for node in range(args.nodes))}  (one per node)")
    print(f"  follow:  tail -f {log(0)}")
    print(f"  status:  squeue -j {job.job_id}    after it ended: sacct -j {job.job_id}")
    print(f"  cancel:  scancel {job.job_id}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(lambda: main(sys.argv[1:])))
