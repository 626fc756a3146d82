"""`trace_jax.train` is the device core of training (loss, step, state, optimizer, checkpoints, distribution,
FLOPs): no module of it imports the RL application or what only the application needs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trace_jax.train

CORE = sorted(Path(trace_jax.train.__file__).parent.glob("*.py"))
FORBIDDEN = ("trace_jax.rl", "trace_jax.rollout", "trace_jax.envs", "trace_jax.scoring", "trace_jax.data",
             "trace_jax.plan")


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree`, at any depth (function-level imports too); `from a import b`
    yields `a.b`, so a subpackage imported by name from its parent is caught."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def test_the_core_package_has_its_modules():
    assert {p.stem for p in CORE} >= {"loss", "step", "state", "optimizer", "checkpoint", "distributed", "flops",
                                      "config"}


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_the_training_core_imports_nothing_from_the_rl_application_rollouts_envs_scoring_or_data(path):
    for line, module in _imported_modules(ast.parse(path.read_text(encoding="utf-8"))):
        bad = [f for f in FORBIDDEN if module == f or module.startswith(f + ".")]
        assert not bad, f"trace_jax/train/{path.name}:{line} imports {module}; the core must not depend on {bad[0]}"
