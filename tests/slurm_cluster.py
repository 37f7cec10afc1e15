"""The local Slurm cluster (tests/slurm/local_cluster.sh) as the tests use it: brought up once
per session on free ports, jobs submitted and waited for with a timeout, and on a failure the
daemon logs and job outputs copied to a folder that the failing test names.

    pytest_plugins = ["slurm_cluster"]     # in a test module: its tests may ask for `slurm_cluster`
"""
import contextlib
import fcntl
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO / "tests/slurm/local_cluster.sh"
CANNOT_RUN_HERE = 3  # local_cluster.sh's exit status for "not root / packages cannot be installed"
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
# Shared with local_cluster.sh (flock): apt-get refuses to run while another one holds its lock.
APT_LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "kit-tests-apt.lock"
NODES, GPUS_PER_NODE = 2, 2
# Seconds a preempted job of the default partition has between Slurm's SIGTERM and its SIGKILL
# (the partition's GraceTime; the cluster's KillWait of 10 s comes on top at the end).
PREEMPT_GRACE_TIME = 60
KEPT_LOGS_ROOT = Path(os.environ.get("KIT_SLURM_TEST_LOGS", REPO / "logs/slurm-tests"))


class ClusterUnavailable(Exception):
    """Slurm cannot run on this machine (the reason is one line)."""


def free_ports(count):
    """The first of `count` consecutive free ports: slurmctld's, slurmdbd's, then one per slurmd.
    Taken from 30000-32767, below the kernel's ephemeral range and above the jobs' rendezvous
    ports (20000 + job id)."""
    rng = random.Random()
    while True:
        first = rng.randrange(30000, 32768 - count)
        if all(port_is_free(port) for port in range(first, first + count)):
            return first


def port_is_free(port):
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The local cluster, one for all the Slurm tests of a session (a test module that uses it
    names this module in `pytest_plugins`, which makes the fixture one for the whole session).
    Skips where Slurm cannot run; stopped (daemons and leftover job processes) at the session's end."""
    cluster = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.up()
    except ClusterUnavailable as reason:
        pytest.skip(f"no Slurm on this machine: {reason}")
    yield cluster
    cluster.down()


