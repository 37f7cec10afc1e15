"""The peer baseline: the same fine-tuning with the Hugging Face Trainer and FSDP, set up the way
the AWS SageMaker examples do it (Trainer(fsdp="full_shard auto_wrap", fsdp_config with
transformer_layer_cls_to_wrap), launched with torchrun).

    torchrun --nproc-per-node 2 benchmark/hf_trainer_fsdp.py --output_dir runs/hf_trainer

Same model, same games, same global batch of rows (--total_batch_size, split as the step scripts
split it), AdamW settings and schedule as 04_fsdp. With gradient accumulation the Trainer skips
the reduce-scatter on all but the last micro-batch (accelerate's no_sync calls FSDP2's
set_requires_gradient_sync(False)) but still gathers the weights for every micro-batch.
By default the data is prepared as the SageMaker examples do: one game per row, padded per
micro-batch (they tokenize each example and pad; they do not pack). `--packing` feeds the
Trainer 04_fsdp's packed rows instead, which leaves only the training loops to compare. It
writes metrics.jsonl and summary.json with the same fields as the step scripts, so
benchmark/run.py reads both the same way. Tokens are counted the same way too: loss-bearing
tokens only (non-padding tokens minus each row's first, which nothing predicts).
"""
import functools
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.arguments import DEMO_DIR, Parser  # common first: it quiets torchao, which transformers imports

from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import Trainer, TrainerCallback, TrainingArguments
from common.batch import gradient_accumulation_steps
from common.data import collate
from common.errors import UserError, exit_on_user_error
from common.model import load_config, load_model, load_tokenizer
from common.notation import model_notation
from common.prepare_data import prepared_rows
from common.run_dir import RunDir


def parse_arguments():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", default=str(DEMO_DIR / "model"))
    parser.add("data_dir", default=str(DEMO_DIR / "data"))
    parser.add("prepared_dir", default=None, help="where the tokenized games are kept (as the step scripts)")
    parser.add("output_dir", required=True, help="metrics.jsonl, summary.json and the Trainer's files go here")
    parser.add("overwrite", action="store_true", help="replace the run in --output_dir")
    parser.add("total_batch_size", type=int, default=16, help="rows per optimiser step, over all ranks")
    parser.add("batch_size_per_device", type=int, default=4,
               help="rows per forward pass on each rank; the gradient accumulation makes up the rest")
    parser.add("max_steps", type=int, default=100)
    parser.add("learning_rate", type=float, default=1e-3)
    parser.add("max_seq_length", type=int, default=256)
    parser.add("seed", type=int, default=0)
    parser.add("packing", action="store_true", help="04_fsdp's packed rows instead of one padded game per row")
    return parser.parse_args()


