"""Every command and example in README.md and docs/*.md runs here, so the docs cannot drift
from what pyplan does.

A guide's blocks run in order in a working directory of its own that holds a copy of plans/
(the commands are written for the repository's root) and the source folder pyplan/, as the
root does; README.md, the newcomer's guide, runs again in a folder with plans/ alone (the rest
of the suite runs the installed package from elsewhere). By their
fence's language:

- `yaml` or `python` whose first line is `# FILE`: written to FILE for the blocks after it;
  other `yaml` must parse, and a whole plan (`pyplan: 1`) must validate;
- `sh`: run by bash, stopping at the first command that fails;
- `console`: each `$ COMMAND` runs, and what it prints (its output, then its errors) must be the
  lines below it, where `...` stands for anything;
- `python`: run as a script; `pycon`: run as a doctest, the outputs compared;
- `text`: output or a synopsis, not run.

A block that cannot run here (installing into a fresh virtualenv, several machines, hours of
benchmarks) says why on the line before it, `<!-- not run: REASON -->`; there are few.

To keep this quick, `pyplan partition` times each unit once (`--repeats 1`, where the guide gives
no --repeats): what it prints is the same but for the figures; and `torchrun` is torch's
launcher with warm workers (tests/warm_torchrun.py: forked from a process that has imported
torch, each running the script as under torchrun), not a new interpreter per worker.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import PLANS, ROOT

GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"sh", "console", "python", "pycon", "yaml", "text"}
MAX_NOT_RUN = 5  # blocks marked <!-- not run: ... --> in all the guides together
README_LINES = 300
SLOW_GUIDES = {"search.md", "partition.md", "training-loop.md"}  # the longest: `pytest -m slow`
TIMEOUT = 600  # seconds for one command (a torchrun launch takes 5-20)
_FENCE = re.compile(r"^```(\S*)\s*$")
_NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
_FILE = re.compile(r"^# ([\w./-]+\.(?:py|yaml))$")
_CHECK = doctest.OutputChecker()
WARM_TORCHRUN = Path(__file__).resolve().parent / "warm_torchrun.py"


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    """Where its first line is (1-based, the line after the fence)."""
    language: str
    text: str
    not_run: str | None
    """Why it does not run here, or None."""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
        reason = _NOT_RUN.match(lines[i - 1]) if i else None
        found.append(Block(path, i + 2, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           reason.group(1) if reason else None))
        i = end + 1
    return found


def test_every_block_says_what_it_is_and_few_do_not_run():
    every = [b for guide in GUIDES for b in blocks(guide)]
    untagged = [b.where for b in every if b.language not in LANGUAGES]
    assert not untagged, f"fences need one of {sorted(LANGUAGES)}: {untagged}"
    not_run = [f"{b.where}: {b.not_run}" for b in every if b.not_run]
    assert len(not_run) <= MAX_NOT_RUN, "\n".join(not_run)
    for guide in GUIDES:  # a marker that precedes no block would exempt nothing
        text = guide.read_text()
        assert text.count("<!-- not run:") == sum(1 for b in blocks(guide) if b.not_run), guide


def test_readme_is_a_front_page_whose_test_command_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) <= README_LINES
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = [b for b in blocks(ROOT / "README.md") if b.not_run and ".ci/run" in b.not_run]
    assert len(test_command) == 1
    assert test_command[0].text.strip() in ci.split("\n")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_links_lead_somewhere(guide):
    text = re.sub(r"```.*?```", "", guide.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file, _, anchor = target.partition("#")
        linked = (guide.parent / file).resolve() if file else guide
        assert linked.exists(), f"{guide.name}: {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"{guide.name}: {target}"


def _environment() -> dict[str, str]:
    env = dict(os.environ)  # conftest's: the CPU, a cache of our own
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("COLUMNS", None)
    return env


def _quicker(command: str) -> str:
    """The command with less repetition (see the module's docstring)."""
    lines = command.replace("\\\n", " ").split("\n")
    for i, line in enumerate(lines):
        if re.match(r"\s*pyplan partition ", line) and "--repeats" not in line:
            code, hash_, comment = line.partition(" #")
            lines[i] = f"{code.rstrip()} --repeats 1" + (f" #{comment}" if hash_ else "")
        warm = f"{shlex.quote(sys.executable)} {shlex.quote(str(WARM_TORCHRUN))} "
        lines[i] = re.sub(r"^(\s*)torchrun ", lambda m: m[1] + warm, lines[i])
    return "\n".join(lines)


def _run(command: str, cwd: Path, where: str) -> subprocess.CompletedProcess:
    command = _quicker(command)
    try:
        return subprocess.run(["bash", "-c", command], cwd=cwd, env=_environment(), text=True,
                              capture_output=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where}: {command!r} ran over {TIMEOUT} s")


def _sh(block: Block, cwd: Path) -> None:
    done = _run("set -eu\n" + block.text, cwd, block.where)
    assert done.returncode == 0, (f"{block.where}: exit {done.returncode}\n{block.text}\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _commands(block: Block):
    """(command, the output shown below it) of each `$ ` line of a console block."""
    sessions: list[list] = []
    lines = block.text.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + lines[i].strip()
            sessions.append([command, []])
        else:
            assert sessions, f"{block.where}: a console block starts with `$ COMMAND`"
            sessions[-1][1].append(line)
        i += 1
    return [(command, "\n".join(shown).rstrip("\n") + "\n") for command, shown in sessions]


def _console(block: Block, cwd: Path) -> None:
    for command, shown in _commands(block):
        done = _run(command, cwd, block.where)
        printed = done.stdout + ("" if done.stdout.endswith("\n") or not done.stdout else "\n")
        printed += done.stderr
        if "error:" not in shown:  # a session that shows no error shows a success
            assert done.returncode == 0, f"{block.where}: {command}\n{printed[-4000:]}"
        assert _CHECK.check_output(shown, printed, doctest.ELLIPSIS), (
            f"{block.where}: {command}\n--- the guide shows:\n{shown}--- it prints:\n{printed}")


def _python(block: Block, cwd: Path) -> None:
    script = cwd / f"_block_{block.line}.py"
    script.write_text(block.text)
    _sh(Block(block.path, block.line, "sh", f"python {script.name}\n", None), cwd)


def _pycon(block: Block, cwd: Path, namespace: dict) -> None:
    test = doctest.DocTestParser().get_doctest(block.text, namespace, block.where,
                                               str(block.path), block.line - 1)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []
    runner.run(test, out=report.append, clear_globs=False)
    namespace.update(test.globs)  # (the doctest ran in a copy) for the guide's next blocks
    assert runner.failures == 0, "".join(report)


def _yaml(block: Block, cwd: Path) -> None:
    data = yaml.safe_load(block.text)
    if isinstance(data, dict) and data.get("pyplan") == 1:
        from pyplan.problem import build_problem
        from pyplan.planfile import spec_from_text

        build_problem(spec_from_text(block.text, block.where))


@pytest.mark.torchrun
@pytest.mark.parametrize("guide, where", [
    pytest.param(guide, where, marks=[pytest.mark.slow]
                 if guide.name in SLOW_GUIDES or where == "clean" else [])
    for guide in GUIDES
    for where in (("root", "clean") if guide.name == "README.md" else ("root",))],
    ids=lambda x: x.name if isinstance(x, Path) else x)
def test_guide_runs(guide, where, tmp_path, monkeypatch):
    """`root`: the folder is laid out as the repository's root, its source folder pyplan/
    beside plans/ (Python started there imports that folder first, which has no compiled core
    after `pip install .`); `clean`: plans/ alone."""
    shutil.copytree(PLANS, tmp_path / "plans")
    if where == "root":
        (tmp_path / "pyplan").symlink_to(ROOT / "pyplan", target_is_directory=True)
    monkeypatch.chdir(tmp_path)  # the doctests' files are relative to it
    namespace: dict = {}
    for block in blocks(guide):
        if block.not_run or block.language == "text":
            continue
        file = _FILE.match(block.text.split("\n", 1)[0])
        if file and block.language in ("python", "yaml"):
            (tmp_path / file.group(1)).write_text(block.text)
            if block.language == "yaml":
                _yaml(block, tmp_path)
        elif block.language == "sh":
            _sh(block, tmp_path)
        elif block.language == "console":
            _console(block, tmp_path)
        elif block.language == "python":
            _python(block, tmp_path)
        elif block.language == "pycon":
            _pycon(block, tmp_path, namespace)
        elif block.language == "yaml":
            _yaml(block, tmp_path)
