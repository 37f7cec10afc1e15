"""Starting the process group: which library carries which tensors, and how long a rank waits.

Under torchrun every rank joins one group (steps 3 to 5). On GPUs NCCL carries the collectives,
and only GPU tensors; on the CPU gloo does. A collective waits at most `timeout_s` for the other
ranks, then fails the job: long enough for the slowest legitimate wait (the other ranks wait in
the first broadcast while rank 0 reads 7B from a shared file system, and at a barrier while rank 0
writes a 7B checkpoint), short enough that a hung job does not hold its GPUs for hours.
common/hang.py's watchdog reports a hang at `timeout_s`, with every rank's stacks; the backend's
own timeout is a minute longer, so that the watchdog speaks first.

gloo has no reduce-scatter of its own: it all-reduces the whole tensor and keeps one slice, twice
the bytes a reduce-scatter needs, in a call that FSDP waits for on the CPU (it overlaps
communication through GPU streams only). `reduce_scatter_by_all_to_all` gives FSDP's CPU
reduce-scatters the bytes of a real one: one all-to-all and a local sum (benchmark/NOTES.md,
"gloo's reduce-scatter").

PyTorch's Flight Recorder is on (TORCH_FR_BUFFER_SIZE, unless set already): each rank keeps its
last collectives, as it issues them, which is how the watchdog tells the rank that is behind.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from common.signals import die_with_launcher

WATCHDOG_FIRST_S = 60  # the backend's timeout is this much longer than the watchdog's
FLIGHT_RECORDER_ENTRIES = 2000  # the last collectives each rank keeps (FSDP: about 3 per layer and micro-batch)


def backend(device_type, cpu_tensors=False):
    """gloo on the CPU; NCCL on GPUs. Where some reduced tensors stay in host memory (FSDP's CPU
    offload keeps the sharded weights and gradients there, so the gradient norm and the load's
    broadcast reduce CPU tensors), gloo carries those: "cuda:nccl,cpu:gloo", as torchtitan does."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_tensors else "nccl"


def init_process_group(device, timeout_s, cpu_tensors=False):
    """Join the job's process group, dying with the launcher. On a GPU, `device_id` binds this
    rank's GPU to it: NCCL connects at once (a broken network shows here, not at the first
    collective), and the sub-groups of a 2-D mesh are split from it."""
    die_with_launcher()  # no orphaned ranks if torchrun is killed
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))  # read as the group starts
    timeout = timedelta(seconds=timeout_s + WATCHDOG_FIRST_S)
    dist.init_process_group(backend=backend(device.type, cpu_tensors), timeout=timeout,
                            device_id=device if device.type == "cuda" else None)


class AllToAllReduceScatter:
    """FSDP's reduce-scatter (its `set_custom_reduce_scatter` interface: `allocate` and the call)
    for CPU tensors: every rank sends each rank its slice of the gradients (one all-to-all), then
    sums the slices it received, in rank order. Reductions other than a sum or a mean take the
    library's reduce-scatter, as FSDP calls it."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        ranks = dist.get_world_size(group)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(ranks, -1), dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(ranks)
        return None  # done: nothing left to wait for


def reduce_scatter_by_all_to_all(model, device):
    """On the CPU, every FSDP unit of `model` reduce-scatters its gradients with
    AllToAllReduceScatter. On GPUs (CPU offload too: FSDP reduce-scatters on the GPU, then copies
    the shard to host memory) FSDP keeps NCCL's own, untouched."""
    if device.type != "cpu":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(AllToAllReduceScatter())
