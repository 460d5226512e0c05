"""Loading the training recipe (heads/training/config.py): YAML plus ``key=value`` / ``a.b=value`` overrides, checked
strictly by selfspec's one config checker (selfspec/core/typed.py), and the help that lists every key.

Overrides are parsed as YAML scalars (``3``, ``1e-3``, ``true``, ``null``, ``[a, b]``), except that a field typed
``str`` keeps the text as written. No exec, no eval. An unknown key fails with the closest known names ("did you mean
'optim.max_steps'?"), a wrong type with what was expected and what was found.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any, Sequence

import yaml

from heads.training.config import TrainConfig
from selfspec.core import typed


# ------------------------------------------------------------------------------------------------ strict loading
RECIPE = typed.Wording(unknown="unknown key {key!r}{hint} (expected one of {known} {section})")
"""how the recipe words its errors: dotted keys as the user typed them, and the key they probably meant."""


def apply_overrides(data: dict, overrides: Sequence[str], cls: type = None) -> dict:
    """``a.b=value`` strings applied to a nested dict (a copy). Values are YAML scalars unless the field is a str or
    one of a list of words."""
    cls = cls or TrainConfig
    data = yaml.safe_load(yaml.safe_dump(data)) or {}  # a deep copy
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value (e.g. optim.lr=3e-4)")
        path = key.strip().split(".")
        tp = typed.field_type(cls, path)
        if (tp in (str, str | None) or typed.string_choices(tp)) and text.strip() not in ("null", "~", ""):
            value = text  # a str field keeps what was written ("001" stays "001", mixed_precision=no stays 'no')
        else:
            try:
                value = yaml.safe_load(text) if text.strip() else None
            except yaml.YAMLError as err:
                raise ValueError(f"override {item!r}: expected a YAML value (3, 1e-3, true, null, [a, b], ...), found "
                                 f"{text!r}, which YAML cannot read: {yaml_problem(err)}") from err
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {'.'.join(path[: i + 1])} is {child!r}, not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The recipe at ``path`` (YAML; None: all defaults) with ``key=value`` overrides applied, checked strictly."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: expected a YAML mapping of recipe sections, found text YAML cannot read: "
                             f"{yaml_problem(err)}") from err
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a YAML mapping of recipe sections, found {type(data).__name__}")
    return typed.from_dict(TrainConfig, apply_overrides(data, overrides), where="", wording=RECIPE, text_floats=True)


def yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's own problem and where it is, on one line (its message spans several, quoting the text)."""
    if not isinstance(err, yaml.MarkedYAMLError):
        return " ".join(str(err).split())

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    text = f"{err.problem or 'invalid YAML'}" + (f" at {at(err.problem_mark)}" if err.problem_mark else "")
    if err.context:
        text += f" ({err.context}" + (f" that starts at {at(err.context_mark)}" if err.context_mark else "") + ")"
    return text


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its one-line docstring (read from the source), for --help."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def describe(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """One line per leaf field: dotted name, type, default, docstring (what ``train.py --help`` prints)."""
    lines = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.extend(describe(tp, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  {prefix}{f.name} ({typed.type_name(tp)}, default {default!r}): {docs.get(f.name, '')}")
    return lines
