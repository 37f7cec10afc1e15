"""The pages agree with the repository and with each other (issue 40, point 6).

Every tracked Markdown file (git ls-files '*.md') is read, and:
  * each relative link (and image) leads to a file or folder of the repository, and each #anchor
    to a heading of its page, by GitHub's rules for heading ids;
  * each option a page gives a script (in a command of a ```bash block, or in backticks:
    "`04_fsdp/train.py --cpu_offload`") is one that script's argparse defines;
  * each file or folder a page names in backticks exists in the repository, or is one a command
    writes (OUTPUTS below, each with its reason);
  * each measured figure that more than one page states (FIGURES below) is the same on every page,
    and within the budget a configuration file sets for it (the same for a fact such as the folder of
    the kit's environment);
  * tests/README.md names every test file.
Each test prints every disagreement it finds, not only the first.
"""
import ast
import os
import re
import shlex
import subprocess
from functools import cache
from pathlib import Path

import pytest
from conftest import run_python

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.quick


@cache
def tracked():
    """The repository's tracked files (and untracked ones not ignored: a page added in this very change)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return {name for name in listed if (REPO / name).is_file()}


@cache
def folders():
    return {str(parent) for name in tracked() for parent in Path(name).parents if str(parent) != "."}


def pages():
    return sorted(name for name in tracked() if name.endswith(".md"))


def exists(path):
    path = path.rstrip("/")
    return path in tracked() or path in folders()


def prose_and_code(text):
    """(prose, [fenced code blocks]): the prose with its code blocks blanked, line for line."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            if block is None:
                block = []
            else:
                blocks.append("\n".join(block))
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def inline_code(prose):
    return [match.group(2).strip() for match in INLINE_CODE.finditer(prose)]


# --- links and anchors ---------------------------------------------------------------------------

def slug(heading):
    """GitHub's id for a heading: its text (links and code as their text) in lower case, without
    punctuation but hyphens and underscores, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page):
    """The ids a page's headings (and its explicit <a name>/id) give, duplicates numbered as GitHub does."""
    prose, _ = prose_and_code((REPO / page).read_text())
    ids, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.MULTILINE):
        base = slug(heading)
        ids.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    ids.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", prose))
    return ids


def read(page, text=None):
    """A page's text: `text` where given (a test's own page), else the file's."""
    return (REPO / page).read_text() if text is None else text


def links(page, text=None):
    prose, _ = prose_and_code(read(page, text))
    prose = INLINE_CODE.sub("code", prose)  # a link's text may be code; a link inside code is none
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)


