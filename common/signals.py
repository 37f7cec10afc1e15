"""Stopping well: on a preemption warning, and when the launcher dies.

Slurm warns a job before its time limit or a preemption with a signal (`--signal=USR2@120` in
the kit's templates; submitit uses USR2 too). A training process that gets it finishes the
optimiser step it is in, saves a checkpoint, and exits cleanly; the job is requeued and
continues with --resume. The signal handler only raises a flag: saving inside a handler could
interrupt a collective halfway, and the ranks must all stop at the same step.
"""
import ctypes
import os
import signal
import sys

import torch
import torch.distributed as dist

PREEMPTION_SIGNAL = signal.SIGUSR2  # one signal for the whole kit, the same as submitit's
_PR_SET_PDEATHSIG = 1


class PreemptionFlag:
    """Set by the preemption signal; `requested()` tells, at a step boundary, whether to stop."""

    def __init__(self, device):
        self.device = device
        self.received = False
        signal.signal(PREEMPTION_SIGNAL, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def requested(self):
        """True on every rank if any rank got the signal (the signal may reach the ranks of
        different nodes a step apart). A collective: call it at the same point on all ranks."""
        if not dist.is_initialized():
            return self.received
        flag = torch.tensor(float(self.received), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


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
