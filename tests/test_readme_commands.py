"""The README files' commands work as written. Every command line in a ```bash block of a README.md
is either run here, literally, from the repository root with the kit's environment first on PATH
(as after `source .venv/bin/activate`; a plain `python SCRIPT ARGS` line by conftest.run_python, in a
Python forked from one that imported the libraries already), or matches SKIPPED, which says why it
is not run here (cluster-only, needs the real model or the network, or takes minutes). A command
that is neither fails the test: a new README command has to be decided on.

The commands run here write nothing into the repository (the prepared games go to the session's
HF_DATASETS_CACHE, see conftest.py). The generation snippet of the main README runs too, on a model
that a one-step training run makes in a temporary folder."""
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, run_python

ENV_BIN = Path(sys.executable).parent  # the kit's environment: .venv/bin under ./test.sh

# Commands run here: (pattern, the exit statuses that count as success). The first match decides.
REFUSED = r"^python submit\.py .*--gpu_memory_gib 2 --dry-run$"  # the README shows the plan check's refusal
RUN = [
    (r"^diff \S+/train\.py \S+/train\.py$", {0, 1}),  # diff exits 1 when the files differ: the lesson
    (r"^python \S+\.py --help$", {0}),
    (r"^python 01_download/prepare\.py --model demo/model --data_dir demo/data$", {0}),
    (r"^python tools/check_plan\.py --model demo/model ", {0}),
    (r"^python tools/estimate_memory\.py ", {0}),
    (REFUSED, {2}),
    (r"^python submit\.py .*--dry-run$", {0}),
    (r"^python benchmark/sweep\.py --slurm .*--dry-run$", {0}),
    (r"^python benchmark/muon_step\.py$", {0}),
    (r"^torchrun --standalone --nproc-per-node 2 benchmark/tp_layouts\.py$", {0}),
]

# Commands not run here, and why. A command may match several; every entry must match one.
SKIPPED = {
    r"^\./demo\.sh\b": "the demo itself: installs and trains three runs, minutes",
    r"^\./test\.sh\b": "the test suite itself",
    r"^pytest tests/": "a part of the test suite itself",
    r"\b(sbatch|squeue|scancel|srun|sacct|sinfo)\b": "cluster-only: needs Slurm",
    r"^tail -f ": "cluster-only: follows a job's log",
    r"^cat runs/fsdp-1234/": "cluster-only: the output of a Slurm job",
    r"^python submit\.py (?!.*--dry-run)": "submits a job: needs Slurm (the --dry-run forms are run)",
    r"^tests/slurm/local_cluster\.sh |^\. /tmp/kit-slurm/": "starts or uses the local Slurm cluster, as root "
                                                            "(tests/test_slurm.py and test_preemption.py do)",
    r"/scratch/": "cluster-only: the shared disk, with the real model and games",
    r"^git clone ": "needs the network",
    r"^bash install\.sh\b|^pip install ": "installs packages from PyPI (./demo.sh and ./test.sh run install.sh)",
    r"^export HF_HOME=": "cluster-only: the shared cache",
    r"^python 01_download/download\.py --demo --out demo$": "rebuilds demo/, as ./demo.sh and ./test.sh do; the "
                                                           "`demo` fixture runs it for the tests",
    r"^(torchrun|python) (?!.*--help).*\b0[2-6]_\w+/train\.py": "a training run of 100 steps, minutes on a CPU "
                                                                "(the training tests run every step)",
    r"^python tools/export\.py runs/fsdp/": "needs the checkpoint of the 100-step run above (tests/test_export.py "
                                              "exports one)",
    r"^python benchmark/run\.py( --quick)?$": "the benchmark: 35 minutes (--quick: minutes, tests/test_benchmark.py)",
    r"^python benchmark/gpu_check\.py$": "the GPU check on the full 7B shape: a GPU node, 8 minutes "
                                         "(tests/test_gpu_check.py runs a shrunk shape)",
    r"^python benchmark/learn_chess\.py$": "the learning run: 10 minutes (tests/test_learn_chess.py runs --quick)",
    r"^ONEDNN_MAX_CPU_ISA=AVX2 .*python benchmark/learn_chess\.py --out ": "the learning run as on an AVX2-only CPU: "
                                                                           "10 minutes",
    r"^python play\.py --model runs/learn_chess/": "plays the learning run's model (tests/test_play.py plays the demo "
                                                  "model and a sub-word one, also as a UCI engine)",
    r"^tensorboard ": "starts a server that runs until stopped",
    r"^python -m torch\.distributed\.flight_recorder\.fr_trace ": "reads the Flight Recorder dumps of a hung NCCL job "
                                                                 "(tests/test_hang.py makes gloo's)",
    r"^torchrun .*--nproc-per-node 4 benchmark/tp_layouts\.py": "4 ranks, a few minutes on 2 cores (the 2-rank form "
                                                                  "is run)",
    r"^python benchmark/sweep\.py$": "the sweep: minutes (tests/test_sweep.py runs a tiny one)",
    r"^torchrun --nproc-per-node 2 benchmark/muon_step\.py$": "Muon's designs timed: a minute (tests/test_muon.py "
                                                              "runs it with --steps 1)",
    r"^python benchmark/sweep\.py --slurm (?!.*--dry-run)": "submits a job array: needs Slurm",
    r"^python benchmark/sweep\.py --collect ": "needs a finished sweep on Slurm (tests/test_sweep.py collects one)",
    r"^python workshop/check\.py ": "reads the runs of the exercise's training commands "
                                    "(tests/test_workshop_check.py runs every check on real runs)",
    r"^python tools/check_plan\.py --model benchmark/codellama-7b-config\.json ": "the plan check of the whole 7B "
                                                                                  "shape: a minute on 2 cores (tests/"
                                                                                  "test_check_plan.py checks it)",
}


