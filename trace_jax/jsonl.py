"""Reading JSONL files record by record, with errors that name the file and the line.

Host-side helper shared by the corpus reader and the dataset importers; it knows nothing about what the records
mean (callers check their fields).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator


def read_jsonl(path: str | os.PathLike, *, error: type[Exception] = ValueError) -> Iterator[tuple[str, Any]]:
    """Yield `(where, record)` for each non-blank line of `path`, `where` being `"PATH:LINE"` (lines count from 1).

    Raises `error` when the file is missing or a line is not valid JSON. A record may be any JSON value; callers
    check its shape and report problems with `where`.
    """
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: file not found.")
    with path.open("r", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON "
                            "value.") from None
            yield where, record
