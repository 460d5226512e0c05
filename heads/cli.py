"""What the heads.* command-line tools share: a user's mistake as one ``error:`` line (exit 2, no traceback), option
types that name the option they check, and output directories that are refused when they hold something else.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Callable

from selfspec.tools.options import integer

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, TypeError)
"""what a wrong argument, path or checkpoint raises: reported in one line, never as a traceback."""


def one_line(err: BaseException | str) -> str:
    """The message on one line (a library's multi-line message joined with '; ')."""
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


def report_errors(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a tool's ``main``: USER_ERRORS become ``error: <message>`` on stderr and exit status 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except USER_ERRORS as err:
            print(f"error: {one_line(err)}", file=sys.stderr)
            return 2

    return wrapped


positive_int = integer(1)
"""argparse type: a whole number >= 1 (argparse names the option in its message)."""


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, found {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, found {value}")
    return value


# ------------------------------------------------------------------------------------------- output directories
def _config(directory: Path) -> dict:
    try:
        data = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe(directory: Path) -> str:
    """What a directory holds, in words ("a selfspec medusa checkpoint", "a transformers model directory", ...)."""
    directory = Path(directory)
    if not directory.exists():
        return "nothing (it does not exist)"
    if not directory.is_dir():
        return "a file, not a directory"
    entries = sorted(p.name for p in directory.iterdir())
    if not entries:
        return "nothing (an empty directory)"
    config = _config(directory)
    if isinstance(config.get("draft_type"), str):
        return f"a selfspec {config['draft_type']} checkpoint"
    if config.get("model_type") == "medusa" and "MedusaModel" in (config.get("architectures") or []):
        return "a vLLM Medusa export"
    if "medusa_num_heads" in config or any(n.startswith("medusa_lm_head.") for n in entries):
        return "a FasterDecoding Medusa checkpoint"
    if "model_type" in config or "architectures" in config:
        return "a transformers model directory"
    if "progress.json" in entries and any(n.startswith("random_states_") for n in entries):
        return "a selfspec training checkpoint"
    if "checkpoints" in entries or "metrics.jsonl" in entries:
        return "a selfspec training run"
    if "state.json" in entries and "dataset_info.json" in entries:
        return "a datasets directory"
    if "distill.json" in entries:
        return "a heads.distill run"
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    return f"{len(entries)} other file(s) ({shown})"


def is_draft_checkpoint(directory: Path, draft_type: str) -> bool:
    """A selfspec checkpoint of this draft_type (config.json says so)."""
    return _config(Path(directory)).get("draft_type") == draft_type


def check_output(out: Path, ours: Callable[[Path], bool], wanted: str, option: str = "the output directory") -> None:
    """Refuse an ``out`` that exists and is not empty unless ``ours(out)`` (it already is this tool's kind of
    output, ``wanted`` in words), so a tool never overwrites files that are not its own."""
    out = Path(out).expanduser()
    if not out.exists():
        return
    if not out.is_dir():
        raise NotADirectoryError(f"{option} {out} is a file; expected a directory to write {wanted} into: choose "
                                 "another path or delete it")
    if not any(out.iterdir()) or ours(out):
        return
    raise ValueError(f"{option} {out} already holds {describe(out)}, not {wanted}; writing there would overwrite its "
                     "files: choose another path or delete it")


def dtype_name(text: str) -> str:
    """argparse type: a dtype name selfspec.core.models knows (float32, fp32, bfloat16, bf16, ...), kept as given."""
    from selfspec.core.models import parse_dtype

    try:
        parse_dtype(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def check_source(source: str | None) -> None:
    """A --source that is a local path must exist: said before any model loads, naming the option."""
    from selfspec.core.models import looks_local

    if source is not None and looks_local(source) and not Path(source).expanduser().exists():
        raise FileNotFoundError(f"--source {source}: no such file or directory; expected 'sharegpt', a "
                                ".json/.jsonl/.parquet file, a save_to_disk directory or a Hub dataset id")
