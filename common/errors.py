"""One clear line for a user's mistake, instead of a traceback."""
import atexit
import os
import shlex
import sys
import time


class UserError(Exception):
    """A problem the user can fix: bad paths, bad arguments, bad data. Printed as one line, by rank 0
    (every rank fails the same way), or by the rank that `by_this_rank` names when only some ranks see it."""

    def __init__(self, message, by_this_rank=None):
        super().__init__(message)
        self.by_this_rank = by_this_rank


def say(line, file=None):
    """Print an `error:`, `warning:` or `preempted:` line (on `file`, stdout by default, as
    tqdm.write) so that it starts a line of its own, also after a progress bar. A bar is text with
    no line break after it, redrawn in place: in a log file (Slurm's .out, a redirected run) and on
    a terminal the line would follow it, where `grep '^error:'` (and a reader) misses it. So while
    a bar is drawn the line goes below it, and the bar, as it was, stays above (it is redrawn below
    if the run goes on). Another rank's bar, on the job's shared output, cannot be seen from here:
    a rank other than 0 always starts a new line."""
    from tqdm import tqdm
    file = sys.stdout if file is None else file
    with tqdm.get_lock():
        drawn = any(hasattr(bar, "start_t") and not bar.disable for bar in list(getattr(tqdm, "_instances", [])))
        file.write(("\n" if drawn or os.environ.get("RANK", "0") != "0" else "") + line + "\n")
        file.flush()


def first_line(err):
    """The first line of an exception's message (at most 300 characters), for a one-line error."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


# torchrun sets it for every rank it starts.
LAUNCHED_BY_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ

# How a run that ends early explains itself: the parts that know tell it through the two functions below.
_where_to_continue = None
_stop_signal = None


def explain_interrupts_with(where_to_continue):
    """The run's output directory registers `where_to_continue()`, asked when a Ctrl-C stops the
    run at once: it says what is on disk to continue from at that moment."""
    global _where_to_continue
    _where_to_continue = where_to_continue


def stop_was_requested(signum):
    """The stop flag (common/signals.py) says that a signal asked the run to stop: an error that
    follows is the loss of another rank, and the exit status tells the signal."""
    global _stop_signal
    _stop_signal = signum


def exit_on_user_error(main, needs_torchrun=False):
    """Run main(); turn a UserError into `error: ...` on stderr and exit status 2, and a Ctrl-C
    into one `interrupted:` line. Under torchrun every rank checks the same inputs and fails the
    same way, so only rank 0 prints the line: once per job, not once per rank. A rank that
    torchrun started and whose main() finished exits at once (leave_after_success says why).
    `needs_torchrun`: a script of one process per GPU (steps 3 to 6; require_torchrun)."""
    speaks = os.environ.get("RANK", "0") == "0"
    try:
        if needs_torchrun:
            require_torchrun()
        result = main()
    except UserError as err:
        speaks = speaks if err.by_this_rank is None else err.by_this_rank
        if speaks:
            say(f"error: {err}", file=sys.stderr)
        leave_after_user_error(speaks)
    except KeyboardInterrupt:
        if speaks:
            note = _where_to_continue() if _where_to_continue else "nothing was saved"
            say(f"interrupted: {note}", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader of our output went away (`| head`): end quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error while Python flushes
        sys.exit(141)  # 128 + SIGPIPE
    except Exception as err:
        if _stop_signal is None and not lost_another_rank(err):
            raise
        # Another rank ended first (an error, a kill), and this one learnt it from a collective that
        # failed, or from torchrun's SIGTERM: the rank that ended says why; no traceback here.
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        say(f"stopped: rank {os.environ.get('RANK', 0)} lost another rank of the job ({first})",
            file=sys.stderr)
        sys.exit(128 + _stop_signal if _stop_signal else 1)
    if LAUNCHED_BY_TORCHRUN:
        leave_after_success()
    return result


def require_torchrun():
    """torchrun starts the processes of steps 3 to 6, one per GPU, and tells each its rank (RANK,
    WORLD_SIZE, LOCAL_RANK...): started with plain python, a script stops with one line that gives
    the command, rather than a KeyError. --help answers without torchrun."""
    launched = all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if launched or {"-h", "--help"} & set(sys.argv[1:]):
        return
    script = os.path.relpath(sys.argv[0])
    command = " ".join(["torchrun --nproc-per-node N", shlex.quote(script), *map(shlex.quote, sys.argv[1:])])
    raise UserError(f"{script} runs one process per GPU, which torchrun starts: run `{command}` (N: the "
                    "node's GPUs, or CPU processes on a machine without one)")


def leave_after_success():
    """Exit 0 without the interpreter's shutdown: a gloo process group that outlives
    destroy_process_group() (fully_shard's hooks keep step 4's alive; so does the Trainer's)
    still has worker threads, and one of them freeing a finished collective's tensors needs
    Python; while Python shuts down, that aborts the process ("terminate called without an
    active exception") and fails a job that has done its work. By now the run has closed
    everything it wrote; only the standard streams need flushing."""
    exit_without_shutdown(0)


def leave_after_user_error(speaks):
    """Exit 2. Under torchrun without the interpreter's shutdown, as after a success: the gloo
    threads that outlive the run can abort any rank while Python shuts down, and torchrun would
    then report that rank's SIGABRT instead of the user's mistake. The exit handlers still run
    (a tracker's run is finished and flushed, as on a normal exit). The other ranks give rank 0 a
    moment to print its line first, since torchrun stops every rank when the first one exits."""
    if not LAUNCHED_BY_TORCHRUN:
        sys.exit(2)
    atexit._run_exitfuncs()
    if not speaks:
        time.sleep(1)
    exit_without_shutdown(2)


def exit_without_shutdown(status):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def lost_another_rank(err):
    """A collective that failed because a peer process is gone (gloo, NCCL, the rendezvous store)."""
    import torch.distributed as dist
    text = str(err)
    return isinstance(err, dist.DistError) or any(words in text for words in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted"))
