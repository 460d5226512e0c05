"""Proof by the other side for a draft in vLLM's ``speculators`` format: speculators 0.9 itself, in a venv of its own
(its pins, transformers <= 5.19 and datasets <= 5.1, conflict with selfspec's), loads the checkpoint with its own
loader and runs its own draft model on the target's states of real prompts; its draft logits and drafted tokens are
compared with selfspec's drafter's.

    python -m heads.speculators_check DRAFT [--model BASE] [--prompts 20] [--steps 3] [--out report.json]

DRAFT is a speculators EAGLE-3 or DFlash checkpoint (trained by ``train.py`` with ``method: eagle3`` / ``dflash``, or
written by ``python -m heads.export --format speculators``). The prompts are the first turns of the MT-bench
questions, one per category in turn, in the target's chat template. Everything runs in fp32.

- EAGLE-3: at every position of a prompt, speculators' training-time test (step 0 on the target's aux states, step u
  on its own step u-1 output) against selfspec's drafter fed the same tokens (``eagle3_side``), ``--steps`` steps;
- DFlash: speculators' anchored-block pass with every position an anchor against the block selfspec's drafter
  computes with that prefix (``dflash_side``).

A prompt passes when every draft logit agrees to ``ATOL`` / ``RTOL`` and the chain selfspec drafts after it is the
one speculators' logits give. The venv is created once per machine (``SPECULATORS_VENV``, from the package index pip
is configured with: a few minutes) and reused.

Shapes: n committed positions of a prompt, A·D the target's aux states, K steps or block slots drafted, V' draft
vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, PreTrainedModel

from heads.block.dflash import DFlashHead
from heads.block.drafter import BlockDrafter
from heads.checkpoints.files import CONFIG, resolve
from heads.cli import report_errors
from heads.eagle.drafter import EagleDrafter
from heads.eagle.eagle3 import Eagle3Head
from heads.speculators_export import export_speculators, module_for
from selfspec.core.drafter import DraftState
from selfspec.core.models import cache_dir, load_model
from selfspec.core.models import resolve as resolve_model
from selfspec.core.target import Target
from selfspec.core.tree import Tree
from selfspec.tools.bench import DEFAULT_QUESTIONS
from selfspec.tools.specbench import load_questions

SIDE = Path(__file__).with_name("speculators_side.py")
PINS = ("torch==2.13.0", "speculators==0.9.0")
SPECULATORS_VENV = cache_dir() / "speculators-0.9.0-venv"
ATOL = RTOL = 1e-4
"""fp32 tolerance on draft logits (measured differences on tiny drafts: ~1e-6, rounding from speculators' own order
of operations)."""


class VenvError(RuntimeError):
    """The speculators venv could not be created (pip's own words)."""


def speculators_python(venv: Path = SPECULATORS_VENV) -> Path:
    """The python of a venv with speculators==0.9.0, created on first use (in a temporary directory renamed into place,
    so a half-made venv is never reused). torchvision and torchaudio, which pip pulls in for speculators but
    speculators never imports, are removed: the registry's wheels are built for CUDA torch, and with the CPU torch
    torchvision's operators fail to register, which breaks transformers' import of its image utilities."""
    python = venv / "bin" / "python"
    if (venv / "READY").is_file():
        return python
    base = shutil.which("python3.11") or sys.executable
    tmp = venv.with_name(f"{venv.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    steps = {f"{Path(base).name} -m venv": [base, "-m", "venv", str(tmp)],
             f"pip install {' '.join(PINS)}": [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q",
                                               "--disable-pip-version-check", *PINS]}
    for what, step in steps.items():
        done = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            lines = [line for line in done.stderr.splitlines() if "is ignored: it is neither" not in line]
            raise VenvError(f"cannot create the speculators venv ({what}): " + " | ".join(lines[-6:]))
    subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio"],
                   capture_output=True, timeout=300)
    check = subprocess.run([str(tmp / "bin" / "python"), "-c", "import speculators.models.eagle3"],
                           capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"speculators installed but does not import: {check.stderr[-2000:]}")
    (tmp / "READY").write_text(" ".join(PINS) + "\n")
    try:
        os.rename(tmp, venv)
    except OSError:  # another process made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return python


# ----------------------------------------------------------------------------------------------- selfspec's side
def prefilled(model: PreTrainedModel, prompt: torch.Tensor) -> DraftState:
    """The DraftState a drafter sees at the first step of ``prompt`` on ``model``."""
    return DraftState.after_prefill(Target(model), prompt)


