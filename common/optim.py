"""The optimiser and its learning-rate schedule, the same in every step."""
import math

import torch


def make_optimizer(model, args, foreach=None):
    """AdamW over the trainable parameters only (with LoRA: the adapters, not the frozen model).
    foreach=None is PyTorch's choice (multi-tensor on GPU); the plan check passes False."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    return torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                             foreach=foreach)


def make_scheduler(optimizer, args):
    """Linear warm-up to the peak learning rate, then cosine decay to 10% of it at max_steps."""
    def factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
