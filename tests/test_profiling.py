"""--profile_steps and --collective_timeout at their edges (issue 36, cases 9 and 11): a range past
--max_steps, or a timeout no timer can hold, is one error line before any work (they ended in a
SIGSEGV after the run, a run with no trace and no word, or a watchdog thread that died); a run
stopped in the middle of its profiled steps ends normally with the steps it recorded; a resumed run
past the range says that nothing is profiled."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from common.arguments import check_arguments, training_arguments
from common.errors import UserError
from conftest import RESUMABLE, REPO, STEP_SCRIPTS, demo_args, read_metrics, run_step, with_changed


def checked(*options):
    args = training_arguments("test").parse_args(["--output_dir", "unused", *map(str, options)])
    check_arguments(args)
    return args


@pytest.mark.quick
@pytest.mark.parametrize("steps, max_steps", [("2-3", 2), ("3-4", 2), ("5-7", 4), ("2-5", 4), ("3", 2)])
def test_a_profile_range_past_the_run_is_refused(steps, max_steps):
    first, _, last = steps.partition("-")
    with pytest.raises(UserError, match=rf"^--profile_steps {first}-{last or first} reaches past --max_steps "
                                        rf"{max_steps}: profile steps of the run, from 1 to {max_steps}$"):
        checked("--max_steps", max_steps, "--profile_steps", steps)
    assert checked("--max_steps", max_steps, "--profile_steps", f"1-{max_steps}").profile_steps == (1, max_steps)


@pytest.mark.quick
@pytest.mark.parametrize("seconds", [10_000_000_000, 604_801, 0])
def test_a_collective_timeout_no_timer_holds_is_refused(seconds):
    """10^10 s: the watchdog thread died (OverflowError) and the run went on unwatched; under
    torchrun a 31-line traceback."""
    with pytest.raises(UserError, match=rf"--collective_timeout must be from 1 second to a week, 604800 "
                                        rf"\(got {seconds}\)"):
        checked("--collective_timeout", seconds)
    assert checked("--collective_timeout", 604_800).collective_timeout == 604_800


def test_the_refusal_comes_before_any_work(demo, tmp_path):
    result = run_step("single", demo_args(demo, tmp_path / "run") + ["--max_steps", 2, "--profile_steps", "2-3"],
                      check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["error: --profile_steps 2-3 reaches past --max_steps 2: profile "
                                                  "steps of the run, from 1 to 2"]
    assert not (tmp_path / "run").exists()


def test_a_run_stopped_while_profiling_ends_normally_with_its_trace(demo, tmp_path):
    """Ctrl-C in the middle of the profiled steps: exit 0 (it was SIGSEGV, 139, as the interpreter
    ended with the profiler running), and the steps recorded are written."""
    out = tmp_path / "run"
    args = demo_args(demo, out) + ["--max_steps", 500, "--profile_steps", "2-400", "--total_batch_size", 4]
    process = subprocess.Popen([sys.executable, str(STEP_SCRIPTS["single"]), *map(str, args)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.time() + 120
        while len(read_metrics(out) if (out / "metrics.jsonl").is_file() else []) < 3:
            assert process.poll() is None and time.time() < deadline, "the run did not get going"
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-3000:]
    trace = json.loads((out / "profile/rank0.pt.trace.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
    assert (out / "profile/summary-rank0.txt").read_text().startswith("rank 0: ")


def test_a_resumed_run_past_the_range_says_nothing_is_profiled(demo, uninterrupted, tmp_path):
    import shutil
    out = tmp_path / "run"
    shutil.copytree(uninterrupted("single"), out)
    args = with_changed(demo_args(demo, out) + RESUMABLE, ["--max_steps", 8]) + ["--profile_steps", "2-3", "--resume"]
    result = run_step("single", args)
    assert "note: --profile_steps 2-3: this run resumes after step 6, past them: nothing is profiled" in result.stdout
    assert not (out / "profile").exists()


@pytest.mark.quick
def test_the_summary_counts_nested_ranges_once():
    """MuonWithAdamW's step holds Muon's and AdamW's, and Muon's holds its all-to-alls: each
    millisecond counts once, in the outermost range (the summary once gave an optimiser share of
    twice its time). Times in µs, in one 1,000 µs step."""
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from common.profiling import summary

    def event(name, start, end):
        events.append(FunctionEvent(id=len(events), name=name, thread=0, start_us=start, end_us=end, stack=[]))

    events = []
    event("ProfilerStep#1", 0, 1000)
    event("c10d::allreduce_", 100, 200)  # the loop's: communication
    event("Optimizer.step#MuonWithAdamW.step", 500, 900)
    event("Optimizer.step#Muon.step", 500, 800)
    event("c10d::alltoall_base_", 550, 600)  # Muon's: the optimiser's
    event("Optimizer.step#AdamW.step", 800, 900)
    events = EventList(events)
    events._build_tree()  # who runs in whom, from the times, as the profiler does
    text = summary(events, 0)
    shares = dict(re.findall(r"^  (communication|optimizer|compute) +([\d.]+)%", text, re.MULTILINE))
    assert shares == {"communication": "10.0", "optimizer": "40.0", "compute": "50.0"}, text
