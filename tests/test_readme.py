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
