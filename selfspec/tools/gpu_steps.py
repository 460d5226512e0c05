"""What each step of the GPU run does (``gpu.py step NAME``, a child of ``gpu.py there``, which caps and archives it).

A step writes what should come back into its ``back`` folder and returns an exit status: 0 done, ``FRESH`` when call 2
finds the machine fresh (the first half of the model's parts gone with the last machine), anything else failed. The
work that needs torch runs in grandchildren (``heads.distill``, ``train.py``, ``pytest``, ``infer.py bench``), each
under the time its step has left, so this module stays on the standard library. ``SIZES`` holds the GPU's sizes and the
rehearsal's (a tiny model on the CPU; ``gpu_rehearse``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

if __package__:
    from selfspec.tools import gpu_plan as plan
else:
    import gpu_plan as plan  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
FRESH = 3
MODEL = "smollm2-135m-instruct"
SIZES = {
    False: {"device": "cuda", "dtype": "bfloat16", "batch": plan.REGEN["batch"], "new_tokens": plan.REGEN["new_tokens"],
            "minutes": plan.TRAIN_MINUTES, "train_batch": 32, "recipe": [], "tests": [],
            "bench": ["--limit", str(plan.BENCH["questions"]), "--max-new-tokens", str(plan.BENCH["new_tokens"])]},
    True: {"device": "cpu", "dtype": "float32", "batch": 4, "new_tokens": 8, "minutes": 0.1, "train_batch": 4,
           "recipe": ["eagle.draft_vocab=64", "eagle.feature_layers=[0,1,2]", "data.max_length=64"],
           "tests": ["-k", "lossless_on_the_device and llama"],
           "bench": ["--limit", "1", "--max-new-tokens", "8"]},
}
"""per mode (rehearse or not): the device, regeneration's dtype, batch and reply length, training's minutes, batch and
recipe overrides, the tests' selection, the bench's size."""


@dataclass(frozen=True)
class Ctx:
    call: int
    pack: Path
    back: Path
    seconds: float
    rehearse: bool
    start: float

    @property
    def sizes(self) -> dict:
        return SIZES[self.rehearse]

    def left(self, reserve: float = 5) -> float:
        """seconds this step has left for a grandchild, ``reserve`` kept for what follows it."""
        return max(self.seconds - (time.monotonic() - self.start) - reserve, 1)


def state() -> Path:
    return Path(os.environ.get("SELFSPEC_GPU_STATE", "/tmp/selfspec-gpu"))


def run(cmd: list[str], timeout: float, **env: str) -> int | None:
    """``cmd`` in the checkout, its output into this step's log, killed as a group at ``timeout`` -> exit status
    (None: out of time)."""
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"$ out of time after {timeout:.0f} s", flush=True)
        return None


def py(code: str, *args: str, timeout: float = 60) -> int | None:
    return run([sys.executable, "-c", code, *args], timeout)


# --------------------------------------------------------------------------------------------------------- call 1
def store(ctx: Ctx) -> int:
    """Call 1's model parts and manifest into the state folder (for call 2)."""
    folder = ctx.pack / "call1"
    (state() / "model").mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "manifest.json", state() / "manifest.json")
    for f in sorted((folder / "model").iterdir()):
        shutil.copy(f, state() / "model" / f.name)
        print(f"stored {f.name}: {f.stat().st_size / plan.MIB:.1f} MiB", flush=True)
    return 0


PROBE = """import json, sys, time, torch
dev = sys.argv[1]
x = torch.randn(2048, 2048, device=dev)
t = time.perf_counter(); y = (x @ x).sum().item(); t = time.perf_counter() - t
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "matmul_2048_s": round(t, 4)}
print(json.dumps(info)); open(sys.argv[2], "w").write(json.dumps(info, indent=1))"""


def probe(ctx: Ctx) -> int:
    """The machine's Python, torch, CUDA and device, with one matrix product on it; nvidia-smi's view."""
    rc = py(PROBE, ctx.sizes["device"], str(ctx.back / "probe.json"), timeout=ctx.left(6))
    if shutil.which("nvidia-smi"):
        run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"], 5)
    return 1 if rc is None else rc


# --------------------------------------------------------------------------------------------------------- call 2
def setup(ctx: Ctx) -> int:
    """Call 2's packages unpacked and registered; with call 1's parts, the model joined, checked, converted."""
    folder = ctx.pack / "call2"
    manifest = json.loads((folder / "manifest.json").read_text())
    for kind in ("model", "data"):
        (state() / kind).mkdir(parents=True, exist_ok=True)
        for f in sorted((folder / kind).iterdir()):
            shutil.copy(f, state() / kind / f.name)
    with tarfile.open(folder / manifest["site"]) as tar:
        tar.extractall(state() / "site", filter="data")
    add_entry_points(state() / "site")
    parts = sorted((state() / "model").iterdir())
    if len(parts) != manifest["model_parts"]:
        print(f"fresh machine: {len(parts)} of {manifest['model_parts']} model parts here, expected all (call 1's "
              "went with the last machine, given back over 30 s idle): only the steps without the model run")
        return FRESH
    return convert(join(parts, manifest), manifest, ctx)


