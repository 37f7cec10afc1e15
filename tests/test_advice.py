"""Issue 36, "Advice that misleads": the one error line says what the folder is and what to do. A
run's folder, a checkpoint or LoRA adapters given as --model said "re-run the download step";
--resume without the run's --notation said the model differs; tools/export.py on a run's folder
said "its save was interrupted"; a read-only HF_HOME did not mention --prepared_dir. Real runs of
the steps make the folders."""
import json
import os
import subprocess
import sys

import pytest

from conftest import QUICK, REPO, run_python, run_step

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ONE_STEP = QUICK + ["--max_steps", 1, "--total_batch_size", 2, "--batch_size_per_device", 2]


def one_error_line(result):
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), result.stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def runs(demo, tmp_path_factory):
    """A finished run of step 2 (its folder, checkpoint and final/) and of step 5 (LoRA adapters)."""
    folder = tmp_path_factory.mktemp("advice")
    for step, nproc in (("single", 1), ("lora", 1)):
        run_step(step, ["--model", demo / "model", "--data_dir", demo / "data", "--output_dir", folder / step,
                        *ONE_STEP], nproc=nproc)
    return folder


def play(model, tmp_path):
    return run_python([REPO / "play.py", "--model", model, "--pgn", tmp_path / "game.pgn"], env=ENV, timeout=120)


def test_a_run_folder_as_model_names_its_final_model(runs, tmp_path):
    run = runs / "single"
    assert one_error_line(play(run, tmp_path)) == f"error: {run} is a run's folder: its model is {run / 'final'}"
    trained = run_step("single", ["--model", run, "--output_dir", tmp_path / "more", *ONE_STEP], check=False)
    assert one_error_line(trained) == f"error: {run} is a run's folder: its model is {run / 'final'}"


def test_a_checkpoint_as_model_points_to_final_and_export(runs, tmp_path):
    checkpoint = runs / "single/checkpoints/step-000001"
    assert one_error_line(play(checkpoint, tmp_path)) == (
        f"error: {checkpoint} is a training checkpoint, not a Hugging Face model: use the run's final/ folder, or "
        f"export a checkpoint of step 4 with `python tools/export.py {checkpoint} OUT_DIR`")


@pytest.mark.parametrize("where", ["final", "checkpoints/step-000001"])
def test_lora_adapters_as_model_name_the_base_model(runs, tmp_path, where):
    adapters = runs / "lora" / where
    assert one_error_line(play(adapters, tmp_path)).startswith(
        f"error: {adapters} holds LoRA adapters (05_lora's final/ or checkpoint), not a whole model: pass the base "
        "model the run trained (run.json's model) as --model")


def test_export_of_a_run_folder_names_its_newest_checkpoint(runs, tmp_path):
    def export(source):
        return run_python([REPO / "tools/export.py", source, tmp_path / "out"], env=ENV, timeout=120)
    run = runs / "single"
    assert one_error_line(export(run)) == (
        f"error: {run} is a run's folder: pass one of its checkpoints, a folder OUTPUT_DIR/checkpoints/step-NNNNNN "
        f"(the newest complete one is {run / 'checkpoints/step-000001'})")
    assert one_error_line(export(run / "final")) == (
        f"error: {run / 'final'} is a Hugging Face model already (a run's final/ folder, or an export): "
        "AutoModelForCausalLM.from_pretrained loads it as it is")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def two_notation_model(tmp_path_factory):
    """The built-in model's shape (small) with a tokenizer that holds both notations' words, so that
    it trains in either; its config.json names the piece notation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from common.notation import vocabulary
    from launch.steps import load_step
    download = load_step("download")
    words = download.SPECIAL_TOKENS + vocabulary("piece") + vocabulary("uci")
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    out = tmp_path_factory.mktemp("two_notations") / "model"
    download.build_tiny_llama(tokenizer, 0, "piece", layers=1, hidden=32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_resume_without_the_run_s_notation_names_it(demo, two_notation_model, tmp_path):
    out = tmp_path / "run"
    args = ["--model", two_notation_model, "--data_dir", demo / "data", "--output_dir", out, *QUICK,
            "--total_batch_size", 2, "--batch_size_per_device", 2]
    run_step("single", args + ["--max_steps", 2, "--notation", "uci"])
    assert json.loads((out / "run.json").read_text())["notation"] == "uci"
    refused = run_step("single", args + ["--max_steps", 3, "--resume"], check=False)
    assert one_error_line(refused) == (f"error: the run in {out} trains in the uci notation, not piece: pass "
                                       "--notation uci to continue it, or start a new run in another --output_dir")
    run_step("single", args + ["--max_steps", 3, "--resume", "--notation", "uci"])


@pytest.fixture
def read_only_folder(tmp_path):
    folder = tmp_path / "hf_home"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes anywhere a mode allows nothing: a read-only file system then
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a read-only tmpfs here")
        yield folder
        subprocess.run(["umount", "-l", str(folder)], check=False)
    else:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)


def test_a_read_only_hf_home_names_prepared_dir(demo, read_only_folder, tmp_path):
    env = {**ENV, "HF_HOME": str(read_only_folder)}
    env.pop("HF_DATASETS_CACHE", None)
    result = subprocess.run([sys.executable, str(REPO / "02_singlegpu/train.py"), "--model", str(demo / "model"),
                             "--data_dir", str(demo / "data"), "--output_dir", str(tmp_path / "run"),
                             *map(str, ONE_STEP)], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert one_error_line(result).startswith(f"error: cannot write the prepared data to {read_only_folder}/datasets/"
                                             "chess-kit (") and "set --prepared_dir" in result.stderr