def readme_files():
    """Every README.md of the kit: tracked, or new and not ignored."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*README.md"],
                            cwd=REPO, capture_output=True, text=True)
    if listed.returncode == 0:
        names = sorted(set(listed.stdout.split()))
    else:  # not a git checkout
        names = sorted(str(p.relative_to(REPO)) for p in REPO.rglob("README.md") if ".venv" not in p.parts)
    return [REPO / name for name in names if Path(name).name == "README.md" and (REPO / name).is_file()]


def without_comment(line):
    """The line up to a `#` that starts a comment: outside quotes, at the start or after a blank."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def commands_in(text):
    """The command lines of the ```bash blocks (fences may be indented), continuations joined."""
    commands, block, pending = [], None, ""
    for line in text.splitlines():
        fence = re.match(r"^(\s*)```(\w*)\s*$", line)
        if fence and block is None:
            block = fence.group(1) if fence.group(2) == "bash" else False
            continue
        if fence:
            block = None
            continue
        if block is None or block is False:
            continue
        line = line.removeprefix(block).rstrip()
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        command = " ".join(without_comment(pending + line.strip()).split())
        pending = ""
        if command:
            commands.append(command)
    return commands


def all_commands():
    """{command: [README files it is in]}"""
    found = {}
    for path in readme_files():
        for command in commands_in(path.read_text()):
            found.setdefault(command, []).append(str(path.relative_to(REPO)))
    return found


def run_rule(command):
    return next((statuses for pattern, statuses in RUN if re.search(pattern, command)), None)


def skip_reasons(command):
    return [reason for pattern, reason in SKIPPED.items() if re.search(pattern, command)]


def test_every_readme_command_is_run_or_skipped_for_a_reason():
    commands = all_commands()
    assert len(commands) > 20, "no README commands found"
    undecided = [f"{c}  ({', '.join(where)})" for c, where in commands.items() if not run_rule(c)
                 and not skip_reasons(c)]
    assert not undecided, ("README commands neither run nor skipped: add each to RUN (a few seconds, writes nothing "
                           "into the repository) or to SKIPPED with its reason:\n" + "\n".join(undecided))
    both = [c for c in commands if run_rule(c) and skip_reasons(c)]
    assert not both, "README commands both run and skipped:\n" + "\n".join(both)
    stale = [pattern for pattern in SKIPPED if not any(re.search(pattern, c) for c in commands)]
    assert not stale, "SKIPPED entries that match no README command any more: " + ", ".join(stale)


# ---- running them ---------------------------------------------------------------------------------

