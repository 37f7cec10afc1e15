"""The optimiser and its learning-rate schedule, the same in every step."""
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

# Newton-Schulz: Keller Jordan's quintic iteration, as torch.optim.Muon runs it
NS_COEFFICIENTS, NS_STEPS, NS_EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7
# The matrices one rank orthogonalises at a time, in elements: all of the built-in model's in one
# bucket (2 all-to-alls per step); for CodeLlama-7b two attention matrices or one MLP matrix per rank
MUON_BUCKET_ELEMENTS = 2**25


def make_optimizer(model, args, newton_schulz_dtype=None):
    """AdamW over the trainable parameters only (with LoRA: the adapters, not the frozen model);
    with --optimizer muon, Muon for the trainable matrices between hidden states (the decoder's
    weight matrices; with LoRA its adapters A and B) and AdamW for the rest.
    AdamW runs its fused kernel, on the CPU (a CPU run, or FSDP's CPU offload) and on GPUs: on the
    CPU the Hugging Face Trainer's default, PyTorch's own CPU default updating one tensor at a time,
    about 5 times slower (benchmark/NOTES.md); on a GPU one kernel for all the tensors, without the
    multi-tensor (foreach) version's temporary copy of exp_avg_sq. The plan check sets Newton-Schulz's
    dtype on a GPU."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    if args.optimizer == "adamw":
        return adamw(trainable, args)
    # Muon is for the matrices between hidden states; the embedding and the output head map tokens
    # and are AdamW's, as are the norms' vectors (Muon takes matrices only).
    language_model = getattr(model, "module", model)  # under DDP, the model it wraps
    token_maps = {id(language_model.get_input_embeddings().weight), id(language_model.get_output_embeddings().weight)}
    for_muon = {id(param) for param in trainable if param.ndim == 2 and id(param) not in token_maps}
    matrices = [param for param in trainable if id(param) in for_muon]
    others = [param for param in trainable if id(param) not in for_muon]
    # under DDP every rank holds the same matrices: each orthogonalises its share of them
    replicas = model.process_group if isinstance(model, DistributedDataParallel) else None
    return MuonWithAdamW(Muon(matrices, args, newton_schulz_dtype, replicas=replicas) if matrices else None,
                         adamw(others, args) if others else None)


def adamw(params, args):
    return torch.optim.AdamW(params, lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                             fused=True)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the given matrices, the given AdamW for the other parameters (either may be None:
    LoRA trains matrices only); one optimiser to the schedule and the checkpoints. Both keep their
    state in this one's `state` and their groups in its `param_groups`, so the schedule sets both
    learning rates and a checkpoint holds both, as it holds AdamW's alone."""

    def __init__(self, muon, adamw_part):
        self.muon, self.adamw = muon, adamw_part
        super().__init__([group for part in self.parts() for group in part.param_groups], {})
        self.share_with_parts()

    def parts(self):
        return [part for part in (self.muon, self.adamw) if part is not None]

    def share_with_parts(self):
        groups = iter(self.param_groups)
        for part in self.parts():
            part.param_groups = [next(groups) for _ in part.param_groups]
            part.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        for part in self.parts():
            part.step()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # replaces param_groups and state: share them again
        self.share_with_parts()


class Muon(torch.optim.Optimizer):
    """Muon: SGD with Nesterov momentum whose update is orthogonalised (Newton-Schulz), so that
    every direction of a matrix moves alike. The same update as torch.optim.Muon (whose state and
    groups it keeps, so that checkpoints carry over), with two differences:
      * Newton-Schulz runs in fp32 on the CPU (torch.optim.Muon always casts to bf16, and a CPU
        without native bf16 emulates it: 14 times slower, benchmark/NOTES.md), in bf16 on a GPU.
      * a parameter that FSDP shards (a DTensor) is orthogonalised whole, once, by one rank of its
        shard group (its owner), not through DTensor's implicit collectives: one all-to-all brings
        each matrix's rows to its owner, the owner orthogonalises it, a second all-to-all sends every
        rank its rows back (04_fsdp/README.md: "An optimiser that needs whole matrices").
        Matrices that every rank holds alike (DDP's, `replicas` its process group) are shared out
        too: each rank orthogonalises its share, and an all-gather gives every rank every update.
    match_rms_adamw scales each matrix's update to the size of an AdamW update (Moonshot's "Muon is
    scalable"), so one --learning_rate serves Muon and AdamW."""

    def __init__(self, params, args, dtype=None, momentum=0.95, replicas=None):
        self.dtype = dtype  # of Newton-Schulz; None: by where it runs (newton_schulz_dtype)
        self.replicas = replicas if replicas is not None and dist.get_world_size(replicas) > 1 else None
        super().__init__(params, {"lr": args.learning_rate, "weight_decay": args.weight_decay, "momentum": momentum,
                                  "nesterov": True, "ns_coefficients": NS_COEFFICIENTS, "eps": NS_EPS,
                                  "ns_steps": NS_STEPS, "adjust_lr_fn": "match_rms_adamw"})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            whole, sharded = [], {}  # sharded: by the process group and dimension they are cut along
            for param in params:
                cut = shard_layout(param)
                (sharded.setdefault(cut, []) if cut else whole).append(param)
            if whole and self.replicas is not None:
                owner_replicated(whole, lambda param: self.momentum_update(param, group),
                                 lambda param, update: apply(param, update, group), self.replicas, group, self.dtype)
            else:
                for param in whole:
                    device = compute_device(param)
                    update = self.momentum_update(param, group).to(device, self.dtype or newton_schulz_dtype(device))
                    apply(param, newton_schulz(update, group), group)
            for (process_group, dim), matrices in sharded.items():
                owner_sharded(matrices, lambda param: self.momentum_update(param, group),
                              lambda param, update: apply(param, update, group), process_group, dim, group, self.dtype)

    def momentum_update(self, param, group):
        """The momentum step on this rank's piece of the matrix (element by element, so a shard's is
        the whole matrix's, cut): the buffer and the Nesterov update."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad)  # a DTensor like the gradient: sharded
        buffer, grad = local(state["momentum_buffer"]), local(param.grad)
        buffer.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer


def local(tensor):
    """This rank's piece of a DTensor (a view: writing to it writes to the DTensor), or the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def compute_device(param):
    """Where Newton-Schulz runs: where the training runs (with FSDP's CPU offload a sharded
    parameter lives on the CPU, its mesh on the GPU)."""
    return torch.device(param.device_mesh.device_type) if isinstance(param, DTensor) else param.device