class LocalSlurmCluster:
    def __init__(self, directory):
        self.dir = Path(directory)
        self.jobs_dir = self.dir / "jobs"  # job outputs, submitit logs and training outputs
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        ctld_port = free_ports(2 + NODES)
        self.settings = {"CLUSTER_DIR": str(self.dir), "NODES": str(NODES), "GPUS_PER_NODE": str(GPUS_PER_NODE),
                         "SLURMCTLD_PORT": str(ctld_port), "SLURMDBD_PORT": str(ctld_port + 1),
                         "SLURMD_PORT": str(ctld_port + 2), "PREEMPT_GRACE_TIME": str(PREEMPT_GRACE_TIME)}
        # What a user's shell has after `. env.sh` with the kit's virtual environment active:
        # sbatch passes this environment on to the jobs.
        venv_bin = str(Path(sys.executable).parent)
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf"),
                    "PATH": os.pathsep.join([venv_bin, os.environ.get("PATH", "")])}
        self.grace_time = PREEMPT_GRACE_TIME
        self.kept_logs = None

    def up(self):
        result = subprocess.run([str(CLUSTER_SCRIPT), "up"], env={**os.environ, **self.settings},
                                capture_output=True, text=True, timeout=600)
        if result.returncode == CANNOT_RUN_HERE:
            raise ClusterUnavailable(result.stderr.strip().splitlines()[-1])
        if result.returncode != 0:
            self.down()
            kept = self.keep_logs()
            raise RuntimeError(f"local Slurm cluster did not come up (logs: {kept}):\n{result.stdout}\n{result.stderr}")

    def down(self):
        subprocess.run([str(CLUSTER_SCRIPT), "down"], env={**os.environ, **self.settings},
                       capture_output=True, text=True, timeout=120)

    def run(self, command, extra_env=None, timeout=60):
        """A command in the submitting shell: repository root as cwd, the cluster's environment."""
        return subprocess.run(command, cwd=REPO, env={**self.env, **(extra_env or {})},
                              capture_output=True, text=True, timeout=timeout)

    def sbatch(self, *arguments, extra_env=None):
        """Submit like a user (`sbatch OPTIONS SCRIPT ARGS`) with output into jobs_dir; the job id."""
        result = self.run(["sbatch", "--parsable", f"--output={self.jobs_dir}/%x-%j.out", *arguments], extra_env)
        assert result.returncode == 0, f"sbatch failed: {result.stderr}"
        return result.stdout.strip().split(";")[0]

    def state(self, job_id):
        result = self.run(["squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T"])
        return result.stdout.strip()

    def wait(self, job_id, timeout):
        """The job's final state; cancels it and fails the test when it takes longer than timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in FINISHED_STATES:
                return state
            time.sleep(1)
        self.run(["scancel", job_id])
        raise TimeoutError(f"job {job_id} did not finish within {timeout} s (state {self.state(job_id)})")

    def accounting(self, job_id, *fields):
        """The job's records in the accounting database (the real `sacct`), one dict of `fields`
        per start of the job: a requeued job has one for every attempt, oldest first."""
        result = self.run(["sacct", "--duplicates", "--allocations", "--noheader", "--parsable2",
                           f"--jobs={job_id}", f"--format={','.join(fields)}"])
        assert result.returncode == 0, f"sacct failed: {result.stderr}"
        return [dict(zip(fields, line.split("|"))) for line in result.stdout.splitlines()]

    def accounted(self, job_id, *fields, timeout=30):
        """`accounting()` once slurmctld has passed the job's end on to slurmdbd (a moment after
        squeue shows it): the last record's State is squeue's final state."""
        final = self.state(job_id)
        assert final in FINISHED_STATES, f"job {job_id} has not finished ({final})"
        deadline = time.monotonic() + timeout
        while True:
            records = self.accounting(job_id, "State", *fields)
            if records and records[-1]["State"].split()[0] == final:  # "CANCELLED by 0" -> CANCELLED
                return records
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: sacct shows {records}, squeue {final}")
            time.sleep(0.5)

    def wait_until(self, job_id, condition, timeout, what):
        """Poll `condition()` until it is true; fail when the job ends first or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            state = self.state(job_id)
            if state in FINISHED_STATES:
                raise AssertionError(f"job {job_id} ended ({state}) before {what}")
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id}: no {what} within {timeout} s (state {self.state(job_id)})")

    def keep_logs(self):
        """Copy the daemon logs, slurm.conf and everything the jobs wrote to a folder that stays."""
        if self.kept_logs is None:
            self.kept_logs = KEPT_LOGS_ROOT / time.strftime("%Y%m%d-%H%M%S")
            self.kept_logs.mkdir(parents=True, exist_ok=True)
        for name in ("log", "jobs"):
            if (self.dir / name).is_dir():
                shutil.copytree(self.dir / name, self.kept_logs / name, dirs_exist_ok=True)
        for name in ("slurm.conf", "gres.conf", "slurmdbd.conf"):
            if (self.dir / name).is_file():
                shutil.copy2(self.dir / name, self.kept_logs / name)
        return self.kept_logs

    @contextlib.contextmanager
    def logs_kept_on_failure(self):
        """Wrap a test's checks: if one fails, keep the logs and say where they are."""
        try:
            yield
        except (Exception, pytest.fail.Exception) as failure:
            kept = self.keep_logs()
            print(f"Slurm daemon logs and job outputs kept in {kept}", file=sys.stderr)
            failure.add_note(f"Slurm daemon logs and job outputs kept in {kept}")
            raise


def install_when_missing(command, package):
    """apt-get install PACKAGE if COMMAND is missing (root, Debian); True if COMMAND is there now."""
    if shutil.which(command):
        return True
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open(APT_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one apt-get at a time: the other test worker may be installing Slurm
        for step in (["apt-get", "update", "-q"],
                     ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]):
            if subprocess.run(step, env=env, capture_output=True, timeout=600).returncode != 0:
                return False
    return shutil.which(command) is not None
