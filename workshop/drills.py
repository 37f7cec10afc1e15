"""Failure drills: a small run of the built-in demo model on CPU ranks, one real fault injected from
outside the training code, and a question: what went wrong, and where? The answer is checked.

    python workshop/drills.py list
    python workshop/drills.py start frozen-rank          # runs the job, injects the fault, keeps its log
    python workshop/drills.py answer frozen-rank --rank 1 --phase training --cause frozen

The faults come from outside, as on a cluster: signals to one rank's process (SIGSTOP freezes it,
SIGKILL kills it, SIGSTOP/SIGCONT over and over makes it a straggler, SIGTERM or USR2 is a
preemption), a learning rate that makes the loss non-finite, or a "node" (a second torchrun
--nnodes invocation) that gets an output folder of its own. The step scripts know nothing of the
drills: what the participant reads is what the kit prints on any job. Which rank (node, step) is at
fault is drawn at random per attempt, from the seed in DRILL_FOLDER/drill.json.
Needs the demo assets (`./demo.sh` or `python 01_download/download.py --demo --out demo`).
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
STEPS = {"ddp": REPO / "03_ddp/train.py", "fsdp": REPO / "04_fsdp/train.py"}
QUICK = ["--max_seq_length", "64", "--eval_every", "0", "--eval_rows", "8", "--eval_games", "8"]
CAUSES = ("frozen", "killed", "straggler", "learning-rate", "unshared-folder", "preempted")
PHASES = ("loading", "untrained evaluation", "training", "evaluation", "checkpoint", "final model")
START_WITHIN_S = 300  # the demo job loads in seconds; a busy laptop may take a minute


class DrillError(Exception):
    """A problem the participant can fix (no demo assets, no drill started): one line, exit status 2."""


class Drill:
    """One fault: `draw()` picks it from the seed, `inject()` runs the job and injects it, `answers()` are
    the right answers, and `why` what a wrong answer to each question overlooked (a hint, not the answer)."""
    summary = ""  # what `list` says of it
    questions = ()
    why = {}

    def __init__(self, folder, seed, demo, timeout_s, ranks, facts=None):
        self.folder, self.seed, self.demo, self.timeout_s, self.ranks = Path(folder), seed, Path(demo), timeout_s, ranks
        self.rng = random.Random(seed)
        self.drawn = self.draw()  # the fault, from the seed: the same seed, the same fault
        self.run = self.folder / "run"
        self.log = self.folder / "log.txt"
        self.facts = facts or {}  # what the drill saw as it injected, kept in drill.json for the answer
        self.jobs = []  # the torchruns it started, ended with the drill (they run in sessions of their own)

    def answers(self):
        """The right answer to each question: what was drawn, unless the run's files tell it."""
        return {question: self.drawn[question] for question in self.questions}

    def args(self, run=None, *extra):
        """The job's arguments: the demo, small and quick, with `extra` (which may change a QUICK one)."""
        quick = [value for option, value in zip(QUICK[::2], QUICK[1::2]) if option not in extra for value in
                 (option, value)]
        return ["--model", self.demo / "model", "--data_dir", self.demo / "data", "--output_dir", run or self.run,
                *quick, "--collective_timeout", self.timeout_s, *extra]

    def launch(self, step, nproc, args, log=None, torchrun=("--standalone",)):
        """The step under python -m launch.torchrun, as a user starts it; its output in the log."""
        command = [sys.executable, "-m", "launch.torchrun", *torchrun, f"--nproc-per-node={nproc}",
                   str(STEPS[step]), *map(str, args)]
        with open(log or self.log, "a") as out:
            out.write(f"$ {' '.join(command[1:])}\n")
            out.flush()
            self.jobs.append(subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                           "TOKENIZERS_PARALLELISM": "false",
                                                                           "PYTHONUNBUFFERED": "1"}))
        return self.jobs[-1]

    def steps_done(self):
        metrics = self.run / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    def wait_until(self, condition, job, what):
        deadline = time.time() + START_WITHIN_S
        while not condition():
            if job.poll() is not None:
                raise DrillError(f"the job ended before {what}: see {self.log}")
            if time.time() > deadline:
                raise DrillError(f"the job did not reach {what} in {START_WITHIN_S} s: see {self.log}")
            time.sleep(0.01)

    def finish(self, job, within_s=None):
        """Wait for the job to end by itself; end it, and say so, if it does not within `within_s`."""
        try:
            job.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            end_job(job)
            raise DrillError(f"the job did not end by itself within {within_s} s: ended it; see {self.log}")
        return job.returncode


