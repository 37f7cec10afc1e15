"""Peak host memory (RSS) per rank while the model is loaded and sharded: every rank loading the
model (the naive way), or rank 0 loading it and broadcasting (common/sharded_loading.py, as train.py does).

    python tools/measure_loading.py --ranks 2 4      # a random 270M-parameter Llama (1 GiB in fp32)
    python tools/measure_loading.py --model DIR      # or a model of your own

Each measurement is a fresh torchrun on the CPU (gloo). A rank's figure is its peak RSS during the
load minus its RSS just before (torch, transformers and the process group already set up): the
extra memory the load needed. The peak is the kernel's high-water mark (VmHWM), reset to the
current RSS just before the load.
"""
import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common.arguments import Parser, at_least
from common.errors import UserError, exit_on_user_error

METHODS = {"every_rank": "every rank loads the model", "rank0_broadcast": "rank 0 loads, broadcasts (train.py)"}


def memory_mib(field):
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in MiB."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024


def measure_one_rank(method, model_dir):
    """Run under torchrun: load with `method`, return this rank's figures (on rank 0: all ranks')."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from transformers import AutoModelForCausalLM

    from common.model import load_config, load_model
    from common.sharded_loading import load_sharded_model
    from launch.steps import load_step
    train = load_step("fsdp")

    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    mesh = train.build_mesh("FULL_SHARD", "cpu", world_size, world_size)

    def shard(model):
        train.shard_model(model, mesh, "FULL_SHARD", MixedPrecisionPolicy(), OffloadPolicy())
    config = load_config(model_dir)
    with torch.device("meta"):  # import the model's code now, so that it does not count as loading
        AutoModelForCausalLM.from_config(config)
    dist.barrier()
    before = memory_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current RSS
    if method == "every_rank":
        model = load_model(model_dir)
        shard(model)
    else:
        model = load_sharded_model(model_dir, config, rank, device, shard)
    peak = memory_mib("VmHWM")
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensor: the full size
    figures = {"rank": rank, "peak_mib": round(peak - before, 1), "after_mib": round(memory_mib("VmRSS") - before, 1),
               "shard_mib": round(shard_bytes / 2**20, 1), "model_mib": round(model_bytes / 2**20, 1)}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, figures)
    # Free the model before the process group (the other way round, gloo can abort at exit,
    # pytorch#56297); FSDP modules sit in reference cycles, so only the garbage collector frees them.
    del model
    gc.collect()
    dist.destroy_process_group()
    return gathered


def make_model(out_dir, hidden_size, layers, vocab_size):
    """A Llama with random weights, saved like a downloaded one (no download needed): in bf16, as
    CodeLlama-7b is on the Hub, so loading it for fp32 training converts every tensor."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=hidden_size * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=hidden_size // 64, num_key_value_heads=hidden_size // 64,
                         vocab_size=vocab_size, max_position_embeddings=2048)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)


def run(model_dir, ranks):
    """One torchrun per (ranks, method); returns [{ranks, method, model_mib, per_rank: [...]}]."""
    results = []
    for world_size in ranks:
        for method in METHODS:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
                       __file__, "--worker", method, "--model", str(model_dir)]
            done = subprocess.run(command, capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode != 0:
                sys.exit(f"error: the {method} measurement on {world_size} ranks failed:\n{done.stderr[-3000:]}")
            per_rank = json.loads(done.stdout.strip().splitlines()[-1])
            results.append({"ranks": world_size, "method": method, "model_mib": per_rank[0]["model_mib"],
                            "per_rank": per_rank})
    return results


def print_table(results):
    print(f"model: {results[0]['model_mib']:.0f} MiB of fp32 weights\n")
    print("| ranks | loading | extra peak RSS per rank while loading (MiB) | after loading | own shard |")
    print("|---:|---|---|---|---:|")
    for result in results:
        peaks = " / ".join(f"{r['peak_mib']:.0f}" for r in result["per_rank"])
        after = " / ".join(f"{r['after_mib']:.0f}" for r in result["per_rank"])
        print(f"| {result['ranks']} | {METHODS[result['method']]} | {peaks} | {after} | "
              f"{result['per_rank'][0]['shard_mib']:.0f} |")


def main():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", help="a local model directory (default: build a random Llama)")
    parser.add("ranks", type=at_least(1), nargs="+", default=[2, 4])
    parser.add("hidden_size", type=at_least(64), default=1024, help="of the random Llama: heads of 64")
    parser.add("layers", type=at_least(1), default=16, help="of the random Llama")
    parser.add("vocab_size", type=at_least(1), default=32000, help="of the random Llama")
    parser.add("json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add("worker", choices=list(METHODS), help=argparse.SUPPRESS)  # one rank under torchrun
    args = parser.parse_args()
    if args.hidden_size % 64:
        raise UserError(f"--hidden_size {args.hidden_size}: the random Llama has heads of 64, so a multiple of 64 "
                        f"(e.g. {args.hidden_size // 64 * 64 or 64})")
    if args.worker:
        figures = measure_one_rank(args.worker, args.model)
        if int(os.environ["RANK"]) == 0:
            print(json.dumps(figures))
        return
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(scratch) / "model"
            make_model(model_dir, args.hidden_size, args.layers, args.vocab_size)
        results = run(model_dir, args.ranks)
    if args.json:
        print(json.dumps(results))
    else:
        print_table(results)


if __name__ == "__main__":
    exit_on_user_error(main)  # its torchrun ranks then end as the training scripts' do
