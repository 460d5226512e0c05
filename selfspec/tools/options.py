"""Value types for infer.py's options: argparse calls them on the text given, and what they refuse becomes
``infer.py costs: error: argument --sizes: expected comma-separated integers >= 1, found '0,x'`` (the option named,
exit code 2) before anything loads."""

from __future__ import annotations

import argparse
from typing import Callable


def _range(low: int, high: int | None) -> str:
    return f">= {low}" if high is None else f"from {low} to {high}"


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer from low to high (no upper bound when high is None)."""
    def parse(text: str) -> int:
        value = int(text) if text.strip().lstrip("-").isdigit() else None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected an integer {_range(low, high)}, found {text!r}")
        return value
    return parse


def integers(low: int) -> Callable[[str], tuple[int, ...]]:
    """Comma-separated integers, each >= low, at least one."""
    def parse(text: str) -> tuple[int, ...]:
        pieces = [p.strip() for p in text.split(",")]
        if not all(p.lstrip("-").isdigit() and int(p) >= low for p in pieces):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers {_range(low, None)}, found {text!r}")
        return tuple(int(p) for p in pieces)
    return parse


def number(low: float, high: float) -> Callable[[str], float]:
    """A number from low to high."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not low <= value <= high:  # nan fails too
            raise argparse.ArgumentTypeError(f"expected a number from {low} to {high}, found {text!r}")
        return value
    return parse


def probabilities(text: str) -> tuple[float, ...]:
    """Comma-separated probabilities, each 0 <= p < 1, at least one ('0,0.05' -> (0.0, 0.05))."""
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        values = (float("nan"),)
    if not all(0 <= v < 1 for v in values):  # nan fails too
        raise argparse.ArgumentTypeError(f"expected comma-separated probabilities from 0 to below 1, found {text!r}")
    return values


def names(text: str) -> tuple[str, ...]:
    """Comma-separated names ('fp32, bf16' -> ('fp32', 'bf16')), blanks dropped. (Lists of drafts: their options hold
    commas too, ``selfspec.registry.split_drafts``.)"""
    return tuple(p for p in (s.strip() for s in text.split(",")) if p)
