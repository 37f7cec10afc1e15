"""The code stays readable: flake8-clean Python (ruff with the rules of pyproject.toml, blank
lines included), and each step's lesson stays its diff to the previous step. A diff that grows
past its budget means something that is not the lesson crept into a step script: move it to
common/ (if the steps share it) or to the tool that needs it, or raise the budget here if the
lesson itself grew."""
import difflib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.quick

# Changed lines (added + removed) between consecutive steps' train.py.
DIFF_BUDGETS = {
    ("02_singlegpu", "03_ddp"): 140,   # DDP: torchrun's ranks, the process group, DDP(), no_sync, all-reduces
    ("03_ddp", "04_fsdp"): 202,        # FSDP: strategies and mesh, fully_shard per layer then root, mixed
                                       # precision, rank-0 loading, sharded checkpoints, gathered export,
                                       # CPU offload's gloo for the offloaded tensors
    ("04_fsdp", "05_lora"): 125,       # LoRA/QLoRA: adapters, the frozen base in bf16, adapter-only checkpoints, export
    ("04_fsdp", "06_tp"): 220,         # tensor parallel: the 2-D mesh, the layer and root plans, parallelize then
                                       # fully_shard over dp, loss parallel, sums and batches by data-parallel rank
}


def changed_lines(before, after):
    a = (REPO / before / "train.py").read_text().splitlines()
    b = (REPO / after / "train.py").read_text().splitlines()
    return sum(1 for line in difflib.unified_diff(a, b, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def test_python_is_flake8_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -r requirements-test.txt)")
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


@pytest.mark.parametrize("steps", DIFF_BUDGETS, ids=lambda steps: f"{steps[0]}->{steps[1]}")
def test_each_step_differs_from_the_last_by_its_lesson_only(steps):
    assert changed_lines(*steps) <= DIFF_BUDGETS[steps], (
        f"diff {steps[0]}/train.py {steps[1]}/train.py changes {changed_lines(*steps)} lines, "
        f"more than its budget of {DIFF_BUDGETS[steps]}")


def test_no_script_edits_sys_path():
    """The kit is installed (install.sh: pip install -e .), so nothing needs to."""
    edit = "sys.path." + "insert"
    offenders = [str(path.relative_to(REPO)) for path in REPO.rglob("*.py")
                 if ".venv" not in path.parts and edit in path.read_text()]
    assert offenders == []


def imported_packages(path):
    """The top-level names a file imports (import x.y / from x.y import z)."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_lessons_and_common_stand_on_their_own():
    """common/ and the step scripts import neither the launchers (launch/) nor the tools, the
    benchmarks or submit.py, and none of them loads a script by its path: the folders form layers
    (steps -> common), so a lesson never depends on a later one or on what runs it."""
    above = {"launch", "tools", "benchmark", "submit", "play"}
    files = [*(REPO / "common").glob("*.py"), *(REPO / step / "train.py" for step in
                                                ("02_singlegpu", "03_ddp", "04_fsdp", "05_lora", "06_tp"))]
    offenders = {str(path.relative_to(REPO)): sorted(imported_packages(path) & above) for path in files}
    assert {name: found for name, found in offenders.items() if found} == {}
    by_path = ("spec_from_file_location", "run_path", "SourceFileLoader")
    assert [str(p.relative_to(REPO)) for p in files if any(call in p.read_text() for call in by_path)] == []


@pytest.mark.parametrize("steps", DIFF_BUDGETS, ids=lambda steps: f"{steps[0]}->{steps[1]}")
def test_each_readme_quotes_the_diff_as_it_is(steps):
    """A step's README walks its diff, quoting it: every line it quotes as added is in the step's
    script, every line quoted as removed in the previous step's, every context line in either."""
    import re
    before, after = ((REPO / step / "train.py").read_text().splitlines() for step in steps)
    added, removed = {line.rstrip() for line in after}, {line.rstrip() for line in before}
    stale = []
    for block in re.findall(r"```diff\n(.*?)```", (REPO / steps[1] / "README.md").read_text(), re.S):
        for line in block.splitlines():
            sign, text = line[:1], line[1:].rstrip()
            if (sign == "+" and text not in added) or (sign == "-" and text not in removed) or (
                    sign == " " and text not in added | removed):
                stale.append(line)
    assert not stale, f"{steps[1]}/README.md quotes lines its diff no longer has:\n" + "\n".join(stale)


# The names a step script imports before its first line of logic: what a reader holds in their head
# (nanoGPT's train.py about a dozen, the Lambda guide's chapter scripts about 25).
IMPORTED_NAMES = {"02_singlegpu": 40, "03_ddp": 40, "04_fsdp": 40, "05_lora": 45}


@pytest.mark.parametrize("step", IMPORTED_NAMES)
def test_a_step_script_imports_few_names(step):
    import ast
    tree = ast.parse((REPO / step / "train.py").read_text())
    names = [alias.asname or alias.name for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
             for alias in node.names]
    assert len(names) <= IMPORTED_NAMES[step], f"{step}/train.py imports {len(names)} names: {names}"


def test_step_2_readme_quotes_its_script_as_it_is():
    """Step 2's README walks the script itself, in python blocks: every line it quotes is in it."""
    import re
    script = {line.rstrip() for line in (REPO / "02_singlegpu/train.py").read_text().splitlines()}
    quoted = [line for block in re.findall(r"```python\n(.*?)```", (REPO / "02_singlegpu/README.md").read_text(), re.S)
              for line in block.splitlines() if line.strip()]
    assert quoted and not [line for line in quoted if line.rstrip() not in script]