def eagle3_side(head: Eagle3Head, model: PreTrainedModel, prompt: torch.Tensor, steps: int) -> dict:
    """What selfspec's EAGLE drafter computes on ``prompt`` (n + 1 tokens): the chain it drafts (chain:steps), the draft
    logits [steps, n, V'] of every pair's chain (step u at pair i fed the tokens the speculators side is fed: the
    prompt's, then the drafted chain), and the inputs the speculators side reads."""
    state = prefilled(model, prompt)
    features = state.new_states.take(head.config.feature_layers)  # [n, A·D]
    drafted = EagleDrafter.with_tree(head, Tree.chain(steps)).draft(state).tokens[1:]  # [steps] base ids
    n = prompt.shape[0] - 1
    ids = torch.cat([prompt[1:], drafted[:-1]])  # [n + steps - 1]: pair i's step u reads ids[i + u]
    logits = torch.full((steps, n, head.config.draft_vocab_size), float("nan"))
    with torch.inference_mode():
        g = head.true_features(features)[None]  # [1, n, D]
        for i in range(n):
            cache = DynamicCache(config=head.decoder.config)
            f = head.step(g[:, : i + 1], ids[None, : i + 1], torch.arange(i + 1)[None], None, cache)[:, -1:]
            for u in range(steps):
                logits[u, i] = head.logits(f)[0, -1]
                if u + 1 < steps:
                    f = head.step(f, ids[None, i + u + 1: i + u + 2], torch.tensor([[i + u + 1]]), None, cache)
    hidden = torch.cat([features, features.new_zeros(steps - 1, features.shape[1])])[None]  # [1, n + steps - 1, A·D]
    return {"features": hidden, "ids": ids[None], "drafted": drafted, "logits": logits}


def dflash_side(head: DFlashHead, model: PreTrainedModel, prompt: torch.Tensor) -> dict:
    """What selfspec's DFlash drafter computes on ``prompt`` (n + 1 tokens): the chain it drafts after the prompt
    (chain:K), the draft logits [n + 1, K, V'] of the block at every anchor a = 1..n (root x_a, context 0..a-1; anchor
    0 has no context: NaN), and the inputs the speculators side reads, padded by a block so that the last root is an
    anchor there too (its last block_size positions are none)."""
    state = prefilled(model, prompt)
    features = state.new_states.take(head.config.feature_layers)  # [n, A·D]
    K, n = head.block_size, prompt.shape[0] - 1
    drafted = BlockDrafter.with_tree(head, Tree.chain(K)).draft(state).tokens[1:]  # [K] base ids
    logits = torch.full((n + 1, K, head.config.draft_vocab_size), float("nan"))
    with torch.inference_mode():
        for a in range(1, n + 1):
            logits[a] = head.logits(head.block(head.new_cache(), features[:a], prompt[: a + 1]))
    pad = K + 1
    hidden = torch.cat([features, features.new_zeros(1 + pad, features.shape[1])])[None]  # [1, n + 1 + pad, A·D]
    ids = torch.cat([prompt, prompt.new_zeros(pad)])[None]
    return {"features": hidden, "ids": ids, "drafted": drafted, "logits": logits}


def side_of(head: Eagle3Head | DFlashHead, model: PreTrainedModel, prompt: torch.Tensor, steps: int) -> dict:
    return dflash_side(head, model, prompt) if isinstance(head, DFlashHead) else eagle3_side(head, model, prompt, steps)


