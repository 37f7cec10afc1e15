"""Stopping well: on a preemption or time-limit signal, on Ctrl-C, and when the launcher dies.

A signal handler only raises a flag; the training loop asks for it at points that every rank
reaches together (after each optimiser step, and between evaluation batches), the ranks agree
with one all-reduce, save a checkpoint and exit. Saving inside the handler could interrupt a
collective halfway, and the ranks must all stop at the same step.

  SIGTERM  "stop now": Slurm at a preemption (to every process of the job) and at the time limit,
           torchrun when it is stopped (it forwards SIGTERM to its ranks and kills them 30 s
           later), `kill`. The run finishes the optimiser step it is in, saves, and exits.
  SIGUSR2  Slurm's early warning before the time limit (`--signal=B:USR2@300` in the kit's
           templates; submitit uses USR2 too): the same, with minutes to spare.
  SIGINT   Ctrl-C: the same; a second Ctrl-C stops at once, without saving.

Slurm's warning can come at any moment, also while the run still loads: the templates' launcher
holds it (blocked, slurm/preemption.sh: USR2_IGNORED), and so do the ranks, which inherit that, until
their stop flag is set; torchrun (launch/torchrun.py) passes on one that comes before it has started
its ranks, through their environment. So the run saves at its first step boundary.
"""
import ctypes
import os
import signal
import sys

import torch
import torch.distributed as dist

from common import errors

PREEMPTION_SIGNAL = signal.SIGUSR2  # one warning signal for the whole kit, the same as submitit's
WARNED_BEFORE_START = "KIT_PREEMPTION_WARNED"  # set by launch/torchrun.py for the ranks it starts after a warning
_PR_SET_PDEATHSIG = 1


class StopFlag:
    """Set by SIGTERM, SIGUSR2 or Ctrl-C; `requested()` tells, at a point every rank reaches,
    whether to save and stop."""

    def __init__(self, device):
        self.device = device
        self.received = None
        for signum in (signal.SIGTERM, PREEMPTION_SIGNAL, signal.SIGINT):
            signal.signal(signum, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {PREEMPTION_SIGNAL})  # a warning held until now arrives here
        if os.environ.get(WARNED_BEFORE_START):
            self._handle(PREEMPTION_SIGNAL, None)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop at once
        self.received = signum
        errors.stop_was_requested(signum)

    def any_rank(self):
        """1.0 if any rank got a signal (it may reach the ranks of different nodes at different
        moments), else 0.0: a tensor on the device, all-reduced, not read yet, so that the step reads it
        with its figures, in the step's one wait for the GPU. A collective: call it at the same point
        on all ranks."""
        flag = torch.tensor(float(self.received is not None), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def requested(self):
        """True on every rank if any rank got a signal; reads the flag at once (the evaluation asks
        between its batches, which wait for the GPU anyway). A collective, like any_rank."""
        return bool(self.any_rank().item())

    def say_saved(self, step, output_dir):
        """The run's last line when a signal stopped it (rank 0's): where it saved, and how to go on."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            errors.say(f"preempted: saved a checkpoint at step {step} in {output_dir}; continue with --resume "
                       f"(stopped by {self.reason()})")

    def reason(self):
        names = {signal.SIGTERM: "SIGTERM", PREEMPTION_SIGNAL: "the preemption warning (USR2)",
                 signal.SIGINT: "Ctrl-C"}
        return names.get(self.received, "a signal on another rank")


def leave_stopping_to_the_rank(worker_id=None):
    """A data loader worker's first act (the DataLoader's worker_init_fn). Slurm signals every process
    of the job, torchrun its ranks' whole process groups: the loader's workers get the SIGTERM, USR2 or
    Ctrl-C too. PyTorch's worker dies of a signal not sent by its own rank, and the rank then fails
    its step ("DataLoader worker is killed by signal") before it can save. So a worker ignores them:
    its rank decides when to stop, and the worker dies with its rank."""
    for signum in (signal.SIGTERM, PREEMPTION_SIGNAL, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_launcher():
    """Ask Linux to kill this process when its parent (torchrun) dies. torchrun starts its
    workers in their own session, so a torchrun killed with -9 would otherwise leave ranks that
    hold the GPUs (and, blocked in a collective, never end). No-op where prctl is missing."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before the request was in place
        os._exit(1)
