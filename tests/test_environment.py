"""environment.yml (clusters, conda) and requirements.txt (pip, CI) pin the same packages."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pins(lines):
    return {line.strip() for line in lines if "==" in line and not line.strip().startswith("#")}


def test_conda_environment_matches_pip_requirements():
    """The same pins."""
    conda = [line.strip().removeprefix("- ") for line in (REPO / "environment.yml").read_text().splitlines()
             if line.strip().startswith("- ") and "==" in line]
    assert pins(conda) == pins((REPO / "requirements.txt").read_text().splitlines())


def test_torch_is_pinned_exactly():
    assert "torch==2.13.0" in pins((REPO / "requirements.txt").read_text().splitlines())
