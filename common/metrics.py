"""metrics.jsonl (one JSON object per optimiser step), memory figures and the final table."""
import contextlib
import json
import resource
import sys
import time

import psutil
import torch

from common.tracking import Tracker


class MetricsLog:
    """Where each optimiser step's figures go: one JSON line in metrics.jsonl, always, and the
    trackers asked for with --report_to; summary.json at the end. Only the rank that logs (rank 0)
    writes anything. It knows the run (its arguments, ranks and device, the model's FLOPs per
    token for MFU), so that a step hands it only what the step measured."""

    def __init__(self, run_dir, enabled, args, model, world_size, accumulation, device, resumed_at=0):
        path = run_dir.metrics
        self.resumed = None  # the record of the step the run resumed at, if on file
        if enabled and resumed_at and path.exists():  # keep the steps up to the checkpoint; later ones will be redone
            kept = [line for line in path.read_text().splitlines() if step_of(line) <= resumed_at]
            path.write_text("".join(line + "\n" for line in kept))
            self.resumed = json.loads(kept[-1]) if kept and step_of(kept[-1]) == resumed_at else None
        self.file = path.open("a" if resumed_at else "w", encoding="utf-8") if enabled else None
        self.tracker = Tracker(list(args.report_to), run_dir.path, run_dir.path.name,
                               run_params(args, world_size, device), enabled)
        self.run_dir, self.records, self.enabled = run_dir, [], enabled
        self.args, self.world_size, self.accumulation, self.device = args, world_size, accumulation, device
        self.model_flops = flops_per_token(getattr(model, "module", model), args.max_seq_length)  # DDP's: its model

    def timer(self):
        """A new step's timer (StepTimer)."""
        return StepTimer()

    def step_record(self, step, tokens, loss_total, grad_norm, lr, timer):
        """The figures of optimiser step `step`: what the step measured (already read from the GPU)
        and what follows from it. Stops `timer`."""
        elapsed, data_wait = timer.finish()
        per_device = tokens / elapsed / self.world_size
        return {"step": step, "loss": loss_total / tokens, "lr": lr, "grad_norm": grad_norm, "tokens": int(tokens),
                "tokens_per_s": tokens / elapsed, "tokens_per_s_per_device": per_device, "step_time_s": elapsed,
                "data_wait_s": data_wait, "world_size": self.world_size,
                "gradient_accumulation_steps": self.accumulation,
                "batch_size_per_device": self.args.batch_size_per_device, **peak_memory(self.device),
                **model_flops_utilization(per_device, self.model_flops, self.device)}

    def evaluates_at(self, step):
        """Whether optimiser step `step` ends with an evaluation: every --eval_every steps, and the last one."""
        return bool(self.args.eval_every and step % self.args.eval_every == 0) or step == self.args.max_steps

    def evaluation_missing(self):
        """True on every rank if the step the run resumed at was due an evaluation that a stop cut short
        (a preemption in the last step left no final evaluation). A collective, as rank 0 alone reads the
        log: call it at the same point on all ranks."""
        missing = self.resumed is not None and self.evaluates_at(self.resumed["step"]) \
            and "eval_loss" not in self.resumed
        flag = torch.tensor(float(missing), device=self.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def add_evaluation(self, figures):
        """The missing evaluation's figures, added to the resumed step's record as if never cut short."""
        if self.file is None:
            return
        self.resumed.update(figures)
        lines = self.run_dir.metrics.read_text().splitlines()[:-1] + [json.dumps(self.resumed)]
        self.file.close()  # written again with the record completed, then appended to as before
        self.run_dir.metrics.write_text("".join(line + "\n" for line in lines))
        self.file = self.run_dir.metrics.open("a", encoding="utf-8")
        self.records.append(self.resumed)  # the run's last step, if it was the last: the summary's figures
        self.tracker.log(figures, step=self.resumed["step"])
        print(f"step {self.resumed['step']}: eval_loss={figures['eval_loss']:.4f} "
              f"legal_move_rate={figures['legal_move_rate']:.3f}", flush=True)

    def write(self, record):
        record["since_start_s"] = round(time.time() - psutil.Process().create_time(), 2)  # time to first step
        if self.file is not None:
            self.records.append(record)
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()  # a killed job still leaves every finished step on disk
            self.tracker.log(record, step=record["step"])

    def peak_memory(self):
        """This process's peak memory so far (peak_memory)."""
        return peak_memory(self.device)

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None
        self.tracker.close()

    def finish(self, name, untrained, peaks_per_rank):
        """summary.json, and its figures in one line on stdout: the run has ended."""
        self.close()
        if self.enabled:
            print_summary(name, write_summary(self.run_dir, name, self.records, untrained, peaks_per_rank))


def step_of(line):
    """The step of a metrics.jsonl line; a line cut short by a killed write counts as a later step."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def run_params(args, world_size, device):
    """What describes a run for a tracker: its arguments, the world size and the GPU type."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    return {**vars(args), "world_size": world_size, "gpu_type": gpu}


def peak_memory(device):
    """Peak memory of this process in MiB: CPU resident set, and on GPU what PyTorch allocated
    and reserved (reserved is what nvidia-smi would show as used by us)."""
    mib = 1024 * 1024
    figures = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.type == "cuda":
        figures["peak_gpu_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / mib, 1)
        figures["peak_gpu_reserved_mib"] = round(torch.cuda.max_memory_reserved(device) / mib, 1)
    return figures


# Dense bf16 peak of one GPU, FLOP/s, from the vendors' data sheets (without sparsity), by the
# full name CUDA gives the device: the PCIe and NVL H100s are slower than the SXM one.
PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
}


def flops_per_token(model, seq_len):
    """Training FLOPs per token, as PaLM (appendix B) and torchtitan count them: each weight of a
    matrix multiplication costs 2 FLOPs in forward (one multiply-add), 2 in backward for the
    gradient of its input and 2 for its own gradient: 6 for a trained weight, 4 for a frozen one
    (LoRA's base model: no weight gradient is computed; about 4, as the first layer's projections
    of the embeddings need no input gradient either). Plus attention's scores and weighted sum,
    12 × layers × hidden × seq_len. The weights are counted by the layers' shapes (in × out), not
    by numel(): a 4-bit QLoRA weight is stored packed, 2 values a byte. The input embedding is a
    table lookup, no matmul; norms and biases are left out (a few thousandths of the total).
    Recomputation for activation checkpointing is not counted: MFU measures useful work."""
    config = model.config
    flops = 12 * config.num_hidden_layers * config.hidden_size * seq_len
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):  # also QLoRA's 4-bit layers and peft's adapters
            flops += (6 if module.weight.requires_grad else 4) * module.in_features * module.out_features
    return flops


