"""The code that only a GPU job runs, checked on the CPU where it can be (issue 26): the process
group's backends and timeout, the device RNG state in checkpoints, the disk space a sharded save
needs, and the allocator and thread settings of the Slurm templates. Where CUDA itself would be
needed, the test replaces the one CUDA call and says so."""
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common import checkpoint, process_group
from common.arguments import COLLECTIVE_TIMEOUT_S, check_arguments
from common.errors import UserError
from launch.steps import load_step
from conftest import REPO, run_ranks


# ---- the process group ------------------------------------------------------------------------

def test_cpu_tensors_are_reduced_by_gloo_beside_the_gpu_backend(tmp_path):
    """With CPU offload the gradient norm and the load's broadcast reduce CPU tensors, which NCCL
    cannot carry (torch's own table: NCCL is for cuda only). The backend string for that case puts
    gloo beside the GPU backend. Here torch's fake backend stands in for NCCL on "cuda" (this machine
    has none), and a real gloo all-reduce of CPU tensors between 2 ranks goes through the group."""
    assert dist.Backend.backend_capability["nccl"] == ["cuda"]
    assert process_group.backend("cuda") == "nccl" and process_group.backend("cpu") == "gloo"
    assert process_group.backend("cuda", cpu_tensors=True) == "cuda:nccl,cpu:gloo"
    out = run_ranks(tmp_path, """
        import os, torch, torch.distributed as dist
        import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
        from common.process_group import backend
        dist.init_process_group(backend("cuda", cpu_tensors=True).replace("nccl", "fake"))
        group = dist.group.WORLD
        norm = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(norm)
        cpu, cuda = group._get_backend(torch.device("cpu")).name(), group._get_backend(torch.device("cuda")).name()
        print(cpu, cuda, norm.item())
        dist.destroy_process_group()
    """)
    assert out.splitlines() == ["gloo fake 3.0"] * 2


def test_the_collective_timeout_reaches_the_process_group(tmp_path):
    out = run_ranks(tmp_path, """
        import torch, torch.distributed as dist
        from common.process_group import init_process_group
        init_process_group(torch.device("cpu"), 1234)
        print(dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds(), flush=True)
        dist.destroy_process_group()
    """, nproc=1)
    assert out.split() == [f"{1234 + process_group.WATCHDOG_FIRST_S}.0"]  # common/hang.py's watchdog speaks first


def test_on_a_gpu_the_group_is_bound_to_the_ranks_gpu(monkeypatch):
    """Code path only (init_process_group on CUDA needs a GPU): what the call is given."""
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    process_group.init_process_group(torch.device("cuda", 3), 3600, cpu_tensors=True)
    process_group.init_process_group(torch.device("cpu"), 60)
    later = process_group.WATCHDOG_FIRST_S  # common/hang.py's watchdog speaks first
    assert calls == [{"backend": "cuda:nccl,cpu:gloo", "timeout": timedelta(seconds=3600 + later),
                      "device_id": torch.device("cuda", 3)},
                     {"backend": "gloo", "timeout": timedelta(seconds=60 + later), "device_id": None}]


def test_collective_timeout_option():
    """Every step takes it; its default covers a slow 7B load; zero is refused in one line."""
    for step in ("singlegpu", "ddp", "fsdp", "lora"):
        assert load_step(step).parse_arguments(["--output_dir", "x"]).collective_timeout == COLLECTIVE_TIMEOUT_S
    assert 1800 <= COLLECTIVE_TIMEOUT_S <= 3600
    args = load_step("ddp").parse_arguments(["--output_dir", "x", "--collective_timeout", "0"])
    with pytest.raises(UserError, match="--collective_timeout must be from 1 second to a week"):
        check_arguments(args)


# ---- the device RNG state of a checkpoint -----------------------------------------------------

class FakeGPUs:
    """torch.cuda's RNG functions over `count` GPUs, each with its own generator state, as torch's
    own: a GPU index beyond the count raises IndexError. Only this table is fake (no CUDA here);
    torch.cuda.get_rng_state_all and set_rng_state_all stay torch's, looping over it."""

    def __init__(self, monkeypatch, count, current):
        self.states = [torch.tensor([gpu], dtype=torch.uint8) for gpu in range(count)]
        self.current = current
        for module in (torch.cuda, torch.cuda.random):
            monkeypatch.setattr(module, "device_count", lambda: count)
            monkeypatch.setattr(module, "get_rng_state", self.get)
            monkeypatch.setattr(module, "set_rng_state", self.set)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def index(self, device):
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        return self.current if device.index is None else device.index

    def get(self, device="cuda"):
        return self.states[self.index(device)].clone()

    def set(self, new_state, device="cuda"):
        self.states[self.index(device)] = new_state.clone()


class Schedule:
    def state_dict(self):
        return {}


@pytest.mark.parametrize("saved_on, resumed_on", [(8, 4), (4, 8), (2, 1)])
def test_a_checkpoint_resumes_on_another_number_of_gpus_per_node(monkeypatch, tmp_path, saved_on, resumed_on):
    """Saved by rank 0 (GPU 0) of a node with `saved_on` GPUs, resumed by the last local rank of
    a node with `resumed_on`: each rank's own GPU takes the saved GPU's state (all ranks start
    from one seed), no other GPU is touched, and nothing raises IndexError."""
    FakeGPUs(monkeypatch, saved_on, current=0).states[0] = torch.tensor([42], dtype=torch.uint8)
    torch.save(checkpoint.train_state(7, Schedule(), {}), tmp_path / checkpoint.TRAIN_STATE)
    resumed = FakeGPUs(monkeypatch, resumed_on, current=resumed_on - 1)
    checkpoint.restore_rng(checkpoint.load_file(tmp_path / checkpoint.TRAIN_STATE))
    assert [state.item() for state in resumed.states] == [*range(resumed_on - 1), 42]


