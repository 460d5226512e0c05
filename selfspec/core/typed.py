"""Typed, strict configs: the one checker every config dataclass of selfspec and heads uses.

A config is a dataclass whose fields carry type hints. ``from_dict`` builds one from a mapping (a JSON config, a YAML
recipe) strictly: an unknown key, a missing required key (a field without a default) and a value of the wrong type
raise, each message saying what was expected and what was found; nested dataclass fields read nested mappings.
``check`` runs the same type checks on an instance (a dataclass's ``__post_init__`` calls it), so a config built in
code is held to the same types as one read from a file.

Types understood: ``bool``, ``int`` (not a bool), ``float`` (an int is taken and stored as a float), ``str``, ``Path``
(text is taken and stored as a Path),
``X | None``, ``Literal[...]``, ``list[X]``, ``tuple[X, ...]`` (a list or tuple, stored as a tuple), ``dict`` (any
mapping, stored as a dict), nested dataclasses, and ``Any``.

How the messages are worded is the config's own (``Wording``): the recipe says ``optim.lr: expected float, found str
'abc'`` and suggests the key meant, a head's config ``unknown MedusaConfig keys [...]``, a layer-skip config
``num_hidden_layers must be int, found str '4'``. Only the words differ; what is checked is the same for all.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Literal, Mapping, Sequence, TypeVar

T = TypeVar("T")
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


@dataclass(frozen=True)
class Wording:
    """How a family of configs words its errors. Each template is a ``str.format`` string; the fields it may use:

    - ``unknown``: ``name`` (the class's name), ``where`` (the section's dotted path), ``key`` (the first unknown key,
      dotted), ``unknown`` (every unknown key, sorted), ``known`` (the keys, in field order), ``hint`` ("; did you
      mean 'x'?" or ""), ``section`` ("in section 'optim'" / "at the top level");
    - ``missing``: ``name``, ``where``, ``missing`` (the missing required keys, sorted);
    - ``wrong_type``: ``where`` (the field's dotted path), ``expected`` (the type in words), ``found`` (``found``
      filled in: ``type`` the value's type name, ``value`` the value's repr, at most 80 characters).
    """

    unknown: str = "unknown {name} keys {unknown}; expected a subset of {known}"
    missing: str = "{name} is missing required keys {missing}"
    wrong_type: str = "{where}: expected {expected}, found {found}"
    found: str = "{type} {value}"
    type_error: type[Exception] = ValueError
    """raised for a value of the wrong type (unknown and missing keys raise ValueError)."""


WORDING = Wording()
"""the default: a head's config (``unknown MedusaConfig keys [...]``, ``MedusaConfig.num_heads: expected int, ...``)."""


def from_dict(cls: type[T], data: Mapping[str, Any], where: str | None = None, wording: Wording = WORDING,
              text_floats: bool = False) -> T:
    """Build dataclass ``cls`` from a (nested) mapping, strictly.

    where: the dotted path of ``cls`` in messages (a recipe section: "optim"; a head's config: its class name, the
    default; "" for none). text_floats: a float field also takes text in scientific notation ("1e-4", which YAML 1.1
    reads as a string)."""
    where = cls.__name__ if where is None else where
    hints = _hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    prefix = f"{where}." if where else ""
    unknown = [key for key in data if key not in known]
    if unknown:
        first = str(unknown[0])
        close = [prefix + c for c in difflib.get_close_matches(first, known, n=3, cutoff=0.6)]
        close += [p for p in leaf_paths(cls, prefix) if p.rsplit(".", 1)[-1] == first]  # a key in the wrong section
        raise ValueError(wording.unknown.format(
            name=cls.__name__, where=where, key=prefix + first, unknown=sorted(map(str, unknown)), known=known,
            hint=f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "",
            section=f"in section {where!r}" if where else "at the top level"))
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.init and f.name not in data and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(wording.missing.format(name=cls.__name__, where=where, missing=missing))
    values = {key: fit(value, hints[key], prefix + key, wording, text_floats) for key, value in data.items()}
    return cls(**values)


def check(config: Any, where: str | None = None, wording: Wording = WORDING) -> None:
    """Refuse a dataclass instance whose fields do not hold their hinted types (for ``__post_init__``); an int in a
    float field becomes a float, a list in a tuple field a tuple (frozen dataclasses included)."""
    where = type(config).__name__ if where is None else where
    prefix = f"{where}." if where else ""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        fitted = fit(value, _hints(type(config))[f.name], prefix + f.name, wording)
        if fitted is not value:
            object.__setattr__(config, f.name, fitted)


def fit(value: Any, tp: Any, where: str, wording: Wording = WORDING, text_floats: bool = False) -> Any:
    """``value`` checked against the annotation ``tp`` -> the value to store (nested mappings become dataclasses,
    ints in float fields floats, lists in tuple fields tuples)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            found = _found(value, wording)
            raise ValueError(f"{where}: expected a section (a mapping of {where}.* keys), found {found}")
        return from_dict(tp, value, where, wording, text_floats)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return fit(value, option, where, wording, text_floats)
            except (ValueError, TypeError):
                continue
        raise wording.type_error(_wrong(where, type_name(tp), value, wording))
    if origin is Literal:
        if value not in args:
            raise wording.type_error(f"{where}: expected one of {list(args)}, found {value!r:.80}"
                                     + _yaml_bool(value, repr(list(args))))
        return value
    if origin in (list, tuple, collections.abc.Sequence) or tp in (list, tuple):
        return _fit_sequence(value, tp, where, wording, text_floats)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise wording.type_error(_wrong(where, "a mapping", value, wording))
        return value if type(value) is dict else dict(value)
    return _fit_scalar(value, tp, where, wording, text_floats)


def _fit_sequence(value: Any, tp: Any, where: str, wording: Wording, text_floats: bool) -> Any:
    """A list (or a tuple, for a tuple field) whose items fit the item type; a bad item is named with the whole
    field's type ("a list of integers")."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    as_tuple = tuple in (origin, tp)
    if not isinstance(value, (list, tuple)):
        raise wording.type_error(_wrong(where, "a list", value, wording))
    item = args[0] if args else Any
    try:
        items = [fit(v, item, f"{where}[{i}]", wording, text_floats) for i, v in enumerate(value)]
    except (ValueError, TypeError):
        raise wording.type_error(_wrong(where, f"a list of {_plural(item)}", value, wording)) from None
    if as_tuple:
        return value if type(value) is tuple and all(a is b for a, b in zip(items, value)) else tuple(items)
    return value if type(value) is list and all(a is b for a, b in zip(items, value)) else items


def _fit_scalar(value: Any, tp: Any, where: str, wording: Wording, text_floats: bool) -> Any:
    if tp is type(None):
        ok = value is None
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        if text_floats and isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            value = float(value)  # PyYAML (YAML 1.1) reads 1e-4 and 3E5 as text
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and type(value) is not float:
            value = float(value)
    elif tp is str:
        ok = isinstance(value, str)
    elif tp is Path:
        ok = isinstance(value, (str, PurePath))
        if ok and not isinstance(value, Path):
            value = Path(value)
    else:
        raise TypeError(f"{where}: config fields of type {type_name(tp)} are not supported")
    if not ok:
        raise wording.type_error(_wrong(where, type_name(tp), value, wording))
    return value


def _found(value: Any, wording: Wording) -> str:
    return wording.found.format(type=type(value).__name__, value=f"{value!r:.80}")


def _wrong(where: str, expected: str, value: Any, wording: Wording) -> str:
    return wording.wrong_type.format(where=where, expected=expected, found=_found(value, wording)) + _yaml_bool(value,
                                                                                                             expected)


YAML_BOOL_WORDS = ("no", "yes", "off", "on", "n", "y")
"""words YAML 1.1 (PyYAML) reads as a boolean when unquoted: ``mixed_precision: no`` is False, not 'no'."""


def _yaml_bool(value: Any, expected: str) -> str:
    """A hint when a boolean was found where a word YAML reads as one was expected ('' otherwise)."""
    if not isinstance(value, bool):
        return ""
    words = [w for w in YAML_BOOL_WORDS if f"'{w}'" in expected]
    if not words:
        return ""
    return f" (YAML reads an unquoted {words[0]} as a boolean: quote it, '{words[0]}')"


def string_choices(tp: Any) -> bool:
    """Whether ``tp`` is a ``Literal`` of strings, alone or ``| None``: a field whose value is one word of a list."""
    args = [a for a in (typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,))
            if a is not type(None)]
    return len(args) == 1 and typing.get_origin(args[0]) is Literal and all(isinstance(a, str)
                                                                             for a in typing.get_args(args[0]))


def type_name(tp: Any) -> str:
    """A type hint in words: ``int``, ``int | null``, ``one of 'no'/'fp16'``, ``list[float]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return "one of " + "/".join(repr(a) for a in args)
    if isinstance(tp, type) and not args:
        return tp.__name__
    return str(tp).replace("typing.", "")


def _plural(tp: Any) -> str:
    """The items of a list type in words: ``integers``, ``lists of numbers``."""
    if tp in _PLURALS:
        return _PLURALS[tp]
    if typing.get_origin(tp) in (list, tuple):
        args = typing.get_args(tp)
        return f"lists of {_plural(args[0]) if args else 'values'}"
    return f"{type_name(tp)} values"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def leaf_paths(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every field below dataclass ``cls`` (nested dataclasses included)."""
    paths = []
    for name, tp in _hints(cls).items():
        paths.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            paths.extend(leaf_paths(tp, f"{prefix}{name}."))
    return paths


def field_type(cls: type, path: Sequence[str]) -> Any:
    """The annotation at a dotted path through nested dataclasses (None when the path leaves them)."""
    tp: Any = cls
    for key in path:
        candidates = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if not candidates:
            return None
        hints = _hints(candidates[0])
        if key not in hints:
            return None
        tp = hints[key]
    return tp
