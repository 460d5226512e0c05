"""The lease rehearsed on the CPU: ``gpu.py rehearse`` packs for a tiny model and runs both calls end to end here,
on a simulated machine, with the device tool's limits checked as it would check them.

What is the same as on the GPU: the commands (``gpu_plan.command``, with ``--rehearse``), the pack's layout (the model
in two parts across the calls, joined and checked by sha256; the packages as one xz tar; the conversations), every
step as a capped child process archived into $OUT, the regeneration cut into shards, training, the tests, the bench.
What differs: the model (the tests' tiny random Llama chat model in the built-in model's place, so the GGUF conversion
is not rehearsed), the packages (one marker module: this Python has them), the device (cpu) and the sizes and caps
(``gpu_steps.SIZES``, ``Step.rehearse_cap``).

The simulated machine is a temporary folder: ``repo`` (the files the tool would send: tracked and untracked-not-
ignored, plus the carried folder), ``tmp`` (``$SELFSPEC_GPU_STATE``), ``out`` (``$OUT``, emptied before each call).
Between calls, a gap over 30 s (``--gap``) gives a fresh machine: ``repo`` and ``tmp`` wiped. Checked: each call's
command length, carry and payload (<= 60 MiB), its timeout_s (the command runs under it, killed as a group), what
$OUT returns (<= 8 plain-named files, <= 16 MiB, two folders down), each step's status, and what came back: the
regenerated data, the trained head, the tests' report and the bench's summary (or, after a fresh machine, the one-line
reason and the tests alone). Printed last: the budget, each step's GPU cap beside what it took here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

if __package__:
    from selfspec.tools import gpu_here as gpu
    from selfspec.tools import gpu_plan as plan
else:
    import gpu_here as gpu  # type: ignore[no-redef]
    import gpu_plan as plan  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"store": "ok", "probe": "ok", "setup": "ok", "regen": "ok", "train": "ok", "tests": "ok", "bench": "ok"}
EXPECTED_FRESH = {**EXPECTED, "setup": "fresh", "regen": "skipped", "train": "skipped", "bench": "skipped"}


class Machine:
    """The simulated GPU machine: a checkout copy, a /tmp, an $OUT."""

    def __init__(self, root: Path):
        self.root, self.repo, self.tmp, self.out = root, root / "repo", root / "tmp", root / "out"

    def fresh(self) -> None:
        for d in (self.repo, self.tmp):
            shutil.rmtree(d, ignore_errors=True)

    def send(self, carry: list[str]) -> int:
        """The working tree and the carried folders copied over (what the tool sends) -> bytes sent."""
        sent = 0
        for f in gpu.tree_files():
            target = self.repo / f.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
            sent += f.stat().st_size
        for c in carry:
            shutil.rmtree(self.repo / c, ignore_errors=True)
            shutil.copytree(ROOT / c, self.repo / c)
            sent += gpu.folder_bytes(ROOT / c)
        return sent

    def run(self, command: str, timeout_s: int) -> tuple[int | None, float]:
        """``command`` in the copy, under ``timeout_s`` (killed as a group) -> (exit status or None, seconds)."""
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir(parents=True)
        env = {**os.environ, "OUT": str(self.out), "SELFSPEC_GPU_STATE": str(self.tmp / "selfspec-gpu"),
               "OMP_NUM_THREADS": "1"}  # tiny models gain nothing from threads; on a shared CPU they spin
        start = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", command], cwd=self.repo, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        return rc, time.monotonic() - start


def run_calls(machine: Machine, planned: list[dict], gap: float, back: Path, check: plan.Checked) -> dict[str, float]:
    """Both calls on ``machine``, what each returns copied to ``back``/callK -> seconds per budget row."""
    measured: dict[str, float] = {}
    for call, p in zip(plan.CALLS, planned):
        if call.number > 1 and gap > plan.IDLE_S:
            print(f"--- {gap:.0f} s between the calls (over {plan.IDLE_S}): a fresh machine ---", flush=True)
            machine.fresh()
        sent = machine.send(p["carry"])
        check.expect(sent <= plan.PAYLOAD_MIB * plan.MIB, f"call {call.number}: {sent / plan.MIB:.1f} MiB sent: "
                                                           f"expected at most {plan.PAYLOAD_MIB} MiB")
        print(f"--- call {call.number}: {sent / plan.MIB:.1f} MiB sent, timeout_s {p['timeout_s']} ---", flush=True)
        rc, seconds = machine.run(p["command"], p["timeout_s"])
        check.expect(rc is not None, f"call {call.number}: ran past its timeout_s {p['timeout_s']}: expected its "
                                     "own caps to end it first")
        files = plan.check_files_back(machine.out, check, f"call {call.number}")
        shutil.copytree(machine.out, back / f"call{call.number}")
        print(f"call {call.number}: exit status {rc} in {seconds:.0f} s, {len(files)} files back: "
              + ", ".join(f.name for f in files), flush=True)
        steps = json.loads((back / f"call{call.number}" / "steps.json").read_text())
        measured.update({f"call {call.number} {s['step']}": s["seconds"] for s in steps})
    return measured


def check_results(back: Path, fresh: bool, check: plan.Checked) -> None:
    """Each step's status as expected, and what came back usable here (``gpu.py unpack``)."""
    expected = EXPECTED_FRESH if fresh else EXPECTED
    for call in plan.CALLS:
        for s in json.loads((back / f"call{call.number}" / "steps.json").read_text()):
            found = s["status"].split(":")[0]
            check.expect(found == expected[s["step"]], f"call {call.number} {s['step']}: {s['status']}: expected "
                                                       f"{expected[s['step']]}")
    got = back / "unpacked"
    for call in plan.CALLS:
        gpu.unpack(back / f"call{call.number}", got / f"call{call.number}")
    wanted = ["call1/probe/probe.json", "call2/tests/junit.xml"]
    if not fresh:
        wanted += ["call2/regen/regen.json", "call2/train/eagle_head/config.json",
                   "call2/train/eagle_head/model.safetensors", "call2/bench/bench/summary.json"]
    for rel in wanted:
        check.expect((got / rel).exists(), f"{rel} did not come back: expected it in the call's archives")


def rehearse(gap: float = 0.0, keep: Path | None = None) -> int:
    """Pack for the tiny model, both calls on a simulated machine, every limit checked; the budget printed."""
    print(json.dumps(gpu.pack(ROOT / gpu.REHEARSAL, rehearse=True)), flush=True)
    planned = gpu.calls(gpu.REHEARSAL, rehearse=True)
    check = gpu.check_calls(planned)
    with tempfile.TemporaryDirectory(prefix="selfspec-rehearse-") as tmp:
        back = keep or Path(tmp) / "back"
        measured = run_calls(Machine(Path(tmp) / "machine"), planned, gap, back, check)
        check_results(back, gap > plan.IDLE_S, check)
    print(plan.format_budget(plan.budget(), measured))
    for line in check.breaches:
        print("LIMIT:", line)
    print("rehearsal:", "every check passed" if not check.breaches else f"{len(check.breaches)} checks failed")
    return 1 if check.breaches else 0