def join(parts: list[Path], manifest: dict) -> Path:
    target = state() / "joined" / manifest["model"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as dst:
        for p in parts:
            dst.write(p.read_bytes())
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != manifest["model_sha256"]:
        raise SystemExit(f"{target.name}: sha256 {digest[:12]}, expected {manifest['model_sha256'][:12]} (the packed "
                         "file's): a part is missing or damaged")
    return target


def convert(joined: Path, manifest: dict, ctx: Ctx) -> int:
    """The joined model into selfspec's cache as the built-in model: a GGUF converted as selfspec converts it, or (the
    rehearsal's) a tar of a model directory unpacked."""
    if manifest["model_kind"] == "dir":
        with tarfile.open(joined) as tar:
            tar.extractall(state() / "cache" / "models", filter="data")
    else:
        rc = py("import sys; from pathlib import Path; from selfspec.core.models import _materialise_builtin; "
                "print(_materialise_builtin(sys.argv[1], Path(sys.argv[2])))", MODEL, str(joined),
                timeout=ctx.left(15))
        if rc != 0:
            return 1
    code = ("import sys, torch, transformers, datasets, accelerate, peft, selfspec, heads; "
            "print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', "
            "transformers.__version__, 'datasets', datasets.__version__)")
    rc = py(code, timeout=ctx.left(2))
    return 1 if rc is None else rc


def add_entry_points(site: Path) -> None:
    """selfspec's entry points (the registry loads draft kinds through them) for a checkout that is not installed: a
    dist-info in ``site``, from pyproject.toml."""
    found = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; m.distribution('selfspec')"],
                           capture_output=True)
    if found.returncode == 0:
        return  # installed (pip install -e .), or added before
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = site / f"selfspec-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: selfspec\nVersion: {project['version']}\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n" for group, points in groups.items()))


def regen(ctx: Ctx) -> int:
    """The target answers the packed user turns (heads.distill, shards of one batch); what finished is the data."""
    s, out = ctx.sizes, ctx.back / "data"
    batch = str(s["batch"])
    run([sys.executable, "-m", "heads.distill", "--model", MODEL, "--source",
         str(state() / "data" / "conversations.parquet"), "--out", str(out), "--device", s["device"], "--dtype",
         s["dtype"], "--batch-size", batch, "--shard-size", batch, "--max-new-tokens", str(s["new_tokens"])],
        ctx.left(25))
    rc = py("import sys; from heads.gpu_pack import finished; print('regenerated:', finished(sys.argv[1]))",
            str(out), timeout=ctx.left(2))
    return 1 if rc is None else rc


def train(ctx: Ctx) -> int:
    """The EAGLE-3 head of configs/eagle3_smollm2.yaml trained on the regenerated data for ``minutes``."""
    s, run_dir = ctx.sizes, state() / "work" / "train" / "run"
    data = state() / "work" / "regen" / "back" / "data"
    recipe = ["--config", "configs/eagle3_smollm2.yaml", f"output_dir={run_dir}", f"data.source={data}",
              "data.max_conversations=null", "hidden_cache.enabled=false", "optim.scheduler=constant_with_warmup",
              "optim.epochs=1000", f"optim.max_minutes={s['minutes']}", f"optim.batch_size={s['train_batch']}",
              "checkpoint.every=0", "logging.log_with=[]", "logging.progress_bar=false", "eval.every=0",
              *s["recipe"]]
    rc = run([sys.executable, "train.py", *recipe], ctx.left(5))
    if (run_dir / "eagle_head").is_dir():
        shutil.copytree(run_dir / "eagle_head", ctx.back / "eagle_head")
    for name in ("metrics.jsonl", "run.json"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, ctx.back / name)
    return 1 if rc is None else rc


def tests(ctx: Ctx) -> int:
    """The cuda-marked tests (tests/test_device.py) on the device, one line each as it ends (a timeout keeps what
    ran), with a JUnit report when they all ran."""
    rc = run([sys.executable, "-m", "pytest", "-v", "-m", "cuda", "tests/test_device.py", "-p", "no:cacheprovider",
              "--junitxml", str(ctx.back / "junit.xml"), *ctx.sizes["tests"]], ctx.left(3),
             SELFSPEC_TEST_DEVICE=ctx.sizes["device"])
    return 1 if rc is None else rc


def bench(ctx: Ctx) -> int:
    """One short infer.py bench: plain, n-gram, and the head just trained with its own tree (bf16)."""
    head = state() / "work" / "train" / "back" / "eagle_head"
    methods = ["plain", "ngram"] + ([str(head)] if head.is_dir() else [])
    rc = run([sys.executable, "infer.py", "bench", "--device", ctx.sizes["device"], "--dtype", "bf16", "--methods",
              ",".join(methods), *ctx.sizes["bench"], "--out-dir", str(ctx.back / "bench"), "--no-progress"],
             ctx.left(3))
    return 1 if rc is None else rc


STEPS = {"store": store, "probe": probe, "setup": setup, "regen": regen, "train": train, "tests": tests,
         "bench": bench}
