"""Package layers: `trace_jax.scoring` and `trace_jax.serve` sit below `trace_jax.abc` and never import it; the
`trace-jax` dispatcher composes ABC's parts into their commands (`trace_jax.cli.EXTENSIONS`)."""

import argparse
import ast
import importlib
import inspect
import pathlib

import pytest

from trace_jax import cli

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "trace_jax"
LOWER = ("scoring", "serve")
UPPER = "trace_jax.abc"


def imported_modules(source: str, path: pathlib.Path) -> set[str]:
    """Every module an `import` or `from ... import` statement anywhere in `source` (the text of the module file
    `path`) names, function-level imports included, relative ones resolved against the file's package; for
    `from X import y` both `X` and `X.y` (y may be a module)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = list(package[: len(package) - node.level + 1]) if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def names_abc(names: set[str]) -> list[str]:
    return sorted(n for n in names if n == UPPER or n.startswith(UPPER + "."))


@pytest.mark.parametrize("source, imports_abc", [
    ("import trace_jax.abc", True), ("from trace_jax.abc.rules import x", True), ("from trace_jax import abc", True),
    ("def f():\n    from trace_jax.abc import counts_to_arrays", True), ("from .. import abc", True),
    ("from ..abc.judge import y", True), ("import trace_jax.abcd", False),
    ("from collections.abc import Mapping", False), ("from trace_jax.credit import abc_step_rewards", False),
    ("from . import fork", False)])
def test_the_import_check_sees_every_way_of_importing_abc(source, imports_abc):
    assert bool(names_abc(imported_modules(source, PACKAGE / "scoring" / "probe.py"))) == imports_abc


@pytest.mark.parametrize("package", LOWER)
def test_scoring_and_serve_never_import_abc(package):
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files
    offenders = {str(f.relative_to(PACKAGE.parent)): names_abc(imported_modules(f.read_text(encoding="utf-8"), f))
                 for f in files}
    assert {f: names for f, names in offenders.items() if names} == {}


def test_every_extension_gives_keywords_its_command_run_takes():
    for command, (module_name, function) in cli.EXTENSIONS.items():
        assert command in cli.COMMANDS
        extras = getattr(importlib.import_module(module_name), function)()
        run = importlib.import_module(cli.COMMANDS[command][0]).run
        assert extras and set(extras) <= set(inspect.signature(run).parameters)


def test_credit_without_the_dispatcher_refuses_abc_estimators_naming_the_command(tmp_path, capsys):
    from trace_jax.scoring import cli as credit_cli

    records = tmp_path / "in.jsonl"
    records.write_text("{}\n")
    assert credit_cli.main([str(records), "--reference", str(tmp_path), "--out", str(tmp_path / "out"),
                            "--estimator", "abc_grpo"]) == 2
    assert "run it as `trace-jax credit`" in capsys.readouterr().err


def test_serve_gets_the_scripted_judge_from_the_dispatcher(monkeypatch, capsys):
    import uvicorn

    from trace_jax.abc.judge import scripted_rubric_reply
    from trace_jax.serve import app, cli as serve_cli

    served = []
    real_create_app = app.create_app
    monkeypatch.setattr(app, "create_app", lambda backend, config: served.append(backend) or real_create_app(
        backend, config))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    assert cli.main(["serve", "--scripted-judge", "--port", "8123"]) == 0
    assert served[0].respond is scripted_rubric_reply and served[0].name == "scripted-judge"
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert serve_cli.run(parser.parse_args(["--scripted-judge"])) == 2  # alone, it has no judge to serve
    assert "--scripted-judge needs" in capsys.readouterr().err
