"""tools/estimate_memory.py: its sharded figures are what FSDP2 really holds on each rank, its
activation count is what autograd really keeps, and its arithmetic and command line behave.

The measurement is a real multi-process run: this file, started by torchrun, is its own helper
(see `measure` at the bottom)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import estimate_memory as em
from conftest import run_python


REPO = Path(__file__).resolve().parents[1]
ESTIMATOR = REPO / "tools" / "estimate_memory.py"
CODELLAMA_PARAMS = 6_738_546_688


GiB = em.GiB


@pytest.fixture(scope="module")
def demo_model(demo):
    """The demo model directory (conftest's `demo` builds it once with 01_download/download.py --demo)."""
    return demo / "model"


@pytest.fixture(scope="module")
def demo_shape(demo_model):
    config, _ = em.load_config(str(demo_model))
    return em.model_shape(config, "demo")


@pytest.fixture(scope="module")
def codellama():
    config, _ = em.load_config("codellama/CodeLlama-7b-hf")
    return em.model_shape(config, "codellama/CodeLlama-7b-hf")


# ---- the requirement: estimate == measured per-rank sharded bytes ------------------------

# (ranks sharded over, GPUs per "node", strategy): all measured in one torchrun launch of 4 processes,
# on meshes of the first 1, 2, 3 or 4 ranks (one launch instead of four: each process spends
# seconds importing transformers).
CASES = [(1, 1, "FULL_SHARD"), (3, 3, "FULL_SHARD"),  # 3: dims do not divide, FSDP2 pads
         (2, 2, "FULL_SHARD"), (2, 2, "SHARD_GRAD_OP"), (2, 2, "NO_SHARD"),
         (4, 4, "FULL_SHARD"), (4, 4, "SHARD_GRAD_OP"), (4, 2, "HYBRID_SHARD"), (4, 4, "NO_SHARD"),
         (2, 2, "TP"), (4, 2, "TP"), (4, 4, "TP")]  # step 6: tensor parallel over per_node ranks, FSDP across
LAUNCH_RANKS = max(ranks for ranks, _, _ in CASES)


@pytest.fixture(scope="module")
def measured(demo_model):
    """{(ranks, per_node, strategy): [one dict of bytes per rank]}, from a real gloo run on the CPU."""
    cases = [f"{ranks}:{per_node}:{strategy}" for ranks, per_node, strategy in CASES]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={LAUNCH_RANKS}",
               __file__, str(demo_model), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    results = {}
    for line in run.stdout.splitlines():
        if line.startswith("MEASURED "):
            row = json.loads(line[len("MEASURED "):])
            results.setdefault((row["ranks"], row["per_node"], row["strategy"]), []).append(row)
    return results


@pytest.mark.parametrize("ranks,per_node,strategy", CASES)
def test_sharded_state_matches_fsdp2_on_every_rank(measured, demo_shape, ranks, per_node, strategy):
    rows = measured[(ranks, per_node, strategy)]
    assert sorted(row["rank"] for row in rows) == list(range(ranks))
    if strategy == "TP":  # each rank's tensor-parallel part, sharded over the ranks // per_node groups
        estimated = em.sharded_state_bytes(em.fsdp_units(demo_shape, tp_size=per_node), ranks // per_node)
    else:
        degree = em.shard_degree(strategy, per_node, ranks // per_node)
        estimated = em.sharded_state_bytes(em.fsdp_units(demo_shape), degree)
    for row in rows:
        for part in ("parameters", "gradients", "optimizer"):
            assert row[part] > 0
            assert abs(estimated[part] - row[part]) <= 0.02 * row[part], (part, row, estimated)
        assert estimated["parameters"] == row["parameter_storage"]  # exact, padding included


# ---- activations: the per-layer count against what autograd keeps -------------------------------

def saved_bytes_per_token_of_one_layer(model_dir, precision, attention, lora_targets=None, seq_length=128,
                                       batch_size=2):
    """Run the demo model and add up the tensors autograd saves inside decoder layer 1 (not the
    weights, which are counted elsewhere; not layer 0, which also keeps the shared RoPE tables).
    With lora_targets: peft's LoRA adapters (rank 16) on those layers, the rest frozen, as step 5."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
    if lora_targets:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=lora_targets))
    model.to(torch.bfloat16 if precision == "bf16" else torch.float32).train()  # as FSDP's bf16 compute sees it
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = [False]
    layer = (model.get_base_model() if lora_targets else model).model.layers[1]
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    saved = [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[0] += storage.nbytes()
        return tensor

    ids = torch.randint(4, model.config.vocab_size, (batch_size, seq_length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids)
    return saved[0] / (seq_length * batch_size)


@pytest.mark.quick
@pytest.mark.parametrize("precision,attention,lora_targets", [
    ("bf16", "sdpa", None), ("fp32", "sdpa", None), ("bf16", "eager", None),
    ("bf16", "sdpa", em.LORA_TARGETS.split(",")), ("fp32", "sdpa", em.LORA_TARGETS.split(",")),
    ("bf16", "sdpa", ["q_proj", "v_proj"]), ("bf16", "sdpa", ["down_proj"])])
def test_layer_activation_count_matches_saved_tensors(demo_model, demo_shape, precision, attention, lora_targets):
    measured = saved_bytes_per_token_of_one_layer(demo_model, precision, attention, lora_targets)
    estimated = em.layer_activation_bytes_per_token(demo_shape, em.COMPUTE_BYTES[precision], attention, 128,
                                                    16 if lora_targets else None, lora_targets or ())
    assert abs(estimated - measured) <= 0.02 * measured, (estimated, measured)


@pytest.mark.quick
def test_lora_adapters_are_what_peft_adds(demo_model, demo_shape):
    """The trainable parameters are peft's, and only their gradients and AdamW state are kept; the
    frozen weights are stored in the compute dtype (05_lora/train.py: add_lora)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(demo_model)),
                               LoraConfig(r=16, target_modules=em.LORA_TARGETS.split(","), task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora = em.estimate(demo_shape, lora_rank=16, lora_targets=em.LORA_TARGETS.split(","))
    assert lora["trainable_parameters"] == trainable
    assert lora["gradients"] == 4 * trainable and lora["optimizer"] == 8 * trainable
    frozen = sum(p.numel() for p in model.parameters()) - trainable
    assert lora["parameters"] == 4 * trainable + 2 * frozen  # the frozen ones in bf16, the compute dtype
    fp32 = em.estimate(demo_shape, lora_rank=16, lora_targets=em.LORA_TARGETS.split(","), precision="fp32")
    assert fp32["parameters"] == 4 * (trainable + frozen)
    qlora = em.estimate(demo_shape, lora_rank=16, lora_targets=em.LORA_TARGETS.split(","), qlora=True)
    assert qlora["parameters"] < 0.5 * lora["parameters"] and qlora["gradients"] == lora["gradients"]


@pytest.mark.quick
def test_accumulate_unsharded_keeps_the_whole_model_and_its_gradients(codellama):
    """Between micro-batches every rank holds the whole model in bf16 and whole gradients in fp32."""
    sharded = em.estimate(codellama, gpus_per_node=8, accumulation=4)
    kept = em.estimate(codellama, gpus_per_node=8, accumulation=4, accumulate_unsharded=True)
    assert kept["gathered_parameters"] == 2 * CODELLAMA_PARAMS
    assert kept["unsharded_gradients"] > 4 * CODELLAMA_PARAMS > 20 * sharded["unsharded_gradients"]
    assert kept["peak"] > sharded["peak"] + 30 * GiB
    # With one micro-batch per step there is nothing to keep.
    assert em.estimate(codellama, gpus_per_node=8, accumulate_unsharded=True) == em.estimate(codellama, gpus_per_node=8)


@pytest.mark.quick
def test_names_and_defaults_are_the_step_scripts():
    from launch.steps import load_step
    fsdp, lora = load_step("fsdp"), load_step("lora")
    assert em.STRATEGIES == fsdp.STRATEGIES and set(em.COMPUTE_BYTES) == set(fsdp.PRECISIONS)
    defaults = lora.parse_arguments(["--output_dir", "unused"])
    assert (defaults.lora_rank, ",".join(defaults.lora_target_modules)) == (em.LORA_RANK, em.LORA_TARGETS)


# ---- arithmetic -----------------------------------------------------------------------------------

@pytest.mark.quick
def test_codellama_parameter_count_from_the_meta_model(codellama):
    assert codellama.num_params == CODELLAMA_PARAMS
    assert codellama.num_layers == 32
    state = em.sharded_state_bytes(em.fsdp_units(codellama), 8)  # 16 bytes per parameter over 8 GPUs
    assert sum(state.values()) / GiB == pytest.approx(16 * CODELLAMA_PARAMS / 8 / GiB, rel=1e-4)


@pytest.mark.quick
def test_muon_keeps_4_bytes_for_the_decoders_matrices_and_one_bucket_in_its_step(codellama):
    """--optimizer muon: momentum for the 224 decoder matrices, AdamW's 8 B for the embedding, the
    head and the norms; during the step one MLP matrix per rank, whole, in bf16 (04_fsdp/MEMORY.md)."""
    matrices = sum(math.prod(shape) for shape in em.muon_matrices(em.fsdp_units(codellama)))
    assert len(em.muon_matrices(em.fsdp_units(codellama))) == 224 and matrices == 6_476_005_376
    muon = em.estimate(codellama, gpus_per_node=8, optimizer="muon")
    adamw = em.estimate(codellama, gpus_per_node=8)
    assert muon["optimizer"] == adamw["optimizer"] - 4 * matrices / 8
    mlp, short = 11008 * 4096, 4096
    assert muon["optimizer_step_temporaries"] == 2 * (2 * mlp + 3 * mlp + 2 * short ** 2)
    assert em.estimate(codellama, gpus_per_node=16, optimizer="muon")["optimizer_step_temporaries"] \
        == muon["optimizer_step_temporaries"]  # still one MLP matrix per rank and bucket
    assert muon["peak"] < adamw["peak"]


@pytest.mark.quick
def test_dim0_is_padded_to_a_multiple_of_the_shard_degree():
    # 5 rows over 4 ranks: 2 rows each (8 padded); 7 elements: 2 each; a scalar: 1 each.
    assert em.sharded_bytes([(5, 3), (7,), ()], 4, 4) == (2 * 3 + 2 + 1) * 4
    assert em.sharded_bytes([(8, 3)], 4, 4) == 2 * 3 * 4


def without(estimate, *keys):
    return {k: v for k, v in estimate.items() if k not in keys}


@pytest.mark.quick
def test_no_shard_on_many_gpus_is_one_gpu(codellama):
    no_shard = em.estimate(codellama, "NO_SHARD", gpus_per_node=4, nodes=2)
    assert no_shard == em.estimate(codellama, "FULL_SHARD", gpus_per_node=1, nodes=1)
    assert no_shard["parameters"] == 4 * CODELLAMA_PARAMS


@pytest.mark.quick
def test_hybrid_on_one_node_is_full_shard(codellama):
    assert (em.estimate(codellama, "HYBRID_SHARD", gpus_per_node=4, nodes=1)
            == em.estimate(codellama, "FULL_SHARD", gpus_per_node=4, nodes=1))
    # Across nodes HYBRID keeps a node's share: 2 nodes x 4 holds what 1 node x 4 holds.
    assert (em.estimate(codellama, "HYBRID_SHARD", gpus_per_node=4, nodes=2)
            == em.estimate(codellama, "FULL_SHARD", gpus_per_node=4, nodes=1))


@pytest.mark.quick
def test_shard_grad_op_keeps_the_whole_model_gathered(codellama):
    zero2 = em.estimate(codellama, "SHARD_GRAD_OP", gpus_per_node=8)
    zero3 = em.estimate(codellama, "FULL_SHARD", gpus_per_node=8)
    differ = ("gathered_parameters", *em.PEAK_MOMENTS, "peak")
    assert without(zero2, *differ) == without(zero3, *differ)
    assert zero2["gathered_parameters"] == 2 * CODELLAMA_PARAMS > zero3["gathered_parameters"]
    assert zero2["peak"] > zero3["peak"] + 10 * GiB


@pytest.mark.quick
def test_hybrid_shard_group_size(codellama):
    assert em.shard_degree("HYBRID_SHARD", 8, 2, shard_group_size=2) == 2
    assert (em.estimate(codellama, "HYBRID_SHARD", gpus_per_node=8, nodes=2, shard_group_size=2)
            == em.estimate(codellama, "FULL_SHARD", gpus_per_node=2, nodes=1))


@pytest.mark.quick
def test_checkpointing_and_offload_shrink_the_gpu_peak(codellama):
    plain = em.estimate(codellama, gpus_per_node=8)
    checkpointed = em.estimate(codellama, gpus_per_node=8, gradient_checkpointing=True)
    offloaded = em.estimate(codellama, gpus_per_node=8, gradient_checkpointing=True, cpu_offload=True)
    assert offloaded["peak"] < checkpointed["peak"] < plain["peak"]
    assert offloaded["host_per_node"] == 8 * 16 * CODELLAMA_PARAMS // 8  # the whole state, spread over the node
    assert offloaded["optimizer_step"] == 0  # the step runs on the CPU


@pytest.mark.quick
def test_peak_is_the_largest_moment(codellama):
    # One GPU with checkpointing: the optimizer step holds 4 + 4 + 8 bytes of state per parameter and,
    # fused, no temporary; backward a little more (all the gradients but a layer's, and the activations).
    one_gpu = em.estimate(codellama, gpus_per_node=1, gradient_checkpointing=True)
    assert one_gpu["optimizer_step"] == 16 * CODELLAMA_PARAMS
    assert one_gpu["peak"] == one_gpu["backward"] < 16.5 * CODELLAMA_PARAMS
    # Eight GPUs without checkpointing: activations win, in backward.
    eight = em.estimate(codellama, gpus_per_node=8)
    assert eight["peak"] == eight["backward"] > eight["optimizer_step"]
    # With gradient accumulation the gradients of earlier micro-batches are there in forward too.
    accumulating = em.estimate(codellama, gpus_per_node=8, accumulation=2)
    assert accumulating["end_of_forward"] == eight["end_of_forward"] + eight["gradients"]


@pytest.mark.quick
def test_fit_verdict(codellama):
    one_gpu = em.estimate(codellama, gpus_per_node=1)["peak"]
    eight_gpus = em.estimate(codellama, gpus_per_node=8, gradient_checkpointing=True)["peak"]
    assert one_gpu > 100 * GiB and not em.fits(one_gpu, 80)
    assert em.fits(eight_gpus, 80)
    # The margin is part of the verdict: 3 GiB + 10% of the peak.
    assert em.fits(10 * GiB, 14.01) and not em.fits(10 * GiB, 13.99)


# ---- the command line -----------------------------------------------------------------------------

@pytest.mark.quick
def test_table_works_offline_from_the_built_in_config(monkeypatch, capsys):
    import transformers
    from_pretrained = transformers.AutoConfig.from_pretrained

    def nothing_cached(name, *args, **kwargs):
        if name == "codellama/CodeLlama-7b-hf":
            raise OSError(f"{name} is not in the cache")
        return from_pretrained(name, *args, **kwargs)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", nothing_cached)
    em.main(["--table", "--gradient_checkpointing"])
    out = capsys.readouterr().out
    assert "the kit's copy of its config" in out and f"{CODELLAMA_PARAMS:,}" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(em.TABLE_GPUS) * len(em.STRATEGIES)


@pytest.mark.quick
def test_report_on_a_local_model_directory(demo_model, capsys):
    em.main(["--model", str(demo_model), "--gpus_per_node", "2", "--max_seq_length", "256"])
    out = capsys.readouterr().out
    assert "1,616,000 parameters" in out and "verdict: fits in 80 GiB" in out


def test_bad_input_is_one_error_line():
    result = run_python([ESTIMATOR, "--nodes", 0, "--gpus_per_node", 2], timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: --nodes must be at least 1 (got 0)"], result.stderr


@pytest.mark.quick
def test_unknown_model_names_the_download_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        em.exit_on_user_error(lambda: em.main(["--model", "nobody/no-such-model-xyz"]))
    assert exit_info.value.code == 2
    assert "01_download/download.py --model nobody/no-such-model-xyz" in capsys.readouterr().err


# ---- the helper torchrun starts ------------------------------------------------------------------

def measure(model_dir, cases):
    """On every rank of a mesh: shard the model as 04_fsdp does, take one AdamW step, then print
    the bytes of this rank's local shards of parameters, gradients and optimizer state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def local_bytes(tensor):
        local = tensor.to_local()
        return local.numel() * local.element_size()

    for case in cases:
        ranks, per_node, strategy = case.split(":")
        ranks, per_node = int(ranks), int(per_node)
        if strategy == "HYBRID_SHARD":  # replicate across "nodes", shard inside one
            layout, names = (ranks // per_node, per_node), ("replicate", "shard")
        elif strategy == "TP":  # step 6's (dp, tp) mesh, tensor parallel inside a "node"
            layout, names = (ranks // per_node, per_node), ("dp", "tp")
        elif strategy == "NO_SHARD":  # replicate everywhere, "shard" over 1
            layout, names = (ranks, 1), ("replicate", "shard")
        else:
            layout, names = (ranks,), None
        # Every process takes part in making the mesh (it creates process groups); only the
        # first `ranks` processes are in it.
        mesh = DeviceMesh("cpu", torch.arange(ranks).reshape(layout), mesh_dim_names=names)
        if rank < ranks:
            options = {"reshard_after_forward": strategy != "SHARD_GRAD_OP"}  # as train.py does
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            ids = torch.randint(4, model.config.vocab_size, (2, 16))
            if strategy == "TP":  # 06_tp's own function, and its loss on the vocabulary's parts
                from torch.distributed.fsdp import MixedPrecisionPolicy
                from torch.distributed.tensor.parallel import loss_parallel

                from common.data import loss_sum
                from launch.steps import load_step
                load_step("tp").parallelize_and_shard(model, mesh, "FULL_SHARD", MixedPrecisionPolicy())
                model.train()  # from_pretrained gives it in evaluation mode, with its logits made whole
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                with loss_parallel():
                    loss_sum(model, {"input_ids": ids, "labels": ids}).to_local().backward()
            else:
                for layer in model.model.layers:
                    fully_shard(layer, mesh=mesh, **options)
                fully_shard(model, mesh=mesh, **options)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after sharding
                model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()  # now AdamW's state exists
            params = list(model.parameters())
            row = {"ranks": ranks, "per_node": per_node, "rank": rank, "strategy": strategy,
                   "parameters": sum(local_bytes(p) for p in params),
                   # what is allocated: FSDP2 keeps each local shard in a buffer padded to ceil(dim0 / N) rows
                   "parameter_storage": sum(p.to_local().untyped_storage().nbytes() for p in params),
                   "gradients": sum(local_bytes(p.grad) for p in params),
                   "optimizer": sum(local_bytes(value) for state in optimizer.state.values()
                                    for name, value in state.items() if name != "step")}
            os.write(1, ("MEASURED " + json.dumps(row) + "\n").encode())  # one write: lines never interleave
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    measure(sys.argv[1], sys.argv[2:])


def test_output_cut_short_by_head_ends_quietly():
    """`estimate_memory.py --table | head -3`: the reader goes away; no traceback, no 'lost another rank'."""
    process = subprocess.Popen([sys.executable, str(ESTIMATOR), "--table", "--gradient_checkpointing"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    process.stdout.close()  # as head does once it has its lines: the tool's next write finds no reader
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 141 and stderr == "", stderr


# ---- step 6: tensor parallel x FSDP ---------------------------------------------------------------

@pytest.mark.quick
def test_tensor_parallel_parts_and_what_they_divide(codellama):
    """Each parameter as 06_tp's plans split it over 8 ranks; the state is then 1/GPUs as with
    FULL_SHARD over all of them (but the norms, whole on every rank of a group); checkpointed
    activations are each layer's input on 1/8 of the sequence (the first layer's whole)."""
    parts = {name: em.tp_part(name, shape, 8) for name, shape in codellama.root + codellama.layers[0]}
    assert parts == {"model.embed_tokens.weight": (32016, 512), "model.norm.weight": (4096,),
                     "lm_head.weight": (4002, 4096), "self_attn.q_proj.weight": (512, 4096),
                     "self_attn.k_proj.weight": (512, 4096), "self_attn.v_proj.weight": (512, 4096),
                     "self_attn.o_proj.weight": (4096, 512), "mlp.gate_proj.weight": (1376, 4096),
                     "mlp.up_proj.weight": (1376, 4096), "mlp.down_proj.weight": (4096, 1376),
                     "input_layernorm.weight": (4096,), "post_attention_layernorm.weight": (4096,)}
    tp = em.estimate(codellama, gpus_per_node=8, nodes=2, tp_size=8, gradient_checkpointing=True, seq_length=16384)
    fsdp = em.estimate(codellama, gpus_per_node=8, nodes=2, gradient_checkpointing=True, seq_length=16384)
    assert tp["shard_degree"] == 2 and fsdp["shard_degree"] == 16
    assert tp["parameters"] == pytest.approx(fsdp["parameters"], rel=1e-3) and tp["parameters"] > fsdp["parameters"]
    assert tp["activations_kept"] / fsdp["activations_kept"] == pytest.approx((32 / 8 + 1 - 1 / 8) / 32)
    assert em.estimate(codellama, tp_size=1) == em.estimate(codellama)


@pytest.mark.quick
def test_tp_table_shows_where_tensor_parallelism_makes_a_job_fit(capsys):
    """The README's table (06_tp/README.md): CodeLlama-70b on 4 nodes of 8 x 80 GB at 16,384 tokens
    fits only with checkpointing, and with tensor parallelism it leaves 30 GiB more room; CodeLlama-7b
    at 16,384 without checkpointing fits one node only with tensor parallelism."""
    em.main(["--tp_table", "--gpus_per_node", "8", "--model", "codellama/CodeLlama-70b-hf"])
    rows = {tuple(cells[1:3]): cells[3:7] for line in capsys.readouterr().out.splitlines()
            if len(cells := [cell.strip() for cell in line.split("|")]) > 6 and cells[1][:1].isdigit()}
    assert len(rows) == 6, rows
    fsdp, fsdp_checkpointed, tp, tp_checkpointed = rows["4 × 8", "16,384"]
    assert fsdp.endswith(" no") and tp.endswith(" no") and fsdp_checkpointed.endswith(" fits")
    assert tp_checkpointed.endswith(" fits")
    assert float(fsdp_checkpointed.split()[0]) - float(tp_checkpointed.split()[0]) > 20
    em.main(["--tp_table", "--gpus_per_node", "8"])
    rows = {tuple(cells[1:3]): cells[3:7] for line in capsys.readouterr().out.splitlines()
            if len(cells := [cell.strip() for cell in line.split("|")]) > 6 and cells[1][:1].isdigit()}
    fsdp, _, tp, _ = rows["1 × 8", "16,384"]
    assert fsdp.endswith(" no") and tp.endswith(" fits")


@pytest.mark.quick
@pytest.mark.parametrize("options,message", [
    (["--gpus_per_node", "4", "--tp_size", "3"], "--tp_size 3 does not divide the 4 GPUs into tensor-parallel groups"),
    (["--gpus_per_node", "4", "--tp_size", "2", "--lora"], "--tp_size is step 6: FSDP FULL_SHARD or SHARD_GRAD_OP"),
    (["--gpus_per_node", "16", "--tp_size", "16", "--model", "codellama/CodeLlama-70b-hf"],
     "--tp_size 16: codellama/CodeLlama-70b-hf has 8 key-value heads, which do not split into 16 equal parts"),
])
def test_tensor_parallel_options_are_refused_in_one_line(capsys, options, message):
    with pytest.raises(SystemExit) as exit_info:
        em.exit_on_user_error(lambda: em.main(options))
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines


@pytest.mark.quick
def test_the_speed_levers_memory(codellama):
    """Selective recomputation keeps each layer's 8 matmul and attention outputs besides its input
    (between full checkpointing and none); the chunked loss holds one chunk's logits, not the micro-batch's."""
    def peak(**levers):
        return em.estimate(codellama, gpus_per_node=8, seq_length=4096, batch_size=2, **levers)
    full, selective, none = peak(gradient_checkpointing=True), peak(gradient_checkpointing="selective"), peak()
    assert full["peak"] < selective["peak"] < none["peak"]
    h, i, tokens = 4096, 11008, 2 * 4096
    assert selective["activations_kept"] - full["activations_kept"] == 32 * tokens * 2 * (6 * h + 2 * i)
    chunked = peak(gradient_checkpointing=True, loss_chunk_size=1024)
    vocab_bytes = full["activations_head"] - chunked["activations_head"]
    assert vocab_bytes == (tokens - 1024) * 12 * 32016  # backward's fp32 log-softmax, its gradient, a temporary
