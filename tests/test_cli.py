"""The `trace-jax` dispatcher and the commands the README's demo runs."""

import pathlib
import shlex
import subprocess
import sys

import pytest

from trace_jax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_listed_command_exists_and_parses_help(capsys):
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            cli.main([name, "--help"])
        assert exit_info.value.code == 0
        assert name in capsys.readouterr().out


def test_the_command_list_imports_only_the_standard_library():
    """`trace-jax --help` (and a typo) answer at once: a sub-command's module, and JAX, load only when named."""
    code = ("import sys\nfrom trace_jax import cli\ncli.build_parser([])\n"
            "print(sorted(m for m in ('jax', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["no-such-command"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_script_is_valid_bash_and_its_commands_parse(tmp_path):
    script = ROOT / "scripts" / "demo.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    commands = [line.strip() for line in script.read_text().splitlines() if line.strip().startswith("trace-jax ")]
    assert len(commands) == 3
    for command in commands:
        argv = shlex.split(command.replace('"$out', f'"{tmp_path}'))[1:]
        args = cli.build_parser(argv).parse_args(argv)
        assert args.command == argv[0]
