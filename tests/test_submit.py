"""submit.py and the sbatch templates without Slurm: the batch arithmetic (the one function the
training scripts and submit.py share) and its refusals, the --dry-run plan, and shellcheck."""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import submit
from common.batch import gradient_accumulation_steps
from common.errors import UserError
from slurm_cluster import install_when_missing
from conftest import run_python

REPO = submit.REPO
pytestmark = pytest.mark.quick


@pytest.fixture
def no_slurm_env():
    """Only the virtual environment on PATH: no sbatch, so nothing here can submit a job; and no
    site settings (a developer's slurm/site.sh or sourced use_site.sh would change the defaults)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "SITE_"))},
            "PATH": str(Path(sys.executable).parent), "KIT_SITE": "/nonexistent/site.sh"}


def run_submit(args, env):
    return run_python(["submit.py", *args], env={**env, "OMP_NUM_THREADS": "1"}, timeout=120)


# (total batch, per device, world size) -> accumulation
DIVIDES = [((64, 4, 1), 16), ((64, 4, 8), 2), ((64, 4, 16), 1), ((8, 2, 4), 1), ((48, 2, 6), 4)]
DOES_NOT_DIVIDE = [(64, 4, 32), (10, 2, 4), (64, 3, 2), (4, 4, 2)]


@pytest.mark.parametrize("request_, accumulation", DIVIDES)
def test_accumulation_keeps_the_total_batch(request_, accumulation):
    assert gradient_accumulation_steps(*request_) == accumulation


@pytest.mark.parametrize("request_", DOES_NOT_DIVIDE)
def test_accumulation_that_does_not_divide_is_refused(request_):
    total, per_device, world_size = request_
    with pytest.raises(UserError, match=f"--total_batch_size {total} is not a multiple of --batch_size_per_device "
                                        f"{per_device} × {world_size} ranks = {per_device * world_size}"):
        gradient_accumulation_steps(*request_)


@pytest.mark.parametrize("script", ["singlegpu", "ddp", "fsdp", "lora", "tp"])
def test_template_outside_slurm_says_to_use_sbatch(script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", f"slurm/{script}.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == "error: submit this script with sbatch (it needs a Slurm allocation)\n"


def test_dry_run_prints_the_plan_and_the_sbatch_script_without_slurm(no_slurm_env):
    result = run_submit(["--dry-run", "--gpus", "4", "--nodes", "2", "--step", "fsdp", "--partition", "gpu",
                         "--account", "chess", "--time", "1-00:30:00", "--", "--learning_rate", "2e-5"], no_slurm_env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "total batch 64 = 4 per device × 8 devices × 2 gradient accumulation steps" in out
    assert ("torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=FIRST_NODE:PORT "
            "--rdzv-id=JOBID-RESTARTS 04_fsdp/train.py") in out
    assert "--total_batch_size 64 --batch_size_per_device 4 --learning_rate 2e-5" in out
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=32", "#SBATCH --partition=gpu", "#SBATCH --account=chess",
                 "#SBATCH --time=1470", "#SBATCH --signal=USR2@300", "#SBATCH --requeue",
                 "export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1",
                 "export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"]:
        assert line in out.splitlines(), line
    assert "--kill-on-bad-exit=1 --cpus-per-task=32" in out
    assert "nothing submitted" in out and "submitted job" not in out
    # Several nodes: the plan check chooses the sharding first, and the job names it
    first, second = out.splitlines()[:2]
    assert first.startswith("sharding: HYBRID_SHARD on 2 nodes: "), out
    assert second.startswith("plan check: fits: "), out  # the demo model: 8 ranks x 4 rows of 512 tokens
    assert "--learning_rate 2e-5 --sharding_strategy HYBRID_SHARD\n" in out


def test_dry_run_of_step_6_splits_each_node_and_shares_out_the_batch_by_group(no_slurm_env):
    """--step tp: the tensor-parallel size goes to the training script (a node's GPUs by default,
    lowered to the demo model's 4 heads), the batch is shared out by data-parallel group, and the
    plan check runs step 6."""
    result = run_submit(["--dry-run", "--step", "tp", "--gpus", "8", "--nodes", "2", "--total_batch_size", "16",
                         "--batch_size_per_device", "2"], no_slurm_env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("plan check: fits: "), out
    assert ("total batch 16 = 2 per device × 4 data-parallel groups × 2 gradient accumulation steps; tensor parallel "
            "over 4 GPUs of each node") in out
    assert "--rdzv-id=JOBID-RESTARTS 06_tp/train.py " in out and out.count("--tp_size 4") == 1, out
    explicit = run_submit(["--dry-run", "--step", "tp", "--tp_size", "2", "--gpus", "4", "--total_batch_size", "8",
                           "--batch_size_per_device", "2", "--force"], no_slurm_env)
    assert explicit.returncode == 0 and "plan check" not in explicit.stdout, explicit.stderr
    assert "2 per device × 2 data-parallel groups × 2 gradient accumulation steps" in explicit.stdout
    assert "--batch_size_per_device 2 --tp_size 2" in explicit.stdout


def test_short_jobs_are_warned_halfway(no_slurm_env):
    result = run_submit(["--dry-run", "--step", "ddp", "--gpus", "2", "--time", "4"], no_slurm_env)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --signal=USR2@120" in result.stdout.splitlines()


HOSTILE = "chess 'run' \"two\" $(touch injected); `touch injected` & \\ *"


def test_hostile_job_name_stays_one_quoted_value(no_slurm_env, tmp_path):
    """submitit quotes #SBATCH values; the script must parse back to exactly the name, and
    running its shell lines must not run anything hidden in it (tests/test_preemption.py runs
    such a job on Slurm)."""
    result = run_submit(["--dry-run", "--step", "ddp", "--gpus", "2", "--job_name", HOSTILE,
                         "--log_dir", str(tmp_path / "logs 'x' $(touch injected)")], no_slurm_env)
    assert result.returncode == 0, result.stderr
    script = result.stdout.split("---- sbatch script (dry run: nothing submitted) ----\n")[1]
    name_lines = [line for line in script.splitlines() if line.startswith("#SBATCH --job-name=")]
    assert len(name_lines) == 1 and shlex.split(name_lines[0].removeprefix("#SBATCH --job-name=")) == [HOSTILE]
    # The setup lines, with srun and python replaced by printing their arguments one per line.
    check = subprocess.run([shutil.which("bash"), "-c", "srun() { printf '%s\\n' \"$@\"; }\n" + script], cwd=tmp_path,
                           capture_output=True, text=True, env={**no_slurm_env, "PYTHONPATH": ""})
    assert check.returncode == 0, check.stderr
    assert str(tmp_path / "logs 'x' $(touch injected)" / "%j") in check.stdout.splitlines()
    assert not list(tmp_path.rglob("injected")) and not (REPO / "injected").exists()


@pytest.mark.parametrize("option", ["--job_name", "--partition", "--account", "--log_dir"])
def test_line_breaks_in_sbatch_values_are_refused(no_slurm_env, option):
    """A line break would end the `#SBATCH` comment and run the rest as a command."""
    result = run_submit(["--dry-run", "--step", "ddp", option, "chess\ntouch injected"], no_slurm_env)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"error: {option} 'chess\\ntouch injected' contains a line break")
    assert result.stderr.count("\n") == 1


def test_another_submitit_signal_is_refused(no_slurm_env):
    """The training scripts stop on USR2; submitit would send USR1 instead."""
    result = run_submit(["--dry-run", "--step", "ddp"], {**no_slurm_env, "SUBMITIT_PREEMPT_SIGNAL": "USR1"})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("error: SUBMITIT_PREEMPT_SIGNAL=USR1: the training scripts stop on USR2, submitit's "
                             "default: unset SUBMITIT_PREEMPT_SIGNAL\n")


def test_dry_run_quotes_paths_for_the_shell(no_slurm_env, tmp_path):
    data_dir = tmp_path / "chess data; rm -rf ~"
    data_dir.mkdir()
    for name in ("train.jsonl", "validation.jsonl"):
        (data_dir / name).write_text('{"text": "e2e4 e7e5"}\n')
    result = run_submit(["--dry-run", "--step", "ddp", "--gpus", "2", "--data_dir", str(data_dir)], no_slurm_env)
    assert result.returncode == 0, result.stderr
    plan = next(line for line in result.stdout.splitlines() if line.startswith("on each node: "))
    command = shlex.split(plan.removeprefix("on each node: "))
    assert command[command.index("--data_dir") + 1] == str(data_dir)


@pytest.mark.parametrize("arguments, message", [
    (["--step", "fsdp", "--gpus", "3", "--nodes", "2"],
     "--total_batch_size 64 is not a multiple of --batch_size_per_device 4 × 6 ranks = 24"),
    (["--step", "fsdp", "--gpus", "0"], "--gpus must be at least 1 (got 0)"),
    (["--step", "ddp", "--nodes", "0"], "--nodes must be at least 1 (got 0)"),
    (["--step", "fsdp", "--batch_size_per_device", "0"], "--batch_size_per_device must be at least 1"),
    (["--step", "singlegpu", "--gpus", "2"], "--step singlegpu runs on one GPU of one node"),
    (["--step", "singlegpu", "--nodes", "2"], "--step singlegpu runs on one GPU of one node"),
    (["--step", "tensor_parallel"], "argument --step: invalid choice: 'tensor_parallel'"),
    (["--gpus", "2"], "the following arguments are required: --step"),
    (["--step", "fsdp", "--time", "two hours"], "--time 'two hours' is not a Slurm time limit"),
    # issue 23: a GPU of no finite, positive size; a time whose hours, minutes or seconds run over
    (["--step", "fsdp", "--gpu_memory_gib", "inf"], "--gpu_memory_gib must be a positive number of GiB"),
    (["--step", "fsdp", "--gpu_memory_gib", "nan"], "(got nan; an A100 or H100 has 80)"),
    (["--step", "ddp", "--gpu_memory_gib", "-5"], "--gpu_memory_gib must be a positive number of GiB, the memory of "
                                                  "one GPU of the partition (got -5; an A100 or H100 has 80)"),
    (["--step", "fsdp", "--time", "1-99:99:99"],
     "--time '1-99:99:99' is not a Slurm time limit: after D- the hours run 0-23, and minutes and seconds 0-59"),
    (["--step", "fsdp", "--time", "02:75:00"], "--time '02:75:00' is not a Slurm time limit: after D- the hours"),
    (["--step", "fsdp", "--", "--total_batch_size", "4"], "use submit.py's --total_batch_size"),
    (["--step", "fsdp", "--", "--batch-size-per-device=4"], "use submit.py's --batch_size_per_device"),
    (["--step", "tp", "--", "--tp_size", "2"], "use submit.py's --tp_size"),
    (["--step", "fsdp", "--tp_size", "2"], "--tp_size is step 6's (--step tp), not --step fsdp's"),
    (["--step", "tp", "--gpus", "4", "--tp_size", "3"], "--tp_size 3 does not divide the 4 ranks into tensor-parallel "
                                                         "groups: choose one of 1, 2, 4"),
    (["--step", "tp", "--gpus", "2", "--nodes", "2", "--tp_size", "4"],  # issue 43 case 8: the step's own refusal
     "--tp_size 4 does not divide the 2 ranks of each of the 2 nodes into tensor-parallel groups (a group stays "
     "inside a node, on its fast links): choose one of 1, 2"),
    (["--step", "tp", "--tp_size", "0"], "--tp_size must be at least 1 (got 0)"),
    (["--step", "tp", "--gpus", "8", "--tp_size", "8"], "--tp_size 8: "),  # the demo model's 4 heads
    (["--step", "tp", "--gpus", "4", "--total_batch_size", "5", "--batch_size_per_device", "2"],
     "--total_batch_size 5 is not a multiple of --batch_size_per_device 2 × 1 data-parallel groups = 2"),
    (["--step", "fsdp", "--", "--gradient_accumulation_steps", "4"], "unrecognized arguments"),
    (["--step", "fsdp", "--", "--learning_rat", "1e-4"], "unrecognized arguments: --learning_rat"),
    (["--step", "fsdp", "--", "--max_grad_norm", "0"], "--max_grad_norm must be a positive number"),
    (["--step", "fsdp", "--data_dir", "/nonexistent/chess/data"],
     "no train.jsonl in /nonexistent/chess/data: run `python 01_download/download.py --out /nonexistent/chess`"),
    (["--step", "fsdp", "--model", "/nonexistent/model"],
     "model /nonexistent/model is neither a directory nor in the Hugging Face cache"),
    (["--step", "fsdp", "--model", "nobody/no-such-model"],
     "model nobody/no-such-model is neither a directory nor in the Hugging Face cache"),
])
def test_impossible_requests_are_refused_with_one_line(no_slurm_env, monkeypatch, capsys, arguments, message):
    """In this process, as `python submit.py` runs main() (one subprocess per case took minutes in all;
    test_submitting_without_slurm_says_where_to_run runs the real command)."""
    monkeypatch.setenv("PATH", no_slurm_env["PATH"])
    monkeypatch.setenv("KIT_SITE", no_slurm_env["KIT_SITE"])
    monkeypatch.chdir(REPO)
    for dry_run in ([], ["--dry-run"]):
        with pytest.raises(SystemExit) as exit_info:
            submit.exit_on_user_error(lambda: submit.main(dry_run + arguments))
        out, err = capsys.readouterr()
        assert exit_info.value.code == 2 and out == ""
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err


def test_submitting_without_slurm_says_where_to_run(no_slurm_env):
    result = run_submit(["--step", "fsdp", "--gpus", "2"], no_slurm_env)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("error: no Slurm here (sbatch not found): run this on the cluster's login node, "
                             "or add --dry-run\n")


def test_time_limits_in_slurm_formats():
    assert [submit.time_limit_minutes(t) for t in ["90", "5:30", "02:00:00", "1-0", "1-2:30", "0-00:01:01"]] == \
        [90, 6, 120, 1440, 1590, 2]
    assert [submit.time_limit_minutes(t) for t in ["48:00:00", "1-23:59:59", "100:59"]] == [2880, 2880, 101]


@pytest.mark.parametrize("text", ["1-99:99:99", "1-24", "1-0:60", "1-0:0:60", "2:60:00", "5:60", "0:00:75"])
def test_time_fields_that_run_over_are_refused(text):
    """Issue 23: after the first field each counts only up to the next one's unit."""
    with pytest.raises(UserError, match=f"--time '{text}' is not a Slurm time limit: after D- the hours run 0-23"):
        submit.time_limit_minutes(text)


def test_shell_scripts_are_shellcheck_clean():
    # CI starts from a fresh machine and installs it; elsewhere a missing shellcheck is a skip.
    if os.environ.get("CI") == "true":
        install_when_missing("shellcheck", "shellcheck")
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = sorted(str(p.relative_to(REPO)) for p in [*REPO.glob("*.sh"), *REPO.glob("slurm/*.sh"),
                                                          *REPO.glob("tests/slurm/*.sh"), REPO / ".ci/run"])
    assert "slurm/preemption.sh" in scripts and "slurm/fsdp.sh" in scripts
    result = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.quick
@pytest.mark.parametrize("script", ["singlegpu", "ddp", "fsdp", "lora", "tp"])
@pytest.mark.parametrize("cpus, gpus, threads", [(32, 4, 8), (2, 4, 1), (1, 8, 1), (None, 4, 1)])
def test_templates_give_each_rank_at_least_one_thread(script, cpus, gpus, threads):
    """The templates' own thread lines, run with a node's Slurm figures: fewer CPUs than GPUs once
    exported OMP_NUM_THREADS=0, which OpenMP does not accept."""
    lines = [line for line in (REPO / "slurm" / f"{script}.sh").read_text().splitlines()
             if line.startswith(("CPUS_PER_GPU=", "export OMP_NUM_THREADS="))]
    assert len(lines) == 2, lines
    env = {"PATH": os.environ["PATH"], "GPUS_PER_NODE": str(gpus),
           **({"SLURM_CPUS_PER_TASK": str(cpus)} if cpus else {})}
    result = subprocess.run(["bash", "-c", "\n".join([*lines, 'echo "$OMP_NUM_THREADS"'])], env=env,
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(threads)


# A site shaped unlike the templates' usual node (tests/test_slurm.py runs jobs with the same file):
# 2 GPUs asked for as GRES, 2 CPUs and 3 GB per node, a GPU partition that is not the default.
SMALL_SITE = """\
SITE_PARTITION=gpu
SITE_QOS=normal
SITE_RESERVATION=workshop
SITE_CONSTRAINT='a100|h100'
SITE_TIME=00:10:00
SITE_GPUS_PER_NODE=2
SITE_CPUS_PER_NODE=2
SITE_MEM_GB_PER_NODE=3
SITE_GPU_REQUEST=gres
site_environment() { echo "site environment loaded"; }
"""


@pytest.fixture
def site_env(no_slurm_env, tmp_path):
    """The submitting shell's environment with the site file named (KIT_SITE) and nothing sourced yet."""
    site = tmp_path / "site.sh"
    site.write_text(SMALL_SITE)
    return {**no_slurm_env, "KIT_SITE": str(site)}


def sourced(env, command='for name in "${!SBATCH_@}"; do echo "$name=${!name}"; done'):
    """`source slurm/use_site.sh` (the line in a user's ~/.bashrc), then `command`."""
    return subprocess.run(["/bin/bash", "-c", f"source slurm/use_site.sh && {command}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)


def test_the_site_file_becomes_sbatch_input_variables(site_env):
    """One file for the site: its settings reach sbatch as SBATCH_* variables (which beat a template's
    #SBATCH lines), CPUs and memory as each GPU's share of the node; a variable the user set is kept."""
    result = sourced({**site_env, "SBATCH_TIMELIMIT": "00:20:00"})
    assert result.returncode == 0, result.stderr
    variables = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert variables == {"SBATCH_PARTITION": "gpu", "SBATCH_QOS": "normal", "SBATCH_RESERVATION": "workshop",
                         "SBATCH_CONSTRAINT": "a100|h100", "SBATCH_TIMELIMIT": "00:20:00", "SBATCH_GRES": "gpu:2",
                         "SBATCH_CPUS_PER_GPU": "1", "SBATCH_MEM_PER_GPU": "1536M"}
    # inside a job it also runs the site's environment (modules, activation, HF_HOME)
    assert "site environment loaded" not in result.stdout
    assert "site environment loaded" in sourced({**site_env, "SLURM_JOB_ID": "1"}, ":").stdout


@pytest.mark.parametrize("setting, message", [
    ("SITE_GPUS_PER_NODE=0", "SITE_GPUS_PER_NODE=0 must be a whole number of at least 1"),
    ("SITE_MEM_GB_PER_NODE=256G", "SITE_MEM_GB_PER_NODE=256G must be a whole number of at least 1"),
    ("SITE_GPU_REQUEST=gpus", "SITE_GPU_REQUEST=gpus must be gpus-per-node (--gpus-per-node=N) or gres"),
])
def test_a_wrong_site_setting_is_one_line(site_env, setting, message):
    Path(site_env["KIT_SITE"]).write_text(SMALL_SITE + setting + "\n")
    result = sourced(site_env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {site_env['KIT_SITE']}: {message}"), result.stderr


def test_submit_py_asks_for_what_the_site_says(site_env):
    """submit.py reads the same file: the partition, QoS, reservation, constraint, time, GPUs as GRES and
    each GPU's share of CPUs and memory, written in its script, and sbatch's own input variables are
    not left to beat them; its options and --sbatch beat the site."""
    result = run_submit(["--dry-run", "--step", "ddp", "--sbatch", "mail-type=END"], site_env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for line in ["#SBATCH --partition=gpu", "#SBATCH --qos=normal", "#SBATCH --reservation=workshop",
                 "#SBATCH --constraint='a100|h100'", "#SBATCH --time=10", "#SBATCH --gres=gpu:2",
                 "#SBATCH --cpus-per-task=2", "#SBATCH --mem=3GB", "#SBATCH --mail-type=END"]:
        assert line in lines, line
    assert not any(line.startswith("#SBATCH --gpus-per-node") for line in lines)
    one_gpu = run_submit(["--dry-run", "--step", "singlegpu", "--gpus", "1", "--qos", "high", "--time", "30"],
                         site_env).stdout.splitlines()
    for line in ["#SBATCH --gres=gpu:1", "#SBATCH --cpus-per-task=1", "#SBATCH --mem=1GB", "#SBATCH --qos=high",
                 "#SBATCH --time=30"]:
        assert line in one_gpu, line


@pytest.mark.parametrize("arguments, message", [
    (["--gpus", "4"], "--gpus 4 {more}: SITE_GPUS_PER_NODE=2 in {site}: use more --nodes"),
    (["--cpus_per_task", "8"], "--cpus_per_task 8 {more}: SITE_CPUS_PER_NODE=2 in {site}"),
    (["--mem_gb", "64"], "--mem_gb 64 {more}: SITE_MEM_GB_PER_NODE=3 in {site}"),
    (["--sbatch", "exclusive"], "--sbatch 'exclusive': give one sbatch option as OPTION=VALUE"),
])
def test_a_request_the_sites_nodes_cannot_hold_is_refused(site_env, arguments, message):
    result = run_submit(["--dry-run", "--step", "ddp", *arguments], site_env)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    message = message.format(more="is more than a node of this site has", site=site_env["KIT_SITE"])
    assert result.stderr.startswith(f"error: {message}") and result.stderr.count("\n") == 1, result.stderr


def test_rank_0_loading_7b_sets_the_memory_request(site_env):
    """Rank 0 holds the whole fp32 model while loading (1.5 x while reading it): about 40 GB for
    CodeLlama-7b's 6,738,546,688 parameters. submit.py asks for that much, and a node that cannot
    hold it is refused, naming the site's setting."""
    site = {"SITE_GPUS_PER_NODE": "4", "SITE_MEM_GB_PER_NODE": "128", "KIT_SITE": "site.sh"}
    args = submit.parse_arguments(["--step", "fsdp", "--gpus", "1"], site)
    args.site = site
    assert submit.memory_request_gb(args, 6_738_546_688) == 41  # more than one GPU's share, 128 / 4 GB
    args.site = {**site, "SITE_MEM_GB_PER_NODE": "32"}
    with pytest.raises(UserError, match="rank 0 needs 41 GB of host memory to load the model, more than a node's "
                                        "SITE_MEM_GB_PER_NODE=32 in site.sh"):
        submit.memory_request_gb(args, 6_738_546_688)
    args.site, args.gpus = site, 4
    assert submit.memory_request_gb(args, 6_738_546_688) == 128  # the 4 GPUs' share is more


def test_template_without_demo_says_how_to_build_it(tmp_path):
    """A fresh clone has no demo/: the template's job says in one line how to build it, before anything."""
    shutil.copytree(REPO / "slurm", tmp_path / "slurm")
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_JOB_NAME": "fsdp", "KIT_SITE": "/nonexistent/site.sh"}
    for script in ("singlegpu", "ddp", "fsdp", "lora", "tp"):
        result = subprocess.run(["bash", str(tmp_path / "slurm" / f"{script}.sh")], cwd=tmp_path, env=env,
                                capture_output=True, text=True)
        assert (result.returncode, result.stdout) == (2, ""), result.stderr
        assert result.stderr == (f"error: no demo/ in {tmp_path}: build the demo model and data on the login node "
                                 "first, python 01_download/download.py --demo --out demo (or set MODEL and "
                                 "DATA_DIR)\n"), result.stderr


def test_submit_py_without_demo_says_how_to_build_it(no_slurm_env, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(submit, "REPO", tmp_path)  # a fresh clone: no demo/
    monkeypatch.setenv("KIT_SITE", no_slurm_env["KIT_SITE"])
    with pytest.raises(SystemExit) as exit_info:
        submit.exit_on_user_error(lambda: submit.main(["--dry-run", "--step", "ddp", "--gpus", "2"]))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"error: no demo/ in {tmp_path}: build the demo model and data first, python "
                                       "01_download/download.py --demo --out demo (or give --model and --data_dir)\n")


def test_install_refuses_an_old_python_in_one_line(tmp_path):
    """RHEL 8's python3 is 3.6: install.sh says so before building anything, and how to choose another."""
    shutil.copy(REPO / "install.sh", tmp_path)
    old_python = tmp_path / "python3.6"
    old_python.write_text('#!/bin/sh\n[ "$1" = -c ] && case "$2" in *platform*) echo 3.6.8;; *) exit 1;; esac\n')
    old_python.chmod(0o755)
    result = subprocess.run(["bash", "install.sh"], cwd=tmp_path, env={**os.environ, "PYTHON": str(old_python)},
                            capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"error: the kit needs Python >= 3.10 and {old_python} is 3.6.8: choose another with "
                             "PYTHON=python3.11 bash install.sh (or after `module load python/3.11`, or a conda "
                             "environment's python)\n")
    assert not (tmp_path / ".venv").exists()