def newton_schulz_dtype(device):
    """fp32 on the CPU: fast on every CPU and as exact as the weights. bf16 on a GPU (tensor cores)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def newton_schulz(matrix, group):
    """The orthogonalised matrix (U S' V^T with S' near 1 for M = U S V^T), on a plain tensor, in its dtype."""
    a, b, c = group["ns_coefficients"]
    x = matrix.T if matrix.size(0) > matrix.size(1) else matrix  # the Gram matrix of the short side
    x = x / x.norm().clamp(min=group["eps"])  # spectral norm at most 1
    for _ in range(group["ns_steps"]):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if matrix.size(0) > matrix.size(1) else x


def apply(param, update, group):
    """Decoupled weight decay, then the orthogonalised update at Moonshot's AdamW-matched scale."""
    scale = 0.2 * math.sqrt(max(param.shape))  # match_rms_adamw, on the whole matrix's shape
    weights = local(param)
    weights.mul_(1 - group["lr"] * group["weight_decay"])
    update, step = update.to(weights.device, weights.dtype), group["lr"] * scale
    if step > torch.finfo(weights.dtype).max:  # alpha= refuses it; the weights become what it makes them (inf)
        update, step = update * step, 1.0
    weights.add_(update, alpha=-step)


def shard_layout(param):
    """(process group, dimension) along which FSDP cut a DTensor parameter over more than one rank,
    or None when this rank holds it whole. FULL_SHARD and SHARD_GRAD_OP cut it over all ranks,
    HYBRID_SHARD within a shard group (replicated across groups, which all compute the same)."""
    if not isinstance(param, DTensor):
        return None
    cuts = [(mesh_dim, placement) for mesh_dim, placement in enumerate(param.placements)
            if not placement.is_replicate() and param.device_mesh.size(mesh_dim) > 1]
    if not cuts:
        return None
    if len(cuts) > 1 or type(cuts[0][1]) is not Shard:
        raise NotImplementedError(f"Muon orthogonalises parameters cut along one mesh dimension (FSDP2's "
                                  f"strategies); this one is laid out as {param.placements}")
    mesh_dim, placement = cuts[0]
    return param.device_mesh.get_group(mesh_dim), placement.dim


def rows_per_rank(size, ranks):
    """How FSDP2 (torch.chunk) cuts `size` rows over `ranks`: ceil(size / ranks) each, the last
    ranks fewer or none."""
    chunk = math.ceil(size / ranks)
    return [max(0, min(chunk, size - rank * chunk)) for rank in range(ranks)]


def buckets(sizes, ranks):
    """Matrices (by index) in buckets: each bucket a list of the indices each rank owns in it. The
    largest first, each to the rank that owns the fewest elements so far, until a rank would own
    more than MUON_BUCKET_ELEMENTS (at least one matrix each): the owners' work is balanced, and a
    bucket holds at most that many elements of whole matrices on a rank."""
    done, owned, loads = [], [[] for _ in range(ranks)], [0] * ranks
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner = loads.index(min(loads))
        if loads[owner] and loads[owner] + sizes[index] > MUON_BUCKET_ELEMENTS:
            done.append(owned)
            owned, loads, owner = [[] for _ in range(ranks)], [0] * ranks, 0
        owned[owner].append(index)
        loads[owner] += sizes[index]
    return done + ([owned] if any(owned) else [])