# ------------------------------------------------------------------------------------------- the other side, compared
def run_speculators(python: Path, cases: list[tuple[Path, dict, int]], workdir: Path) -> list[dict[str, torch.Tensor]]:
    """speculators' side of each (checkpoint, selfspec's side, steps), in one subprocess of the venv's python (-P:
    the script's folder, this package's, stays off its path) -> its logits and the d2t it loaded, per case."""
    job = []
    for k, (checkpoint, ours, steps) in enumerate(cases):
        kind = json.loads((checkpoint / "config.json").read_text())["speculators_model_type"]
        save_file({"hidden_states": ours["features"].contiguous(), "input_ids": ours["ids"].contiguous()},
                  str(workdir / f"inputs-{k}.safetensors"))
        job.append({"kind": kind, "checkpoint": str(checkpoint), "inputs": str(workdir / f"inputs-{k}.safetensors"),
                    "ttt_steps": steps, "out": str(workdir / f"out-{k}.safetensors")})
    (workdir / "job.json").write_text(json.dumps(job))
    done = subprocess.run([str(python), "-P", str(SIDE), str(workdir / "job.json")], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise RuntimeError(f"speculators' side failed: {done.stderr[-4000:]}")
    return [load_file(case["out"]) for case in job]


@dataclass
class Comparison:
    """One prompt: the largest logit difference, how many positions' top tokens agree, whether the drafted chain is
    the same, and whether everything is within tolerance."""

    positions: int
    max_difference: float
    top_agree: int
    chain_same: bool
    within_tolerance: bool


def compare(head: Eagle3Head | DFlashHead, ours: dict, theirs: dict[str, torch.Tensor]) -> Comparison:
    """selfspec's side against speculators' outputs for one prompt (see the module docstring)."""
    if isinstance(head, DFlashHead):
        n = ours["logits"].shape[0] - 1
        mine, got = ours["logits"][1:], theirs["logits"][1: n + 1, 1:]  # [n, K, V'] anchors 1..n, slots 1..K
        top = theirs["logits"][n, 1:].argmax(-1)  # [K] the block at the last root
    else:
        n = ours["logits"].shape[1]
        mine, got = ours["logits"], theirs["logits"][:, :n]  # [steps, n, V']
        top = theirs["logits"][:, n - 1].argmax(-1)  # [steps] the chain at the last pair
    chain = top if head.d2t is None else top + theirs["d2t"][top]
    return Comparison(positions=int(mine[..., 0].numel()), max_difference=float((got - mine).abs().max()),
                      top_agree=int((got.argmax(-1) == mine.argmax(-1)).sum()),
                      chain_same=chain.tolist() == ours["drafted"].tolist(),
                      within_tolerance=bool(torch.allclose(got, mine, atol=ATOL, rtol=RTOL)))


def mtbench_prompts(tokenizer, count: int) -> list[torch.Tensor]:
    """The first turns of ``count`` MT-bench questions, one per category in turn, in the chat template."""
    questions = load_questions(DEFAULT_QUESTIONS, per_category=(count + 7) // 8)
    by_category: dict[str, list] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    ordered = [q for row in zip(*by_category.values()) for q in row][:count]
    return [torch.tensor(tokenizer.apply_chat_template([{"role": "user", "content": q.turns[0]}], tokenize=True,
                                                       add_generation_prompt=True, return_dict=False))
            for q in ordered]


def check(draft: str, model_name: str | None, count: int, steps: int, python: Path) -> list[Comparison]:
    """The draft, on its verifier (or ``model_name``) in fp32, against speculators on ``count`` MT-bench prompts."""
    with tempfile.TemporaryDirectory(prefix="selfspec-speculators-check-") as tmp:
        workdir = Path(tmp)
        cls = module_for(draft)
        config = json.loads((resolve(draft) / CONFIG).read_text())
        name = model_name or config["speculators_config"]["verifier"]["name_or_path"]
        model, tokenizer = load_model(name, dtype="float32")
        local, _ = resolve_model(name)  # speculators' loader reads the verifier's files: name a local directory
        checkpoint = export_speculators(draft, workdir / "draft", model, verifier=str(local))
        head = cls.from_pretrained(checkpoint, model)
        cases = [(checkpoint, side_of(head, model, prompt, steps), steps) for prompt in mtbench_prompts(tokenizer, count)]
        outputs = run_speculators(python, cases, workdir)
        return [compare(head, ours, theirs) for (_, ours, _), theirs in zip(cases, outputs)]


@report_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m heads.speculators_check", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                epilog="Exit status: 0 every prompt within tolerance with the same chain, 1 not, 2 the "
                                       "arguments or the draft are wrong.")
    p.add_argument("draft", help="a speculators EAGLE-3 or DFlash checkpoint directory")
    p.add_argument("--model", default=None, help="the target (default: the verifier the draft names)")
    p.add_argument("--prompts", type=int, default=20, help="MT-bench first turns to check (default 20)")
    p.add_argument("--steps", type=int, default=3, help="EAGLE-3: drafting steps compared per position (default 3)")
    p.add_argument("--out", type=Path, default=None, help="write the per-prompt comparison here as JSON")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= 80 or args.steps < 1:
        p.error(f"expected --prompts 1..80 and --steps >= 1, found {args.prompts} and {args.steps}")
    results = check(args.draft, args.model, args.prompts, args.steps, speculators_python())
    for k, r in enumerate(results):
        print(f"prompt {k:2d}: {r.positions:5d} drafted positions, max |logit difference| {r.max_difference:.2e}, "
              f"top tokens agree {r.top_agree}/{r.positions}, chain {'same' if r.chain_same else 'DIFFERENT'}")
    passed = sum(r.within_tolerance and r.chain_same for r in results)
    print(f"{passed}/{len(results)} prompts: speculators {PINS[1].split('==')[1]} drafts what selfspec drafts "
          f"(logits to {ATOL:g}, the same chain)")
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
