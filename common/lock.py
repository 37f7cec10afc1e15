"""An exclusive lock on a file, for processes on one machine or on several nodes that share a file system.

    with wait_for_lock(folder / "prepare.lock", on_wait=lambda who: print(f"waiting for {who}")):
        ...  # only one process at a time gets here

It is flock(2): the kernel drops the lock when its holder's file is closed, also when the holder
dies (kill -9, out of memory), so a dead holder never blocks anyone. Across nodes, NFS and GPFS
support it as they are; Lustre needs the `flock` mount option. The lock file says who holds it
(host, pid, Slurm job), so that a process that has to wait can name what it waits for.
"""
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from common.errors import UserError

_held = set()  # descriptors of the locks this process holds
_fork_hook = []  # registered once, at the first lock (nothing happens on import)


def _close_held_in_child():
    """A forked child (a DataLoader or `datasets` worker) shares our lock; if we die, it must not
    keep the lock alive, so it lets go of its copy at once."""
    for fd in _held:
        os.close(fd)
    _held.clear()


class Lock:
    """A held lock; release() (or the end of a `with` block) gives it back."""

    def __init__(self, path, fd):
        self.path, self._fd = Path(path), fd

    def release(self):
        if self._fd in _held:  # not in a forked child, which has let go already
            _held.discard(self._fd)
            os.close(self._fd)  # closing the file drops the flock
        self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def describe_this_process():
    """'rank 0, host node1, pid 1234, Slurm job 567, since 2026-11-23 12:00:01' (rank, job where set)."""
    parts = [f"host {socket.gethostname()}", f"pid {os.getpid()}"]
    if os.environ.get("RANK"):
        parts.insert(0, f"rank {os.environ['RANK']}")
    if os.environ.get("SLURM_JOB_ID"):
        parts.append(f"Slurm job {os.environ['SLURM_JOB_ID']}")
    parts.append(f"since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    return ", ".join(parts)


def try_lock(path):
    """The lock if it is free now, else None (never waits)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        raise UserError(f"cannot create the lock file {path} ({err.strerror}){if_full(err)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise UserError(f"cannot lock {path} ({err.strerror}): the file system does not support file locks "
                        "(Lustre needs the `flock` mount option)") from None
    # Someone may have deleted or replaced the file between our open and our flock: then we
    # hold a lock on a file nobody else will open. Start again on the file that is there now.
    try:
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return try_lock(path)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, (describe_this_process() + "\n").encode())
    except OSError as err:
        os.close(fd)
        raise UserError(f"cannot write the lock file {path} ({err.strerror}){if_full(err)}") from None
    if not _fork_hook:
        os.register_at_fork(after_in_child=_close_held_in_child)
        _fork_hook.append(_close_held_in_child)
    _held.add(fd)
    return Lock(path, fd)


def if_full(err):
    """What to do when `err` says the disk is full (or the quota used up), else nothing."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return ": the disk is full; free some space there (or use a folder on another disk)"
    return ""


def holder(path):
    """Who holds (or last held) the lock, as its holder wrote it."""
    try:
        text = Path(path).read_text(errors="replace").strip()
    except OSError:
        text = ""
    return text or "another process"


def wait_for_lock(path, on_wait=None, poll_s=0.5):
    """The lock, waiting as long as it takes; on_wait(holder text) is called once if we have to wait.
    It polls rather than blocking in the kernel: NFS's blocking locks can take tens of seconds to
    notice a release."""
    waited = False
    while True:
        lock = try_lock(path)
        if lock is not None:
            return lock
        if not waited and on_wait is not None:
            on_wait(holder(path))
        waited = True
        time.sleep(poll_s)
