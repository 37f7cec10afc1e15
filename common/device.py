"""Which device a process trains on."""
import os

import torch

from common.errors import UserError


def pick_device(choice, local_rank=0):
    """The device of this process. Under torchrun it is the node-local rank's GPU, never the
    global rank (global rank 5 on a 4-GPU node has no GPU 5). `auto` takes the GPU when CUDA can
    use it, else the CPU: where Slurm allocated GPUs that CUDA cannot use (the kit's test cluster
    has fake ones), the run uses one CPU process per allocated GPU instead, and says so. On the
    CPU, denormal floats are flushed to zero (see below)."""
    usable = torch.cuda.is_available()
    if choice == "cuda" and not usable:
        raise UserError("--device cuda but no usable GPU here: use --device cpu (or auto), or run on a GPU node")
    if choice == "cuda" or (choice == "auto" and usable):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    allocated = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if choice == "auto" and allocated and os.environ.get("RANK", "0") == "0":
        print(f"note: the GPUs that Slurm allocated (CUDA_VISIBLE_DEVICES={allocated}) are not usable by CUDA here: "
              "running one CPU process per allocated GPU instead (--device cpu, gloo)", flush=True)
    # Values below 1.2e-38 (decaying state such as AdamW's moments ends up there) cost an x86 core
    # far more per operation: unflushed, a 2-rank CPU run's step time nearly doubled within 900
    # steps (benchmark/learn_chess.py). Flushed to zero, it stays flat.
    torch.set_flush_denormal(True)
    return torch.device("cpu")
