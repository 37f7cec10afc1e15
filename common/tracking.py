"""Optional experiment tracking: TensorBoard, MLflow and Weights & Biases, offline by design.

Compute nodes usually have no internet, so every backend writes to local files under the
run's OUTPUT_DIR unless the user explicitly points it at a server:

  tensorboard  event files in OUTPUT_DIR/tensorboard/ (scalars, and the parameters as a
               markdown table in the Text tab). View: tensorboard --logdir OUTPUT_DIR
  mlflow       MLFLOW_TRACKING_URI if the site or user set it; otherwise a local SQLite store
               sqlite:///OUTPUT_DIR/mlflow.db. (MLflow 3.x refuses the old ./mlruns file
               store unless MLFLOW_ALLOW_FILE_STORE=true; SQLite is its default now.)
               Experiment: MLFLOW_EXPERIMENT_NAME, else "chess-finetune". MLflow's usage
               telemetry is switched off (MLFLOW_DISABLE_TELEMETRY=true unless already set).
               mlflow-skinny has no UI; on a machine with `pip install mlflow`:
               mlflow ui --backend-store-uri sqlite:///OUTPUT_DIR/mlflow.db
  wandb        offline unless WANDB_MODE=online is set: an API key or `wandb login` alone does
               NOT switch to online, because a shared home directory carries the login from
               the login node to compute nodes that cannot reach the server. The offline run
               lands in OUTPUT_DIR/wandb/offline-run-<date>_<time>-<id>/; upload it later from
               a machine with internet: wandb sync OUTPUT_DIR/wandb/offline-run-*
               Project: WANDB_PROJECT, else "chess-finetune".

Only rank 0 tracks (enabled=True); on the other ranks a Tracker does nothing. Parameters whose
name looks secret, or whose value contains a token from the environment, are never logged.
"""
import importlib
import importlib.util
import numbers
import os
import re
import time
from pathlib import Path

from common.errors import UserError

CHOICES = ("none", "tensorboard", "mlflow", "wandb")
PROJECT = "chess-finetune"
REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements-tracking.txt"
# tracker -> (modules it imports, the pip packages that provide them)
PACKAGES = {
    "tensorboard": (("tensorboard",), "tensorboard"),
    # mlflow-skinny is the client; SQLAlchemy and Alembic run its local SQLite store
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow-skinny sqlalchemy alembic"),
    "wandb": (("wandb",), "wandb"),
}
SECRET_WORDS = {"token", "key", "secret", "password", "passwd", "auth", "authorization",
                "credential", "credentials", "apikey"}
SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")
MLFLOW_PARAM_MAX = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH


def _install_hint(name):
    return (f"--report_to {name} needs the package(s) {PACKAGES[name][1]}, which are not installed "
            f"in this Python environment; install them with: pip install -r {REQUIREMENTS}  "
            f"(or only this tracker: pip install {PACKAGES[name][1]})")


