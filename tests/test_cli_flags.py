"""One flag style across every `trace-jax` command and the launch preflight: `--kebab-case`, with the snake_case
spelling of every multi-word flag accepted as an alias (the spelling the training commands used before)."""

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from trace_jax.cli import COMMANDS, build_parser

KEBAB = re.compile(r"--[a-z0-9]+(?:-[a-z0-9]+)*")
REPO = Path(__file__).resolve().parents[1]


def _sub_parsers(parser: argparse.ArgumentParser):
    """(prog, parser) for `parser` and every sub-command parser below it."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _sub_parsers(sub)


def _flag_problems(parser: argparse.ArgumentParser) -> list[str]:
    problems = []
    for prog, sub in _sub_parsers(parser):
        for action in sub._actions:
            long = [o for o in action.option_strings if o.startswith("--")]
            if not long or isinstance(action, argparse._HelpAction):
                continue
            kebab = long[0]
            expected = list(dict.fromkeys([kebab, "--" + kebab[2:].replace("-", "_")]))
            if not KEBAB.fullmatch(kebab):
                problems.append(f"{prog}: {kebab} is not --kebab-case (list the kebab spelling first)")
            elif long != expected:
                problems.append(f"{prog}: {' '.join(long)} should be exactly {' '.join(expected)}")
    return problems


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_flag_is_kebab_case_with_its_snake_case_alias(command):
    parser = build_parser([command])
    assert _flag_problems(parser) == []


def test_the_launch_preflight_uses_the_same_flag_style():
    check = sys.modules.get("launch_check")  # loaded already by tests/launch
    if check is None:
        spec = importlib.util.spec_from_file_location("launch_check", REPO / "launch" / "check.py")
        check = sys.modules["launch_check"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
        spec.loader.exec_module(check)
    assert _flag_problems(check.build_parser()) == []


@pytest.mark.parametrize("spelling", ["--run-dir", "--run_dir"])
def test_both_spellings_set_the_same_argument(spelling):
    args = build_parser(["eval"]).parse_args(["eval", spelling, "runs/x"])
    assert args.run_dir == "runs/x"


def test_a_snake_case_flag_without_its_kebab_spelling_is_reported():
    parser = argparse.ArgumentParser(prog="demo")
    parser.add_argument("--gin_file")
    parser.add_argument("--run-dir")
    assert _flag_problems(parser) == ["demo: --gin_file is not --kebab-case (list the kebab spelling first)",
                                      "demo: --run-dir should be exactly --run-dir --run_dir"]
