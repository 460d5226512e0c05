"""The GPU run on the lent machine: a call's steps, each a child process under a hard timeout, each archived into $OUT
the moment it ends.

``gpu.py there --call K`` runs call K's steps (gpu_plan.CALLS) in order. Each step is ``gpu.py step NAME`` in a
process group of its own, waited on with ``proc.wait(timeout=cap)`` and killed as a group when the cap passes, whether
or not it printed anything. What a step wants back it writes into its ``back`` folder (with its log); once the step
ends, ok or not, that folder becomes ``$OUT/NAME.tgz`` (cut into ``NAME.tgz.000``, ... above 15 MiB) and
``$OUT/steps.json`` is rewritten, so a later step's timeout, or the command's own, never takes an earlier step's
results. State between the calls (the model's parts, the unpacked packages, the converted model) lives in
``$SELFSPEC_GPU_STATE`` (/tmp/selfspec-gpu), which a fresh machine does not have: call 2 then says so in one line and
runs only the steps that need no model. Standard library only: the machine's packages are not set up when it starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

if __package__:
    from selfspec.tools import gpu_plan as plan
    from selfspec.tools import gpu_steps as steps
else:  # run as a script (python3 -P selfspec/tools/gpu.py): the selfspec package imports torch
    import gpu_plan as plan  # type: ignore[no-redef]
    import gpu_steps as steps  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]


def state() -> Path:
    return Path(os.environ.get("SELFSPEC_GPU_STATE", "/tmp/selfspec-gpu"))


def there(number: int, pack: Path, out: Path, rehearse: bool) -> int:
    """Call ``number``: its steps in order, each capped and archived; 0 unless a step failed outright."""
    call = plan.CALLS[number - 1]
    out.mkdir(parents=True, exist_ok=True)
    if number == 1 and state().exists():
        shutil.rmtree(state())
    state().mkdir(parents=True, exist_ok=True)
    record: list[dict] = []
    failed = False
    for step in call.steps:
        status = skip_reason(step, record)
        if status is None:
            status, seconds = run_step(step, number, pack, out, rehearse)
        else:
            seconds = 0.0
            print(f"call {number} {step.name}: {status}", flush=True)
        record.append({"call": number, "step": step.name, "status": status, "seconds": round(seconds, 1),
                       "cap": step.rehearse_cap if rehearse else step.cap})
        (out / "steps.json").write_text(json.dumps(record, indent=1))
        failed |= status not in ("ok", "fresh") and not status.startswith("skipped")
    return 1 if failed else 0


def skip_reason(step: plan.Step, record: list[dict]) -> str | None:
    """Why ``step`` cannot run after what ran before it (None: it runs)."""
    done = {r["step"]: r["status"] for r in record}
    if step.needs_model and done.get("setup") != "ok":
        return f"skipped: no model (setup {done.get('setup')})"
    if step.name == "train" and done.get("regen") not in ("ok", "timeout"):
        return f"skipped: no regenerated data (regen {done.get('regen')})"
    return None


def run_step(step: plan.Step, number: int, pack: Path, out: Path, rehearse: bool) -> tuple[str, float]:
    """``step`` in a child process group, killed at its cap; its back folder archived into ``out`` -> (status, s)."""
    cap = step.rehearse_cap if rehearse else step.cap
    back = state() / "work" / step.name / "back"
    shutil.rmtree(back.parent, ignore_errors=True)
    back.mkdir(parents=True)
    cmd = [sys.executable, "-P", str(ROOT / "selfspec/tools/gpu.py"), "step", step.name, "--call", str(number),
           "--pack", str(pack), "--back", str(back), "--seconds", str(cap - 5)] + (["--rehearse"] if rehearse else [])
    start = time.monotonic()
    print(f"call {number} {step.name}: at most {cap} s", flush=True)
    with open(back / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=environment(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(cap - 5, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = time.monotonic() - start
    status = "timeout" if rc is None else "ok" if rc == 0 else "fresh" if rc == steps.FRESH else f"failed ({rc})"
    archive(back, out / f"{step.name}.tgz")
    tail = (back / "log.txt").read_text(errors="replace").strip().splitlines()[-1:] or [""]
    print(f"call {number} {step.name}: {status} in {seconds:.0f} s; {tail[0][:200]}", flush=True)
    return status, seconds


def archive(folder: Path, target: Path, part_bytes: int = plan.PART_MIB * plan.MIB) -> list[Path]:
    """``folder`` as a gzipped tar at ``target``, cut into ``target.000``, ... above ``part_bytes``."""
    with tarfile.open(target, "w:gz", compresslevel=6) as tar:
        tar.add(folder, arcname=target.name.removesuffix(".tgz"))
    if target.stat().st_size <= part_bytes:
        return [target]
    return split_file(target, target.parent, part_bytes)


def split_file(path: Path, folder: Path, size: int, remove: bool = True) -> list[Path]:
    """``path`` cut into ``folder/NAME.000``, ``NAME.001``, ... of ``size`` bytes (the last smaller)."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as f:
        while chunk := f.read(size):
            parts.append(folder / f"{path.name}.{len(parts):03d}")
            parts[-1].write_bytes(chunk)
    if remove:
        path.unlink()
    return parts


def join_parts(parts: list[Path], target: Path) -> Path:
    with open(target, "wb") as dst:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, dst)
    return target


def environment(**extra: str) -> dict[str, str]:
    """The steps' environment: the sent packages ahead of the machine's, the checkout importable, nothing online."""
    path = os.pathsep.join(str(p) for p in (state() / "site", ROOT))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH", "")])),
            "SELFSPEC_CACHE": str(state() / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **extra}
