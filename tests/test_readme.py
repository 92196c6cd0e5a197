"""The README's promises: its two set-up commands, and that every command of its tour exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantkit.cli import cli

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:sh|console|bash)?\n(.*?)```", text, flags=re.S)


def test_first_lines_give_exactly_the_two_setup_commands():
    first = code_blocks(README)[0]
    commands = [line.split("#")[0].strip() for line in first.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    assert README.index("make demo") < 400


def test_makefile_and_ci_keep_the_promise():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()


TOUR = [line.split("#")[0].strip() for block in code_blocks(README)[1:] for line in block.splitlines()
        if line.startswith("quantkit ")]


@pytest.mark.parametrize("line", TOUR)
def test_tour_commands_exist_and_name_real_configs(line):
    argv = shlex.split(line)[1:]
    command = [a for a in argv if not a.startswith("-")][:1]
    result = CliRunner().invoke(cli, [*command, "--help"])
    assert result.exit_code == 0, result.output
    for arg in argv:
        if arg.endswith(".yaml"):
            assert (REPO / arg).is_file(), arg


def test_docs_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith("http"):
            assert (REPO / target).exists(), target
