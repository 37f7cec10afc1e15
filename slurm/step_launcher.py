"""What `submit.py` runs inside the Slurm job: one task per node starts the step there.

submitit pickles the launcher *by reference* (module and class name) and the job unpickles it,
so it lives in this module of the repository, which submit.py puts on the job's PYTHONPATH.
Import nothing heavy at module level: submit.py imports this on the login node.
"""
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_SCRIPTS = {"singlegpu": "02_singlegpu/train.py", "ddp": "03_ddp/train.py", "fsdp": "04_fsdp/train.py"}
PREEMPTION_SIGNAL = signal.SIGUSR2  # the kit's one preemption signal (submitit's default)
PREEMPTION_WARNING_S = 300  # how long before the time limit Slurm sends it (as in the templates)
PR_SET_PDEATHSIG = 1


def rendezvous_port(job_id):
    """Derived from the job id: two jobs sharing a node never pick the same port."""
    return 20000 + int(job_id) % 20000


def _prepare_child():
    """Runs in the child between fork and exec."""
    # Die with the launcher: with proctrack/linuxproc (no cgroups) an orphaned torchrun escapes
    # Slurm's clean-up and keeps its rendezvous port and store alive for later jobs.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # Slurm delivers the preemption signal to every process of the step; torchrun's agent would
    # die of it. Ignored here (SIG_IGN survives exec); a training script that checkpoints on
    # preemption installs its own handler.
    signal.signal(PREEMPTION_SIGNAL, signal.SIG_IGN)


class StepLauncher:
    """Starts the step's command on this node and waits for it; fails if it fails.

    On the preemption warning (USR2, `--signal=USR2@...`: Slurm sends it to every process of
    the job) the training processes save a checkpoint and stop; submitit calls `checkpoint()`
    on the first node, which waits for that, and requeues the job with a fresh launcher. The
    requeued job continues the run (`--resume`)."""

    def __init__(self, step, gpus_per_node, cpus_per_task, training_args, warning_s=PREEMPTION_WARNING_S):
        self.step = step
        self.gpus_per_node = gpus_per_node
        self.cpus_per_task = cpus_per_task
        self.training_args = list(training_args)  # `%j` in them becomes the job id
        self.warning_s = warning_s
        self.process = None  # the running torchrun (or python for step 2)

    def command(self, num_nodes, first_node, port, rdzv_id, device, job_id, restarts=0):
        """The step's launch line, as a user would type it on one node. A requeued job (same
        job id, restarts > 0) continues its run from the newest checkpoint: --resume, and an
        --overwrite meant for the first start is dropped (it would delete that checkpoint)."""
        script_args = [arg.replace("%j", str(job_id)) for arg in self.training_args] + ["--device", device]
        if int(restarts) > 0:
            script_args = [arg for arg in script_args if arg != "--overwrite"] + ["--resume"]
        if self.step == "singlegpu":
            return [sys.executable, STEP_SCRIPTS[self.step], *script_args]
        torchrun = Path(sys.executable).with_name("torchrun")  # the one of this environment
        return [str(torchrun) if torchrun.exists() else "torchrun",
                f"--nnodes={num_nodes}", f"--nproc-per-node={self.gpus_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={first_node}:{port}", f"--rdzv-id={rdzv_id}",
                STEP_SCRIPTS[self.step], *script_args]

    def pick_device(self):
        """cuda, or cpu where the allocated GPUs are not usable by CUDA (the test cluster's
        fake GPUs): then one CPU process per allocated GPU, talking over gloo."""
        import torch

        allocated = int(os.environ.get("SLURM_GPUS_ON_NODE", "0"))
        if allocated != self.gpus_per_node:
            raise RuntimeError(f"asked for {self.gpus_per_node} GPUs per node, but Slurm allocated {allocated}")
        usable = torch.cuda.device_count()
        if usable >= allocated:
            return "cuda"
        if usable == 0:
            print(f"note: the GPUs that Slurm allocated (CUDA_VISIBLE_DEVICES="
                  f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}) are not usable by CUDA here: running one "
                  "CPU process per allocated GPU instead (--device cpu, gloo)", flush=True)
            return "cpu"
        raise RuntimeError(f"Slurm allocated {allocated} GPUs but CUDA sees only {usable}")

    def __call__(self):
        import submitit

        job = submitit.JobEnvironment()
        job_id = os.environ["SLURM_JOB_ID"]  # of the whole job, also in an array
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        command = self.command(
            num_nodes=job.num_nodes, first_node=job.hostnames[0], port=rendezvous_port(job_id),
            # A requeued job keeps its id: the restart count makes a fresh rendezvous.
            rdzv_id=f"{job_id}-{restarts}", device=self.pick_device(), job_id=job_id, restarts=restarts)
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, self.cpus_per_task // self.gpus_per_node))}
        print(f"node {job.node} ({job.hostname}), restart {restarts}: {shlex.join(command)}", flush=True)
        self.process = subprocess.Popen(command, cwd=REPO, env=env, preexec_fn=_prepare_child)
        # Poll, never process.wait(): a blocking wait() holds Popen's lock, and submitit's
        # preemption handler (checkpoint() below) runs in this very thread; it could then never
        # reap the child, and the job would hang until Slurm kills it.
        while self.process.poll() is None:
            time.sleep(0.5)
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