def test_a_checkpoint_of_the_cpu_resumes_on_a_gpu(monkeypatch, tmp_path):
    torch.save(checkpoint.train_state(1, Schedule(), {}), tmp_path / checkpoint.TRAIN_STATE)  # no CUDA: None
    gpus = FakeGPUs(monkeypatch, 2, current=1)
    checkpoint.restore_rng(checkpoint.load_file(tmp_path / checkpoint.TRAIN_STATE))
    assert [state.item() for state in gpus.states] == [0, 1]  # as seeded


# ---- the disk space of a sharded save ---------------------------------------------------------

def test_the_space_asked_for_is_what_a_sharded_save_writes(tmp_path):
    """Step 4's own sharding (its build_mesh and shard_model) of a small Llama on 2 ranks, with
    AdamW's state, saved by torch.distributed.checkpoint: the disk check counts the pieces DCP
    writes exactly, and asks for at least the bytes of all its files (the shards and the index:
    each piece adds 1.5-1.9 KB to its tensor's bytes), whether the ranks hold halves (FULL_SHARD)
    or full copies (NO_SHARD, which DCP writes once: the old estimate, one rank's share × 2, asked
    for double)."""
    out = run_ranks(tmp_path, f"""
        import os
        from pathlib import Path
        import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
        from transformers import LlamaConfig, LlamaForCausalLM
        from common.checkpoint import SMALL_FILES, checkpoint_bytes, pieces, tensor_bytes
        from launch.steps import load_step
        step4 = load_step("fsdp")
        dist.init_process_group("gloo")
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=96,
                                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2))
            step4.shard_model(model, step4.build_mesh(strategy, "cpu", 2, 2), strategy, MixedPrecisionPolicy(),
                              OffloadPolicy())
            optimizer = torch.optim.AdamW(model.parameters())
            model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
            optimizer.step()
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {{"model": model_state, "optimizer": optimizer_state}}
            needed, asked = tensor_bytes(state), checkpoint_bytes(state, sharded=True) - SMALL_FILES
            local = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                        for t in [*model_state.values(), *(v for s in optimizer_state["state"].values()
                                                          for v in s.values())])
            folder = Path({str(tmp_path)!r}) / strategy
            dcp.save(state, checkpoint_id=folder)
            dist.barrier()
            if dist.get_rank() == 0:
                written = sum(path.stat().st_size for path in [*folder.glob("*.distcp"), folder / ".metadata"])
                index = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata.values()
                items = sum(len(getattr(entry, "chunks", [None])) for entry in index)
                print(strategy, needed, written, items, local * 2, asked, pieces(state), flush=True)
        dist.destroy_process_group()
    """)
    for line in out.splitlines():
        strategy, needed, written, items, old_estimate, asked, counted = line.split()[0], *map(int, line.split()[1:])
        assert counted == items, line  # DCP's own count, from its index
        assert needed + 1500 * items <= written <= asked, line
        if strategy == "NO_SHARD":  # each rank holds everything: the old estimate asked for twice the checkpoint
            assert old_estimate == 2 * needed, line
    assert [line.split()[0] for line in out.splitlines()] == ["FULL_SHARD", "NO_SHARD"]


# ---- the Slurm templates' environment ---------------------------------------------------------

TEMPLATES = ["singlegpu", "ddp", "fsdp", "lora"]
FAKE_SLURM_COMMANDS = {
    # Slurm's launcher: prints the settings the training would start with.
    "srun": 'echo "launched with PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF OMP_NUM_THREADS=$OMP_NUM_THREADS"\n',
    "scontrol": "echo node1\n",
}


def launch_line(tmp_path, template, **job):
    """The templates' own lines up to the launch, as a one-node job (one GPU unless `job` says
    otherwise); srun and scontrol (Slurm's, absent here) are replaced by stand-ins that print.
    The line the stand-in srun printed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM_COMMANDS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM", "PYTORCH_CUDA", "OMP_NUM_THREADS"))}
    env.update({"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}", "SLURM_JOB_ID": "7",
                "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "1", "SLURM_SUBMIT_DIR": str(REPO),
                "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NAME": "t", "FORCE": "1", "OUTPUT_DIR": str(tmp_path / "run"),
                **job})
    result = subprocess.run([shutil.which("bash"), f"slurm/{template}.sh"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("launched with ")]
    return line


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("preset", [None, "max_split_size_mb:256"])
def test_the_templates_launch_with_expandable_segments(tmp_path, template, preset):
    """A value set before sbatch wins."""
    job = {"PYTORCH_CUDA_ALLOC_CONF": preset} if preset else {}
    line = launch_line(tmp_path, template, **job)
    assert f"PYTORCH_CUDA_ALLOC_CONF={preset or 'expandable_segments:True'} " in line


@pytest.mark.parametrize("template, gpus, cpus, threads", [
    ("singlegpu", 1, 8, 8),
    *[(template, 4, 10, 2) for template in TEMPLATES[1:]],
    *[(template, 4, 2, 1) for template in TEMPLATES[1:]],  # fewer CPUs than GPUs: 1 each, not 2 // 4 = 0
])
def test_the_templates_split_the_cpus_among_the_gpus(tmp_path, template, gpus, cpus, threads):
    line = launch_line(tmp_path, template, SLURM_GPUS_ON_NODE=str(gpus), SLURM_CPUS_PER_TASK=str(cpus))
    assert line.endswith(f" OMP_NUM_THREADS={threads}"), line
