"""The GPU run (selfspec/tools/gpu.py, issue 59): its plan fits the lease by arithmetic, the device tool's limits are
checked and a breach says expected vs found, a step that prints nothing is stopped at its cap and its archive still
lands in $OUT, archives cut into parts come back byte for byte, a fresh machine at call 2 is told in one line, and
the rehearsal runs both calls end to end on a tiny model with every check passing (its timing is not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from selfspec.tools import gpu_here as gpu
from selfspec.tools import gpu_plan as plan
from selfspec.tools import gpu_steps, gpu_there

REPO = Path(__file__).resolve().parents[1]


def test_the_plan_fits_the_lease_by_arithmetic():
    rows = plan.budget()
    assert sum(s for _, s, _ in rows) <= plan.BUDGET_S == 720
    assert len(plan.CALLS) == 2 and all(c.timeout_s <= plan.CALL_S for c in plan.CALLS)
    names = [s.name for c in plan.CALLS for s in c.steps]
    assert names.index("train") < names.index("tests") < names.index("bench")  # the unique work first
    regen = next(s for s in plan.CALLS[1].steps if s.name == "regen")
    r = plan.REGEN
    steps = -(-r["conversations"] // r["batch"]) * r["turns"] * r["new_tokens"]
    assert steps * 0.025 + 30 <= regen.cap  # sized from its rate, with the model's load
    for call in plan.CALLS:
        for rehearse in (False, True):
            assert len(plan.command(call, ".gpu/pack", rehearse)) <= plan.COMMAND_CHARS
            assert f"timeout -k 5 {call.timeout(rehearse) - 5} " in plan.command(call, ".gpu/pack", rehearse)
        assert plan.max_files_back(call, {"train": 2}) <= plan.FILES_BACK


def test_the_model_is_cut_so_that_both_calls_fit():
    gguf, site, data = 98_362_432, 9_567_052, 1_500_000  # the GGUF, the packages' xz tar, 1,536 conversations
    first = gpu.first_part_size(gguf, site + data)
    tree = 4 * plan.MIB
    assert tree + first <= plan.PAYLOAD_MIB * plan.MIB
    assert tree + (gguf - first) + site + data <= plan.PAYLOAD_MIB * plan.MIB


def test_a_call_over_the_tools_limits_is_refused_in_one_line_each():
    check = plan.Checked()
    plan.check_call(plan.CALLS[0], "x" * 2001, [f"p{k}" for k in range(9)], 61 * plan.MIB, check)
    assert [line.split(":")[1].strip()[:11] for line in check.breaches] == ["command of ", "carry ['p0'",
                                                                            "61.0 MiB se"]
    assert all("expected" in line and "\n" not in line for line in check.breaches)
    slow = (plan.Call(1, (plan.Step("regen", 700, 1, "?"),), "call1"),)
    check = plan.Checked()
    plan.check_budget(check, slow)
    assert check.breaches == ["the plan holds the machine 835 s: expected at most 720 s"]


def test_what_out_would_return_is_checked(tmp_path):
    out = tmp_path / "out"
    (out / "a" / "b" / "c").mkdir(parents=True)
    for k in range(7):
        (out / f"f{k}.tgz").write_bytes(b"x")
    (out / "a" / "b" / "c" / "deep").write_bytes(b"x")
    (out / "odd@name=1").write_bytes(b"x")
    with open(out / "big", "wb") as f:
        f.truncate(17 * plan.MIB)
    check = plan.Checked()
    assert len(plan.check_files_back(out, check, "call 2")) == 10
    found = "\n".join(check.breaches)
    assert "10 files in $OUT: expected at most 8" in found
    assert "a/b/c/deep is 3 folders down: expected at most 2" in found
    assert "odd@name=1: expected a name of letters" in found
    assert "big is 17.0 MiB: expected at most 16 MiB" in found
    assert len(check.breaches) == 4


def test_a_step_that_prints_nothing_is_killed_at_its_cap_with_its_children():
    start = time.monotonic()
    assert gpu_steps.run(["bash", "-c", "sleep 60 & sleep 60"], timeout=1) is None
    assert time.monotonic() - start < 10


def test_a_step_out_of_time_still_leaves_its_archive(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_GPU_STATE", str(tmp_path / "state"))
    out = tmp_path / "out"
    out.mkdir()
    quick = plan.Step("probe", cap=6, rehearse_cap=6, basis="1 s for a torch import: never enough")
    status, seconds = gpu_there.run_step(quick, 1, tmp_path / "pack", out, rehearse=True)
    assert status == "timeout" and seconds < 6
    failing = plan.Step("store", cap=30, rehearse_cap=30, basis="no pack: fails at once")
    status, _ = gpu_there.run_step(failing, 1, tmp_path / "pack", out, rehearse=True)
    assert status == "failed (1)"
    with tarfile.open(out / "store.tgz") as tar:
        log = tar.extractfile("store/log.txt").read().decode()
    assert "manifest.json" in log  # the traceback came back in the step's archive


def test_steps_that_need_what_failed_are_skipped():
    regen, train = plan.CALLS[1].steps[1], plan.CALLS[1].steps[2]
    assert gpu_there.skip_reason(regen, [{"step": "setup", "status": "fresh"}]) == "skipped: no model (setup fresh)"
    assert gpu_there.skip_reason(train, [{"step": "setup", "status": "ok"}, {"step": "regen", "status": "timeout"}]) \
        is None
    failed = [{"step": "setup", "status": "ok"}, {"step": "regen", "status": "failed (1)"}]
    assert gpu_there.skip_reason(train, failed) == "skipped: no regenerated data (regen failed (1))"


def test_archives_cut_into_parts_unpack_byte_for_byte(tmp_path):
    folder = tmp_path / "work" / "train" / "back"
    (folder / "eagle_head").mkdir(parents=True)
    payload = os.urandom(5000)
    (folder / "eagle_head" / "model.safetensors").write_bytes(payload)
    out = tmp_path / "out"
    out.mkdir()
    parts = gpu_there.archive(folder, out / "train.tgz", part_bytes=2000)
    assert [p.name for p in parts] == ["train.tgz.000", "train.tgz.001", "train.tgz.002"]
    gpu_there.archive(folder, out / "tests.tgz")
    done = gpu.unpack(out, tmp_path / "here")
    assert [d.name for d in done] == ["tests", "train"]
    assert (tmp_path / "here" / "train" / "eagle_head" / "model.safetensors").read_bytes() == payload


def test_call_2_on_a_fresh_machine_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_GPU_STATE", str(tmp_path / "state"))
    pack = tmp_path / "pack" / "call2"
    (pack / "model").mkdir(parents=True)
    (pack / "data").mkdir()
    (pack / "model" / "m.bin.001").write_bytes(b"tail")
    (pack / "manifest.json").write_text(json.dumps({"model_parts": 2, "site": "site.tar.xz"}))
    with tarfile.open(pack / "site.tar.xz", "w:xz") as tar:
        tar.add(pack / "manifest.json", arcname="marker.json")
    ctx = gpu_steps.Ctx(2, tmp_path / "pack", tmp_path / "back", 30, True, time.monotonic())
    assert gpu_steps.setup(ctx) == gpu_steps.FRESH
    said = capsys.readouterr().out.strip().splitlines()
    assert said == ["fresh machine: 1 of 2 model parts here, expected all (call 1's went with the last machine, "
                    "given back over 30 s idle): only the steps without the model run"]
    assert (tmp_path / "state" / "site" / "marker.json").exists()  # the packages call 2 carries are set up anyway


def test_the_rehearsal_runs_both_calls_within_every_limit():
    """gpu.py rehearse: pack for the tiny model, both calls on a simulated machine, every limit and result checked."""
    done = subprocess.run([sys.executable, "-P", "selfspec/tools/gpu.py", "rehearse"], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "rehearsal: every check passed" in done.stdout
    assert "call 2 train" in done.stdout and "of 720 s planned" in done.stdout
