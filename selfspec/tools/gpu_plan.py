"""The GPU run's plan as data: its two calls, their steps with hard caps, what each carries, and the lease's limits.

The lent machine (one H100 or H200; /work/.library/device/README.md in this workplace) counts every second from the
asking to the giving back: its start (a minute or more), the transfers, the idle time between calls and after the
last. A call is one shell command of at most 2,000 characters, at most 600 s, with at most 64 MiB sent (the working
tree and its carried paths) and at most 8 files back from $OUT (16 MiB each, two folders deep, plain names); the
machine goes back 30 s after a call ends, and a fresh one holds nothing of the last. The plan here is built to fit:

    call 1  store, probe                       the first half of the model's parts; the machine's versions and GPU
    call 2  setup, regen, train, tests, bench  the rest, then the unique work first (regeneration and training at
                                               scale, the trained head archived the moment it exists), the cuda
                                               tests and a short bench after

Two calls because the built-in model's GGUF (94 MiB) cannot travel in one; call 2 is issued as soon as call 1 returns,
and if the machine was given back in between (call 2 finds no part 1), it says so in one line and runs the steps that
need no model (setup's install, the tests). Every step has a cap (``Step.cap``: seconds on the GPU, sized from the
rate in its ``basis``) that a hard timeout enforces without waiting for output, and the caps, the start, the transfers
and the gaps add up to ``BUDGET_S`` at most (``budget``). This module is data and arithmetic over the standard
library: ``gpu.py plan`` prints the calls from it, ``gpu_there`` runs them, ``gpu_rehearse`` runs them here on a
tiny model with the same limits checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20
BUDGET_S = 12 * 60
"""the device time planned for, start included (of the 15 minutes a session is lent: the rest is slack)."""
PAYLOAD_MIB = 60
"""what one call may send (working tree + carried paths): the machine takes 64 MiB, the rest is room to grow."""
COMMAND_CHARS = 2000
CALL_S = 600
"""the longest a command may run."""
FILES_BACK, FILE_BACK_MIB, DEPTH_BACK = 8, 16, 2
PART_MIB = 15
"""a file sent back larger than this is cut into NAME.000, NAME.001, ... (the limit is 16 MiB a file)."""
IDLE_S = 30
"""a machine left idle this long goes back; the next call finds a fresh one."""
PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")

OVERHEADS = {"start": (90, "a fresh machine: 'a minute or more' (README); 90 s planned"),
             "transfer 1": (20, "call 1's ~55 MiB up, its output back"),
             "gap": (15, "call 2 issued as soon as call 1's reply is in (no analysis between)"),
             "transfer 2": (20, "call 2's ~55 MiB up, ~25 MiB of archives back"),
             "give back": (15, "give_back called at once (else 30 s idle)")}
"""device seconds outside the commands, planned."""

REGEN = {"conversations": 1536, "batch": 256, "new_tokens": 256, "turns": 2}
"""regeneration at scale: 6 batches x 2 turns x 256 steps = 3,072 generate steps; at a conservative 25 ms a step for
a 135M model at batch 256 (issue 59 reads 11-20 ms from 64 calls of 256 steps in 3-5.5 minutes) that is 77 s, under
its 120 s cap with the model's load; a slower rate loses only the shard under way (shards of one batch)."""
TRAIN_MINUTES = 1.5
BENCH = {"questions": 3, "new_tokens": 128}
"""3 questions x 2 turns x 128 tokens x 3 methods = 2,304 decoding steps at <= 20 ms: 46 s of the bench's 60."""


@dataclass(frozen=True)
class Step:
    """One unit of a call's work: run under a hard timeout, its files packed into one archive in $OUT when it ends."""

    name: str
    cap: int
    """seconds on the GPU machine, enforced by a timeout that does not wait for output."""
    rehearse_cap: int
    """seconds on this CPU with the tiny model (the rehearsal's own timeout)."""
    basis: str
    """the rate the cap is sized from."""
    needs_model: bool = False


@dataclass(frozen=True)
class Call:
    number: int
    steps: tuple[Step, ...]
    carry: str
    """the carried folder, relative to the pack folder (call1, call2)."""

    @property
    def work_s(self) -> int:
        return self.work(False)

    @property
    def timeout_s(self) -> int:
        return self.timeout(False)

    def work(self, rehearse: bool) -> int:
        return sum(s.rehearse_cap if rehearse else s.cap for s in self.steps)

    def timeout(self, rehearse: bool) -> int:
        """the call's timeout_s: its steps' caps, the command's own cap 5 s above them, 5 s more for the tool."""
        return self.work(rehearse) + 10


CALLS = (
    Call(1, (Step("store", 10, 10, "copying ~52 MiB of model parts into /tmp"),
             Step("probe", 20, 30, "python3, torch import, one CUDA matmul, nvidia-smi")), "call1"),
    Call(2, (Step("setup", 90, 60, "unpacking ~90 MiB of packages (xz: ~3 s), joining + sha256 of 94 MiB, "
                  "the GGUF converted on the CPU (~30 s on 2 cores here)"),
             Step("regen", 120, 60, "1,536 conversations: 3,072 generate steps at 25 ms (batch 256) + the load", True),
             Step("train", 140, 90, f"{TRAIN_MINUTES} min of optim.max_minutes + 50 s to load, tokenise, save", True),
             Step("tests", 90, 120, "tests/test_device.py -m cuda: 18 tests, the last 8 train.py runs of 3 steps "
                  "(~8 s each: a timeout cuts only those)"),
             Step("bench", 60, 60, "3 questions x 2 turns x 128 tokens x 3 methods at <= 20 ms a step", True)),
         "call2"),
)
"""the rehearsal's caps (``rehearse_cap``) are for its tiny model on a shared 2-core CPU, with room to spare."""


