"""Pictures of the lesson, measured from the code: what each rank holds and which collectives run.

    python workshop/pictures.py                 # writes workshop/pictures/*.png and measured.json

Each step (02 to 06) trains 3 optimiser steps on the built-in demo model as a user runs it (torchrun,
gloo, CPU ranks: 2, and 4 for step 6's 2-D mesh), and during the third step every rank records
  * the bytes it holds: parameters, gradients, optimizer state (its own shards where FSDP shards),
    and the activations that the forward pass keeps for backward (one micro-batch's);
  * the collectives it issues, in order, from PyTorch's Flight Recorder (the C++ log of every
    collective, which common/process_group.py turns on), by phase: each micro-batch's forward and
    backward, then clipping and the optimiser's step.
Step 4's run also profiles its step 2 (--profile_steps), where the recorder does not run: the timeline
picture is that trace. The step scripts are not changed: this file starts each under its own recorder
(`record`, below), which wraps what the loop calls (MetricsLog, loss_sum, clip_grad_norm_, the
optimiser's step hook). The figures the pictures are drawn from go to measured.json; on 2 busy cores
the whole takes a few minutes; tests/test_pictures.py checks the figures.
"""
import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEASURED_STEP = 3  # DDP builds its gradient buckets in step 1 and syncs them in step 2: measure the third
# step: (script, ranks, its extra options)
STEPS = {"02_singlegpu": ("02_singlegpu/train.py", 1, []),
         "03_ddp": ("03_ddp/train.py", 2, []),
         "04_fsdp": ("04_fsdp/train.py", 2, ["--profile_steps", "2-2"]),  # not the measured step: no recorder in it
         "05_lora": ("05_lora/train.py", 2, []),
         "06_tp": ("06_tp/train.py", 4, [])}
# Small and quick: 2 micro-batches per rank and step, short rows, little evaluation.
RUN_OPTIONS = ["--max_steps", str(MEASURED_STEP), "--total_batch_size", "8", "--batch_size_per_device", "2",
               "--max_seq_length", "64", "--eval_every", "0", "--eval_rows", "4", "--eval_games", "4",
               "--device", "cpu"]


# ---------------------------------------------------------------------------------------------------
# The recorder: runs inside each rank, around the unchanged step script.