def broken_links(page, text=None):
    broken = []
    for target in links(page, text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not the repository's
            continue
        path, _, anchor = target.partition("#")
        resolved = (REPO / page).parent / path if path else REPO / page
        name = str(resolved.resolve().relative_to(REPO)) if resolved.resolve().is_relative_to(REPO) else None
        if name is None or not exists(name):
            broken.append(f"{page}: ({target}): no such file or folder in the repository")
        elif anchor and (not name.endswith(".md") or anchor not in anchors(name)):
            broken.append(f"{page}: ({target}): no heading of {name} has the id #{anchor}")
    return broken


def test_every_relative_link_and_anchor_resolves():
    broken = [line for page in pages() for line in broken_links(page)]
    assert broken == [], "\n".join(broken)


def missing_sections(page):
    """A section named in words ("the main README's GPU section"): the main README has a heading that says so."""
    prose, _ = prose_and_code((REPO / page).read_text())
    sections = re.findall(r"^#{2,6}\s+(.+)$", prose_and_code((REPO / "README.md").read_text())[0], re.M)
    return [f"{page}: the main README has no {name} section (no heading names it)"
            for name in re.findall(r"the main README's ([\w -]+?) section", " ".join(prose.split()))
            if not any(re.search(rf"\b{re.escape(name)}\b", re.sub(r"\(.*?\)", "", section), re.I)  # not its aside
                       for section in sections)]


def test_every_section_a_page_names_in_words_exists():
    missing = [line for page in pages() for line in missing_sections(page)]
    assert missing == [], "\n".join(missing)


def test_each_rule_finds_what_it_is_for():
    """On a page of this test's own (never written to disk), in the folder workshop/."""
    page = "workshop/EXAMPLE.md"
    text = ("[a](../slurm/README.md#when-a-job-hangs) [b](../slurm/README.md#no-such-heading) [c](../nope.md)\n"
            "`04_fsdp/train.py --cpu_offload` `04_fsdp/train.py --no_such_option` `benchmark/NOPE.md` "
            "`runs/nobody-writes-this/results.md` [benchmark/GPU.md](../benchmark/README.md) `OUTPUT_DIR/final/`\n"
            "```bash\ntorchrun --nproc-per-node 2 03_ddp/train.py --max_steps 2 --nope 3  # and --not_this\n```\n")
    assert broken_links(page, text) == [
        f"{page}: (../slurm/README.md#no-such-heading): no heading of slurm/README.md has the id #no-such-heading",
        f"{page}: (../nope.md): no such file or folder in the repository"]
    assert sorted(unknown_options(page, text)) == [f"{page}: 03_ddp/train.py has no option --nope",
                                                   f"{page}: 04_fsdp/train.py has no option --no_such_option"]
    assert missing_paths(page, text) == [
        f"{page}: `benchmark/GPU.md`: not in the repository", f"{page}: `benchmark/NOPE.md`: not in the repository",
        f"{page}: `runs/nobody-writes-this/results.md`: no command on this page or in the kit writes "
        "runs/nobody-writes-this"]


def test_slugs_follow_githubs_rules():
    assert slug("Where the time goes: `--profile_steps`") == "where-the-time-goes---profile_steps"
    assert slug("On a GPU: `benchmark/gpu_check.py`") == "on-a-gpu-benchmarkgpu_checkpy"
    assert slug("Step 6 — 2-D mesh (tp × dp)") == "step-6--2-d-mesh-tp--dp"
    assert slug("[The guide](x.md) & more") == "the-guide--more"


# --- options a page gives a script ---------------------------------------------------------------

def has_option(script, option):
    """Whether `script` takes `option` (dashes and underscores alike: the kit takes both spellings):
    read from its source, or, where an option is made in a way the source does not show
    literally, from its --help."""
    option = option.replace("-", "_")
    return option in options_in_source(script) or option in options_in_help(script)


@cache
def options_in_help(script):
    if not re.search(r"\bParser\(|ArgumentParser\(", (REPO / script).read_text()):
        return set()  # no argparse of its own: --help could run it
    helped = run_python([script, "--help"], timeout=120)
    return {option.replace("-", "_") for option in re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", helped.stdout)}


@cache
def options_in_source(script):
    """The options a script's argparse defines: its own add_argument calls and those of the kit's
    modules it imports (common.arguments, say), read from the source (no torch to import)."""
    found, seen, todo = {"--help"}, set(), [REPO / script]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            call = getattr(node.func, "attr", "") if isinstance(node, ast.Call) else ""
            names = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)] \
                if call in ("add_argument", "add") else []
            found.update(name for name in names if name.startswith("--"))
            if call == "add" and names:  # common.arguments.Parser.add("max_steps"): --max_steps
                found.add(f"--{names[0]}")
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            todo += [base / (module.replace(".", "/") + ".py") for module in modules for base in (REPO, path.parent)]
    return {option.replace("-", "_") for option in found}  # the kit takes the dashed spellings too


def script_of(token, page):
    """The tracked Python script a command's token names (from the repository root, or the page's folder)."""
    if not token.endswith(".py"):
        return None
    for base in (Path(), Path(page).parent):
        name = str(Path(base, token.removeprefix("./")))
        if name in tracked():
            return name
    return None


def commands(page, text=None):
    """Each command a page shows: the lines of its fenced blocks (continuations joined, comments
    and prompts left out) and its inline code that names a .py script."""
    prose, blocks = prose_and_code(read(page, text))
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    lines += [code for code in inline_code(prose) if re.search(r"\.py\b", code)]
    for line in lines:
        line = re.sub(r"(^|\s)#.*$", "", line).strip().removeprefix("$ ")
        try:
            yield shlex.split(line)
        except ValueError:  # an unbalanced quote: read it word by word
            yield line.split()


