"""The command line's help and the guides agree: every option of every command has help text
and is shown by --help (but for testing aids), is named in README.md or docs/*.md, and every
option a guide gives a command (in a command line or a synopsis, with its metavar) is that
command's; the same for the scripts in benchmarks/ and docs/benchmarks.md. `pyplan --help`
names every export format."""

from __future__ import annotations

import argparse
import re

import pytest

from conftest import ROOT
from pyplan.cli.main import _parser

GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TESTING_AIDS = {("run", "--perturb")}  # hidden from --help on purpose
_FENCE = re.compile(r"^```(\S*)\s*$")


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


COMMANDS = _commands()


def _docs() -> str:
    return "\n".join(path.read_text() for path in GUIDES)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o != "-h"
            and o != "--help"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_and_is_shown(command):
    for option, action in _options(COMMANDS[command]).items():
        if (command, option) in TESTING_AIDS:
            continue
        assert action.help and action.help != argparse.SUPPRESS, \
            f"pyplan {command} {option} has no help" if not action.help else \
            f"pyplan {command} {option} is hidden from --help"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_is_in_the_guides(command):
    docs = _docs()
    missing = []
    for action in {id(a): a for a in _options(COMMANDS[command]).values()}.values():
        if any((command, o) in TESTING_AIDS for o in action.option_strings):
            continue
        if not any(re.search(re.escape(o) + r"(?![\w-])", docs) for o in action.option_strings):
            missing.append("/".join(action.option_strings))
    assert not missing, f"pyplan {command}: no guide names {missing}"


def _command_lines():
    """(where, command, the text after `pyplan COMMAND`) of each command line in a guide's
    code blocks (backslash continuations joined; in a `text` synopsis, its indented lines too)
    and in its inline code."""
    pattern = re.compile(r"(?:^|[\s$(])pyplan (\w+)((?: [^;&`#]*)?)")
    for path in GUIDES:
        lines = path.read_text().split("\n")
        language, i = None, 0
        while i < len(lines):
            line, start = lines[i], i
            fence = _FENCE.match(line)
            if fence:
                language = None if language is not None else fence.group(1)
            elif language is not None:
                text = line
                while i + 1 < len(lines) and (text.endswith("\\") or (
                        language == "text" and "pyplan " in line
                        and re.match(r"^\s+[-\[]", lines[i + 1]))):
                    i += 1
                    text = text.rstrip("\\") + " " + lines[i].strip()
                for found in pattern.finditer(text):
                    yield f"{path.name}:{start + 1}", found.group(1), found.group(2)
            else:
                for code in re.findall(r"`([^`]+)`", line):
                    for found in pattern.finditer(code):
                        yield f"{path.name}:{start + 1}", found.group(1), found.group(2)
            i += 1


def test_every_option_a_guide_gives_a_command_is_its_own():
    wrong = []
    for where, command, rest in _command_lines():
        if command not in COMMANDS:
            continue  # (prose: "pyplan plans and runs ...")
        options = _options(COMMANDS[command])
        rest = re.split(r" \| (?!-)", rest)[0]  # a shell pipe (`a|b`, `| --x`: alternatives)
        tokens = rest.replace("[", " ").replace("]", " ").replace("|", " ").split()
        for k, token in enumerate(tokens):
            name = token.split("=")[0]
            if not re.fullmatch(r"--[a-z][\w-]*", name) or name == "--help":
                continue
            if name not in options:
                wrong.append(f"{where}: pyplan {command} has no {name}")
                continue
            action = options[name]
            shown = tokens[k + 1] if k + 1 < len(tokens) else ""
            metavar = action.metavar if isinstance(action.metavar, str) else None
            if metavar and re.fullmatch(r"[A-Z][A-Z_.:,]*", shown) and shown != metavar:
                wrong.append(f"{where}: pyplan {command} {name} {shown}, --help says {metavar}")
    assert not wrong, "\n".join(wrong)


def test_the_top_level_help_names_every_export_format():
    from pyplan.cli import export
    from pyplan.export import FORMATS

    assert list(FORMATS) == [*export.FORMATS, *export.LAYOUTS]
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    said = next(c.help for c in sub._choices_actions if c.dest == "export")
    assert all(name in said for name in FORMATS), said
    assert all(name in COMMANDS["export"].format_help() for name in FORMATS)


def _benchmark_options() -> dict[str, set[str]]:
    """Each benchmark script's options, read from its source (its argparse calls)."""
    out = {}
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        text = script.read_text()
        calls = re.findall(r"add_argument\(\s*\"(--[\w-]+)\"((?:[^()]|\([^()]*\))*)\)", text)
        out[script.name] = {name for name, rest in calls if "argparse.SUPPRESS" not in rest}
    return out


def test_every_benchmark_option_is_in_the_benchmarks_guide_and_no_other():
    guide = (ROOT / "docs" / "benchmarks.md").read_text()
    options = _benchmark_options()
    missing = [f"{script} {o}" for script, found in options.items() for o in sorted(found)
               if not re.search(rf"{re.escape(script)}.*{re.escape(o)}(?![\w-])", guide)]
    assert not missing, f"docs/benchmarks.md names no {missing}"
    wrong = []
    for path in GUIDES:
        for script, rest in re.findall(r"benchmarks/(\w+\.py)((?: --?[\w-]+(?: [\w.,]+)?)*)",
                                       path.read_text()):
            for name in re.findall(r"--[\w-]+", rest):
                if name not in options.get(script, set()):
                    wrong.append(f"{path.name}: benchmarks/{script} has no {name}")
    assert not wrong, "\n".join(wrong)
