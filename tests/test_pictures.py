"""The workshop's pictures and slides: `python workshop/pictures.py` measures what each rank holds and
which collectives run by training every step under its recorder, and draws them; workshop/slides.sh
builds the deck that shows them. Here the pictures are made again, in a temporary folder, and the
figures they are drawn from are checked against what each method must hold and send; the committed
pictures' figures must be those the code measures now."""
import json
import shutil
import subprocess

import pytest

from conftest import REPO, run_python

STEPS = ["02_singlegpu", "03_ddp", "04_fsdp", "05_lora", "06_tp"]
PICTURES = [*STEPS, "06_tp_mesh", "holdings", "timeline"]
MODEL_STATE = ("parameters", "gradients", "optimizer state")


@pytest.fixture(scope="module")
def pictures(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("pictures")
    run_python([REPO / "workshop/pictures.py", "--out", out, "--model", demo / "model", "--data_dir", demo / "data"],
               check=True, timeout=600)
    return out, json.loads((out / "measured.json").read_text())


@pytest.fixture(scope="module")
def config(demo):
    return json.loads((demo / "model" / "config.json").read_text())


def state(measured, step, rank="0"):
    holdings = measured["steps"][step]["holdings"][rank]
    return sum(holdings[part] for part in MODEL_STATE)


def collectives(measured, step):
    return measured["steps"][step]["collectives (rank 0)"]


def test_every_picture_is_drawn(pictures):
    out, _ = pictures
    for name in PICTURES:
        assert (out / f"{name}.png").stat().st_size > 10_000, name


def test_one_process_holds_16_bytes_per_parameter_and_sends_nothing(pictures):
    _, measured = pictures
    holdings = measured["steps"]["02_singlegpu"]["holdings"]["0"]
    count = holdings["parameter count (whole model)"]
    assert (holdings["parameters"], holdings["gradients"], holdings["optimizer state"]) == (4 * count, 4 * count,
                                                                                            8 * count)
    assert holdings["activations (one micro-batch)"] > 0
    assert collectives(measured, "02_singlegpu") == []


def test_ddp_holds_everything_and_all_reduces_the_gradients_once_per_step(pictures):
    _, measured = pictures
    assert state(measured, "03_ddp", "0") == state(measured, "03_ddp", "1") == state(measured, "02_singlegpu")
    gradient_reductions = [entry for entry in collectives(measured, "03_ddp")
                           if entry["op"] == "all-reduce" and entry["bytes"] > 8]  # not the loss's sum, a scalar
    micro_batches = measured["steps"]["03_ddp"]["micro_batches"]
    assert micro_batches > 1
    # In buckets (more than one), all in the last micro-batch's backward (no_sync before it), the whole gradient.
    assert len(gradient_reductions) > 1
    assert {entry["phase"] for entry in gradient_reductions} == {f"backward {micro_batches}"}
    assert not [entry for entry in collectives(measured, "03_ddp") if entry["phase"] == "backward 1"]
    assert sum(entry["bytes"] for entry in gradient_reductions) == measured["steps"]["03_ddp"]["holdings"]["0"][
        "gradients"]


def test_fsdp_holds_a_share_per_rank_and_gathers_then_reduce_scatters_layer_by_layer(pictures, config):
    _, measured = pictures
    ranks = measured["steps"]["04_fsdp"]["ranks"]
    for rank in map(str, range(ranks)):
        assert state(measured, "04_fsdp", rank) == pytest.approx(state(measured, "03_ddp") / ranks, rel=0.02)
    units = config["num_hidden_layers"] + 1  # every decoder layer, then the root
    steps = collectives(measured, "04_fsdp")
    for micro_batch in range(1, measured["steps"]["04_fsdp"]["micro_batches"] + 1):
        forward = [entry["op"] for entry in steps if entry["phase"] == f"forward {micro_batch}"]
        backward = [entry["op"] for entry in steps if entry["phase"] == f"backward {micro_batch}"]
        assert forward == ["all-gather"] * units  # before each layer runs
        # In backward each layer is gathered again (the root stays gathered), then its gradients reduce-scattered.
        assert backward.count("all-gather") == units - 1
        assert backward.count("reduce-scatter (all-to-all)") == units
        assert backward.index("all-gather") < backward.index("reduce-scatter (all-to-all)")
    # No gradient all-reduce (only the loss's and the token count's sums, scalars): FSDP never holds it whole.
    assert all(entry["bytes"] <= 8 for entry in steps
               if entry["op"] == "all-reduce" and entry["phase"] != "clipping, optimiser step")


def test_lora_trains_only_its_adapters(pictures, config):
    _, measured = pictures
    holdings = measured["steps"]["05_lora"]["holdings"]["0"]
    rank, hidden, width = 16, config["hidden_size"], config["intermediate_size"]  # step 5's --lora_rank default
    heads = config["num_attention_heads"] * config["head_dim"]
    # A (r x in) and B (out x r) beside q, k, v, o, gate, up and down, in every layer.
    per_layer = rank * (4 * (hidden + heads) + 3 * (hidden + width))
    assert holdings["trainable parameter count (whole model)"] == per_layer * config["num_hidden_layers"]
    assert holdings["trainable parameter count (whole model)"] < 0.2 * holdings["parameter count (whole model)"]
    ranks = measured["steps"]["05_lora"]["ranks"]
    assert holdings["gradients"] == pytest.approx(holdings["trainable parameters"], rel=0.02)
    assert holdings["optimizer state"] == pytest.approx(2 * holdings["trainable parameters"], rel=0.02)
    assert holdings["parameters"] == pytest.approx(
        4 * holdings["parameter count (whole model)"] / ranks, rel=0.02)  # the frozen base sharded too


def test_tp_groups_stay_in_a_node_and_dp_groups_cross_nodes(pictures):
    _, measured = pictures
    tp = measured["steps"]["06_tp"]
    groups = {(name, tuple(ranks)) for name, ranks in tp["groups"]}
    assert {("tp", (0, 1)), ("tp", (2, 3)), ("dp", (0, 2)), ("dp", (1, 3))} <= groups  # tp: a node's ranks
    by_group = {}
    for entry in tp["collectives (rank 0)"]:
        by_group.setdefault(entry["group"], set()).add(entry["op"])
    assert "all-reduce" in by_group["tp"]  # the activations' sums, in every layer
    assert {"all-gather", "reduce-scatter (all-to-all)"} <= by_group["dp"]  # FSDP's, across the nodes
    assert state(measured, "06_tp") == pytest.approx(state(measured, "03_ddp") / 4, rel=0.05)


def test_the_timeline_shows_communication_on_every_rank(pictures):
    _, measured = pictures
    shares = measured["timeline (04_fsdp)"]
    assert sorted(shares) == ["0", "1"]
    assert all(0 < share["communication"] < 1 and 0 < share["optimizer"] < 1 for share in shares.values())


def test_the_committed_pictures_are_those_the_code_draws(pictures):
    """The bytes and the collectives do not depend on the machine: the committed measured.json must be
    the one made now, or the pictures in the READMEs and slides show an older code."""
    _, measured = pictures
    committed = json.loads((REPO / "workshop/pictures/measured.json").read_text())
    assert committed["steps"] == measured["steps"], "run `python workshop/pictures.py` and commit the pictures"
    for name in PICTURES:
        assert (REPO / "workshop/pictures" / f"{name}.png").is_file()


def test_the_slides_build_and_show_every_step_and_picture(tmp_path):
    if shutil.which("npx") is None:
        pytest.skip("workshop/slides.sh needs npx (Node.js) to install Marp CLI")
    deck = tmp_path / "slides.html"
    subprocess.run([str(REPO / "workshop/slides.sh"), str(deck)], check=True, capture_output=True, text=True,
                   timeout=300)
    html = deck.read_text()
    for step in ("Step 2", "Step 3", "Step 4", "Step 5", "Step 6", "Slurm", "Failure drills"):
        assert step in html, step
    for name in PICTURES:
        assert f"pictures/{name}.png" in html, name