def local_bytes(tensor):
    """The bytes this rank holds of `tensor` (its own shard, for a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def flight_recorder_entries():
    import torch
    if not int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")):
        return []
    return json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False)).get("entries", [])


def last_record_id():
    return max((entry["record_id"] for entry in flight_recorder_entries()), default=-1)


def record(result_path, script, script_args):
    """Run `script` as __main__ with `script_args`, recording the measured step into `result_path`
    (one JSON file per rank)."""
    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import common.data
    import common.metrics

    state = {"step": 0, "done": False, "model": None, "marks": [], "forward": False, "activation_bytes": 0,
             "holdings": None}

    def measuring():
        return state["step"] == MEASURED_STEP and not state["done"]
    seen = set()  # the storages of the activations counted so far (views share one)

    def mark(phase):  # the collectives from here on belong to `phase`
        if measuring() and dist.is_initialized():
            state["marks"].append((phase, last_record_id() + 1))

    # The model: MetricsLog is given it (DDP's wrapper, FSDP's or TP's sharded model).
    metrics_init = common.metrics.MetricsLog.__init__

    def capture_model(self, run_dir, is_main, args, model, world_size, accumulation, *rest, **kwargs):
        state["model"], state["micro_batches"] = model, accumulation
        metrics_init(self, run_dir, is_main, args, model, world_size, accumulation, *rest, **kwargs)
    common.metrics.MetricsLog.__init__ = capture_model

    # A step begins where the loop asks MetricsLog for its timer, and ends where it makes the step's record.
    metrics_timer, metrics_step_record = common.metrics.MetricsLog.timer, common.metrics.MetricsLog.step_record

    def step_begins(self):
        state["step"] += 1
        mark("step begins")
        return metrics_timer(self)

    def step_ends(self, *args, **kwargs):
        if measuring():
            save_step(result_path, state)
            state["done"] = True  # the evaluation and the checkpoint that may follow are not the step's
        return metrics_step_record(self, *args, **kwargs)
    common.metrics.MetricsLog.timer, common.metrics.MetricsLog.step_record = step_begins, step_ends

    # Each micro-batch's forward pass is its call of loss_sum; its backward follows.
    loss_sum = common.data.loss_sum

    def marked_loss_sum(model, batch, *options):  # options: the chunk size, as the step passes it
        mark("forward")
        state["forward"] = True
        seen.clear()  # the last micro-batch's activations are freed: their addresses may come again
        loss = loss_sum(model, batch, *options)
        state["forward"] = False
        mark("backward")
        return loss
    common.data.loss_sum = marked_loss_sum

    # The gradient's norm (for clipping) and the optimiser's step close the step.
    clip_grad_norm = torch.nn.utils.clip_grad_norm_

    def marked_clip_grad_norm(*args, **kwargs):
        mark("clipping, optimiser step")
        return clip_grad_norm(*args, **kwargs)
    torch.nn.utils.clip_grad_norm_ = marked_clip_grad_norm

    # What the rank holds, once the gradients are there: right after the optimiser's step.
    def holdings(optimizer, args, kwargs):
        if measuring() and state["holdings"] is None:
            parameters = list(state["model"].parameters())
            trainable = [p for p in parameters if p.requires_grad]
            optimizer_bytes = sum(local_bytes(value) for per_parameter in optimizer.state.values()
                                  for value in per_parameter.values() if torch.is_tensor(value) and value.dim())
            state["holdings"] = {
                "parameters": sum(local_bytes(p) for p in parameters),
                "trainable parameters": sum(local_bytes(p) for p in trainable),
                "gradients": sum(local_bytes(p.grad) for p in trainable if p.grad is not None),
                "optimizer state": optimizer_bytes,
                "parameter count (whole model)": sum(p.numel() for p in parameters),  # a DTensor's: the whole
                "trainable parameter count (whole model)": sum(p.numel() for p in trainable),
            }
    register_optimizer_step_post_hook(holdings)

    # Activations: what autograd saves for backward in the forward passes, apart from the weights themselves.
    def pack(tensor):
        if measuring() and state["forward"]:
            base = tensor._base if tensor._base is not None else tensor
            storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()  # a DTensor's: this rank's part
            if not isinstance(base, torch.nn.Parameter) and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                state["activation_bytes"] += storage.nbytes()
        return tensor

    sys.argv = [script, *script_args]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        runpy.run_path(script, run_name="__main__")


def save_step(result_path, state):
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    result = {"rank": rank, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
              "micro_batches": state["micro_batches"], "holdings": dict(state["holdings"]),
              "collectives": [], "groups": {}}
    result["holdings"]["activations (one micro-batch)"] = state["activation_bytes"] // state["micro_batches"]
    if dist.is_initialized():
        dump = json.loads(__import__("torch")._C._distributed_c10d._dump_fr_trace_json(True, False))
        marks = state["marks"]
        for entry in dump.get("entries", []):
            if entry["record_id"] < marks[0][1]:  # before the step began
                continue
            phase, micro_batch = "step begins", 0
            for name, first in marks:
                if entry["record_id"] < first:
                    break
                micro_batch += name == "forward"
                phase = f"{name} {micro_batch}" if name in ("forward", "backward") else name
            result["collectives"].append({"op": entry["profiling_name"], "phase": phase,
                                          "group": entry["process_group"][1] or entry["process_group"][0],
                                          "sizes": entry["input_sizes"], "dtypes": entry["input_dtypes"]})
        # The Flight Recorder names each collective's group; gloo leaves its ranks out of the dump.
        result["groups"] = {group.group_desc: dist.get_process_group_ranks(group)
                            for group in dist.distributed_c10d._world.pg_names}
    Path(result_path).mkdir(parents=True, exist_ok=True)
    (Path(result_path) / f"rank{rank}.json").write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------------------------------------------
# The runs: each step as a user starts it, under the recorder.

def run_step(name, work, model, data_dir):
    """Train step `name` on the demo model under the recorder; {rank: its record}, and its run folder."""
    script, ranks, options = STEPS[name]
    run_dir, records = work / f"run-{name}", work / f"record-{name}"
    step_args = [*RUN_OPTIONS, *options, "--model", str(model), "--data_dir", str(data_dir),
                 "--output_dir", str(run_dir)]
    here = [str(Path(__file__).resolve()), "record", str(records), str(REPO / script), *step_args]
    launcher = [sys.executable, *here] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), *here]
    # One thread per rank (the machine's cores are shared by the ranks), and the Flight Recorder on.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "2000"}
    log = work / f"{name}.log"
    with log.open("w") as output:
        done = subprocess.run(launcher, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"error: {name} failed under the recorder (exit {done.returncode}):\n{log.read_text()[-4000:]}")
    return {str(rank): json.loads((records / f"rank{rank}.json").read_text()) for rank in range(ranks)}, run_dir


def collective_name(op, step):
    """What a collective is, in the lesson's words: on gloo, FSDP's reduce-scatter is an all-to-all
    and a local sum (common/process_group.py)."""
    name = op.split(":", 1)[-1].replace("_", "-")
    if name == "all-to-all" and step in ("04_fsdp", "05_lora", "06_tp"):
        return "reduce-scatter (all-to-all)"
    return name


def dtype_bytes(dtype):
    return {"Float": 4, "Long": 8, "Int": 4, "BFloat16": 2, "Half": 2, "Byte": 1, "Char": 1, "Double": 8}.get(dtype, 4)


def collective_bytes(entry):
    """The bytes this rank puts into the collective."""
    total = 0
    for size, dtype in zip(entry["sizes"], entry["dtypes"]):
        count = 1
        for dimension in size:
            count *= dimension
        total += count * dtype_bytes(dtype)
    return total


def summarise(name, records):
    """The figures the pictures are drawn from (measured.json's entry for the step)."""
    first = records["0"]
    collectives = [{"op": collective_name(entry["op"], name), "phase": entry["phase"],
                    "group": group_name(entry["group"]), "bytes": collective_bytes(entry)}
                   for entry in first["collectives"]]
    return {"ranks": first["world_size"], "micro_batches": first["micro_batches"],
            "holdings": {rank: record["holdings"] for rank, record in records.items()},
            "collectives (rank 0)": collectives,
            "groups": sorted({(group_name(desc), tuple(ranks)) for record in records.values()
                              for desc, ranks in record["groups"].items()})}


def group_name(desc):
    """A process group's name: the 2-D mesh's dimensions (mesh_dp, mesh_tp), or all ranks."""
    return desc.removeprefix("mesh_") if desc.startswith("mesh_") else "all ranks"


def timeline(run_dir, ranks):
    """{rank: [(start ms, duration ms, kind)]} of the profiled step, from the traces --profile_steps wrote."""
    from common.profiling import COMMUNICATION, OPTIMIZER
    lanes, origin = {}, None
    for rank in range(ranks):
        events = json.loads((run_dir / "profile" / f"rank{rank}.pt.trace.json").read_text())["traceEvents"]
        spans = [event for event in events
                 if event.get("ph") == "X" and event.get("cat") in ("cpu_op", "user_annotation")]
        step = next(event for event in spans if event["name"].startswith("ProfilerStep"))
        origin = step["ts"] if origin is None else min(origin, step["ts"])
        intervals = [(step["ts"], step["dur"], "compute")]
        for event in spans:
            if event["name"].startswith(("c10d::", "gloo:")) and COMMUNICATION.search(event["name"]):
                intervals.append((event["ts"], event["dur"], "communication"))
            elif OPTIMIZER.search(event["name"]):
                intervals.append((event["ts"], event["dur"], "optimizer"))
        lanes[rank] = intervals
    return {rank: [((start - origin) / 1e3, duration / 1e3, kind) for start, duration, kind in intervals]
            for rank, intervals in lanes.items()}


def busy_share(intervals, kind):
    """The share of the step's time spent in `kind` (overlapping intervals counted once)."""
    step = intervals[0]
    covered, end = 0.0, step[0]
    for start, duration, _ in sorted(interval for interval in intervals[1:] if interval[2] == kind):
        covered += max(0.0, start + duration - max(start, end))
        end = max(end, start + duration)
    return covered / step[1]


# ---------------------------------------------------------------------------------------------------
# The pictures: readable on a projector (large type, every bar labelled).

COLOURS = {"parameters": "#4C72B0", "frozen parameters": "#A6BDDB", "gradients": "#DD8452",
           "optimizer state": "#55A868", "activations (one micro-batch)": "#8172B3",
           "all-reduce": "#C44E52", "all-gather": "#4C72B0", "reduce-scatter (all-to-all)": "#DD8452",
           "reduce-scatter": "#DD8452", "broadcast": "#937860", "all-to-all": "#DA8BC3", "barrier": "#8C8C8C",
           "compute": "#D0D0D0", "communication": "#C44E52", "optimizer": "#55A868"}
TIMELINE_LABELS = {"compute": "compute (forward, backward, the rest)",
                   "communication": "communication (collectives, waiting for the other rank included)",
                   "optimizer": "the optimiser's step"}
TITLES = {"02_singlegpu": "Step 2: one process holds everything",
          "03_ddp": "Step 3, DDP: every rank holds everything; gradients all-reduced in buckets",
          "04_fsdp": "Step 4, FSDP: every rank holds 1/N; each layer gathered, then its gradients reduce-scattered",
          "05_lora": "Step 5, LoRA: the base is frozen; only the small adapters have gradients and optimizer state",
          "06_tp": "Step 6, 2-D mesh: tensor parallel inside a node, FSDP across nodes"}


def megabytes(count):
    return count / 1e6


def holding_parts(holdings):
    """[(label, bytes)] of what one rank holds, in the order drawn."""
    frozen = holdings["parameters"] - holdings["trainable parameters"]
    parts = [("parameters", holdings["trainable parameters"])]
    if frozen:
        parts = [("frozen parameters", frozen), ("parameters", holdings["trainable parameters"])]
    return parts + [(part, holdings[part]) for part in ("gradients", "optimizer state",
                                                         "activations (one micro-batch)")]


def draw_holdings(axes, summary, scale):
    import matplotlib.ticker
    ranks = sorted(summary["holdings"], key=int)
    for row, rank in enumerate(ranks):
        left = 0.0
        for label, count in holding_parts(summary["holdings"][rank]):
            width = megabytes(count)
            axes.barh(row, width, left=left, color=COLOURS[label], edgecolor="white",
                      label=label.replace("parameters", "trainable parameters") if label == "parameters"
                      and "frozen parameters" in dict(holding_parts(summary["holdings"][rank])) else label)
            if width > scale * 0.07:
                axes.text(left + width / 2, row, f"{width:.1f}", ha="center", va="center", fontsize=15, color="white",
                          fontweight="bold")
            left += width
    axes.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks], fontsize=16)
    axes.invert_yaxis()
    axes.set_xlim(0, scale)
    axes.set_xlabel("MB held by each rank (fp32)", fontsize=16)
    axes.tick_params(axis="x", labelsize=14)
    axes.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes.legend(unique.values(), unique.keys(), fontsize=14, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes.set_title("What each rank holds (MB)", fontsize=18, loc="left")


def draw_collectives(axes, summary):
    collectives = summary["collectives (rank 0)"]
    if not collectives:
        axes.text(0.5, 0.5, "one process:\nno collectives", ha="center", va="center", fontsize=22,
                  transform=axes.transAxes)
        axes.set_axis_off()
        axes.set_title("Collectives of one step", fontsize=18, loc="left")
        return
    rows = sorted({row_label(entry, summary) for entry in collectives}, reverse=True)  # by group, then by kind
    # The step's phases, in the loop's order, as bands behind their collectives (one empty slot where a
    # phase has none: DDP's no_sync), named above them.
    micro_batches = range(1, summary["micro_batches"] + 1)
    phases = ["step begins", *(f"{part} {number}" for number in micro_batches for part in ("forward", "backward")),
              "clipping, optimiser step"]
    slot, positions = 0, []
    for number, phase in enumerate(phases):
        members = [entry for entry in collectives if entry["phase"] == phase]
        first = slot
        for entry in members:
            positions.append((slot, entry))
            slot += 1
        slot += not members
        axes.axvspan(first - 0.5, slot - 0.5, color="#F2F2F2" if number % 2 else "#FFFFFF", zorder=0)
        wide = slot - first > 0.06 * len(collectives)
        axes.text((first + slot - 1) / 2, len(rows) - 0.4, phase_label(phase) + ("" if members else ": none"),
                  ha="center", va="bottom", fontsize=14 if wide else 12, rotation=0 if wide else 90)
    largest = max(entry["bytes"] for entry in collectives) or 1
    for index, entry in positions:
        height = 0.15 + 0.7 * entry["bytes"] / largest  # the box's height grows with its bytes
        axes.bar(index, height, bottom=rows.index(row_label(entry, summary)) - height / 2, width=0.8,
                 color=COLOURS.get(entry["op"], "#8C8C8C"), zorder=2)
    axes.set_yticks(range(len(rows)), rows, fontsize=14)
    axes.set_ylim(-0.6, len(rows) + 1.6)
    axes.set_xlim(-0.7, slot - 0.3)
    axes.set_xlabel("collectives of one optimiser step on rank 0, in order (box height: bytes)", fontsize=15)
    axes.tick_params(axis="x", labelsize=13)
    axes.set_title("Collectives of one step", fontsize=18, loc="left")


def phase_label(phase):
    return {"step begins": "token count", "clipping, optimiser step": "clip + step"}.get(phase, phase.replace(
        "forward ", "fwd ").replace("backward ", "bwd "))


def row_label(entry, summary):
    scalar = " (scalars)" if entry["bytes"] <= 8 else ""
    group = "" if entry["group"] == "all ranks" else f"{entry['group']} group: "
    return f"{group}{entry['op']}{scalar}"


def draw_step(name, summary, scale, path):
    """What each rank holds (above), and the collectives of one step in order (below)."""
    import matplotlib.pyplot as plt
    rows = len({row_label(entry, summary) for entry in summary["collectives (rank 0)"]}) or 2
    figure, (holdings, collectives) = plt.subplots(
        2, 1, figsize=(20, 3.5 + 0.75 * summary["ranks"] + 0.6 * rows),
        gridspec_kw={"height_ratios": [0.6 + 0.75 * summary["ranks"], 1.8 + 0.6 * rows]})
    draw_holdings(holdings, summary, scale)
    draw_collectives(collectives, summary)
    figure.suptitle(TITLES[name], fontsize=22, fontweight="bold")
    figure.tight_layout()
    figure.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(figure)


def draw_comparison(summaries, path):
    """Rank 0's holdings, step by step: the picture of the whole lesson."""
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(16, 6.5))
    names = list(summaries)
    for row, name in enumerate(names):
        summary = summaries[name]
        left = 0.0
        for label, count in holding_parts(summary["holdings"]["0"]):
            if label == "activations (one micro-batch)":
                continue  # they depend on the batch, not on the method: the picture compares the methods
            axes.barh(row, megabytes(count), left=left, color=COLOURS[label], edgecolor="white", label=label)
            left += megabytes(count)
        axes.text(left + 0.2, row, f"{left:.1f} MB", va="center", fontsize=16)
    axes.set_yticks(range(len(names)), [f"{name}\n({summaries[name]['ranks']} rank"
                                        f"{'s' if summaries[name]['ranks'] > 1 else ''})" for name in names],
                    fontsize=15)
    axes.invert_yaxis()
    axes.set_xlabel("MB of model state held by rank 0 (the demo model, fp32)", fontsize=16)
    axes.tick_params(axis="x", labelsize=14)
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes.legend(unique.values(), unique.keys(), fontsize=14, loc="lower right")
    axes.set_title("Model state per rank: parameters, gradients, optimizer state", fontsize=20, fontweight="bold")
    figure.tight_layout()
    figure.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(figure)


