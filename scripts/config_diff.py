"""Check that editing the shipped gin files changed no run's resolved config.

    python scripts/config_diff.py [--against REV]     (default REV: main)

Extracts `configs/` of git revision REV into a temporary directory and resolves the same runs from it and from this
checkout's `configs/` with this checkout's code (`gin_setup.parse`), then prints every field that differs and exits
1 if any does. The runs: every top-level `configs/*.gin` that parses on its own, alone and followed by each
`configs/credit/*.gin` (how studies combine them). Use it before committing a gin edit that should only drop
restated defaults: both sides must resolve to equal `RunConfig`s.

This script knows gin_setup's `parse` and git; it runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from trace_jax.rl.gin_setup import ConfigError, RunConfig, parse  # noqa: E402


@contextlib.contextmanager
def _working_directory(path: Path):
    # gin_setup resolves `include 'configs/...'` against the working directory first
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def runs(root: Path) -> list[tuple[str, ...]]:
    """The gin file lists (relative to `root`) whose resolved configs are compared."""
    credit = sorted(str(p.relative_to(root)) for p in (root / "configs" / "credit").glob("*.gin"))
    tops = sorted(str(p.relative_to(root)) for p in (root / "configs").glob("*.gin"))
    return [(top,) for top in tops] + [(top, method) for top in tops for method in credit]


def resolve(root: Path, files: tuple[str, ...]) -> RunConfig | str:
    """The `RunConfig` of `files` resolved under `root`, or the error text when they do not parse."""
    with _working_directory(root):
        try:
            return parse(list(files))
        except ConfigError as error:
            return f"error: {str(error).replace(str(root), '<root>')}"


def differences(old: RunConfig | str, new: RunConfig | str) -> list[str]:
    """`concern.field: old -> new` for every field that differs, or the error when only one side fails (a file
    that is no run on its own, e.g. base.gin, fails on both)."""
    if isinstance(old, str) and isinstance(new, str):
        return []
    if isinstance(old, str) or isinstance(new, str):
        return [f"{old!r} -> {new!r}"]
    out = []
    for concern in dataclasses.fields(RunConfig):
        a, b = dataclasses.asdict(getattr(old, concern.name)), dataclasses.asdict(getattr(new, concern.name))
        out += [f"{concern.name}.{key}: {a.get(key)!r} -> {b.get(key)!r}" for key in sorted(a.keys() | b.keys())
                if a.get(key) != b.get(key)]
    return out


def compare_trees(old_root: Path, new_root: Path) -> dict[tuple[str, ...], list[str]]:
    """Runs present in both trees -> their differences (only runs that differ; files only in one tree are
    skipped)."""
    old_runs, new_runs = set(runs(old_root)), runs(new_root)
    report = {}
    for files in new_runs:
        if files not in old_runs:
            continue
        diff = differences(resolve(old_root, files), resolve(new_root, files))
        if diff:
            report[files] = diff
    return report


def extract_configs(rev: str, into: Path) -> Path:
    """`configs/` of git revision `rev` extracted under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar", rev, "configs"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="main", help="git revision whose configs/ is the reference")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = compare_trees(extract_configs(args.against, Path(tmp)), REPO_ROOT)
    compared = len(runs(REPO_ROOT))
    for files, diff in report.items():
        print(" + ".join(files))
        for line in diff:
            print(f"    {line}")
    print(f"{compared} runs compared against {args.against}: {len(report)} differ")
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main())