def ranks_of(job, nproc):
    """The job's rank processes, by global rank (torchrun starts them a moment after itself)."""
    deadline = time.time() + START_WITHIN_S
    while time.time() < deadline:
        ranks = {}
        for child in psutil.Process(job.pid).children(recursive=True):
            try:
                if "train.py" in " ".join(child.cmdline()) and "RANK" in child.environ():
                    ranks[int(child.environ()["RANK"])] = child
            except psutil.Error:
                pass
        if len(ranks) == nproc:
            return ranks
        if job.poll() is not None:
            raise DrillError("torchrun ended before it started its ranks")
        time.sleep(0.05)
    raise DrillError(f"torchrun did not start {nproc} ranks in {START_WITHIN_S} s")


def end_job(job):
    """Kill what is left of a job (a drill stopped early): its torchrun and its ranks."""
    if job.poll() is None:
        try:
            ranks = psutil.Process(job.pid).children(recursive=True)
        except psutil.Error:
            ranks = []
        for process in ranks:
            with_gone(process.kill)
        job.kill()
    job.wait()


class FrozenRank(Drill):
    """SIGSTOP to one rank: it neither dies nor answers; the others wait for it in a collective."""
    summary = "a rank stops taking part (SIGSTOP)"
    questions = ("rank", "phase", "cause")
    why = {"rank": "a rank the error line finds `waiting in` or `busy in` something answered the watchdog: it was "
                   "alive. Which one did not answer?",
           "phase": "the error line says in which phase of the run there was no progress",
           "cause": "no rank died (no exit code -9 in the log): the job ended on its own watchdog, exit status 3"}

    def draw(self):
        return {"rank": self.rng.randrange(self.ranks), "phase": self.rng.choice(["untrained evaluation", "training"]),
                "cause": "frozen"}

    def inject(self):
        rank, phase = self.drawn["rank"], self.drawn["phase"]
        extra = ["--max_steps", 30, "--total_batch_size", 2 * self.ranks, "--batch_size_per_device", 2]
        if phase == "untrained evaluation":  # long enough to be frozen inside it
            extra += ["--eval_games", 64]
        job = self.launch("ddp", self.ranks, self.args(None, *extra))
        ranks = ranks_of(job, self.ranks)
        if phase == "training":
            self.wait_until(lambda: self.steps_done() >= 2, job, "its second step")
        else:  # rank 0 prints the batch plan just before the untrained model's evaluation
            self.wait_until(lambda: "total batch" in self.log.read_text(), job, "the first evaluation")
        ranks[rank].send_signal(signal.SIGSTOP)
        try:
            self.finish(job, self.timeout_s + 120)
        finally:
            for process in ranks.values():
                with_gone(process.kill)
        self.facts = {"returncode": job.returncode}


class KilledRank(Drill):
    """SIGKILL to one rank in the middle of training (out of memory, a node lost)."""
    summary = "a rank dies (SIGKILL)"
    questions = ("rank", "cause")
    why = {"rank": "the ranks that say `stopped: rank N lost another rank` are the survivors; torchrun's report "
                   "names the one that failed, with its exit code",
           "cause": "an exit code of -9 is a process killed by SIGKILL, not a hang (the watchdog's exit status is 3)"}

    def draw(self):
        return {"rank": self.rng.randrange(self.ranks), "cause": "killed"}

    def inject(self):
        rank = self.drawn["rank"]
        job = self.launch("ddp", self.ranks, self.args(None, "--max_steps", 30, "--total_batch_size", 2 * self.ranks,
                                                       "--batch_size_per_device", 2))
        ranks = ranks_of(job, self.ranks)
        self.wait_until(lambda: self.steps_done() >= 2, job, "its second step")
        time.sleep(self.rng.uniform(0, 0.3))  # somewhere in the step: forward, backward or optimiser
        ranks[rank].send_signal(signal.SIGKILL)
        self.finish(job, 120)
        self.facts = {"returncode": job.returncode}


