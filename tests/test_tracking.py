"""common/tracking.py: each tracker's output is read back with that library's own reader.

Nothing here may reach the network: every test runs with W&B offline and silent, no API keys,
no MLFLOW_TRACKING_URI (unless a test sets one), and a guard that fails any host-name lookup.
The backend tests are skipped where requirements-tracking.txt is not installed.
"""
import importlib.util
import json
import socket
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import UserError
from common.tracking import Tracker, parse_report_to, safe_params, wandb_mode

HF_SECRET = "hf_abcdefghijklmnopqrstuvwxyz0123"
HUB_SECRET = "hf_ZYXWVUTSRQPONMLKJIHGFEDCBA9876"
WANDB_SECRET = "0123456789abcdef0123456789abcdef01234567"
PARAMS = {
    "lr": 1e-4, "batch_size": 8, "output_dir": Path("/scratch/run"), "max_new_tokens": 16,
    "tokenizer": "llama", "world_size": 4, "gpu": "NVIDIA H100", "grad_accum": 2,
    "hf_token": "looks-secret", "wandb_api_key": "also", "dbPassword": "hunter2",
    "model": HF_SECRET,  # the value of $HF_TOKEN under an innocent name
    "note": f"Authorization: Bearer {HUB_SECRET}",  # contains $HUGGING_FACE_HUB_TOKEN
}
SECRETS = ("looks-secret", "also", "hunter2", HF_SECRET, HUB_SECRET)
# the values a training loop might hand over: None and non-numeric ones are skipped
STEPS = [{"train/loss": 2.0, "lr": 1e-4, "eval/acc": None, "phase": "train", "done": False},
         {"train/loss": 1.5, "lr": 1e-4, "grad_norm": np.float32(0.75)},
         {"train/loss": 1.25, "lr": 5e-5, "eval/acc": 0.5, "grad_norm": torch.tensor(0.5)}]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    for var in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "MLFLOW_TRACKING_URI",
                "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc login, no ~/.config/wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "wandb-cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # anything sent would fail locally
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("HF_TOKEN", HF_SECRET)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", HUB_SECRET)
    monkeypatch.chdir(tmp_path)  # so a stray ./mlruns or ./wandb would be noticed
    looked_up = []
    real = socket.getaddrinfo

    def guard(host, *args, **kwargs):
        if host not in ("localhost", "127.0.0.1", "::1", None):
            looked_up.append(host)
            raise OSError(f"test: no network ({host})")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guard)
    yield
    assert looked_up == [], f"tried to resolve {looked_up}"


def run(report_to, output_dir, params=PARAMS):
    with Tracker(report_to, output_dir, "unit-run", params, enabled=True) as tracker:
        for step, metrics in enumerate(STEPS):
            tracker.log(metrics, step)


# ---- choices, installation, secrets, rank != 0 ---------------------------------------------

