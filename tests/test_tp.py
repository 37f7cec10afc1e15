"""Step 6, tensor parallel × FSDP, trains the same model as one process, whatever the mesh.

The layouts of issue 34 on the demo model, fp32, with tests/test_equivalence.py's settings (rows of
unequal length, a small learning rate): tp 2 on 2 ranks, 2 × 2 and 1 × 4 on 4 ranks, each against
step 2 on one process (the per-step losses, and the final model, a plain Hugging Face one, within
1e-5). A run preempted by SIGTERM at 2 × 2 resumes at 1 × 4 and at 4 × 1 to the same losses: its
checkpoint does not depend on the mesh. Generation (the evaluation's greedy moves, with the KV
cache) gives the tokens and logits of the whole model. A --tp_size that the model's layers or the
ranks cannot be split by is one error line.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from conftest import (EQUIVALENCE, QUICK, REPO, STEP_SCRIPTS, assert_same_run, demo_args, read_metrics, run_python,
                      run_ranks, run_step)

# name: (ranks, --tp_size); 8 rows per optimiser step, 2 per forward pass
LAYOUTS = {"tp2_on_2_ranks": (2, 2), "2x2": (4, 2), "1x4": (4, 4)}
SPLIT = ["--total_batch_size", 8, "--batch_size_per_device", 2]
# One layout also recomputes each split layer's activations selectively (common/speed.py): a speed
# lever, the same maths, checked here rather than in a run of its own (the chunked loss is refused in
# step 6: tests/test_speed.py)
LEVERS = {"tp2_on_2_ranks": ["--gradient_checkpointing", "selective"]}


@pytest.fixture(scope="module")
def layouts(demo, tmp_path_factory):
    runs = {}
    for name, (ranks, tp_size) in LAYOUTS.items():
        runs[name] = tmp_path_factory.mktemp(name) / "run"
        result = run_step("tp", demo_args(demo, runs[name]) + EQUIVALENCE + SPLIT + ["--tp_size", tp_size]
                          + LEVERS.get(name, []), nproc=ranks)
        runs[name, "output"] = result.stdout + result.stderr
    return runs


@pytest.mark.parametrize("name", LAYOUTS)
def test_same_losses_and_weights_as_one_process(single_reference, layouts, name):
    ranks, tp_size = LAYOUTS[name]
    assert f"mesh {ranks // tp_size} × {tp_size}: tensor parallel over {tp_size} ranks" in layouts[name, "output"]
    assert read_metrics(layouts[name])[-1]["world_size"] == ranks
    assert_same_run(single_reference, layouts[name], tolerance=1e-5)  # the final model's tensors: whole, plain
    print(f"{name}: {differences(single_reference, layouts[name])}")
    assert read_metrics(layouts[name])[-1]["eval_loss"] == pytest.approx(
        read_metrics(single_reference)[-1]["eval_loss"], abs=1e-5)


def test_preempted_at_2x2_resumes_at_1x4_and_at_4x1(demo, tmp_path, single_reference):
    """SIGTERM to torchrun, as Slurm sends it: the 2 × 2 run saves at the end of its step and stops;
    the same checkpoint then resumes on a 1 × 4 mesh and, in a copy, on a 4 × 1 one."""
    stopped = tmp_path / "stopped"
    args = demo_args(demo, stopped) + EQUIVALENCE + SPLIT
    launcher = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=4",
                str(STEP_SCRIPTS["tp"]), *map(str, args), "--tp_size", "2"]
    process = subprocess.Popen(launcher, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while not (stopped / "metrics.jsonl").exists() or not read_metrics(stopped):
        assert process.poll() is None and time.time() < deadline, "no training step in time"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    stopped_at = len(read_metrics(stopped))
    assert stopped_at < 6 and f"preempted: saved a checkpoint at step {stopped_at}" in output, output[-3000:]
    copy = tmp_path / "copy"
    shutil.copytree(stopped, copy)
    for run, tp_size in ((stopped, 4), (copy, 1)):
        result = run_step("tp", with_output(args, run) + ["--tp_size", tp_size, "--resume"], nproc=4)
        assert f"resuming from {run}/checkpoints/step-{stopped_at:06d}" in result.stdout + result.stderr
        assert f"mesh {4 // tp_size} × {tp_size}" in result.stdout + result.stderr
        assert_same_run(single_reference, run, tolerance=1e-5)
        print(f"stopped at step {stopped_at} at 2 x 2, resumed at {4 // tp_size} x {tp_size}: "
              f"{differences(single_reference, run)}")


def differences(reference_dir, other_dir):
    """The largest per-step loss and final weight differences, for the log (pytest -s)."""
    from safetensors.torch import load_file
    losses = max(abs(a["loss"] - b["loss"]) for a, b in zip(read_metrics(reference_dir), read_metrics(other_dir)))
    ours, theirs = (load_file(Path(d) / "final/model.safetensors") for d in (reference_dir, other_dir))
    weights = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    return f"losses within {losses:.1e}, final weights within {weights:.1e}"


def with_output(args, output_dir):
    args = list(args)
    args[args.index("--output_dir") + 1] = output_dir
    return args


def test_generation_gives_the_whole_models_tokens(demo, tmp_path):
    """The evaluation's greedy moves (prompts of unequal length, the KV cache, one token at a time:
    sequence shards of one token) on the 2-rank tensor-parallel model: the whole model's tokens,
    and its logits to 1e-5, in evaluation mode; in training the logits stay split by vocabulary."""
    output = run_ranks(tmp_path, f"""
        import torch, torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from common.chess_eval import greedy_tokens
        from common.model import load_config, load_model
        from common.sharded_loading import load_sharded_model
        from launch.steps import load_step
        step = load_step("tp")
        dist.init_process_group("gloo")
        mesh = step.build_mesh("cpu", 2, 2)
        model = load_sharded_model({str(demo / "model")!r}, load_config({str(demo / "model")!r}), dist.get_rank(),
                                   torch.device("cpu"),
                                   shard=lambda m: step.parallelize_and_shard(m, mesh, "FULL_SHARD",
                                                                              MixedPrecisionPolicy()))
        whole = load_model({str(demo / "model")!r}).eval()
        model.eval()
        prompts = [[2, 5, 9, 14, 7], [2, 11], [2, 30, 31, 40, 41, 42, 50, 51]]
        with torch.no_grad():
            ours = greedy_tokens(model, prompts, 6, 0, torch.device("cpu"))
            theirs = greedy_tokens(whole, prompts, 6, 0, torch.device("cpu"))
            ids = torch.tensor([prompts[2]])
            difference = (model(input_ids=ids).logits - whole(input_ids=ids).logits).abs().max().item()
            model.train()
            split = model(input_ids=ids).logits
        print("same tokens", ours == theirs, "logits", difference < 1e-5, type(split).__name__, split.placements)
        model = None
        import gc; gc.collect()
        dist.destroy_process_group()
    """)
    assert output.count("same tokens True logits True DTensor (Shard(dim=2),)") == 2, output


def test_refuses_a_model_whose_layers_do_not_split(demo, tmp_path):
    """Under torchrun (the launcher of the Slurm templates), before any weight is read or any run
    file written: one line, and no report of torchrun's after it."""
    model = tmp_path / "model"
    shutil.copytree(demo / "model", model)
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(config.replace('"intermediate_size": 344', '"intermediate_size": 345'))
    args = ["--model", model, "--data_dir", demo / "data", "--output_dir", tmp_path / "run", *QUICK,
            "--max_steps", 2, "--tp_size", 2]
    result = run_python(["-m", "launch.torchrun", "--standalone", "--nproc-per-node=2", STEP_SCRIPTS["tp"], *args],
                        timeout=300)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stdout + result.stderr[-3000:]
    assert errors[0].startswith(f"error: --tp_size 2: {model} has 345 intermediate size, which do not split into 2 "
                                "equal parts") and errors[0].endswith("choose one of 1"), errors[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run" / "run.json").exists()


@pytest.mark.quick
def test_muon_is_refused_in_one_line():
    """Step 6 cuts each matrix over both mesh dimensions; the kit's Muon orthogonalises matrices cut
    along one (FSDP's). Refused before anything starts, not a NotImplementedError at the first step."""
    as_torchrun_starts_it = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    result = subprocess.run([sys.executable, str(STEP_SCRIPTS["tp"]), "--output_dir", "unused", "--optimizer", "muon"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=as_torchrun_starts_it)
    assert result.returncode == 2 and result.stderr.startswith("error: --optimizer muon: step 6 cuts each matrix"), \
        result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and not (REPO / "unused").exists()
    # the plan check before a step-6 job (submit.py, slurm/tp.sh) refuses it the same way
    plan = run_python(["tools/check_plan.py", "--gpus_per_node", 2, "--tp_size", 2, "--optimizer", "muon",
                       "--max_seq_length", 256], timeout=120)
    assert plan.returncode == 2 and plan.stderr == result.stderr, plan.stderr[-2000:]


@pytest.mark.quick
def test_tp_size_checks_and_default():
    from common.errors import UserError
    from common.tensor_parallel import check_tp_size, default_tp_size
    codellama = types.SimpleNamespace(num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008)
    grouped = types.SimpleNamespace(num_attention_heads=40, num_key_value_heads=8, intermediate_size=13824)
    assert default_tp_size(codellama, 8, on_gpu=True) == 8
    assert default_tp_size(grouped, 16, on_gpu=True) == 8  # capped by the 8 key-value heads
    assert default_tp_size(codellama, 6, on_gpu=True) == 2  # divides the node's 6 GPUs and the heads
    assert default_tp_size(codellama, 4, on_gpu=False) == 2  # the CPU: 4 processes run 2 x 2
    assert default_tp_size(codellama, 1, on_gpu=False) == 1
    # issue 43 case 14: 3 processes on the CPU, no --tp_size: lowered to what divides them, not refused
    assert default_tp_size(codellama, 3, on_gpu=False) == 1
    check_tp_size(8, 16, codellama, "m")
    with pytest.raises(UserError, match=r"^--tp_size 16: m has 40 attention heads, 8 key-value heads, which do "
                                        r"not split into 16 equal parts .*: choose one of 1, 2, 4, 8$"):
        check_tp_size(16, 32, grouped, "m")
    with pytest.raises(UserError, match=r"^--tp_size 3 does not divide the 4 ranks into tensor-parallel groups: "
                                        r"choose one of 1, 2, 4$"):
        check_tp_size(3, 4, codellama, "m")
    # issue 43 case 8: a group that would span nodes (2 nodes x 1 rank, --tp_size 2) is refused
    with pytest.raises(UserError, match=r"^--tp_size 2 does not divide the 1 ranks of each of the 2 nodes into "
                                        r"tensor-parallel groups \(a group stays inside a node, on its fast links\): "
                                        r"choose one of 1$"):
        check_tp_size(2, 2, codellama, "m", ranks_per_node=1)
    check_tp_size(2, 4, codellama, "m", ranks_per_node=2)


def tiny_config(path, model_type="llama", **changes):
    """A config.json of the demo's proportions (Phi-3's layers fuse q, k and v, and gate and up)."""
    from transformers import LlamaConfig, Phi3Config
    kind = {"llama": LlamaConfig, "phi3": Phi3Config}[model_type]
    config = kind(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=128, max_position_embeddings=1024, pad_token_id=0, bos_token_id=2,
                  eos_token_id=3, **changes).to_dict()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config, "chess_notation": "piece"}))
    return path


