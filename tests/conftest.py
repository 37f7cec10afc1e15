"""Shared fixtures: the demo assets, built once per test session, and a way to run a step."""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEP_SCRIPTS = {"single": REPO / "02_singlegpu/train.py", "ddp": REPO / "03_ddp/train.py",
                "fsdp": REPO / "04_fsdp/train.py", "lora": REPO / "05_lora/train.py", "tp": REPO / "06_tp/train.py"}
# The games the runs tokenize are prepared once per test session, in a folder of its own (never the
# user's cache), and shared by every run that asks for the same data, tokenizer and row length.
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="kit-tests-datasets-")

# test.sh runs the suite on two pytest-xdist workers. A test file stays on one worker (its module
# fixtures are made once), and the files that use the local Slurm cluster share one worker, which
# brings the cluster up once; they go first, since they mostly wait for the cluster while the other
# worker runs the rest. The longest of the other files (2-3+ minutes each) follow, so that no long
# file starts last while the other worker sits idle (that tail cost about 3 minutes).
SLURM_FILES = ("test_preemption.py", "test_slurm.py")
LONG_FILES = ("test_faults.py", "test_benchmark.py", "test_resume.py", "test_bad_input.py", "test_fsdp_options.py",
              "test_drills.py", "test_pictures.py", "test_workshop_check.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("slurm") and item.path.name not in SLURM_FILES:
            raise pytest.UsageError(f"{item.nodeid} uses Slurm: add its file to SLURM_FILES in tests/conftest.py")
    # stable: file order otherwise
    items.sort(key=lambda item: (item.path.name not in SLURM_FILES, item.path.name not in LONG_FILES))


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFileSlurmTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            file = nodeid.split("::", 1)[0]
            return "slurm" if Path(file).name in SLURM_FILES else file
    return ByFileSlurmTogether(config, log)


# Small and quick: short rows, little evaluation.
QUICK = ["--max_seq_length", "64", "--eval_every", "0", "--eval_rows", "8", "--eval_games", "8"]


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The built-in tiny default (model + data), made by the real download script."""
    out = tmp_path_factory.mktemp("demo")
    subprocess.run([sys.executable, str(REPO / "01_download/download.py"), "--demo", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    return out


@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(size): a small file system of that size (as `mount -o size=` takes it) for the disk-full
    tests, unmounted at the end; the test is skipped where it cannot be mounted (not root)."""
    mounted = []

    def mount(size):
        disk = tmp_path / f"disk-{len(mounted)}"
        disk.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                                               capture_output=True).returncode != 0:
            pytest.skip("cannot mount a small tmpfs here (needs root)")
        mounted.append(disk)
        return disk
    yield mount
    for disk in mounted:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def one_thread_env():
    """This environment, with one thread per process (the ranks share the machine's cores)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_step(step, args, nproc=1, timeout=600, check=True):
    """Run a training step the way a user does: plain python for step 2, torchrun for the others."""
    if step == "single":
        command = [STEP_SCRIPTS[step]]
    else:
        command = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   STEP_SCRIPTS.get(step, step)]  # or a script's path
    result = run_python([*command, *args], timeout=timeout)  # torchrun's ranks are processes of their own
    if check and result.returncode != 0:
        raise AssertionError(f"{step} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


# What the libraries WarmPython imports read from the environment as they are imported (caches, offline
# modes, threads, home): a warm Python serves only runs whose environment is its own there.
READ_AT_IMPORT = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_",
                  "PYTHON", "LD_", "HOME", "XDG_", "CUDA", "TMPDIR")


def read_at_import(env):
    return tuple(sorted((name, value) for name, value in env.items() if name.startswith(READ_AT_IMPORT)))


class WarmPython:
    """tests/warm_python.py: a Python that has imported torch, transformers and datasets and runs each
    Python script in a child it forks (seconds saved per run). One is started per test worker for the
    tests' usual environment (one_thread_env), and one for another environment the second time a run
    asks for it (test_readme_commands' offline one, say; a folder of a test's own is asked for once):
    at most MOST at a time, each holding those libraries' memory."""
    MOST = 3
    servers = {}  # what an environment gives the imports (read_at_import) -> its process, oldest use first
    asked = set()  # the environments a run has asked for once
    usual = None
    choosing = threading.Lock()  # test_readme_commands runs two at a time

    @classmethod
    def server(cls, env):
        """The warm Python for this environment, or None where the run should start cold."""
        key = read_at_import(env)
        with cls.choosing:
            if key not in cls.servers:
                cls.usual = cls.usual or read_at_import(one_thread_env())  # as at the first run
                if key != cls.usual and key not in cls.asked:
                    cls.asked.add(key)
                    return None
                if len(cls.servers) >= cls.MOST:
                    victim = cls.servers.pop(next(k for k in cls.servers if k != cls.usual))
                    with victim.lock:  # after the script it runs now, if any
                        victim.stdin.close()  # it leaves when its input ends
                cls.servers[key] = subprocess.Popen([sys.executable, str(REPO / "tests/warm_python.py")], env=env,
                                                    cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                    stderr=subprocess.DEVNULL, text=True)
                cls.servers[key].lock = threading.Lock()  # it runs one script at a time
            cls.servers[key] = cls.servers.pop(key)  # the newest use last
            return cls.servers[key]

    @staticmethod
    def run(process, command, env, timeout, cwd):
        with process.lock, tempfile.TemporaryDirectory() as folder:
            stdout, stderr = Path(folder, "stdout"), Path(folder, "stderr")
            stdout.touch()
            stderr.touch()
            request = {"argv": command[1:], "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr),
                       "timeout": timeout}
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            answer = process.stdout.readline()
            assert answer, "tests/warm_python.py ended"
            answer = json.loads(answer)
            if answer["timed_out"]:
                raise subprocess.TimeoutExpired(command, timeout, stdout.read_text(), stderr.read_text())
            return subprocess.CompletedProcess(command, answer["returncode"], stdout.read_text(), stderr.read_text())


