"""The rules of the house (docs/ARCHITECTURE.md), read off the source: the runtime never imports ``heads``, the import
graph has no cycles, selfspec's layers import downwards only, no function outgrows a screen and a half, and imports
inside functions are kept for optional heavy dependencies, each with its reason."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("selfspec", "heads")
MAX_FUNCTION_LINES = 80

LAYERS = {"selfspec.core": 0, "selfspec.drafts": 1, "selfspec.registry": 2, "selfspec.tuned": 2, "selfspec.base_check": 2,
          "selfspec.api": 3, "selfspec.testing": 3, "selfspec.tools": 4, "selfspec": 5}
"""selfspec's layers, lowest first: a module imports only from its own layer or lower ones (the package's own
``__init__``, the public face, sits above them all)."""


def modules() -> dict[str, Path]:
    """Every module of the two packages: dotted name -> file."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool, str]]:
    """The project modules a file imports: (module, line, inside a function, the import's first source line). ``from
    pkg import name`` imports ``pkg.name`` when that is a module, else ``pkg``."""
    source = path.read_text()
    lines = source.splitlines()
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [f"{child.module}.{a.name}" if f"{child.module}.{a.name}" in known else child.module
                         for a in child.names]
            elif isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            for name in names:
                found.append((name, child.lineno, in_function, lines[child.lineno - 1]))
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {name for name, *_ in imports(p, known) if name in known and name != m} for m, p in known.items()}


def layer(module: str) -> int:
    """The layer of ``module``: that of the longest prefix LAYERS names."""
    return max((len(prefix), rank) for prefix, rank in LAYERS.items()
               if module == prefix or module.startswith(prefix + "."))[1]


def test_the_import_graph_has_no_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(g):
        if start not in state:
            walk(start, [start])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_selfspec_never_imports_heads_and_its_layers_import_downwards():
    g = graph()
    upward = [(m, n) for m, targets in g.items() if m.startswith("selfspec") for n in targets
              if n.split(".")[0] == "heads" or (n.startswith("selfspec") and layer(n) > layer(m))]
    assert upward == []


def test_imports_inside_functions_are_optional_heavy_dependencies_with_a_reason():
    """No project module is imported inside a function (the graph says who needs whom), and any other import there
    says why on its line (``# optional: ...``, ``# heavy: ...``)."""
    known = modules()
    project = [(p.relative_to(ROOT), line, name) for m, p in known.items() for name, line, inner, _ in imports(p, known)
               if inner and name.split(".")[0] in PACKAGES]
    unexplained = [(p.relative_to(ROOT), line, text.strip()) for m, p in known.items()
                   for name, line, inner, text in imports(p, known)
                   if inner and name.split(".")[0] not in PACKAGES and "#" not in text]
    assert project == [] and unexplained == []


def test_no_function_is_longer_than_a_screen_and_a_half():
    long = []
    for path in [*modules().values(), ROOT / "train.py", ROOT / "infer.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert long == []


def test_the_house_rules_catch_what_they_are_about(tmp_path, monkeypatch):
    """The checks above fail on a cycle, an upward import and an unexplained import inside a function."""
    pkg = tmp_path / "selfspec"
    (pkg / "core").mkdir(parents=True)
    (pkg / "tools").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from selfspec.tools import b\n")
    (pkg / "tools" / "b.py").write_text("from selfspec.core import a\n\n\ndef f():\n    import json\n")
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="selfspec.core.a -> selfspec.tools.b -> selfspec.core.a"):
        test_the_import_graph_has_no_cycles()
    with pytest.raises(AssertionError):
        test_selfspec_never_imports_heads_and_its_layers_import_downwards()
    with pytest.raises(AssertionError):
        test_imports_inside_functions_are_optional_heavy_dependencies_with_a_reason()


def test_the_runtime_never_loads_heads(model_dir, tmp_path):
    """Importing every selfspec module, and decoding with each built-in draft (prompt lookup, early exit, a layer-skip
    checkpoint, a merge), leaves ``heads`` out of sys.modules; so does ``import selfspec.api`` alone."""
    skip = tmp_path / "skip"
    skip.mkdir()
    (skip / "config.json").write_text(json.dumps({"draft_type": "layerskip", "base_model": "model",
                                                  "num_hidden_layers": 2, "skip_layers": [1], "draft_depth": 3}))
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import selfspec.api
        assert not any(m == "heads" or m.startswith("heads.") for m in sys.modules), "import selfspec.api"
        import selfspec
        for info in pkgutil.walk_packages(selfspec.__path__, "selfspec."):
            importlib.import_module(info.name)
        from selfspec import api
        decoded = []
        for draft in ("ngram", "early-exit:layer=1", {str(skip)!r}, "ngram+" + {str(skip)!r}):
            m = api.load({str(model_dir)!r}, draft=draft)
            decoded.append(len(m.generate("hello there", max_new_tokens=6).tokens))
        loaded = sorted(m for m in sys.modules if m == "heads" or m.startswith("heads."))
        print(decoded, loaded)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[6, 6, 6, 6] []"


