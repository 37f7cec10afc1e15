"""benchmark/data_scale.py, in a small size: it writes the data, prepares it, trains on it and
writes its table (the figures themselves are for the full run on a quiet machine)."""
import json
import subprocess
import sys

from conftest import REPO


def test_data_scale_writes_its_table(demo, tmp_path):
    result = subprocess.run([sys.executable, "benchmark/data_scale.py", "--games", "300", "600", "--steps", "1",
                             "--demo", str(demo), "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "data_scale.json").read_text())
    assert [row["games"] for row in rows] == [300, 600]
    assert rows[1]["rows"] > rows[0]["rows"] > 0 and all(row["first_step_s"] > 0 for row in rows)
    table = (tmp_path / "data_scale.md").read_text()
    assert "| 600 |" in table and "From 300 to 600 games: peak RSS per rank" in table