def budget(calls: tuple[Call, ...] = CALLS) -> list[tuple[str, int, str]]:
    """(what, planned seconds, basis) for every second the lease is held, in order."""
    rows = [("start", *OVERHEADS["start"])]
    for call in calls:
        rows.append((f"transfer {call.number}", *OVERHEADS[f"transfer {call.number}"]))
        rows += [(f"call {call.number} {s.name}", s.cap, s.basis) for s in call.steps]
        rows.append((f"call {call.number} margin", call.timeout_s - call.work_s, "the command's cap above its steps'"))
        if call.number < len(calls):
            rows.append(("gap", *OVERHEADS["gap"]))
    rows.append(("give back", *OVERHEADS["give back"]))
    return rows


def command(call: Call, pack: str, rehearse: bool = False) -> str:
    """The shell command of ``call``: offline, unbuffered, under a hard cap 5 s inside the call's timeout_s."""
    flag = " --rehearse" if rehearse else ""
    cap = call.timeout(rehearse) - 5
    return ("export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1; "
            f"timeout -k 5 {cap} python3 -P selfspec/tools/gpu.py there --call {call.number} --pack {pack}"
            f"{flag} --out \"$OUT\"")


@dataclass
class Checked:
    """What a limit check found: one line per breach."""

    breaches: list[str] = field(default_factory=list)

    def expect(self, ok: bool, line: str) -> None:
        if not ok:
            self.breaches.append(line)


def check_call(call: Call, cmd: str, carry: list[str], payload: int, check: Checked) -> None:
    """The tool's limits on one call: command length, carry, payload, timeout."""
    check.expect(len(cmd) <= COMMAND_CHARS, f"call {call.number}: command of {len(cmd)} characters: expected at "
                                            f"most {COMMAND_CHARS}")
    check.expect(len(carry) <= 8 and all(len(c) <= 200 for c in carry),
                 f"call {call.number}: carry {carry}: expected at most 8 paths of at most 200 characters")
    check.expect(payload <= PAYLOAD_MIB * MIB, f"call {call.number}: {payload / MIB:.1f} MiB sent: expected at "
                                               f"most {PAYLOAD_MIB} MiB")
    check.expect(call.timeout_s <= CALL_S, f"call {call.number}: timeout_s {call.timeout_s}: expected at most {CALL_S}")


def check_budget(check: Checked, calls: tuple[Call, ...] = CALLS) -> int:
    total = sum(s for _, s, _ in budget(calls))
    check.expect(total <= BUDGET_S, f"the plan holds the machine {total} s: expected at most {BUDGET_S} s")
    check.expect(len(calls) <= 2, f"{len(calls)} calls: expected at most 2")
    return total


def check_files_back(out: Path, check: Checked, what: str) -> list[Path]:
    """What $OUT would return: at most 8 plain-named files of <= 16 MiB, at most two folders down."""
    files = sorted(p for p in out.rglob("*") if p.is_file())
    check.expect(len(files) <= FILES_BACK, f"{what}: {len(files)} files in $OUT: expected at most {FILES_BACK}")
    for f in files:
        rel = f.relative_to(out)
        check.expect(len(rel.parts) - 1 <= DEPTH_BACK, f"{what}: {rel} is {len(rel.parts) - 1} folders down: "
                                                        f"expected at most {DEPTH_BACK}")
        check.expect(all(PLAIN_NAME.match(p) for p in rel.parts), f"{what}: {rel}: expected a name of letters, "
                                                                   "digits, '.', '_' and '-' alone")
        check.expect(f.stat().st_size <= FILE_BACK_MIB * MIB, f"{what}: {rel} is {f.stat().st_size / MIB:.1f} MiB: "
                                                              f"expected at most {FILE_BACK_MIB} MiB")
    return files


def max_files_back(call: Call, parts: dict[str, int]) -> int:
    """Files a call can leave in $OUT: steps.json and one archive per step (``parts[name]`` where it is cut)."""
    return 1 + sum(parts.get(s.name, 1) for s in call.steps)


def format_budget(rows: list[tuple[str, int, str]], measured: dict[str, float] | None = None) -> str:
    """The budget as a table: planned seconds (and, from a rehearsal, what each step took here)."""
    lines = [f"{'':18} {'GPU cap s':>9} {'here s':>7}  basis"]
    for what, secs, basis in rows:
        here = measured.get(what) if measured else None
        lines.append(f"{what:18} {secs:9d} {'' if here is None else f'{here:7.1f}':>7}  {basis}")
    total = sum(s for _, s, _ in rows)
    lines.append(f"{'total':18} {total:9d} {'':>7}  of {BUDGET_S} s planned ({BUDGET_S // 60} minutes); "
                 f"the lease is 900 s")
    return "\n".join(lines)
