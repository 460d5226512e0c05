"""train.py on the tiny Medusa recipe in a subprocess, as a user runs it, and one finished 4-step run shared by the
tests that read or damage a run folder (tests/heads/test_train_state.py, test_train_folder.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
QUICK = ["checkpoint.every=2", "eval.every=0", "logging.log_with=[]"]
HANG_S = 900
"""catches a hung run, not a slow one: a tiny run of a few steps takes 10-20 s on an idle 2-core EPYC."""


def train(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """train.py --config configs/medusa_tiny.yaml output_dir=out, checkpoints every 2 steps, no eval, no trackers."""
    cmd = [sys.executable, "train.py", "--config", "configs/medusa_tiny.yaml", f"output_dir={out}", *QUICK, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=HANG_S)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 4-step tiny Medusa run: checkpoints step_0000002 and step_0000004, metrics.jsonl, run.json, heads/."""
    out = tmp_path_factory.mktemp("run")
    result = train(out, "optim.max_steps=4")
    assert result.returncode == 0, result.stderr[-3000:]
    return out