def environment():
    """As after `source .venv/bin/activate`; offline, one thread per process."""
    return {**os.environ, "PATH": f"{ENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "VIRTUAL_ENV": str(ENV_BIN.parent), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(command, cwd=REPO, timeout=180):
    """A command line through bash; a plain `python SCRIPT ARGS` line (no shell syntax), or a list
    [python, SCRIPT, ARGS...], by run_python: the same program in a Python that has the libraries
    imported (seconds of CPU less for each)."""
    began = time.perf_counter()
    if isinstance(command, str) and re.fullmatch(r"python \S+\.py[\w\s./=,:-]*", command):
        command = shlex.split(command)
    if isinstance(command, list):
        done = run_python(command[1:], env=environment(), timeout=timeout, cwd=cwd)
    else:
        done = subprocess.run(command, shell=True, executable="/bin/bash", cwd=cwd, env=environment(),
                              capture_output=True, text=True, timeout=timeout)
    return done, round(time.perf_counter() - began, 1)


def generation_snippet():
    """The python block of the README files that loads a trained model and checks its next move."""
    blocks = [b for path in readme_files() for b in re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
              if "common.notation" in b and "generate(" in b]
    assert len(blocks) == 1, "the README's generation snippet (a ```python block with `common.notation`) is gone"
    return blocks[0]


def train_and_generate(tmp_path):
    """One optimiser step of 02_singlegpu into tmp_path, then the snippet on its final/."""
    output_dir = tmp_path / "tiny"
    trained, seconds = run([sys.executable, str(REPO / "02_singlegpu/train.py"), "--output_dir", str(output_dir),
                            "--max_steps", "1", "--total_batch_size", "2", "--batch_size_per_device", "2",
                            "--max_seq_length", "32", "--eval_rows", "2", "--eval_games", "2", "--eval_every", "0"])
    if trained.returncode != 0:
        return trained, seconds
    snippet = generation_snippet()
    shown = '"runs/demo/02_singlegpu/final"'
    assert shown in snippet, f"the snippet no longer loads {shown}"
    script = tmp_path / "generate.py"
    script.write_text(snippet.replace(shown, repr(str(output_dir / "final"))))
    generated, more = run([sys.executable, str(script)], cwd=tmp_path)
    return generated, seconds + more


@pytest.fixture(scope="module")
def demo_in_repo():
    """demo/ as ./demo.sh and ./test.sh leave it; built the same way where it is missing."""
    if not ((REPO / "demo/model/config.json").is_file() and (REPO / "demo/data/train.jsonl").is_file()):
        done, _ = run("python 01_download/download.py --demo --out demo")
        assert done.returncode == 0, done.stderr[-2000:]
    return REPO / "demo"


@pytest.fixture(scope="module")
def results(demo_in_repo, tmp_path_factory):
    """{command: (completed process, seconds)} for every command in RUN, and the snippet's under
    "generation snippet"; two at a time (the machine may have only 2 cores)."""
    to_run = [c for c in all_commands() if run_rule(c)]
    tmp_path = tmp_path_factory.mktemp("readme")
    with ThreadPoolExecutor(max_workers=2) as pool:
        snippet = pool.submit(train_and_generate, tmp_path)  # the longest first
        futures = {command: pool.submit(run, command) for command in to_run}
        found = {command: future.result() for command, future in futures.items()}
        found["generation snippet"] = snippet.result()
    return found


def test_readme_commands_run_as_written(results):
    failed = []
    for command, (done, seconds) in results.items():
        if command == "generation snippet":
            continue
        if done.returncode not in run_rule(command):
            failed.append(f"$ {command}\nexit status {done.returncode} (expected {sorted(run_rule(command))}), "
                          f"{seconds} s\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    assert not failed, "\n\n".join(failed)


def test_the_plan_check_refusal_is_one_error_line(results):
    (done, _), = [result for command, result in results.items() if re.search(REFUSED, command)]
    assert done.stderr.startswith("error: plan check: does NOT fit:"), done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_the_diffs_show_each_steps_lesson(results):
    diffs = {command: done for command, (done, _) in results.items() if command.startswith("diff ")}
    assert len(diffs) == 4, sorted(diffs)  # steps 3, 4, 5 and 6
    assert all(done.returncode == 1 and done.stdout for done in diffs.values())


def test_generation_snippet_runs_on_a_trained_model(results):
    done, seconds = results["generation snippet"]
    assert done.returncode == 0, f"{seconds} s\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert re.search(r"^next move: '.*' \((legal|not legal) after e2e4 e7e5 g1f3 b8c6\)$", done.stdout, re.M), \
        done.stdout[-2000:]


def test_the_front_page_is_read_in_five_minutes():
    """What it is, the two commands, the steps, the cluster path, where to go next: the rest is one link away."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move a section to the page it belongs on"
