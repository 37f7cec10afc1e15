# shellcheck shell=bash
# Preemption and time limits, for slurm/singlegpu.sh, ddp.sh and fsdp.sh (sourced, never run).
#
# Two signals reach a job before Slurm ends it:
# * USR2, the early warning: `#SBATCH --signal=B:USR2@300` makes Slurm send it to the batch shell
#   (B:), and only to it, 300 s before the time limit (and at a preemption, where the site enables
#   that). The shell forwards it to every training process on every node; they finish the
#   optimiser step they are in, save a checkpoint and exit 0, and the shell requeues the job,
#   which continues the run from the checkpoint (the training script resumes a requeued job).
# * SIGTERM, "stop now": at a preemption (most sites warn with nothing else) and at the time
#   limit, to every process of the job; SIGKILL follows after the site's GraceTime or KillWait
#   (30 s by default). The training saves a checkpoint at the end of its step and exits; this
#   shell keeps waiting for it, since the job ends when this shell does. A preempted job is
#   requeued by Slurm itself.

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

# Runs the command after it with USR2 ignored: torchrun's agent would die of the forwarded
# warning (the default action) and take the training down with it. An ignored signal stays
# ignored across exec; the training processes install their own handler.
# shellcheck disable=SC2016,SC2034  # "$@" is expanded by that inner bash; the templates use it
USR2_IGNORED=(bash -c 'trap "" USR2 && exec "$@"' usr2-ignored)

# The time summary.json was written, or "none": tells whether this attempt finished the run.
finished_at() {
  stat --format=%Y "$OUTPUT_DIR/summary.json" 2>/dev/null || echo none
}
FINISHED_BEFORE=$(finished_at)

# wait_for_training PID: wait for the srun started in the background and return its exit status;
# after a preemption warning, requeue the job if the training stopped early with a checkpoint.
# srun runs in the background because bash runs a signal trap only between commands: a
# foreground srun would hold back the trap until training had ended. `wait` also returns when
# a trapped signal arrives, hence the loop.
wait_for_training() {
  local step_pid=$1 status=0
  while :; do
    wait "$step_pid" && status=0 || status=$?
    kill -0 "$step_pid" 2>/dev/null || break
  done
  ((PREEMPTION_WARNED)) || return "$status"
  if ((status != 0)); then
    echo "the training failed (exit status $status) after the preemption warning: not requeued." \
      "Submit again with OUTPUT_DIR=$OUTPUT_DIR and --resume to continue from its last complete checkpoint" >&2
  elif [[ $(finished_at) != "$FINISHED_BEFORE" ]]; then
    echo "the training finished before it could stop early: nothing to requeue"
  else
    echo "$(date +%T) the training saved a checkpoint and stopped: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$status"
}