def main():
    args = parse_arguments()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    output_dir = Path(args.output_dir)
    if (RunDir(output_dir).metrics.exists() or RunDir(output_dir).summary.exists()) and not args.overwrite:
        raise UserError(f"{output_dir} already holds a run: pass --overwrite to replace it, or choose another "
                        "--output_dir")
    output_dir.mkdir(parents=True, exist_ok=True)

    # The same batch contract as the step scripts: total = per device × ranks × accumulation.
    accumulation = gradient_accumulation_steps(args.total_batch_size, args.batch_size_per_device, world_size)
    config = load_config(args.model)
    tokenizer = load_tokenizer(args.model, config)
    model = load_model(args.model)
    rows = prepared_rows(args.data_dir, "train", tokenizer, args.max_seq_length, args.packing, args.prepared_dir,
                         notation=model_notation(config))
    # Each micro-batch padded to its longest row; padding gets no attention and no loss.
    collator = functools.partial(collate, pad_id=tokenizer.pad_token_id)

    training = TrainingArguments(
        output_dir=str(output_dir / "trainer"), use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.batch_size_per_device,
        gradient_accumulation_steps=accumulation, max_steps=args.max_steps,
        # the step scripts' optimiser and schedule: AdamW (0.9, 0.95), clip at 1, 10% linear
        # warm-up, cosine decay to 10% of the peak
        learning_rate=args.learning_rate, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch", warmup_steps=max(1, args.max_steps // 10),
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        bf16=torch.cuda.is_available(), seed=args.seed, data_seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        include_num_input_tokens_seen="non_padding",  # counted by the Trainer itself, over all ranks
        # As the SageMaker examples: FSDP through accelerate, one unit per decoder layer.
        # transformers 5 runs FSDP2 (fully_shard) by default; "full_shard" = reshard after forward.
        fsdp="full_shard auto_wrap", fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    clock = StepClock(args.total_batch_size)
    trainer = CpuFsdpTrainer(model=model, args=training, train_dataset=rows, data_collator=collator,
                             callbacks=[clock])
    trainer.train()

    peaks = [None] * world_size
    dist.all_gather_object(peaks, {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)})
    if trainer.is_world_process_zero():
        records = clock.records(world_size)
        with RunDir(output_dir).metrics.open("w") as out:
            out.writelines(json.dumps(record) + "\n" for record in records)
        timed = records[1:] or records  # as the step scripts: leave out step 1 (start-up costs)
        tokens_per_s = sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed)
        summary = {"run": "hf_trainer_fsdp", "world_size": world_size, "steps": records[-1]["step"],
                   "final_loss": round(records[-1]["loss"], 4), "tokens_per_s": round(tokens_per_s, 1),
                   "tokens_per_s_per_device": round(tokens_per_s / world_size, 1),
                   "step_time_s": round(sum(r["step_time_s"] for r in timed) / len(timed), 4),
                   "peak_rss_mib_per_rank": max(p["peak_rss_mib"] for p in peaks),
                   "packing": args.packing, "gradient_accumulation_steps": accumulation,
                   "wrapped_as": type(trainer.model_wrapped).__name__}  # FSDP2 names its class FSDP<model class>
        RunDir(output_dir).summary.write_text(json.dumps(summary, indent=1) + "\n")
        print("hf_trainer_fsdp: " + "  ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    # accelerate leaves its process group open; the kit's ranks close theirs (and then leave
    # without the interpreter's shutdown: common/errors.py's leave_after_success says why)
    dist.destroy_process_group()


class CpuFsdpTrainer(Trainer):
    """The Trainer, with FSDP also on the CPU. accelerate 1.15 turns an FSDP plugin on only for
    accelerators (state.py: MULTI_CPU never becomes FSDP), so on the CPU Trainer(fsdp=...) would
    silently train with DDP instead. On a GPU this class changes nothing."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if state.distributed_type == DistributedType.MULTI_CPU and self.args.fsdp_plugin_args is not None:
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True


class StepClock(TrainerCallback):
    """Wall time from one optimiser step's end to the next (data, forward, backward, step, the
    Trainer's own bookkeeping), the tokens of each step, and the logged loss."""

    def __init__(self, rows_per_step):
        self.rows_per_step = rows_per_step
        self.ends, self.tokens_seen, self.losses = [], [], {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.ends, self.tokens_seen = [time.perf_counter()], [state.num_input_tokens_seen]

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        self.tokens_seen.append(state.num_input_tokens_seen)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def records(self, world_size):
        records = []
        for step in range(1, len(self.ends)):
            elapsed = self.ends[step] - self.ends[step - 1]
            # non-padding input tokens, minus each row's first token: the loss-bearing ones
            tokens = self.tokens_seen[step] - self.tokens_seen[step - 1] - self.rows_per_step
            records.append({"step": step, "loss": self.losses.get(step), "tokens": tokens,
                            "tokens_per_s": tokens / elapsed, "tokens_per_s_per_device": tokens / elapsed / world_size,
                            "step_time_s": elapsed, "world_size": world_size})
        return records


if __name__ == "__main__":
    exit_on_user_error(main)
