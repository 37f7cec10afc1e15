"""The batch contract: one global batch per optimiser step, the same at any GPU count.

    total_batch_size = batch_size_per_device × world_size × gradient_accumulation_steps

The user chooses the total (it is a hyperparameter, like the learning rate) and how many rows
fit on one device; the accumulation follows from the world size. The training scripts work it
out at start, and submit.py prints the same plan before it queues a job, with this function.
"""
from common.errors import UserError


def gradient_accumulation_steps(total_batch_size, batch_size_per_device, world_size, ranks="ranks"):
    """total ÷ (per device × world size), refused unless it is a whole number ≥ 1. With tensor
    parallelism (step 6) the world size is the number of data-parallel groups, which `ranks` names."""
    rows_per_pass = batch_size_per_device * world_size
    if total_batch_size % rows_per_pass:
        raise UserError(f"--total_batch_size {total_batch_size} is not a multiple of --batch_size_per_device "
                        f"{batch_size_per_device} × {world_size} {ranks} = {rows_per_pass}: change one of them")
    return total_batch_size // rows_per_pass


def describe(total_batch_size, batch_size_per_device, world_size, accumulation, devices="devices"):
    return (f"total batch {total_batch_size} = {batch_size_per_device} per device × {world_size} {devices} × "
            f"{accumulation} gradient accumulation steps")
