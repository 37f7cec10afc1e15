"""The optimiser and its learning-rate schedule, the same in every step."""
import math

import torch


def make_optimizer(model, args, foreach=None):
    """AdamW over the trainable parameters only (with LoRA: the adapters, not the frozen model).
    Parameters on the CPU (a CPU run, or FSDP's CPU offload) get the fused kernel, the Hugging Face
    Trainer's default: PyTorch's own CPU default updates one tensor at a time, about 5 times slower
    (benchmark/NOTES.md). On a GPU, foreach=None is PyTorch's choice (multi-tensor), whose temporary
    the plan check measures; it passes foreach itself."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    fused = True if foreach is None and all(param.device.type == "cpu" for param in trainable) else None
    return torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                             foreach=foreach, fused=fused)


def make_scheduler(optimizer, args):
    """Linear warm-up to the peak learning rate, then cosine decay to 10% of it at max_steps."""
    def factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
