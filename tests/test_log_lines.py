"""Issue 35, point 3: an `error:`, `warning:` or `preempted:` line starts a line of its own after a
progress bar, in a log file as on a terminal, so that `grep '^error:'` finds it. Lines are split
at line feeds only, as grep splits them (Python's splitlines also splits at the bar's carriage
returns, and would find the line where grep does not)."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import QUICK, REPO, STEP_SCRIPTS

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def grep(pattern, text):
    return [line for line in text.split("\n") if re.match(pattern, line)]


@pytest.mark.quick
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_line_said_during_a_progress_bar_starts_a_line(tmp_path, rank):
    """Rank 0 draws a bar on stderr and says a warning (stderr) and a preempted line (stdout), both
    into one log; rank 1 draws no bar, but rank 0's bar is on the job's shared log before its line."""
    script = tmp_path / "bar.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from tqdm import tqdm
        from common.errors import say
        if os.environ["RANK"] == "0":
            bar = tqdm(range(4), desc="train", mininterval=0)
            bar.update(1)
            say("warning: checkpoint unreadable", file=sys.stderr)
            bar.update(1)
            say("preempted: saved a checkpoint at step 2")
            bar.update(1)
        else:
            sys.stderr.write("train:  50%|#####     | 2/4"); sys.stderr.flush()  # rank 0's, on the shared log
        say("error: no progress for 10 s", file=sys.stderr)
    """))
    log = tmp_path / "log.txt"
    with log.open("w") as file:
        subprocess.run([sys.executable, str(script)], stdout=file, stderr=file, env={**ENV, "RANK": rank},
                       cwd=REPO, check=True, timeout=60)
    text = log.read_bytes().decode()  # not read_text: it turns the bar's \r into \n
    assert len(grep("^error: no progress for 10 s$", text)) == 1, repr(text)
    if rank == "0":
        assert len(grep("^warning: checkpoint unreadable$", text)) == 1, repr(text)
        assert len(grep("^preempted: saved a checkpoint at step 2$", text)) == 1, repr(text)
        assert "train:  50%" in text.split("warning:")[1]  # the bar goes on below the lines


def test_the_preempted_line_of_a_redirected_run_is_found_by_grep(demo, tmp_path):
    """Ctrl-C in the middle of step 2's training, its output redirected into one file as Slurm
    does: the run saves, stops, and says so while its bar is drawn."""
    log, output_dir = tmp_path / "train.log", tmp_path / "run"
    args = ["--model", demo / "model", "--data_dir", demo / "data", "--output_dir", output_dir, *QUICK,
            "--max_steps", 500, "--total_batch_size", 4]
    with log.open("w") as file:
        process = subprocess.Popen([sys.executable, str(STEP_SCRIPTS["single"]), *map(str, args)], stdout=file,
                                   stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
        try:
            deadline = time.time() + 120
            while not (output_dir / "metrics.jsonl").is_file() or not (output_dir / "metrics.jsonl").read_text():
                assert process.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            process.kill()
    text = log.read_bytes().decode()  # not read_text: it turns the bar's \r into \n
    assert "train:" in text and grep(r"^preempted: saved a checkpoint at step \d+ .*stopped by Ctrl-C", text), \
        repr(text[-2000:])
