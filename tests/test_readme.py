"""CI runs exactly the test command the README gives a new user."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "--- the README's test command"


def readme_first_bash_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    assert match, "README.md has no ```bash block"
    return [line.strip() for line in match.group(1).splitlines() if line.strip() and not line.strip().startswith("#")]


def ci_test_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    marked = [i for i, line in enumerate(lines) if line.lstrip().startswith("#") and MARKER in line]
    assert len(marked) == 1, f".ci/run must have exactly one comment line containing {MARKER!r}, found {len(marked)}"
    following = lines[marked[0] + 1].strip()
    assert following, f"the line after {MARKER!r} in .ci/run is empty"
    return following


def test_ci_runs_the_readme_test_command():
    ci = ci_test_command()
    readme = readme_first_bash_block()
    tests = [line for line in readme if "pytest" in line]
    assert len(tests) == 1, f"README's first ```bash block should hold one test command (with pytest), found {tests}"
    assert ci == tests[0], f"README: {tests[0]!r}\n.ci/run: {ci!r}"


def test_ci_script_is_executable_and_strict():
    run = ROOT / ".ci" / "run"
    assert os.access(run, os.X_OK), ".ci/run is not executable"
    text = run.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading suffixed -1, -2, ... (headings inside code blocks are not headings)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#+\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)|^\s*\[[^\]]+\]:\s+([^#\s]*)(?:#(\S+))?", flags=re.M)
"""an inline link ``[text](target#fragment)`` or a reference definition ``[label]: target#fragment``."""


def test_links_in_readme_and_docs_point_to_files_and_headings_that_exist():
    """README.md links into docs/ for everything it leaves out: every relative link of README.md and docs/**/*.md
    (inline or a reference definition) names a file that exists, and a #fragment names a heading of that file."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in LINK.finditer(doc.read_text()):
            target, fragment = (match.group(1), match.group(2)) if match.group(1) is not None else match.group(3, 4)
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path = (doc.parent / target) if target else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif fragment and fragment not in heading_anchors(path):
                broken.append(f"{doc.name}: {target}#{fragment} (no such heading)")
    assert not broken, "\n".join(broken)


MAIN_JOB = "python3.11 -m venv .venv && . .venv/bin/activate && pip install -q -e . && python infer.py main-job"
"""the README's other setup command: the main job, one subcommand (selfspec/tools/main_job.py; tests/test_main_job.py
checks its steps)."""


def test_readme_fits_a_newcomers_screens_and_its_main_job_is_one_short_command():
    lines = (ROOT / "README.md").read_text().splitlines()
    long = [f"line {i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 160]
    assert len(lines) <= 150 and not long, f"README.md: {len(lines)} lines (at most 150); {long}"
    blocks = re.findall(r"^```bash\n(.*?)^```", "\n".join(lines) + "\n", flags=re.S | re.M)
    assert [b.strip() for b in blocks[1:2]] == [MAIN_JOB], "README's second ```bash block should be the main job alone"
