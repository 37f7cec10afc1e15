"""The optimiser and its learning-rate schedule, the same in every step."""
import math

import torch


def make_optimizer(model, args, foreach=None):
    """AdamW over the trainable parameters only (with LoRA: the adapters, not the frozen model);
    with --optimizer muon, Muon for the decoder's weight matrices and AdamW for the rest.
    Parameters on the CPU (a CPU run, or FSDP's CPU offload) get AdamW's fused kernel, the Hugging
    Face Trainer's default: PyTorch's own CPU default updates one tensor at a time, about 5 times
    slower (benchmark/NOTES.md). On a GPU, foreach=None is PyTorch's choice (multi-tensor), whose
    temporary the plan check measures; it passes foreach itself."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    fused = True if foreach is None and all(param.device.type == "cpu" for param in trainable) else None
    if args.optimizer == "adamw":
        return adamw(trainable, args, foreach, fused)
    # Muon is for the matrices between hidden states; the embedding and the output head map tokens
    # and are AdamW's, as are the norms' vectors (Muon takes matrices only).
    language_model = getattr(model, "module", model)  # under DDP, the model it wraps
    token_maps = {id(language_model.get_input_embeddings().weight), id(language_model.get_output_embeddings().weight)}
    for_muon = {id(param) for param in trainable if param.ndim == 2 and id(param) not in token_maps}
    matrices = [param for param in trainable if id(param) in for_muon]
    others = [param for param in trainable if id(param) not in for_muon]
    return MuonWithAdamW(matrices, adamw(others, args, foreach, fused), args)


def adamw(params, args, foreach, fused):
    return torch.optim.AdamW(params, lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                             foreach=foreach, fused=fused)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (torch.optim.Muon: momentum whose update is orthogonalised, so that every direction of
    a matrix moves alike) for the given matrices, the given AdamW for the other parameters; one
    optimiser to the schedule and the checkpoints. Both keep their state in this one's `state` and
    their groups in its `param_groups`, so the schedule sets both learning rates and a checkpoint
    holds both, as it holds AdamW's alone."""

    def __init__(self, matrices, adamw_part, args):
        # match_rms_adamw scales each matrix's update to the size of an AdamW update (Moonshot's
        # "Muon is scalable"), so one --learning_rate serves both
        self.muon = torch.optim.Muon(matrices, lr=args.learning_rate, weight_decay=args.weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = adamw_part
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self.share_with_parts()

    def share_with_parts(self):
        split = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:split], self.param_groups[split:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # replaces param_groups and state: share them again
        self.share_with_parts()


def make_scheduler(optimizer, args):
    """Linear warm-up to the peak learning rate, then cosine decay to 10% of it at max_steps."""
    def factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