def owner_sharded(params, momentum_update, apply_update, process_group, dim, group, dtype=None):
    """Muon's step for matrices cut along `dim` over `process_group`, bucket by bucket; Newton-Schulz
    sees plain tensors. Every rank packs its pieces of the bucket's matrices (their momentum
    update), in the order of their owners, and one all-to-all gives each owner the pieces of its
    matrices from every rank; the owner puts each matrix together (the pieces in rank order),
    orthogonalises it and cuts it as FSDP cut it; a second all-to-all returns every rank its pieces,
    which it applies. Per rank and step that moves 2 x (ranks - 1) / ranks^2 of the matrices'
    elements each way (a gather on every rank would receive (ranks - 1) / ranks of them), and
    Newton-Schulz runs once per matrix, not once per rank. Each phase is a function, so that its
    buffers are freed when it returns: a bucket holds at most its pieces and two copies of the
    owner's matrices, plus one matrix in Newton-Schulz."""
    ranks, me = dist.get_world_size(process_group), dist.get_rank(process_group)
    device = compute_device(params[0])  # with CPU offload still the GPU: NCCL carries the pieces
    dtype = dtype or newton_schulz_dtype(device)
    cuts = [rows_per_rank(param.shape[dim], ranks) for param in params]

    def piece_shape(index, rank):
        shape = list(params[index].shape)
        return shape[:dim] + [cuts[index][rank]] + shape[dim + 1:]

    def sizes(indices, rank):
        return [math.prod(piece_shape(index, rank)) for index in indices]

    def pack(order):  # this rank's pieces, one momentum update at a time
        pieces = torch.empty(sum(sizes(order, me)), device=device, dtype=dtype)
        for index, piece in zip(order, pieces.split(sizes(order, me))):
            piece.copy_(momentum_update(params[index]).reshape(-1))
        return pieces

    def orthogonalise(received, mine, receive_sizes):  # the owner's matrices; every rank's pieces of them
        back = torch.empty_like(received)
        pieces_from = [part.split(sizes(mine, rank)) for rank, part in enumerate(received.split(receive_sizes))]
        pieces_to = [part.split(sizes(mine, rank)) for rank, part in enumerate(back.split(receive_sizes))]
        for k, index in enumerate(mine):
            whole = torch.cat([pieces_from[rank][k].view(piece_shape(index, rank)) for rank in range(ranks)], dim)
            for rank, piece in enumerate(newton_schulz(whole, group).split(cuts[index], dim)):
                pieces_to[rank][k].view(piece.shape).copy_(piece)
        return back

    def unpack(order, returned):
        for index, piece in zip(order, returned.split(sizes(order, me))):
            apply_update(params[index], piece.view(local(params[index]).shape))

    def bucket_step(owned):
        order = [index for mine in owned for index in mine]  # by owner: the all-to-all's layout
        send_sizes = [sum(sizes(owned[rank], me)) for rank in range(ranks)]
        receive_sizes = [sum(sizes(owned[me], rank)) for rank in range(ranks)]
        received = all_to_all(pack(order), send_sizes, receive_sizes, process_group)
        back = orthogonalise(received, owned[me], receive_sizes)
        del received
        returned = all_to_all(back, receive_sizes, send_sizes, process_group)
        del back
        unpack(order, returned)

    for owned in buckets([param.numel() for param in params], ranks):
        bucket_step(owned)


def owner_replicated(params, momentum_update, apply_update, process_group, group, dtype=None):
    """Muon's step for matrices that every rank of `process_group` holds alike, with the same
    gradients (DDP's), bucket by bucket as `buckets` deals them out: every rank keeps every momentum
    buffer, orthogonalises only the matrices it owns, and one all-gather gives every rank every
    update, which it applies. Newton-Schulz runs once per matrix, not once per rank; the weights are
    what each rank's own Newton-Schulz would make them, to the bit (Keller Jordan's Muon under DDP)."""
    ranks, me = dist.get_world_size(process_group), dist.get_rank(process_group)
    device = params[0].device
    dtype = dtype or newton_schulz_dtype(device)
    for owned in buckets([param.numel() for param in params], ranks):
        updates = {}
        for mine in owned:
            for index in mine:  # every buffer moves on every rank; the update is needed by its owner only
                update = momentum_update(params[index])
                if mine is owned[me]:
                    updates[index] = update
        width = max(sum(params[index].numel() for index in mine) for mine in owned)  # the all-gather's
        packed = torch.zeros(width, device=device, dtype=dtype)
        start = 0
        for index in owned[me]:
            update = newton_schulz(updates[index].to(device, dtype), group)
            packed[start: start + update.numel()].copy_(update.reshape(-1))
            start += update.numel()
        del updates
        gathered = torch.empty(ranks * width, device=device, dtype=dtype)
        dist.all_gather_into_tensor(gathered, packed, group=process_group)
        for rank, part in enumerate(gathered.split(width)):
            start = 0
            for index in owned[rank]:
                size = params[index].numel()
                apply_update(params[index], part[start: start + size].view(params[index].shape))
                start += size


def all_to_all(tensor, send_sizes, receive_sizes, process_group):
    received = tensor.new_empty(sum(receive_sizes))
    dist.all_to_all_single(received, tensor, receive_sizes, send_sizes, group=process_group)
    return received


def make_scheduler(optimizer, args):
    """Linear warm-up to the peak learning rate, then cosine decay to 10% of it at max_steps."""
    def factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
