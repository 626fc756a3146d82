"""The Python examples in README.md and docs/*.md run as written (docs that lie are worse than none).

Every ```python block is executed in a fresh namespace inside a temporary directory. Signature listings and
pseudo-code belong in ```text blocks, which are not run.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _examples():
    for path in DOCS:
        if path.exists():
            for number, match in enumerate(BLOCK.finditer(path.read_text()), start=1):
                yield pytest.param(match.group(1), id=f"{path.name}-{number}")


@pytest.mark.parametrize("code", list(_examples()))
def test_documented_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