@pytest.mark.quick
@pytest.mark.parametrize("model_type,changes,says", [
    ("phi3", {}, "(phi3, Phi3ForCausalLM): it has no self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, "
                 "mlp.gate_proj, mlp.up_proj (its layers have self_attn.qkv_proj, mlp.gate_up_proj); step 6 splits "
                 "Llama-style layers"),
    ("llama", {"tie_word_embeddings": True}, "(llama, LlamaForCausalLM): its lm_head is its input embedding "
                                             "(tie_word_embeddings), which step 6 would split two ways"),
])
def test_a_model_step_6_cannot_split_is_refused_by_the_plan_check_and_submit(tmp_path, capsys, model_type, changes,
                                                                           says):
    """Issue 43 cases 6 and 12: step 6's one check (common/tensor_parallel.tp_size_for), from the config
    alone: the plan check (before a job) and submit.py refuse the model in the step's line."""
    from tools import check_plan
    model = tiny_config(tmp_path / "model", model_type, **changes)
    with pytest.raises(SystemExit) as exit_info:
        check_plan.exit_on_user_error(lambda: check_plan.main(["--model", str(model), "--gpus_per_node", "2",
                                                               "--tp_size", "2", "--max_seq_length", "64"]))
    said = capsys.readouterr()
    assert exit_info.value.code == 2 and said.out == "" and said.err.count("\n") == 1, said
    assert said.err.startswith(f"error: step 6 cannot split {model} {says}") and \
        said.err.rstrip().endswith("train this model with step 4"), said.err
    import submit
    with pytest.raises(SystemExit) as exit_info:
        submit.exit_on_user_error(lambda: submit.main(["--step", "tp", "--gpus", "2", "--model", str(model),
                                                       "--dry-run"]))
    assert exit_info.value.code == 2 and capsys.readouterr().err == said.err