class Straggler(Drill):
    """One rank stopped and continued over and over (SIGSTOP/SIGCONT: a slow or shared core, a noisy
    neighbour): the job finishes, slowly; the profile of each rank shows who waits for whom."""
    summary = "one rank is slower than the others (SIGSTOP/SIGCONT, over and over)"
    questions = ("rank", "cause")
    why = {"rank": "a rank that spends much of its step in communication is waiting there for a slower one: "
                   "compare the ranks' profile summaries",
           "cause": "the job finished (exit status 0): nothing froze or died, one rank was slower than the others"}

    def draw(self):
        return {"rank": self.rng.randrange(self.ranks), "cause": "straggler"}

    def inject(self):
        rank = self.drawn["rank"]
        job = self.launch("ddp", self.ranks, self.args(None, "--max_steps", 8, "--total_batch_size", 2 * self.ranks,
                                                       "--batch_size_per_device", 2, "--profile_steps", "3-6"))
        slow = ranks_of(job, self.ranks)[rank]
        self.wait_until(lambda: self.steps_done() >= 1, job, "its first step")
        while job.poll() is None:  # stopped 3/4 of the time
            with_gone(slow.suspend)
            time.sleep(0.15)
            with_gone(slow.resume)
            time.sleep(0.05)
        self.facts = {"returncode": job.returncode}


class NonfiniteLoss(Drill):
    """A learning rate far too high: the loss becomes non-finite within a few steps. No rank is at
    fault; the step is the run's, read from its files."""
    summary = "the loss runs away (a learning rate far too high)"
    questions = ("step", "cause")
    why = {"step": "the error line names the step whose loss, or whose weights after the update, were not finite",
           "cause": "the ranks all ran to that step together: no rank froze, died or lagged; what made the loss "
                    "grow is in the run's settings (run.json) and in metrics.jsonl's grad_norm"}

    def draw(self):
        return {}

    def answers(self):
        return {"step": self.steps_done() + 1, "cause": "learning-rate"}  # the first step missing from metrics.jsonl

    def inject(self):
        job = self.launch("ddp", 2, self.args(None, "--max_steps", 30, "--total_batch_size", 4,
                                              "--batch_size_per_device", 2, "--save_every", 1, "--learning_rate", 1e6))
        self.finish(job, START_WITHIN_S)
        self.facts = {"returncode": job.returncode}


class UnsharedFolder(Drill):
    """Three "nodes" of one rank each (three torchrun --nnodes 3 invocations); one is given an
    output folder of its own, as a node whose --output_dir is its local /tmp."""
    summary = "a node writes to a folder that the others cannot see"
    questions = ("node", "cause")
    why = {"node": "the error line names the node that cannot see what rank 0 wrote",
           "cause": "the job stopped before training, with exit status 2 and one error: line: a setting, not a "
                    "fault of a rank"}

    def draw(self):
        return {"node": self.rng.randrange(1, 3), "cause": "unshared-folder"}

    def inject(self):
        node = self.drawn["node"]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        jobs = []
        for rank in range(3):
            own = self.folder / f"node{rank}-local" / "run" if rank == node else None  # its own disk
            args = self.args(own, "--max_steps", 2, "--total_batch_size", 6, "--batch_size_per_device", 2)
            jobs.append(self.launch("fsdp", 1, args, self.folder / f"log-node{rank}.txt",
                                    torchrun=("--nnodes=3", f"--node-rank={rank}", "--master-addr=127.0.0.1",
                                              f"--master-port={port}")))
        returncodes = [self.finish(job, START_WITHIN_S) for job in jobs]
        self.log.write_text("".join((self.folder / f"log-node{rank}.txt").read_text() for rank in range(3)))
        self.facts = {"returncodes": returncodes}


