"""torchrun, reporting a user's mistake as the one line the rank printed.

    python -m launch.torchrun --nproc-per-node 2 03_ddp/train.py ...   # exactly torchrun's arguments

When a rank stops on a mistake the user can fix (a bad argument, a missing file, a batch that does
not divide), the training script prints one `error:` line (rank 0 only) and exits with status 2.
Plain torchrun then adds a report of its own, a Python traceback and a table, which buries that
line. This runs torchrun itself (torch.distributed.run) and, when the first rank to fail exited
with status 2, leaves that report out and exits with status 2 too. Any other failure (a crash, a
rank killed by a signal or out of memory) keeps torchrun's full report. Stopped by a signal
itself (Ctrl-C, Slurm's SIGTERM), torchrun passes SIGTERM on to the ranks, which save a checkpoint
and say where; its own traceback about the signal is left out, and the exit status is 128 + the
signal (143 for SIGTERM). The Slurm templates and submit.py launch the steps this way.
"""
import contextlib
import logging
import os
import signal
import sys
import threading

import psutil

# Slurm's warning (USR2) is the ranks' to act on (common/signals.py); its default action would end torchrun.
# Held (blocked) from here on, before any thread starts, so that every thread and every rank inherits that.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
# torchrun's C++ side warns, with a C++ stack trace, when a node's rendezvous store goes away:
# what every other node sees after a refused multi-node job's first node has ended. For this
# process only (read when torch loads, then removed, so the ranks keep their own warnings).
QUIET_CPP = "TORCH_CPP_LOG_LEVEL" not in os.environ
if QUIET_CPP:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
import torch  # noqa: E402,F401  (the C++ log level is read now)

if QUIET_CPP:
    del os.environ["TORCH_CPP_LOG_LEVEL"]
from torch.distributed.elastic.multiprocessing import api as elastic_api  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed import DistNetworkError  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.api import RendezvousError  # noqa: E402
from torch.distributed.run import main as torchrun  # noqa: E402

from common.signals import WARNED_BEFORE_START  # noqa: E402

USER_ERROR = 2  # the exit status of common.errors.exit_on_user_error
HANG = 3  # common.hang's: the rank has said where the job hung, in one line
SAID_IN_ONE_LINE = (USER_ERROR, HANG)
HELD_BACK = ("failed (exitcode: %s)", "Sending process %s closing signal %s", "The node '",
             "Unable to shutdown process %s via %s")  # a frozen rank (common/hang.py)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class HoldBack(logging.Filter):
    """Keep torchrun's messages about failed and stopped ranks until we know why they failed."""

    def __init__(self):
        super().__init__()
        self.held, self.user_error, self.released = [], False, False

    def filter(self, record):
        if self.released:  # replayed, or said after that: everything passes
            return True
        if isinstance(record.msg, str) and record.msg.startswith(HELD_BACK):
            self.held.append(record)
            self.user_error |= record.msg.startswith("failed") and record.args[0] in SAID_IN_ONE_LINE
            return False
        return True

    def replay(self):
        self.released = True  # else each replayed record would be held again, and the list would never end
        for record in self.held:  # a real failure: everything torchrun had to say
            logging.getLogger(record.name).handle(record)


def pass_on_preemption_warnings():
    """Each warning that reaches torchrun goes on to its ranks: those running get the signal (held until
    their stop flag is set), those it starts later find it noted in their environment."""
    while True:
        signal.sigwait({signal.SIGUSR2})
        os.environ[WARNED_BEFORE_START] = "1"  # first: a rank started from now on copies it
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                if "RANK" in child.environ():  # a rank, not another helper process of torchrun's
                    child.send_signal(signal.SIGUSR2)


def signalled_once(handler):
    """torchrun's signal handler, for the first signal only: at a time limit Slurm signals torchrun
    and srun forwards the same SIGTERM a moment later, which would interrupt torchrun's shutdown."""
    def handle(signum, frame):
        ignore_stop_signals()
        handler(signum, frame)
    return handle


def main(argv=None):
    threading.Thread(target=pass_on_preemption_warnings, name="preemption warnings", daemon=True).start()
    held = HoldBack()
    for name in ("", "torch", "torch.distributed", "torch.distributed.elastic"):  # where its records meet a handler
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(held)
    elastic_api._terminate_process_handler = signalled_once(elastic_api._terminate_process_handler)
    try:
        torchrun(argv)
    except ChildFailedError as err:
        ignore_stop_signals()  # ending anyway: a late SIGTERM must not interrupt the report
        _, first = err.get_first_failure()
        if first.exitcode in SAID_IN_ONE_LINE:
            sys.exit(first.exitcode)
        if any(failure.exitcode == HANG for failure in err.failures.values()):  # the watchdog killed a silent rank
            sys.exit(HANG)
        held.replay()
        raise
    except SignalException as err:
        sys.exit(USER_ERROR if held.user_error else 128 + int(err.sigval))
    except (RendezvousError, DistNetworkError) as err:
        ignore_stop_signals()
        if held.user_error:  # what follows a rank's user error here: the rendezvous host has gone
            sys.exit(USER_ERROR)
        print(f"stopped: lost the rendezvous of the nodes ({type(err).__name__}): another node ended first (its log "
              "says why) or the network between them failed", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception:
        ignore_stop_signals()
        if held.user_error:
            sys.exit(USER_ERROR)
        held.replay()
        raise


def ignore_stop_signals():
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, signal.SIG_IGN)


if __name__ == "__main__":
    main()
