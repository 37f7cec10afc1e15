"""torchrun, reporting a user's mistake as the one line the rank printed.

    python -m common.torchrun --nproc-per-node 2 03_ddp/train.py ...   # exactly torchrun's arguments

When a rank stops on a mistake the user can fix (a bad argument, a missing file, a batch that does
not divide), the training script prints one `error:` line (rank 0 only) and exits with status 2.
Plain torchrun then adds a report of its own, a Python traceback and a table, which buries that
line. This runs torchrun itself (torch.distributed.run) and, when the first rank to fail exited
with status 2, leaves that report out and exits with status 2 too. Any other failure (a crash, a
rank killed by a signal or out of memory) keeps torchrun's full report. Stopped by a signal
itself (Ctrl-C, Slurm's SIGTERM), torchrun passes SIGTERM on to the ranks, which save a checkpoint
and say where; its own traceback about the signal is left out. The Slurm templates and submit.py
launch the steps this way.
"""
import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

USER_ERROR = 2  # the exit status of common.errors.exit_on_user_error
HELD_BACK = ("failed (exitcode: %s)", "Sending process %s closing signal %s")


class HoldBack(logging.Filter):
    """Keep torchrun's messages about failed and stopped ranks until we know why they failed."""

    def __init__(self):
        super().__init__()
        self.held = []

    def filter(self, record):
        if isinstance(record.msg, str) and record.msg.startswith(HELD_BACK):
            self.held.append(record)
            return False
        return True


def main(argv=None):
    held = HoldBack()
    for name in ("", "torch", "torch.distributed", "torch.distributed.elastic"):  # where its records meet a handler
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(held)
    try:
        torchrun(argv)
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        if first.exitcode == USER_ERROR:
            sys.exit(USER_ERROR)
        for record in held.held:  # a real failure: everything torchrun had to say
            logging.getLogger(record.name).handle(record)
        raise
    except SignalException as err:
        sys.exit(128 + int(err.sigval))


if __name__ == "__main__":
    main()