class PreemptedSave(Drill):
    """SIGTERM or USR2 (Slurm's preemption, its time-limit warning) to one rank while the job writes
    a checkpoint; then the drill resumes the run, as a requeued job does."""
    summary = "a preemption in the middle of a checkpoint save, then the resume"
    questions = ("step", "cause")
    why = {"step": "the resumed run says which checkpoint it continued from",
           "cause": "the job ended with exit status 0 and a `preempted:` line: a signal asked it to stop"}

    def draw(self):
        return {"rank": self.rng.randrange(2), "signal": self.rng.choice(["SIGTERM", "SIGUSR2"]),
                "save": self.rng.choice([4, 6, 8])}

    def answers(self):
        """The step the resumed run continued from: the newest complete checkpoint when it started."""
        return {"step": self.facts["newest_complete"], "cause": "preempted"}

    def inject(self):
        rank, signum, target = self.drawn["rank"], signal.Signals[self.drawn["signal"]], self.drawn["save"]
        args = self.args(None, "--max_steps", 14, "--save_every", 2, "--total_batch_size", 4,
                         "--batch_size_per_device", 2)
        job = self.launch("fsdp", 2, args)
        ranks = ranks_of(job, 2)
        at = self.signal_during_a_save(job, ranks[rank], signum, target)
        self.finish(job, 120)
        newest = sorted(path.parent.name for path in self.run.glob("checkpoints/step-*/COMPLETE"))[-1]
        self.facts = {"returncode": job.returncode, "signalled_during_save_of_step": at,
                      "newest_complete": int(newest.removeprefix("step-"))}
        resumed = self.launch("fsdp", 2, args + ["--resume"])
        self.facts["resume_returncode"] = self.finish(resumed, START_WITHIN_S)

    def signal_during_a_save(self, job, process, signum, target):
        """Signal `process` once the checkpoint of step `target` (or a later one, if that save was
        missed: a tiny model's save takes milliseconds) is being written: files, no COMPLETE yet."""
        for step in range(target, 13, 2):
            folder = self.run / "checkpoints" / f"step-{step:06d}"
            self.wait_until(lambda: self.steps_done() >= step - 1, job, f"step {step - 1}")
            while not (folder / "COMPLETE").exists():
                if folder.is_dir() and any(folder.iterdir()) and not (folder / "COMPLETE").exists():
                    process.send_signal(signum)
                    return step
                if job.poll() is not None:
                    raise DrillError(f"the job ended before the save of step {step}: see {self.log}")
        raise DrillError("every save finished before the drill saw it under way (a busy machine?): start again")


def with_gone(action):
    try:
        action()
    except psutil.Error:  # the process has ended already
        pass


DRILLS = {"frozen-rank": FrozenRank, "killed-rank": KilledRank, "straggler": Straggler,
          "nonfinite-loss": NonfiniteLoss, "unshared-folder": UnsharedFolder, "preempted-save": PreemptedSave}


def folder_of(args):
    return Path(args.folder or REPO / "runs" / "drills" / args.drill)


def start(args):
    demo = Path(args.demo)
    if not (demo / "model" / "config.json").is_file() or not (demo / "data").is_dir():
        raise DrillError(f"no demo assets in {demo}: make them with `python 01_download/download.py --demo "
                         f"--out {demo}` (or pass --demo)")
    folder = folder_of(args)
    if folder.exists():
        shutil.rmtree(folder)  # a drill's own folder: a new attempt replaces the last one
    folder.mkdir(parents=True)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    drill = DRILLS[args.drill](folder, seed, demo, args.collective_timeout, args.ranks)
    record = {"drill": args.drill, "seed": seed, "collective_timeout": args.collective_timeout, "ranks": args.ranks}
    (folder / "drill.json").write_text(json.dumps(record))
    print(f"drill {args.drill}: starting a small job on CPU ranks; a fault will come from outside (about a minute)",
          flush=True)
    try:
        drill.inject()
    finally:  # a drill stopped early (an error, Ctrl-C) leaves no job behind, no rank stopped
        for job in drill.jobs:
            end_job(job)
    (folder / "drill.json").write_text(json.dumps({**record, "facts": drill.facts}))
    print(f"done. The job's output: {drill.log}; its output directory: {drill.run}\n"
          f"What went wrong, and where? Answer with: python workshop/drills.py answer {args.drill} "
          + " ".join(f"--{question} ..." for question in drill.questions))


