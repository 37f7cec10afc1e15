"""Token rows → the same global batches at any GPU count.

The lesson of the steps is that they optimise the same thing. That holds only if every step sees
the same samples in each optimiser step, whatever the world size and the gradient-accumulation
split. So the data order is defined per *global* batch, and each rank takes its share of it
(see `GlobalBatchSampler`). The rows themselves are memory-mapped (common/prepare_data.py):
a rank reads only the rows of its batches, whatever the size of the data set.
"""
import functools

import numpy as np
import torch
import torch.utils.checkpoint

from common.errors import UserError
from common.prepare_data import prepared_rows
from common.signals import leave_stopping_to_the_rank

IGNORE_INDEX = -100  # labels with this value add nothing to the loss (padding)


class ShuffledOrder:
    """A seeded permutation of 0..n-1 that is computed one position at a time: `order(epoch,
    positions)` is the row at those positions of that epoch's shuffle. Nothing of size n is ever
    built, so a step costs the same for a thousand rows or a billion. It is a small Feistel
    network (the construction of block ciphers: a bijection on 2^bits numbers, whatever the round
    function) with cycle-walking: a number that lands outside 0..n-1 is mapped again until inside."""

    ROUNDS = 4

    def __init__(self, n, seed):
        self.n = n
        self.half_bits = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half_bits) - 1)
        self.seed = seed

    @staticmethod
    def _mix(x):
        """splitmix64's finaliser: every input bit affects every output bit."""
        with np.errstate(over="ignore"):
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            return x ^ (x >> np.uint64(31))

    def _permute(self, x, keys):
        left, right = x >> np.uint64(self.half_bits), x & self.mask
        for key in keys:
            with np.errstate(over="ignore"):
                left, right = right, left ^ (self._mix(right + key) & self.mask)
        return (left << np.uint64(self.half_bits)) | right

    def order(self, epoch, positions):
        with np.errstate(over="ignore"):
            keys = [self._mix(np.uint64(self.seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(epoch * self.ROUNDS + r))
                    for r in range(self.ROUNDS)]
        x = np.asarray(positions, dtype=np.uint64)
        x = self._permute(x, keys)
        outside = x >= self.n
        while outside.any():  # at most a few rounds: the domain is less than 4 n
            x[outside] = self._permute(x[outside], keys)
            outside = x >= self.n
        return x.astype(np.int64)


class GlobalBatchSampler:
    """Yields, for this rank, the index lists of its micro-batches, step after step.

    Optimiser step s uses global batch s: `total_batch_size` consecutive positions of a seeded
    shuffle of the rows (a new shuffle each epoch). The global batch never depends on how it is
    split, so 1 GPU × 4 micro-batches and 4 GPUs × 1 see the same rows, and resuming at step s
    needs nothing but s. How it is split is `split_by_length`'s: the same micro-batches at any
    world size, shared out so that every rank gets about as much work (rows of unequal length,
    one game per row), since the ranks wait for the slowest at each step's gradient reduction.
    """

    def __init__(self, rows, total_batch_size, batch_size_per_device, rank, world_size, seed, max_steps):
        """`rows`: the training rows (common/prepare_data.TokenRows: their count and each row's length)."""
        num_rows = len(rows)
        self.global_batch_size, self.world_size = total_batch_size, world_size
        if num_rows < total_batch_size:
            raise UserError(f"the data has {num_rows} rows but one global batch needs {total_batch_size} "
                            "(--total_batch_size): use more data or a smaller --total_batch_size")
        self.row_lengths = rows.row_lengths
        self.micro, self.rank = batch_size_per_device, rank
        self.start_step, self.max_steps = 0, max_steps
        self.steps_per_epoch = num_rows // self.global_batch_size
        self.shuffle = ShuffledOrder(num_rows, seed)

    def starting_at(self, step):
        """The same batches, from optimiser step `step` on (a resumed run)."""
        self.start_step = step
        return self

    def batches(self, rows, start_step, pad_id, device, workers=None):
        """This rank's micro-batches, padded, from optimiser step `start_step` on (make_loader)."""
        return iter(make_loader(rows, self.starting_at(start_step), pad_id, device, workers))

    def global_batch(self, step):
        epoch, position = divmod(step, self.steps_per_epoch)
        first = position * self.global_batch_size
        return self.shuffle.order(epoch, range(first, first + self.global_batch_size)).tolist()

    def __iter__(self):
        for step in range(self.start_step, self.max_steps):
            batch = self.global_batch(step)
            yield from split_by_length(batch, self.row_lengths(batch), self.world_size, self.micro)[self.rank]

    def __len__(self):
        return (self.max_steps - self.start_step) * (self.global_batch_size // self.world_size // self.micro)


def split_by_length(rows, lengths, parts, micro):
    """`rows` (a global batch) in `parts` equal shares, each a list of micro-batches of `micro`
    rows. The rows, longest first, are cut into micro-batches (rows of similar length: little
    padding); each micro-batch in turn, the costliest first, goes to the share with the least
    padded tokens that still has room. A micro-batch is the same rows at any number of parts, so
    one process accumulating them computes exactly what the ranks do; with one row per
    micro-batch the ranks get about as many tokens. The same rows and lengths always give the
    same shares."""
    order = sorted(range(len(rows)), key=lambda i: (-lengths[i], i))
    per_part = len(rows) // micro // parts
    shares, padded = [[] for _ in range(parts)], [0] * parts
    for first in range(0, len(order), micro):
        chunk = order[first: first + micro]
        part = min((p for p in range(parts) if len(shares[p]) < per_part), key=lambda p: (padded[p], p))
        shares[part].append([rows[i] for i in chunk])
        padded[part] += len(chunk) * lengths[chunk[0]]
    return shares


def training_data(args, tokenizer, notation, rank=0, world_size=1):
    """(the training rows, the sampler of this rank's micro-batches): the games of --data_dir,
    tokenized once per data set and memory-mapped here (common/prepare_data.py), and every optimiser
    step one global batch of them."""
    rows = prepared_rows(args.data_dir, "train", tokenizer, args.max_seq_length, not args.no_packing,
                         args.prepared_dir, notation=notation)
    return rows, GlobalBatchSampler(rows, args.total_batch_size, args.batch_size_per_device, rank=rank,
                                    world_size=world_size, seed=args.seed, max_steps=args.max_steps)


def collate(rows, pad_id):
    """Pad a micro-batch to its longest row; padding gets no attention and no loss. Rows of one length
    (packed rows: the default) need no mask: without one the model attends causally, which is what a
    mask of ones gives, and it does not read the mask back from the GPU to find out (Hugging Face
    checks a mask it is given for padding, one wait for the GPU per forward pass)."""
    longest = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        labels[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    batch = {"input_ids": input_ids, "labels": labels}
    if any(len(row) < longest for row in rows):
        batch["attention_mask"] = attention_mask
    return batch


def make_loader(rows, sampler, pad_id, device, workers=None):
    """A DataLoader over the sampler's micro-batches. `workers` processes make the next batches while
    the rank trains (default: 2 on a GPU, none on the CPU, whose cores the ranks use); pinned memory
    on a GPU, for copies that overlap compute. Workers leave stopping to their rank (common/signals.py)."""
    on_gpu = device.type == "cuda"
    workers = (2 if on_gpu else 0) if workers is None else workers
    return torch.utils.data.DataLoader(
        rows, batch_sampler=sampler, collate_fn=functools.partial(collate, pad_id=pad_id),
        num_workers=workers, pin_memory=on_gpu, worker_init_fn=leave_stopping_to_the_rank)


def count_loss_tokens(batch):
    """Tokens that carry a loss: every non-padding label except each row's first (nothing predicts it)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def loss_sum(model, batch, chunk_size=0):
    """Summed next-token cross-entropy over the batch's non-padding tokens; with `chunk_size`
    (--loss_chunk_size) that many tokens at a time (chunked_loss_sum).

    A sum, not a mean: the caller divides by the token count of the whole global batch, so
    every token weighs the same however the batch is split across micro-batches and ranks.
    """
    # Shift the labels, not the logits: logits[:, :-1] would copy rows × length × vocabulary values
    # (42 MB per micro-batch at a 20k vocabulary); the last position, which predicts nothing, is ignored.
    next_tokens = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX).flatten()
    if chunk_size:
        return chunked_loss_sum(model, batch, next_tokens, chunk_size)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    return cross_entropy_sum(logits.flatten(0, 1), next_tokens)


def cross_entropy_sum(logits, targets):
    return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_loss_sum(model, batch, next_tokens, chunk_size):
    """loss_sum's sum, `chunk_size` tokens of the batch at a time. The model runs without its output
    head (lm_head returns the final hidden states); then each chunk's logits are made from them, their
    loss summed, and dropped: backward makes each chunk's logits again (checkpointing), so no more
    than one chunk's are ever held (at a 32k vocabulary 128k bytes of fp32 logits per token: 16 GiB
    for 16 rows of 2,048). lm_head's weight is the one the model's forward used (FSDP keeps the
    root gathered from forward to backward, and DDP's hooks are on the parameter itself)."""
    head = getattr(model, "module", model).get_output_embeddings()  # under DDP's wrapper, or peft's
    head.forward = torch.nn.Identity().forward
    try:
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits.flatten(0, 1)
    finally:
        del head.forward  # the class's forward again
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for first in range(0, len(next_tokens), chunk_size):
        part = slice(first, first + chunk_size)
        total = total + torch.utils.checkpoint.checkpoint(
            lambda hidden, targets: cross_entropy_sum(head(hidden), targets), hidden[part], next_tokens[part],
            use_reentrant=False)
    return total