KIND_REGISTRIES = {"selfspec/registry.py", "heads/kinds.py", "heads/draft_types.py"}
"""Where kinds may be named side by side: the decoding side's registry (the drafts ``--draft`` builds itself, the
speculators types it reads; checkpoint kinds come from entry points), the training side's (recipe method -> the
module of its HeadKind), and the table of checkpoint module classes (by draft_type and speculators type, each read off
its class). A kind's own package (heads/<kind>/) may name its kinds too."""
NOT_KINDS = "# not kinds:"
"""a line marked so (with the reason after it) names another vocabulary that shares kind names (llama.cpp's GGUF
architectures, a command's default drafts to run)."""


def kind_names() -> set[str]:
    """Every kind's name: the drafts --draft builds, the checkpoint kinds registered as entry points, the speculators
    types the registry maps, and the recipe's methods."""
    from heads.kinds import KINDS  # heavy: only this test reads the registries themselves
    from selfspec import registry  # heavy: as above
    return set(registry.BUILT_IN) | set(registry.drafter_loaders()) | set(registry.SPECULATORS_KINDS) | set(KINDS)


def name_lists(root: Path, names: set[str]) -> list[str]:
    """'path:line [names]' for each tuple, list, set or dict (its keys) literal holding two or more of ``names``, in
    the packages and the two commands, outside the registries and the kinds' own packages."""
    own = {f"heads/{p.name}/" for p in (root / "heads").iterdir()
           if (p / "kind.py").is_file() and f"heads.{p.name}" not in SHARED}  # heads/decoder/kind.py: kinds' base
    found = []
    for path in [p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))] + [root / "train.py",
                                                                                               root / "infer.py"]:
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or rel in KIND_REGISTRIES or any(rel.startswith(o) for o in own):
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            elements = (node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else
                        [k for k in node.keys if k is not None] if isinstance(node, ast.Dict) else [])
            hits = sorted({e.value for e in elements if isinstance(e, ast.Constant) and e.value in names})
            if len(hits) >= 2 and NOT_KINDS not in lines[node.lineno - 1]:
                found.append(f"{rel}:{node.lineno} {hits}")
    return found


def test_kinds_declare_what_they_can_do_instead_of_being_listed():
    """No list of kind names outside the registries of kinds and the kinds' own packages: what a kind can do (dynamic
    trees, tuning, its final directory, its recipe checks, its exports) is declared by the kind (selfspec.core.drafter
    DraftKind, heads.training.kind HeadKind, heads.checkpoints.draft DraftCheckpoint), so a new kind is named once."""
    assert name_lists(ROOT, kind_names()) == []


def test_the_kind_list_check_catches_a_list(tmp_path):
    (tmp_path / "selfspec").mkdir()
    (tmp_path / "heads" / "medusa").mkdir(parents=True)
    (tmp_path / "heads" / "medusa" / "kind.py").write_text('OWN = ("medusa", "hydra")\n')
    (tmp_path / "train.py").write_text("")
    (tmp_path / "infer.py").write_text("")
    (tmp_path / "selfspec" / "tuned.py").write_text('TUNABLE = ("medusa", "eagle", "other")\nONE = ["medusa"]\n'
                                                    'ARCH = {"eagle": 1, "medusa": 2}  # not kinds: GGUF names\n')
    assert name_lists(tmp_path, {"medusa", "eagle", "hydra"}) == ["selfspec/tuned.py:1 ['eagle', 'medusa']"]


SHARED = {"heads.base", "heads.checkpoints", "heads.decoder"}
"""the packages and modules of ``heads`` that are no kind's and a kind's drafter may load: the base it is built on
(heads/base.py), checkpoint files (heads/checkpoints/) and the decoder the EAGLE and block kinds share
(heads/decoder/)."""


def kind_packages() -> set[str]:
    """Every kind's package of ``heads`` ('heads.eagle', ...), read off the registries of kinds: the modules of the
    recipe's methods (heads/kinds.py) and of the ``selfspec.drafters`` entry points (pyproject.toml)."""
    from heads.kinds import KINDS  # heavy: only this test reads the registries themselves
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["selfspec.drafters"]
    return {package(target.partition(":")[0]) for target in [*KINDS.values(), *entry_points.values()]
            if target.startswith("heads.")}


def package(module: str) -> str:
    """heads.X.y -> heads.X (a package or a module of ``heads``)."""
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize("drafter", ["heads.block.drafter", "heads.eagle.drafter"])
def test_a_kind_imports_no_other_kind(drafter):
    """``import heads.<kind>.drafter`` in a fresh interpreter loads modules of its own kind's package and of the shared
    ones (``SHARED``) only: no module of another kind's package (the block drafter nothing of heads/eagle/, the EAGLE
    drafter nothing of heads/block/, and neither Medusa's, Hydra's, ...); and ``heads`` itself imports no kind until a
    name of it is asked for."""
    script = textwrap.dedent(f"""
        import json, sys
        import heads
        bare = sorted(m for m in sys.modules if m.startswith("heads."))
        import {drafter}
        print(json.dumps([bare, sorted(m for m in sys.modules if m.startswith("heads."))]))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    bare, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    kinds, own = kind_packages(), package(drafter)
    assert {"heads.eagle", "heads.block", "heads.medusa"} <= kinds and not SHARED & kinds
    others = [m for m in loaded if package(m) in kinds - {own}]
    unlisted = [m for m in loaded if package(m) not in SHARED | {own}]
    assert bare == [] and others == [] and unlisted == [] and drafter in loaded