def recorded(folder):
    """The drill started in `folder`, as it ran (its seed and what it saw)."""
    try:
        record = json.loads((folder / "drill.json").read_text())
    except (OSError, ValueError):
        raise DrillError(f"no drill started in {folder}: run `python workshop/drills.py start ...` first")
    if "facts" not in record:
        raise DrillError(f"the drill in {folder} did not finish: start it again")
    try:
        return DRILLS[record["drill"]](folder, record["seed"], REPO / "demo", record["collective_timeout"],
                                       record["ranks"], record["facts"])
    except KeyError:
        raise DrillError(f"{folder / 'drill.json'} is not a drill's record that this kit reads: start the drill again")


def normalised(question, value):
    if value is None:
        return None
    if question == "phase":
        value = re.sub(r" of step \d+$", "", str(value).strip().lower())
    elif question in ("rank", "node", "step"):
        return int(value)
    return str(value).strip().lower()


def answer(args):
    drill = recorded(folder_of(args))
    if type(drill) is not DRILLS[args.drill]:
        raise DrillError(f"{drill.folder} holds another drill than {args.drill}")
    answers = drill.answers()
    given = {question: getattr(args, question) for question in drill.questions}
    if all(value is None for value in given.values()) and sys.stdin.isatty():  # ask, one question at a time
        choices = {"phase": PHASES, "cause": CAUSES}
        for question in drill.questions:
            options = f" ({', '.join(choices[question])})" if question in choices else ""
            given[question] = input(f"{question}{options}? ").strip() or None
    missing = [question for question, value in given.items() if value is None]
    if missing:
        raise DrillError(f"answer every question of the drill {args.drill}: "
                         + " ".join(f"--{question} ..." for question in missing))
    wrong = 0
    for question in drill.questions:
        try:
            right = normalised(question, given[question]) == answers[question]
        except ValueError:
            raise DrillError(f"--{question} takes a number, not {given[question]!r}")
        print(f"{question} {given[question]}: " + ("right" if right else f"wrong: {drill.why[question]}"))
        wrong += not right
    print("all right: well diagnosed." if not wrong else f"{wrong} of {len(drill.questions)} wrong: read "
          f"{drill.log} again (the error line, torchrun's report, {drill.run}) and answer again.")
    return 0 if not wrong else 1


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the drills")
    starting = commands.add_parser("start", help="run a drill's job and inject its fault")
    answering = commands.add_parser("answer", help="check your diagnosis (asked one by one on a terminal)")
    for command in (starting, answering):
        command.add_argument("drill", choices=DRILLS)
        command.add_argument("--folder", help="the drill's folder (default: runs/drills/DRILL)")
    starting.add_argument("--seed", type=int, help="draw the fault from this seed (default: a new one)")
    starting.add_argument("--demo", default=str(REPO / "demo"), help="the demo assets (default: demo/)")
    starting.add_argument("--collective_timeout", type=int, default=20,
                          help="the job's --collective_timeout, seconds (default: 20)")
    starting.add_argument("--ranks", type=int, default=3, choices=range(2, 9), metavar="{2..8}",
                          help="CPU ranks of the drills of a rank: frozen-rank, killed-rank, straggler (default: 3, "
                               "a guess is right one time in three)")
    answering.add_argument("--rank", help="the rank at fault")
    answering.add_argument("--node", help="the node at fault")
    answering.add_argument("--step", help="the optimiser step")
    answering.add_argument("--phase", help=f"the phase of the run: {', '.join(PHASES)}")
    answering.add_argument("--cause", help=f"what happened: {', '.join(CAUSES)}")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_arguments(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # end the drill's jobs too
    try:
        if args.command == "list":
            for name, drill in DRILLS.items():
                print(f"{name:16} {drill.summary}")
            return 0
        if args.command == "start":
            start(args)
            return 0
        return answer(args)
    except DrillError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