def unknown_options(page, text=None):
    unknown = []
    for words in commands(page, text):
        script = None
        for word in words:
            if word in ("|", "&&", ";", "||", ">", ">>") or word.startswith((">", "2>")):
                script = None  # the next command of the line
            elif script_of(word, page):
                script = script_of(word, page)
            elif script and re.match(r"^--[a-zA-Z]", word):
                option = word.split("=", 1)[0]
                if not has_option(script, option):
                    unknown.append(f"{page}: {script} has no option {option}")
    return unknown


def test_each_option_a_page_names_exists_in_its_script():
    unknown = sorted(set(line for page in pages() for line in unknown_options(page)))
    assert unknown == [], "\n".join(unknown)


# --- files and folders a page names --------------------------------------------------------------

# What a command writes, not the repository's: the folders a page may name that git does not hold.
OUTPUTS = {
    "demo/": "the built-in tiny default: ./demo.sh and `01_download/download.py --demo` make it (gitignored)",
    ".venv/": "install.sh makes it (gitignored)",
    "slurm/site.sh": "the site's own settings, which a site copies from slurm/site.example.sh (gitignored)",
}


@cache
def run_outputs():
    """What a run writes in its OUTPUT_DIR (final/, checkpoints/, hang/, ...), as common/run_dir.py names it."""
    source = (REPO / "common/run_dir.py").read_text()
    return set(re.findall(r'self\.path / "([\w.]+)"', source) + re.findall(r'^CHECKPOINTS = "(\w+)"', source, re.M))


# runs/NAME/... and logs/...: every command's output (gitignored). A page may name one only where a
# command writes it: its name appears in a command of that page, or in a script's source (a default
# output folder, such as benchmark/learn_chess.py's runs/learn_chess).
WRITTEN_BY_COMMANDS = ("runs/", "logs/")
# A path: with a slash, or a script's bare name (a bare results.md, gpu_check.json is mostly a command's output).
PATHLIKE = re.compile(r"^[\w.\-]+(/[\w.\-]*)+$|^[\w.\-]+\.(py|sh)$")


def placeholder(path):
    """A path that stands for one the user chooses: OUTPUT_DIR/..., step-NNNNNN, <run>, *.json."""
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part) or re.search(r"N{4,}|X{3,}|rankN", part)
               for part in path.split("/")) or re.search(r"[<>*{}$~]|\.\.\.", path) is not None


@cache
def script_sources():
    return "\n".join((REPO / name).read_text(errors="replace") for name in tracked()
                     if name.endswith((".py", ".sh")) and not name.startswith("tests/"))  # the kit's, not its tests'


def link_texts(prose):
    """The text of each link that reads as a file's name: [benchmark/GPU.md](...) names benchmark/GPU.md."""
    return [text for text in re.findall(r"\[([^\]`]+)\]\(", prose) if re.fullmatch(r"[\w.\-/]+\.\w+", text)]


def missing_paths(page, text=None):
    prose, blocks = prose_and_code(read(page, text))
    in_commands = "\n".join(blocks + [code for code in inline_code(prose) if " " in code])
    missing = []
    for code in sorted(set(inline_code(prose) + link_texts(prose))):
        path = code.removeprefix("./")
        if not PATHLIKE.match(path) or placeholder(path) or path.startswith(("/", "http")) or "//" in path:
            continue
        if path.startswith(WRITTEN_BY_COMMANDS):
            written = "/".join(path.split("/")[:2])
            if written in in_commands or written in script_sources():
                continue
            missing.append(f"{page}: `{code}`: no command on this page or in the kit writes {written}")
            continue
        first = path.split("/")[0]
        if any(path.startswith(output) or path + "/" == output for output in OUTPUTS) or first in run_outputs():
            continue
        if re.fullmatch(r"[\w\-]+/[\w.\-]+", path) and not exists(first):  # codellama/CodeLlama-7b-hf: a model's id
            continue
        here = os.path.normpath(Path(page).parent / path)
        if exists(path) or exists(here) or ("/" not in path and any(Path(name).name == path for name in tracked())):
            continue
        missing.append(f"{page}: `{code}`: not in the repository")
    return missing