def run_python(args, env=None, timeout=600, cwd=REPO, check=False):
    """`python SCRIPT ARGS` (or -m MODULE ARGS) as subprocess.run(..., capture_output=True, text=True) runs
    it (stdin: nothing; `env`, else this one with a thread per process; `check` as there), by WarmPython
    where it can."""
    command = [sys.executable, *map(str, args)]
    env = env if env is not None else one_thread_env()
    warm = None if str(args[0]).startswith("-") and args[0] != "-m" else WarmPython.server(env)
    if warm is None:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                                stdin=subprocess.DEVNULL)
    else:
        result = WarmPython.run(warm, command, env, timeout, cwd)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, command, result.stdout, result.stderr)
    return result


def run_ranks(tmp_path, source, nproc=2, timeout=300):
    """`source` as a script under torchrun (gloo, `nproc` CPU processes); its output, rank by rank
    (each rank prints to its own file: lines printed at once on one stdout can interleave). Each rank
    leaves as the kit's ranks do (common/errors.py: leave_after_success), so that a gloo group's
    worker thread cannot abort a finished rank while Python shuts down."""
    script = tmp_path / "ranks.py"
    stdout = f"{str(tmp_path)!r} + '/stdout-rank' + os.environ['RANK'] + '.txt'"
    own_file = f"import os, sys\nsys.stdout = open({stdout}, 'w', buffering=1)\n"
    leave = "from common.errors import leave_after_success\nleave_after_success()\n"
    script.write_text(own_file + textwrap.dedent(source) + leave)
    run_step(script, [], nproc=nproc, timeout=timeout)
    return "".join((tmp_path / f"stdout-rank{rank}.txt").read_text() for rank in range(nproc))  # rank by rank


def read_metrics(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def with_changed(args, change):
    """args with one option changed: [--flag] is added; [--option, value] replaces its value, or is added."""
    args = list(args)
    option, *value = change
    if option in args and value:
        args[args.index(option) + 1] = value[0]
    else:
        args += change
    return args


def demo_args(demo, output_dir):
    return ["--model", demo / "model", "--data_dir", demo / "data", "--output_dir", output_dir, *QUICK]


# The equivalence settings: unpacked rows of different lengths (so a wrong loss weighting would
# show) and a small learning rate (see tests/test_equivalence.py for why).
EQUIVALENCE_STEPS = 6
EQUIVALENCE = ["--max_steps", EQUIVALENCE_STEPS, "--no_packing", "--learning_rate", 1e-4]


@pytest.fixture(scope="session")
def single_reference(demo, tmp_path_factory):
    """02 on one process, global batch of 8 rows as 2 rows × 4 micro-batches: the run every
    distributed configuration must reproduce."""
    out = tmp_path_factory.mktemp("single_reference")
    run_step("single", demo_args(demo, out) + EQUIVALENCE + ["--total_batch_size", 8, "--batch_size_per_device", 2])
    return out


# The run the resume, fault and damaged-checkpoint tests continue: 6 steps, a checkpoint every 2
# (the last 2 kept), a global batch of 8 rows (1 process × 2 rows × 4 micro-batches, or 2 ranks × 2 × 2).
RESUMABLE_STEPS = 6
RESUMABLE = ["--max_steps", RESUMABLE_STEPS, "--save_every", 2, "--keep_checkpoints", 2,
             "--total_batch_size", 8, "--batch_size_per_device", 2]
RANKS = {"single": 1, "ddp": 2, "fsdp": 2}


@pytest.fixture(scope="session")
def uninterrupted(demo, tmp_path_factory):
    """uninterrupted(step): that step's RESUMABLE run from start to end, made once per session."""
    runs = {}

    def run(step):
        if step not in runs:
            runs[step] = tmp_path_factory.mktemp(f"uninterrupted-{step}") / "run"
            run_step(step, demo_args(demo, runs[step]) + RESUMABLE, nproc=RANKS[step])
        return runs[step]
    return run


def assert_same_run(reference_dir, other_dir, tolerance, weights=True):
    """Same per-step losses (and final weights) as the reference run, within `tolerance`."""
    from safetensors.torch import load_file
    reference, other = read_metrics(reference_dir), read_metrics(other_dir)
    assert [r["step"] for r in other] == [r["step"] for r in reference]
    for ref, got in zip(reference, other):
        assert got["tokens"] == ref["tokens"], "a different global batch"
        assert abs(got["loss"] - ref["loss"]) <= tolerance, (ref["step"], ref["loss"], got["loss"])
    if weights:
        ref_weights = load_file(Path(reference_dir) / "final/model.safetensors")
        got_weights = load_file(Path(other_dir) / "final/model.safetensors")
        assert ref_weights.keys() == got_weights.keys()
        worst = max((ref_weights[k] - got_weights[k]).abs().max().item() for k in ref_weights)
        assert worst <= tolerance, worst
