"""--profile_steps A-B: a torch.profiler trace of optimiser steps A to B, per rank, and a summary.

    OUTPUT_DIR/profile/rank0.pt.trace.json  Chrome trace format: open it in https://ui.perfetto.dev,
                                            or `tensorboard --logdir OUTPUT_DIR/profile` (torch-tb-profiler)
    OUTPUT_DIR/profile/summary-rank0.txt    one screen: where the steps' time went, top operations

The summary splits the profiled steps' wall time (ProfilerStep#N) into communication (the
collectives' operations: all-gather, reduce-scatter, all-reduce, broadcast, all-to-all), the optimiser
step and the rest, compute. On a GPU the kernels run on their own streams: the trace
shows whether communication overlaps compute (NCCL kernels beside compute kernels), which the
host's time cannot say.

--profile_steps must lie within --max_steps (common/arguments.py). A run that ends before the last
profiled step (stopped by a signal, or failed) stops the profiler as Python exits and writes the
steps it recorded: a profiler left running then crashed the interpreter (SIGSEGV).
"""
import atexit
import re
from pathlib import Path

import torch.distributed as dist
from torch.profiler import ProfilerAction, ProfilerActivity, profile

COMMUNICATION = re.compile(r"all_gather|allgather|reduce_scatter|all_reduce|allreduce|broadcast|alltoall|all_to_all"
                           r"|nccl|gloo", re.IGNORECASE)
OPTIMIZER = re.compile(r"^Optimizer\.step")
TOP_OPERATIONS = 12


class StepProfiler:
    """Call .step() at the end of every optimiser step; does nothing without --profile_steps."""

    def __init__(self, steps, folder, start_step, device):
        """`steps`: --profile_steps (first, last) or None; `folder`: OUTPUT_DIR/profile; `start_step`:
        the steps already taken (a resumed run profiles what is left of the range)."""
        self.profiler = None
        if steps is None:
            return
        if steps[1] <= start_step:
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"note: --profile_steps {steps[0]}-{steps[1]}: this run resumes after step {start_step}, past "
                      "them: nothing is profiled", flush=True)
            return
        first, last = max(steps[0], start_step + 1), steps[1]
        self.folder, self.rank = Path(folder), dist.get_rank() if dist.is_initialized() else 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

        def action(step):  # what to do during optimiser step `step` (counted from 1, as in metrics.jsonl)
            if step == first - 1:
                return ProfilerAction.WARMUP
            if first <= step < last:
                return ProfilerAction.RECORD
            return ProfilerAction.RECORD_AND_SAVE if step == last else ProfilerAction.NONE

        self.profiler = profile(activities=activities, schedule=action, on_trace_ready=self.write)
        # The trace's ProfilerStep#N are the run's optimiser steps: the profiler counts from here.
        self.profiler.step_num = start_step + 1
        self.profiler.current_action = action(self.profiler.step_num)
        self.profiler.start()
        self.remaining = last - start_step
        atexit.register(self.close)  # a run that ends before `last`

    def step(self):
        if self.profiler is None:
            return
        self.profiler.step()
        self.remaining -= 1
        if self.remaining == 0:
            self.close()

    def close(self):
        """Stop the profiler (once); in the middle of the range it writes the steps recorded so far."""
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.stop()

    def write(self, profiler):
        self.folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.folder / f"rank{self.rank}.pt.trace.json"))
        (self.folder / f"summary-rank{self.rank}.txt").write_text(summary(profiler.events(), self.rank))


def is_collective(event):
    return event.name.startswith(("c10d::", "gloo:", "nccl:")) and COMMUNICATION.search(event.name) is not None


def is_optimizer(event):
    return OPTIMIZER.search(event.name) is not None


def within(event, kind):
    """Whether `event` or a range it runs in is of `kind` (is_collective, is_optimizer)."""
    while event is not None:
        if kind(event):
            return True
        event = event.cpu_parent
    return False


def summary(events, rank):
    """Where the profiled steps' time went, on this rank's host threads, and the top operations."""
    averages = events.key_averages()
    steps = [event for event in averages if event.key.startswith("ProfilerStep")]
    wall = sum(event.cpu_time_total for event in steps) or 1.0
    # Outermost ranges only: an optimiser's step includes the parts it calls (MuonWithAdamW's Muon
    # and AdamW) and its collectives (Muon's all-to-alls); a collective includes what it calls.
    communication = sum(event.cpu_time_total for event in events if is_collective(event)
                        and not within(event.cpu_parent, is_collective) and not within(event, is_optimizer))
    optimizer = sum(event.cpu_time_total for event in events
                    if is_optimizer(event) and not within(event.cpu_parent, is_optimizer))
    compute = max(wall - communication - optimizer, 0.0)
    # How often the steps read a tensor's value back to the host (item(), bool(): on a GPU each
    # waits for the GPU's queue to drain) outside the optimiser's own step.
    value_reads = sum(1 for event in events
                      if event.name == "aten::_local_scalar_dense" and not within(event, is_optimizer))
    on_gpu = any(event.device_time_total for event in averages)
    step_count = sum(event.count for event in steps) or 1
    collectives = sum(event.count for event in averages if event.key.startswith(("gloo:", "nccl:")))
    lines = [f"rank {rank}: {sum(event.count for event in steps)} profiled step(s), "
             f"{wall / 1e3:.1f} ms on the host; per step {collectives / step_count:.1f} collectives, "
             f"{value_reads / step_count:.1f} reads of a value from the device besides the figures' "
             "(item(), bool(): on a GPU each waits for it)",
             f"  communication {communication / wall:6.1%}   (collectives, including waiting for other ranks)",
             f"  optimizer     {optimizer / wall:6.1%}   (the optimiser's step)",
             f"  compute       {compute / wall:6.1%}   (forward, backward, the rest)", "",
             f"top {TOP_OPERATIONS} operations by self time:"]
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    operations = sorted((event for event in averages if not event.key.startswith("ProfilerStep")),
                        key=lambda event: getattr(event, key), reverse=True)[:TOP_OPERATIONS]
    for event in operations:
        lines.append(f"  {getattr(event, key) / 1e3:10.1f} ms  {event.count:6d} calls  {event.key[:70]}")
    if on_gpu:
        lines += ["", "GPU: look in the trace for NCCL kernels running beside the compute kernels (overlap)."]
    return "\n".join(lines) + "\n"