def test_parse_report_to(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # all "installed"
    assert parse_report_to("none") == []
    assert parse_report_to("") == []
    assert parse_report_to(" None ") == []
    assert parse_report_to("tensorboard") == ["tensorboard"]
    assert parse_report_to("TensorBoard, wandb,tensorboard,mlflow") == [
        "tensorboard", "wandb", "mlflow"]


def test_unknown_tracker_names_the_choices():
    with pytest.raises(UserError, match=r"'comet'.*none.*tensorboard, mlflow, wandb"):
        parse_report_to("tensorboard,comet")


def test_none_with_others_is_an_error():
    with pytest.raises(UserError, match="'none' cannot be combined"):
        parse_report_to("none,wandb")


@pytest.mark.parametrize("tracker, module, package", [
    ("wandb", "wandb", "pip install wandb"),
    ("tensorboard", "tensorboard", "pip install tensorboard"),
    ("mlflow", "mlflow", "pip install mlflow-skinny sqlalchemy alembic"),
    ("mlflow", "sqlalchemy", "pip install mlflow-skinny sqlalchemy alembic"),
])
def test_missing_package_names_the_install_command(monkeypatch, tracker, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # what Python does for a blocked import
    with pytest.raises(UserError) as err:
        parse_report_to(tracker)
    requirements = Path(__file__).resolve().parents[1] / "requirements-tracking.txt"
    assert requirements.is_file()
    assert f"pip install -r {requirements}" in str(err.value) and package in str(err.value)


def test_secrets_are_never_params(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", WANDB_SECRET)
    assert safe_params({"entity": WANDB_SECRET, "url": f"https://x/?k={WANDB_SECRET}"}) == {}
    kept = safe_params(PARAMS)
    assert set(kept) == {"lr", "batch_size", "output_dir", "max_new_tokens", "tokenizer",
                         "world_size", "gpu", "grad_accum"}
    assert kept["output_dir"] == "/scratch/run" and kept["lr"] == 1e-4
    for key in ("token", "HF_TOKEN", "api-key", "apiKey", "client_secret", "password", "auth",
                "hub_auth_header"):
        assert safe_params({key: "x"}) == {}, key


def test_disabled_tracker_writes_nothing(tmp_path):
    output_dir = tmp_path / "out"
    tracker = Tracker(["tensorboard", "mlflow", "wandb"], output_dir, "r", PARAMS, enabled=False)
    tracker.log({"loss": 1.0}, 1)
    tracker.close()
    assert not output_dir.exists()
    assert not any(p.name in ("mlruns", "wandb", "mlflow.db") for p in tmp_path.iterdir())


def test_wandb_is_offline_unless_asked_for_online(monkeypatch):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", WANDB_SECRET)  # a login alone does not mean online
    assert wandb_mode() == "offline"
    for value, mode in (("offline", "offline"), ("dryrun", "offline"), ("disabled", "offline"),
                        ("Online", "online")):
        monkeypatch.setenv("WANDB_MODE", value)
        assert wandb_mode() == mode


# ---- the three backends, read back with their own readers ----------------------------------

def as_text(logged):
    return json.dumps(logged, default=str)


def test_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(["tensorboard"], tmp_path / "out")
    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    events.Reload()
    scalars = lambda tag: [(e.step, e.value) for e in events.Scalars(tag)]  # noqa: E731
    assert sorted(events.Tags()["scalars"]) == ["eval/acc", "grad_norm", "lr", "train/loss"]
    assert scalars("train/loss") == [(0, 2.0), (1, 1.5), (2, 1.25)]
    assert scalars("eval/acc") == [(2, 0.5)] and scalars("grad_norm") == [(1, 0.75), (2, 0.5)]
    text = events.Tensors("params/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| world_size | 4 |" in text and "| gpu | NVIDIA H100 |" in text
    assert not any(secret in text for secret in SECRETS) and "hf_token" not in text


def mlflow_client(uri):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_mlflow_local_store(tmp_path):
    output_dir = tmp_path / "out"
    client = mlflow_client(f"sqlite:///{output_dir / 'mlflow.db'}")  # the store Tracker picks
    long_value = "x" * 7000
    run(["mlflow"], output_dir, {**PARAMS, "long": long_value})
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()
    experiment = client.get_experiment_by_name("chess-finetune")
    [found] = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "unit-run" and found.info.status == "FINISHED"
    params = found.data.params
    assert params["world_size"] == "4" and params["output_dir"] == "/scratch/run"
    assert params["lr"] == "0.0001" and params["long"] == long_value[:6000]
    assert not any(secret in as_text(params) for secret in SECRETS) and "hf_token" not in params
    history = lambda key: sorted(  # noqa: E731
        (m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
    assert history("train/loss") == [(0, 2.0), (1, 1.5), (2, 1.25)]
    assert history("eval/acc") == [(2, 0.5)] and history("grad_norm") == [(1, 0.75), (2, 0.5)]
    assert set(found.data.metrics) == {"train/loss", "lr", "eval/acc", "grad_norm"}


def test_mlflow_uses_the_site_tracking_uri_and_marks_failures(tmp_path, monkeypatch):
    site = tmp_path / "site" / "mlflow.db"
    site.parent.mkdir()
    client = mlflow_client(f"sqlite:///{site}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{site}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "site-experiment")
    with pytest.raises(RuntimeError):
        with Tracker(["mlflow"], tmp_path / "out", "crashing-run", PARAMS, enabled=True) as tracker:
            tracker.log({"train/loss": 3.0}, 7)
            raise RuntimeError("training crashed")
    assert not (tmp_path / "out" / "mlflow.db").exists()
    [found] = client.search_runs([client.get_experiment_by_name("site-experiment").experiment_id])
    assert found.info.run_name == "crashing-run" and found.info.status == "FAILED"
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(7, 3.0)]


def wandb_records(path):
    """Records of a .wandb file: W&B's header, then the LevelDB log format (32 KiB blocks of
    checksum/length/type-framed chunks), each record a wandb_internal_pb2.Record. wandb 0.31
    has no Python reader any more (wandb.sdk.internal.datastore went with the legacy service)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # block trailer padding
            pos += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run(tmp_path):
    pytest.importorskip("wandb")
    import wandb

    output_dir = tmp_path / "out"
    try:
        run(["wandb"], output_dir)
    finally:
        wandb.teardown()  # stop this process's wandb-core
    assert not (tmp_path / "wandb").exists()
    [run_dir] = (output_dir / "wandb").glob("offline-run-*")
    [run_file] = run_dir.glob("run-*.wandb")
    records = list(wandb_records(run_file))
    [run_record] = [r.run for r in records if r.HasField("run")]
    assert run_record.project == "chess-finetune" and run_record.display_name == "unit-run"
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["world_size"] == 4 and config["output_dir"] == "/scratch/run"
    assert not any(secret in as_text(config) for secret in SECRETS) and "hf_token" not in config
    rows = []
    for record in records:
        if record.HasField("history"):
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                   for item in record.history.item}
            step = row["_step"]
            rows.append({k: v for k, v in row.items() if not k.startswith("_")} | {"step": step})
    assert rows == [{"train/loss": 2.0, "lr": 1e-4, "step": 0},
                    {"train/loss": 1.5, "lr": 1e-4, "grad_norm": 0.75, "step": 1},
                    {"train/loss": 1.25, "lr": 5e-5, "eval/acc": 0.5, "grad_norm": 0.5, "step": 2}]
    [exit_record] = [r.exit for r in records if r.HasField("exit")]
    assert exit_record.exit_code == 0
