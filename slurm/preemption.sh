# shellcheck shell=bash
# Preemption and time limits, for slurm/singlegpu.sh, ddp.sh and fsdp.sh (sourced, never run).
#
# Two signals reach a job before Slurm ends it:
# * USR2, the early warning: `#SBATCH --signal=B:USR2@300` makes Slurm send it to the batch shell
#   (B:), and only to it, 300 s before the time limit (and at a preemption, where the site enables
#   that). The shell forwards it to every training process on every node; they finish the
#   optimiser step they are in, save a checkpoint and exit 0.
# * SIGTERM, "stop now": at a preemption (most sites warn with nothing else) Slurm sends it to
#   every process of the job's steps (not to this shell) and SIGKILL after the partition's
#   GraceTime; at the time limit to this shell too, with SIGKILL after KillWait (30 s by default).
#   The ranks save a checkpoint at the end of their step and exit; torchrun (launch/torchrun.py)
#   then exits 143. This shell keeps waiting for it: the job ends when this shell does.
# Either way, once the training has stopped early with a new complete checkpoint, this shell puts
# the job back in the queue (`scontrol requeue`: same job id, SLURM_RESTART_COUNT + 1), and the
# training continues its run from that checkpoint. A job that failed, or that stopped without
# saving anything new, is not requeued (no endless loop).

PREEMPTION_WARNED=0

# The USR2 trap: forward the warning to the training processes of every node.
forward_preemption_warning() {
  PREEMPTION_WARNED=1
  echo "$(date +%T) preemption warning (USR2): forwarding it to the training processes; the job" \
    "will be requeued once they have saved a checkpoint"
  # No --batch/--full: every process of the job's steps on every node, not this shell.
  scancel --signal=USR2 "$SLURM_JOB_ID" \
    || echo "warning: could not forward USR2 to the training (not started yet?)" >&2
}

# The TERM trap: the training processes got SIGTERM too and are saving; wait for them.
note_termination() {
  echo "$(date +%T) SIGTERM (preemption or time limit): the training saves a checkpoint and stops"
}

trap forward_preemption_warning USR2
trap note_termination TERM

# Runs the command after it with USR2 held (blocked, not ignored: an ignored warning is lost):
# torchrun's agent would die of the forwarded warning (the default action) and take the training
# down with it. A blocked signal stays blocked across exec and in the processes started from there:
# a warning that comes while the training loads waits until its handler is set (common/signals.py).
# shellcheck disable=SC2034  # the templates use it
USR2_IGNORED=(python -c 'import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
signal.signal(signal.SIGUSR2, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])')

# What the run directory holds, asked of the kit, which defines its layout (common/run_dir.py); the
# templates have checked that `python` is the kit's before they source this file.
# When the run last finished, or "none": tells whether this attempt finished the run.
finished_at() {
  python -m common.run_dir finished-at "$OUTPUT_DIR"
}
# The run's newest complete checkpoint, or nothing: tells whether this attempt saved one.
newest_checkpoint() {
  python -m common.run_dir latest-checkpoint "$OUTPUT_DIR"
}
FINISHED_BEFORE=$(finished_at)
CHECKPOINT_BEFORE=$(newest_checkpoint)

# wait_for_training PID: wait for the srun started in the background and return its exit status;
# requeue the job if the training stopped early, on a signal, with a new checkpoint.
# srun runs in the background because bash runs a signal trap only between commands: a
# foreground srun would hold back the trap until training had ended. `wait` also returns when
# a trapped signal arrives, hence the loop.
wait_for_training() {
  local step_pid=$1 status=0
  while :; do
    wait "$step_pid" && status=0 || status=$?
    kill -0 "$step_pid" 2>/dev/null || break
  done
  if [[ $(finished_at) != "$FINISHED_BEFORE" ]]; then
    if ((PREEMPTION_WARNED)); then echo "the training finished before it could stop early: nothing to requeue"; fi
    return "$status"
  fi
  local saved=0
  [[ $(newest_checkpoint) == "$CHECKPOINT_BEFORE" ]] || saved=1
  # Ended cleanly (0; 143: torchrun itself got the SIGTERM) without finishing, with a new checkpoint.
  if ((saved && (status == 0 || status == 143))); then
    echo "$(date +%T) the training saved a checkpoint and stopped: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    return 0
  fi
  if ((PREEMPTION_WARNED || status == 143)); then
    echo "the training stopped (exit status $status) without a new checkpoint after a preemption or time-limit" \
      "signal: not requeued. Submit again with OUTPUT_DIR=$OUTPUT_DIR and --resume to continue from its last" \
      "complete checkpoint" >&2
  fi
  return "$status"
}