def parse_report_to(value: str) -> list[str]:
    """'none' or a comma-separated list of trackers -> list of names. Checks that each requested
    package is installed (without importing it), so a mistake stops the run before any work."""
    names = list(dict.fromkeys(n.strip().lower() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in CHOICES]
    if unknown:
        raise UserError(f"--report_to: unknown tracker {', '.join(map(repr, unknown))}; "
                        f"choose 'none' or a comma-separated list of {', '.join(CHOICES[1:])}")
    if "none" in names:
        if len(names) > 1:
            raise UserError("--report_to: 'none' cannot be combined with other trackers")
        return []
    for name in names:
        if any(importlib.util.find_spec(module) is None for module in PACKAGES[name][0]):
            raise UserError(_install_hint(name))
    return names


def _import(name, module):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise UserError(f"{_install_hint(name)} [import {module}: {err}]") from err


def _looks_secret(key):
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower()
    return any(word in SECRET_WORDS for word in re.split(r"[^a-z0-9]+", words))


def safe_params(params: dict) -> dict:
    """params without secrets, values made plain (str/int/float/bool/None) for every backend."""
    secrets = [os.environ.get(var, "") for var in SECRET_ENV_VARS]
    secrets = [s for s in secrets if s]
    clean = {}
    for key, value in params.items():
        if not isinstance(value, (str, int, float, bool, type(None))):
            value = str(value)
        text = str(value)
        if _looks_secret(key) or any(s == text or (len(s) >= 8 and s in text) for s in secrets):
            continue
        clean[str(key)] = value
    return clean


def _scalar(value):
    """float for a numeric scalar (Python, NumPy or a one-element tensor), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        return _scalar(value.item())
    return None


class _TensorBoard:
    def __init__(self, output_dir, run_name, params):
        writer_cls = _import("tensorboard", "torch.utils.tensorboard").SummaryWriter
        self.writer = writer_cls(log_dir=str(output_dir / "tensorboard"))
        rows = "".join(f"| {k} | {v} |\n" for k, v in params.items())
        header = f"run `{run_name}`\n\n| parameter | value |\n|---|---|\n"
        self.writer.add_text("params", header + rows)

    def log(self, metrics, step):
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self, failed):
        self.writer.close()


class _MLflow:
    def __init__(self, output_dir, run_name, params):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read when mlflow is imported
        site_uri = os.environ.get("MLFLOW_TRACKING_URI")
        _import("mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        self.uri = site_uri or f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # artifacts (none logged today) stay in OUTPUT_DIR, not in the current directory
            local = None if site_uri else (output_dir / "mlartifacts").resolve().as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=local)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        items = [Param(k, str(v)[:MLFLOW_PARAM_MAX]) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def log(self, metrics, step):
        now = int(time.time() * 1000)
        batch = [self.Metric(key, value, now, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self, failed):
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def wandb_mode() -> str:
    """'online' only when the user set WANDB_MODE=online; anything else (unset, offline, an API
    key in the environment or ~/.netrc) is 'offline', so a compute node never waits on the net."""
    return "online" if os.environ.get("WANDB_MODE", "").strip().lower() == "online" else "offline"


class _WandB:
    def __init__(self, output_dir, run_name, params):
        wandb = _import("wandb", "wandb")
        mode = wandb_mode()
        # The process-wide settings decide whether W&B's own telemetry may reach its server;
        # without this, an offline run still resolves W&B's host name.
        wandb.setup(settings=wandb.Settings(mode=mode))
        self.run = wandb.init(mode=mode, dir=str(output_dir), name=run_name, config=params,
                              project=os.environ.get("WANDB_PROJECT") or PROJECT)

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def close(self, failed):
        self.run.finish(exit_code=1 if failed else 0)


BACKENDS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}


class Tracker:
    """Sends parameters once and metrics every log() to the chosen trackers (rank 0 only).

    Usable as a context manager: an exception marks the MLflow/W&B run as failed."""

    def __init__(self, report_to: list[str], output_dir: Path, run_name: str, params: dict,
                 enabled: bool):
        self.backends = []
        if not enabled or not report_to:
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        params = safe_params(params)
        try:
            for name in report_to:
                self.backends.append(BACKENDS[name](output_dir, run_name, params))
        except BaseException:
            self.close(failed=True)  # no run left marked as running
            raise

    def log(self, metrics: dict, step: int):
        """Log the numeric scalars of metrics at step; None and anything non-numeric is skipped."""
        if not self.backends:
            return
        numeric = {str(k): _scalar(v) for k, v in metrics.items()}
        numeric = {k: v for k, v in numeric.items() if v is not None}
        if numeric:
            for backend in self.backends:
                backend.log(numeric, int(step))

    def close(self, failed: bool = False):
        """Flush and finish every tracker; safe to call twice."""
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close(failed)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(failed=exc_type is not None)