def test_each_file_or_folder_a_page_names_exists():
    missing = [line for page in pages() for line in missing_paths(page)]
    assert missing == [], "\n".join(missing)


# --- figures that more than one page states ------------------------------------------------------

class Figure:
    """A measured figure that several pages state: `in_text` finds it, as the number in its first
    group, in a sentence (or table row, or command line) of any page that `about` matches (where
    given); `limit` (file, pattern) a budget that the figure must not exceed."""

    def __init__(self, in_text, about=None, limit=None):
        self.in_text, self.about, self.limit = re.compile(in_text), about and re.compile(about), limit


FIGURES = {
    "the GPU check's minutes": Figure(r"(?:in|up to|after) (\d+) minutes|(\d+) minutes on a GPU node",
                                      about=r"gpu_check|GPU check|--time_limit",
                                      limit=("slurm/gpu_check.sh", r"--time=00:(\d+):00")),
    "the suite's minutes on 2 cores": Figure(r"about (\d+) minutes on 2 cores", about=r"test\.sh|suite",
                                             limit=("pyproject.toml", r"the suite must stay within (\d+) minutes")),
    "the learning run's legal moves (%)": Figure(r"^\| \*\*all\*\* \| 1,000 \| \*\*([\d.]+)%\*\*"),
    "the learning run's seconds": Figure(r"800 steps (?:of 16 games, 4\.3M tokens, |in )(\d+) s\b"),
}
# $KIT_DIR/.venv (the site file's form) is the same folder as .venv
FIGURES["the kit's environment (the folder install.sh makes)"] = Figure(r"source \"?(?:\$\w+/)?(\S+?)/bin/activate")
FIGURE_FILES = tuple(name for name in sorted(tracked()) if name.endswith(".sh"))  # the scripts' comments state them too


def sentences(text):
    """A page's sentences (whitespace made single), table rows and code lines, one per item."""
    prose, blocks = prose_and_code(text)
    items = [line for block in blocks for line in block.splitlines()]
    for paragraph in re.split(r"\n\s*\n", prose):
        rows = [line for line in paragraph.splitlines() if line.lstrip().startswith("|")]
        items += rows
        rest = " ".join(line.strip() for line in paragraph.splitlines() if line not in rows)
        items += re.split(r"(?<=[.;!?])\s+(?=[A-Z`(*\[])", rest)
    return items


def stated(figure):
    """{value: [page, ...]} where the pages state the figure."""
    values = {}
    for name in pages() + list(FIGURE_FILES):
        for sentence in sentences((REPO / name).read_text()):
            if figure.about and not figure.about.search(sentence):
                continue
            for match in figure.in_text.finditer(sentence):
                value = next(group for group in match.groups() if group)
                values.setdefault(value, []).append(name)
    return values


@pytest.mark.parametrize("name", FIGURES)
def test_a_figure_that_several_pages_state_is_the_same_on_each(name):
    values = stated(FIGURES[name])
    assert values, f"no page states {name} any more: take it out of FIGURES"
    assert len(values) == 1, f"{name} differs: " + "; ".join(
        f"{value} in {', '.join(sorted(set(where)))}" for value, where in values.items())
    if FIGURES[name].limit:
        file, pattern = FIGURES[name].limit
        limit = re.search(pattern, (REPO / file).read_text())
        value = float(next(iter(values)))
        assert limit, f"{file} no longer says ({pattern})"
        assert value <= float(limit.group(1)), f"{name}: the pages say {value}, over {file}'s {limit.group(1)}"


def test_the_tests_page_names_every_test_file():
    named = (REPO / "tests/README.md").read_text()
    unnamed = sorted(Path(name).name for name in tracked()
                     if re.fullmatch(r"tests/test_\w+\.py", name) and Path(name).name not in named)
    assert unnamed == [], f"tests/README.md does not name {', '.join(unnamed)}"
