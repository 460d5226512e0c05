"""Files a checkpoint or a run is made of: JSON objects read with errors that name the file, text written
atomically (a reader never sees half a file)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A checkpoint's JSON config as a dict; corrupt JSON or another JSON type fails naming ``what`` and the file."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} ({path}) is not valid JSON: {err}; the file is corrupt, save or download it again") from err
    if not isinstance(data, dict):
        raise ValueError(f"{what} ({path}) should hold a JSON object, found {type(data).__name__}")
    return data
