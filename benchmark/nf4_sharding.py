"""Does sharding change what a 4-bit (QLoRA) model computes? The check that bitsandbytes' 4-bit
weights fail under FSDP2 (bitsandbytes#1945), run on the kit's NF4 weights.

    torchrun --nproc-per-node 2 benchmark/nf4_sharding.py --model demo/model
    torchrun --nproc-per-node 2 benchmark/nf4_sharding.py --model DIR --layers 2      # the first 2 layers

Every rank builds the model from its config (random weights, the same seed on every rank), adds
step 5's LoRA adapters (B made non-zero, so that they count), quantizes the decoder layers' frozen
linear weights to NF4 (common/nf4.py) and computes the logits of a batch; then shards the model
with step 5's shard_model, over all ranks, and computes them again. The compute is fp32 on both
sides, so what is compared is sharding alone: the two must agree to fp32 rounding. Rank 0 prints
one JSON line (the largest difference, the logits' scale, how many 4-bit weights were split over
the ranks and how many stayed whole), and an `error:` line (exit 2) if they do not agree.
"""
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from common.arguments import Parser
from common.errors import UserError, exit_on_user_error
from common.model import build_model, load_config
from common.nf4 import is_nf4, kept_whole, quantize_frozen_linears
from launch.steps import load_step

RELATIVE_TOLERANCE = 1e-5  # fp32 rounding, relative to the largest logit


def main():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", required=True, help="a model directory (its config.json is read, not its weights)")
    parser.add("layers", type=int, default=None, help="build only this many decoder layers (default: all)")
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
              else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = load_config(args.model)
    if args.layers:
        config.num_hidden_layers = args.layers
    step = load_step("lora")
    lora = step.parse_arguments(["--output_dir", "unused", "--model", args.model, "--lora_rank", "8"])
    torch.manual_seed(0)  # the same model and adapters on every rank
    with device:
        model = step.add_lora(build_model(config), lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    for layer in step.decoder_layers(model):
        quantize_frozen_linears(layer)
    ids = torch.randint(0, config.vocab_size, (2, 64), device=device)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    whole = sum(len(kept_whole(layer, dist.get_world_size())) for layer in step.decoder_layers(model))
    step.shard_model(model, init_device_mesh(device.type, (dist.get_world_size(),)), "FULL_SHARD",
                     MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32), OffloadPolicy())
    with torch.no_grad():
        after = model(input_ids=ids).logits
    difference, scale = (after - before).abs().max().item(), before.abs().max().item()
    split = sum(is_nf4(param) and hasattr(param, "to_local") for param in model.parameters())
    agree = difference <= RELATIVE_TOLERANCE * scale
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": dist.get_world_size(), "max_difference": difference, "logit_scale": scale,
                          "split_4bit_weights": split, "whole_4bit_weights": whole, "agree": agree}), flush=True)
    model = None
    dist.destroy_process_group()
    if not agree:
        raise UserError(f"sharding changed the 4-bit model's logits by {difference:.3g} (their scale {scale:.3g})")


if __name__ == "__main__":
    exit_on_user_error(main)
