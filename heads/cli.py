"""What the heads.* command-line tools share: a user's mistake as one ``error:`` line (exit 2, no traceback), and
option types that name the option they check. (An output directory that holds something else is refused by
heads/checkpoints/contents.py.)
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Callable

from selfspec.core.models import looks_local, parse_dtype
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


def dtype_name(text: str) -> str:
    """argparse type: a dtype name selfspec.core.models knows (float32, fp32, bfloat16, bf16, ...), kept as given."""
    try:
        parse_dtype(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def check_source(source: str | None) -> None:
    """A --source that is a local path must exist: said before any model loads, naming the option."""
    if source is not None and looks_local(source) and not Path(source).expanduser().exists():
        raise FileNotFoundError(f"--source {source}: no such file or directory; expected 'sharegpt', a "
                                ".json/.jsonl/.parquet file, a save_to_disk directory or a Hub dataset id")
