"""What `submit.py` runs inside the Slurm job: one task per node starts the step there.

submitit pickles the launcher *by reference* (module and class name) and the job unpickles it,
so it lives in this module of the installed kit. Import nothing heavy at module level: submit.py
imports this on the login node.

The torchrun line is the one of the sbatch templates (slurm/ddp.sh, fsdp.sh); the training script
does the rest as it does there: the gradient accumulation from --total_batch_size, the device,
and continuing the run after a requeue.
"""
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.run_dir import RunDir
from launch.steps import REPO, STEP_SCRIPTS

PREEMPTION_SIGNAL = signal.SIGUSR2  # the kit's one warning signal (submitit's default)
PREEMPTION_WARNING_S = 300  # how long before the time limit Slurm sends it (as in the templates)
PR_SET_PDEATHSIG = 1


STOPPED_BY_SIGTERM = 128 + signal.SIGTERM  # launch/torchrun.py's exit status when torchrun got SIGTERM


def progress(output_dir):
    """(when the run last finished, its newest complete checkpoint): a new checkpoint and no new
    finish mean that the training stopped early."""
    run_dir = RunDir(output_dir)
    return run_dir.finished_at(), run_dir.latest_checkpoint()


def _prepare_child():
    """Runs in the child between fork and exec."""
    # Die with the launcher: with proctrack/linuxproc (no cgroups) an orphaned torchrun escapes
    # Slurm's clean-up and keeps its rendezvous port and store alive for later jobs.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # Slurm delivers the preemption signal to every process of the step; torchrun's agent would
    # die of it. Held (blocked: that survives exec, and an ignored warning would be lost) until the
    # training has set its handler (common/signals.py); torchrun passes on what it gets (launch/torchrun.py).
    signal.pthread_sigmask(signal.SIG_BLOCK, {PREEMPTION_SIGNAL})


class StepLauncher:
    """Starts the step's command on this node and waits for it; fails if it fails.

    On the preemption warning (USR2, `--signal=USR2@...`: Slurm sends it to every process of
    the job) the training processes save a checkpoint and stop; submitit calls `checkpoint()`
    on the first node, which waits for that, and requeues the job with a fresh launcher. The
    requeued job continues the run (the training script sees SLURM_RESTART_COUNT)."""

    def __init__(self, step, gpus_per_node, cpus_per_task, training_args, warning_s=PREEMPTION_WARNING_S):
        self.step = step
        self.gpus_per_node = gpus_per_node
        self.cpus_per_task = cpus_per_task
        self.training_args = list(training_args)  # `%j` in them becomes the job id
        self.warning_s = warning_s
        self.process = None  # the running torchrun (or python for step 2)

    def command(self, num_nodes, first_node, port, job_id, restarts=0):
        """The step's launch line on one node, as in the sbatch templates: the rendezvous on the
        first node, a fresh one for each attempt of the job."""
        script_args = [arg.replace("%j", str(job_id)) for arg in self.training_args]
        if self.step == "singlegpu":
            return [sys.executable, STEP_SCRIPTS[self.step], *script_args]
        # torchrun itself, with a user's mistake reported as one line (launch/torchrun.py)
        return [sys.executable, "-m", "launch.torchrun", f"--nnodes={num_nodes}",
                f"--nproc-per-node={self.gpus_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={first_node}:{port}", f"--rdzv-id={job_id}-{restarts}",
                STEP_SCRIPTS[self.step], *script_args]

    def output_dir(self, job_id):
        args = self.training_args
        return Path(args[args.index("--output_dir") + 1].replace("%j", str(job_id)))

    def __call__(self):
        import submitit

        job = submitit.JobEnvironment()
        job_id = os.environ["SLURM_JOB_ID"]  # of the whole job, also in an array
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        run = progress(self.output_dir(job_id))
        # The port is derived from the job id, as in the templates: jobs sharing a node never collide.
        command = self.command(job.num_nodes, job.hostnames[0], 20000 + int(job_id) % 20000, job_id, restarts)
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, self.cpus_per_task // self.gpus_per_node))}
        print(f"node {job.node} ({job.hostname}), restart {restarts}: {shlex.join(command)}", flush=True)
        self.process = subprocess.Popen(command, cwd=REPO, env=env, preexec_fn=_prepare_child)
        # Poll, never process.wait(): a blocking wait() holds Popen's lock, and submitit's
        # preemption handler (checkpoint() below) runs in this very thread; it could then never
        # reap the child, and the job would hang until Slurm kills it.
        while self.process.poll() is None:
            time.sleep(0.5)
        # A preemption that sends only SIGTERM (most sites: submitit acts on USR2 only): the ranks
        # saved a checkpoint and stopped. Back to the queue, to continue from it (first node only).
        finished, newest = progress(self.output_dir(job_id))
        if self.process.returncode in (0, STOPPED_BY_SIGTERM) and finished == run[0] and newest != run[1]:
            if job.node == 0:
                print("the training saved a checkpoint and stopped (SIGTERM): requeueing", flush=True)
                subprocess.run(["scontrol", "requeue", job_id], check=False)
            return f"node {job.node}: {self.step} stopped early, requeued"
        if self.process.returncode != 0:
            raise RuntimeError(f"{Path(command[0]).name} exited with status {self.process.returncode} "
                               f"on node {job.node}")
        return f"node {job.node}: {self.step} finished"

    def checkpoint(self, *args, **kwargs):
        """submitit calls this on the first node when the preemption warning arrives. The
        training processes got the signal too: wait (polling) until they have saved and
        stopped, then hand submitit a fresh launcher to requeue; None means no requeue."""
        import submitit

        deadline = time.monotonic() + max(10, self.warning_s - 30)  # Slurm ends the job at warning_s
        while self.process is not None and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        if self.process is None:
            print("the preemption warning came before the training started: requeueing", flush=True)
        elif self.process.poll() is None:
            print("the training did not stop in time after the preemption warning: requeueing anyway; the "
                  "job continues from the last complete checkpoint", flush=True)
        elif self.process.returncode != 0:
            print(f"the training failed (exit status {self.process.returncode}) after the preemption warning: not "
                  "requeued. To continue from its last complete checkpoint, submit again with the same "
                  "--output_dir and `-- --resume`", flush=True)
            return None
        else:
            print("the training saved a checkpoint and stopped: requeueing", flush=True)
        fresh = StepLauncher(self.step, self.gpus_per_node, self.cpus_per_task, self.training_args, self.warning_s)
        return submitit.helpers.DelayedSubmission(fresh, *args, **kwargs)