def draw_mesh(summary, path):
    """Step 6's ranks as 2 nodes of 2 GPUs: the tp groups (inside a node) and the dp groups (across)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    groups = {kind: [ranks for group, ranks in summary["groups"] if group == kind] for kind in ("tp", "dp")}
    per_node = len(groups["tp"][0])  # tp_size: by default the GPUs of one node
    traffic = {kind: sum(entry["bytes"] for entry in summary["collectives (rank 0)"] if entry["group"] == kind)
               for kind in ("tp", "dp")}
    figure, axes = plt.subplots(figsize=(13, 7.5))
    position = {}
    for rank in range(summary["ranks"]):
        node, slot = divmod(rank, per_node)
        position[rank] = (2 + 5 * slot, 5.2 - 3.6 * node)
    for node in range(summary["ranks"] // per_node):
        axes.add_patch(FancyBboxPatch((0.6, 3.9 - 3.6 * node), 5 * (per_node - 1) + 2.8, 2.6,
                                      boxstyle="round,pad=0.1", facecolor="#F7F7F7", edgecolor="#555555"))
        axes.text(0.8, 6.25 - 3.6 * node, f"node {node}", fontsize=16, va="top", fontstyle="italic")
    for ranks in groups["tp"]:
        (x0, y0), (x1, y1) = position[ranks[0]], position[ranks[-1]]
        axes.plot([x0, x1], [y0, y1], color="#C44E52", linewidth=7, zorder=1)
        axes.text((x0 + x1) / 2, y0 + 0.45, f"tp group {list(ranks)}", ha="center", fontsize=15, color="#C44E52")
    for ranks in groups["dp"]:
        (x0, y0), (x1, y1) = position[ranks[0]], position[ranks[-1]]
        axes.plot([x0, x1], [y0, y1], color="#4C72B0", linewidth=7, linestyle=(0, (2, 1)), zorder=1)
        axes.text(x0 + 0.25, (y0 + y1) / 2, f"dp group {list(ranks)}", fontsize=15, color="#4C72B0", va="center")
    for rank, (x, y) in position.items():
        axes.add_patch(FancyBboxPatch((x - 1.1, y - 0.55), 2.2, 1.1, boxstyle="round,pad=0.05", facecolor="white",
                                      edgecolor="black", linewidth=2, zorder=2))
        axes.text(x, y, f"rank {rank}", ha="center", va="center", fontsize=17, fontweight="bold", zorder=3)
    right = 5 * (per_node - 1) + 3.6  # the node boxes' right edge, and a margin
    axes.text(right / 2, -0.2, f"one step, rank 0 sends into its tp group {megabytes(traffic['tp']):.1f} MB "
              "(all-reduces of activations: stays inside the node)\n"
              f"and into its dp group {megabytes(traffic['dp']):.1f} MB "
              "(FSDP's all-gathers and reduce-scatters: crosses the network)",
              ha="center", va="top", fontsize=15)
    axes.set_xlim(0, right)
    axes.set_ylim(-1.6, 7)
    axes.set_axis_off()
    axes.set_title("Step 6: 4 ranks as a 2 x 2 mesh (dp, tp), as on 2 nodes of 2 GPUs", fontsize=20,
                   fontweight="bold")
    figure.tight_layout()
    figure.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(figure)


def draw_timeline(lanes, path):
    """The profiled FSDP step, per rank: compute, communication, the optimiser's step."""
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(18, 2.5 + 1.2 * len(lanes)))
    for row, (rank, intervals) in enumerate(sorted(lanes.items())):
        for start, duration, kind in intervals:
            height = 0.7 if kind == "compute" else 0.5
            axes.barh(row, duration, left=start, height=height, color=COLOURS[kind], label=TIMELINE_LABELS[kind],
                      zorder=1 if kind == "compute" else 2)
    axes.set_yticks(range(len(lanes)), [f"rank {rank}" for rank in sorted(lanes)], fontsize=16)
    axes.invert_yaxis()
    axes.set_xlabel("ms since the step began (host time, CPU ranks on gloo)", fontsize=16)
    axes.tick_params(axis="x", labelsize=14)
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes.legend(unique.values(), unique.keys(), fontsize=14, loc="upper center", ncol=2,
                bbox_to_anchor=(0.5, -0.3))
    axes.set_title("One FSDP step, from --profile_steps: where the time goes", fontsize=20, fontweight="bold")
    figure.tight_layout()
    figure.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(figure)