def test_a_model_step_6_cannot_split_is_refused_before_its_weights_are_read(demo, tmp_path):
    """Issue 43 case 12: a Phi-3 (fused qkv_proj and gate_up_proj) under torchrun, with no weights on
    disk at all: one line, no "could not be resolved" warnings, no traceback, nothing of a run written."""
    model = tiny_config(tmp_path / "model", "phi3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / "model" / name, model)
    args = ["--model", model, "--data_dir", demo / "data", "--output_dir", tmp_path / "run", *QUICK, "--max_steps", 2]
    result = run_python(["-m", "launch.torchrun", "--standalone", "--nproc-per-node=2", STEP_SCRIPTS["tp"], *args],
                        timeout=300)
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, output[-3000:]
    assert lines[0].startswith(f"error: step 6 cannot split {model} (phi3, Phi3ForCausalLM)"), lines
    assert not (tmp_path / "run" / "run.json").exists()


def test_evaluation_too_small_for_the_data_parallel_groups_says_so(demo, tmp_path):
    """Issue 43 case 14: --eval_rows 1 on 2 data-parallel groups (2 ranks at --tp_size 1; at 4 ranks and
    --tp_size 2 the same 2 groups): the line counts the groups that share out the evaluation."""
    args = ["--model", demo / "model", "--data_dir", demo / "data", "--output_dir", tmp_path / "run",
            "--max_seq_length", 64, "--max_steps", 1, "--eval_rows", 1, "--eval_games", 8, "--tp_size", 1]
    result = run_python(["-m", "launch.torchrun", "--standalone", "--nproc-per-node=2", STEP_SCRIPTS["tp"], *args],
                        timeout=300)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and errors == [
        "error: the validation data gives 1 rows, fewer than the 2 data-parallel groups that evaluate them: use more "
        "validation games (or raise --eval_rows / --eval_games)"], result.stdout + result.stderr[-3000:]
