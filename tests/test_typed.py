"""selfspec.core.typed: the one checker of every typed config (strict keys, types from the hints, expected vs found)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from selfspec.core import typed


@dataclass
class Inner:
    rate: float = 0.5
    names: list[str] = field(default_factory=list)


@dataclass
class Outer:
    size: int
    kind: Literal["a", "b"] = "a"
    limit: int | None = None
    pair: tuple[int, ...] = ()
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        typed.check(self)


def test_from_dict_builds_nested_sections_and_converts_what_json_cannot_say():
    got = typed.from_dict(Outer, {"size": 3, "pair": [1, 2], "inner": {"rate": 1, "names": ["x"]}})
    assert got == Outer(size=3, pair=(1, 2), inner=Inner(rate=1.0, names=["x"]))
    assert type(got.inner.rate) is float and type(got.pair) is tuple
    assert typed.from_dict(Inner, {"rate": "1e-4"}, text_floats=True).rate == 1e-4  # YAML 1.1 reads 1e-4 as text


@pytest.mark.parametrize("data, message", [
    ({"size": 3, "sise": 4}, "unknown Outer keys ['sise']; expected a subset of ['size', 'kind', 'limit', 'pair', 'inner']"),
    ({}, "Outer is missing required keys ['size']"),
    ({"size": True}, "Outer.size: expected int, found bool True"),
    ({"size": 3, "kind": "c"}, "Outer.kind: expected one of ['a', 'b'], found 'c'"),
    ({"size": 3, "limit": "x"}, "Outer.limit: expected int | null, found str 'x'"),
    ({"size": 3, "pair": [1, 2.5]}, "Outer.pair: expected a list of integers, found list [1, 2.5]"),
    ({"size": 3, "inner": 0.1}, "Outer.inner: expected a section (a mapping of Outer.inner.* keys), found float 0.1"),
    ({"size": 3, "inner": {"names": "x"}}, "Outer.inner.names: expected a list, found str 'x'"),
])
def test_errors_say_expected_and_found(data, message):
    with pytest.raises(ValueError) as err:
        typed.from_dict(Outer, data)
    assert str(err.value) == message


def test_a_config_built_in_code_is_held_to_the_same_types():
    with pytest.raises(ValueError, match=r"^Outer.size: expected int, found str '3'$"):
        Outer(size="3")
    assert Outer(size=3, pair=[4]).pair == (4,)


def test_the_wording_is_the_configs_own():
    recipe = typed.Wording(unknown="unknown key {key!r}{hint} (expected one of {known} {section})")
    with pytest.raises(ValueError, match=r"^unknown key 'inner.rat'; did you mean 'inner.rate'\? \(expected one of "
                                         r"\['rate', 'names'\] in section 'inner'\)$"):
        typed.from_dict(Outer, {"size": 1, "inner": {"rat": 1}}, where="", wording=recipe)
    strict = typed.Wording(wrong_type="{where} must be {expected}, found {found}", found="{value} ({type})",
                           type_error=TypeError)
    with pytest.raises(TypeError, match=r"^size must be int, found '1' \(str\)$"):
        typed.from_dict(Outer, {"size": "1"}, where="", wording=strict)