# ---------------------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "workshop" / "pictures",
                        help="where the pictures and measured.json go")
    parser.add_argument("--model", type=Path, default=REPO / "demo" / "model", help="the demo model")
    parser.add_argument("--data_dir", type=Path, default=REPO / "demo" / "data", help="the demo data")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file() or not args.data_dir.is_dir():
        print(f"error: no demo model at {args.model} or data at {args.data_dir}: "
              "make them with `python 01_download/download.py --demo --out demo`", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="pictures-") as work:
        summaries, lanes = measure(Path(work), args.model, args.data_dir)
    draw(summaries, lanes, args.out)
    print(f"wrote {', '.join(sorted(path.name for path in args.out.glob('*.png')))} and measured.json in {args.out}")


def measure(work, model, data_dir):
    """Every step's figures (summarise), and the profiled FSDP step's timeline."""
    summaries = {}
    for name in STEPS:
        print(f"{name}: training {MEASURED_STEP} steps under the recorder", flush=True)
        records, run_dir = run_step(name, work, model, data_dir)
        summaries[name] = summarise(name, records)
        if name == "04_fsdp":
            lanes = timeline(run_dir, summaries[name]["ranks"])
    return summaries, lanes


def draw(summaries, lanes, out):
    """The pictures, and measured.json: the figures they are drawn from."""
    import matplotlib
    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    measured = {"steps": summaries, "timeline (04_fsdp)": {
        str(rank): {kind: round(busy_share(intervals, kind), 3) for kind in ("communication", "optimizer")}
        for rank, intervals in lanes.items()}}
    (out / "measured.json").write_text(json.dumps(measured, indent=1) + "\n")
    # One scale for the steps' pictures: the bars compare across the steps.
    scale = 1.05 * max(megabytes(sum(count for _, count in holding_parts(holdings)))
                       for summary in summaries.values() for holdings in summary["holdings"].values())
    for name, summary in summaries.items():
        draw_step(name, summary, scale, out / f"{name}.png")
    draw_comparison(summaries, out / "holdings.png")
    draw_mesh(summaries["06_tp"], out / "06_tp_mesh.png")
    draw_timeline(lanes, out / "timeline.png")


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        record(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