def forward_flops_per_token(model, seq_len):
    """The forward pass's share of flops_per_token: 2 FLOPs per weight, a third of attention's. What full
    activation checkpointing computes a second time (selective recomputes almost none of it)."""
    config = model.config
    weights = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 2 * weights + 4 * config.num_hidden_layers * config.hidden_size * seq_len


def peak_flops(device):
    """(the dense bf16 peak FLOP/s of this GPU, its name), or (None, name) for a GPU not in the table."""
    name = torch.cuda.get_device_name(device)
    return PEAK_BF16_FLOPS.get(name), name


def model_flops_utilization(tokens_per_s_per_device, flops_per_token, device):
    """{"mfu": achieved / peak FLOP/s, "mfu_peak_tflops": the peak it was measured against} on a
    GPU whose peak we know (the GPU's name is the run's gpu_type, run_params); {} elsewhere (CPU,
    other GPUs: add yours to PEAK_BF16_FLOPS under the name CUDA gives it)."""
    if device.type != "cuda":
        return {}
    peak, _ = peak_flops(device)
    if peak is None:
        return {}
    return {"mfu": round(tokens_per_s_per_device * flops_per_token / peak, 4), "mfu_peak_tflops": peak / 1e12}


class StepTimer:
    """Wall time of a step, split into waiting for data and the rest (compute + communication).
    It does not wait for the GPU itself: the step's one read of its figures has (see the loop)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.data_wait = 0.0

    @contextlib.contextmanager
    def waiting_for_data(self):
        since = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - since

    def seconds(self, work, *args):
        """Runs work(*args) and returns how long it took (a checkpoint's save)."""
        since = time.perf_counter()
        work(*args)
        return time.perf_counter() - since

    def finish(self):
        return time.perf_counter() - self.start, self.data_wait


def print_summary(title, figures, file=sys.stdout):
    print(f"{title}: " + "  ".join(f"{k}={v}" for k, v in figures.items()), file=file, flush=True)


def write_summary(run_dir, name, records, untrained, peaks_per_rank):
    """summary.json: the figures the demo's side-by-side table shows. Throughput leaves out the
    first step (start-up costs: allocator warm-up, first collectives)."""
    if not records:  # resumed a run that had already finished
        return {}
    timed = records[1:] or records
    last = records[-1]
    step_time = sum(r["step_time_s"] for r in timed)
    tokens_per_s = sum(r["tokens"] for r in timed) / step_time
    summary = {
        "run": name,
        "world_size": last["world_size"],
        "steps": last["step"],
        "final_loss": round(last["loss"], 4),
        "eval_loss": round(last.get("eval_loss", float("nan")), 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "tokens_per_s_per_device": round(tokens_per_s / last["world_size"], 1),
        "step_time_s": round(step_time / len(timed), 4),
        "data_wait_share": round(sum(r["data_wait_s"] for r in timed) / step_time, 4),
        "peak_rss_mib_per_rank": max(p["peak_rss_mib"] for p in peaks_per_rank),
        "legal_move_rate_untrained": round(untrained["legal_move_rate"], 3),
        "legal_move_rate": round(last.get("legal_move_rate", float("nan")), 3),
    }
    for key in ("peak_gpu_allocated_mib", "peak_gpu_reserved_mib"):
        if key in peaks_per_rank[0]:
            summary[f"{key}_per_rank"] = max(p[key] for p in peaks_per_rank)
    if "mfu" in last:
        summary["mfu"] = round(sum(r["mfu"] for r in timed) / len(timed), 4)
        summary["mfu_peak_tflops"] = last["mfu_peak_tflops"]
    saves = [r["checkpoint_save_s"] for r in records if "checkpoint_save_s" in r]
    if saves:
        summary["checkpoint_save_s_max"] = round(max(saves), 3)
    run_dir.summary.write_text(json.dumps(summary, indent=1) + "\n")
    return summary
