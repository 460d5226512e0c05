"""Where users decode: on a GPU. Every tensor the loop, the drafters and the acceptance rules create lives on the
target's device.

- Everywhere: every random draw of seeded sampling is made on its generator's device (a draw without a device was made
  on the CPU, which raises with a CUDA generator: every seeded sampled request with a non-empty tree on a GPU).
- Marked ``cuda`` (skipped where torch sees no CUDA device, saying why; ``SELFSPEC_TEST_DEVICE=cpu`` runs them on the
  CPU, the rehearsal of selfspec/tools/gpu.py): greedy decoding with every kind of draft is token-identical to ``generate`` on
  the five tiny architectures (fp32); the KV cache after many steps is a fresh forward's; seeded sampling with trees
  repeats, and samples from the generator on the device; bf16 and fp16 decode; each trainable draft kind trains a few
  steps with train.py, loads back through ``--draft``'s registry onto the device and decodes token-identically.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ARCHS, GPU, VOCAB, random_prompts, reference, tiny_model
from selfspec import Sampling, Target, Tree
from selfspec.core.generate import generate
from selfspec.testing import OracleDrafter, RandomDrafter

REPO = Path(__file__).resolve().parents[1]
NEW = 12


def test_every_random_draw_is_made_on_its_generators_device(monkeypatch, model_dir):
    """Seeded sampling through the loop (trees of random drafts: the rejection sampler's uniform draws and its
    residual draws) and through the API (prompt lookup; a draft model sampling its own drafts): each draw that takes
    a generator is made on the generator's device, named, not left to the CPU default."""
    from selfspec import api

    draws: list[tuple[str, torch.device, torch.device | None]] = []
    rand, multinomial = torch.rand, torch.multinomial

    def spy_rand(*args, generator=None, device=None, **kwargs):
        if generator is not None:
            draws.append(("rand", generator.device, None if device is None else torch.device(device)))
        return rand(*args, generator=generator, device=device, **kwargs)

    def spy_multinomial(probs, *args, generator=None, **kwargs):
        if generator is not None:
            draws.append(("multinomial", generator.device, probs.device))
        return multinomial(probs, *args, generator=generator, **kwargs)

    monkeypatch.setattr(torch, "rand", spy_rand)
    monkeypatch.setattr(torch, "multinomial", spy_multinomial)
    model = tiny_model("llama")
    for prompt in random_prompts(2, VOCAB, seed=11):
        generate(Target(model), RandomDrafter(Tree.full([2, 2]), VOCAB, seed=1), prompt, 16,
                 sampling=Sampling(temperature=1.0), generator=torch.Generator().manual_seed(0))
    m = api.load(str(model_dir), draft=f"model:{model_dir}", tree="chain:2")
    m.generate("hello hello hello", max_new_tokens=12, temperature=0.9, seed=4)
    assert {kind for kind, _, _ in draws} == {"rand", "multinomial"}
    wrong = [d for d in draws if d[2] != d[1]]
    assert not wrong, f"{len(wrong)} of {len(draws)} draws not on their generator's device, e.g. {wrong[0]}"


# ------------------------------------------------------------------------------------------ on the device (cuda)
@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kind_of_draft_is_lossless_on_the_device(arch):
    """tests/test_architectures.py's check on the device: a tree, an EAGLE head, a block drafter, early exit (chain and
    dynamic tree), layer skipping; greedy fp32, each token-identical to the model's own ``generate`` there."""
    from test_architectures import check_every_kind_of_draft

    model = tiny_model(arch).to(GPU)
    check_every_kind_of_draft(model, [p.to(GPU) for p in random_prompts(3, VOCAB, seed=5)], NEW)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_cache_after_many_steps_is_a_fresh_forwards_on_the_device(arch):
    from test_cache import TREE, assert_same_cache, plain_cache
    from conftest import REPEATING, Recording

    model = tiny_model(arch, initializer_range=REPEATING).to(GPU)
    prompt = random_prompts(1, VOCAB, seed=7, min_len=8, max_len=12)[0].to(GPU)
    ref = reference(model, prompt, 40)
    rec = Recording(OracleDrafter(TREE, VOCAB, ref, branch_rank=1))
    out = generate(Target(model), rec, prompt, 40)
    assert out.tokens == ref and len(out.steps) > 5
    accepted = torch.cat([prompt, torch.tensor(out.tokens[:-1], device=GPU)])
    assert_same_cache(rec.states[-1].cache, plain_cache(model, accepted), f"{arch} on {GPU}")


@pytest.mark.cuda
def test_seeded_sampling_with_trees_repeats_on_the_device(model_dir):
    """The loop with a tree of random drafts and a generator on the device (the rejection sampler's draws there), twice
    with one seed: the same tokens; another seed: others. Through the API: a seeded sampled request with prompt lookup
    and with a draft model sampling its own drafts, twice each."""
    from selfspec import api

    model = tiny_model("llama").to(GPU)
    prompt = random_prompts(1, VOCAB, seed=3)[0].to(GPU)

    def sampled(seed: int) -> list[int]:
        return generate(Target(model), RandomDrafter(Tree.full([2, 2]), VOCAB, seed=1), prompt, 24,
                        sampling=Sampling(temperature=1.0),
                        generator=torch.Generator(device=GPU).manual_seed(seed)).tokens

    assert sampled(0) == sampled(0) != sampled(1)
    for draft, tree in (("ngram", None), (f"model:{model_dir}", "chain:2")):
        m = api.load(str(model_dir), draft=draft, tree=tree, device=GPU)
        runs = [m.generate("hello hello hello", max_new_tokens=16, temperature=0.9, seed=4).tokens for _ in range(2)]
        assert runs[0] == runs[1], draft


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_decodes_on_the_device(model_dir, dtype):
    """bf16 and fp16: plain decoding through the loop is transformers' own (one token a forward), and prompt lookup
    decodes to the end."""
    from selfspec import api

    for draft in ("none", "ngram"):
        m = api.load(str(model_dir), draft=draft, dtype=dtype, device=GPU)
        out = m.generate("count to ten", max_new_tokens=16)
        assert m.target.model.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        assert 0 < len(out.tokens) <= 16
        if draft == "none":
            assert out.tokens == m.generate_plain("count to ten", max_new_tokens=16).tokens


ROUND_TRIP = {  # train.py's arguments for a few steps of each draft kind on the tiny recipes' targets
    "medusa": ["--config", "configs/medusa_tiny.yaml"],
    "hydra": ["--config", "configs/medusa_tiny.yaml", "method=hydra"],
    "exit_head": ["--config", "configs/medusa_tiny.yaml", "method=exit_head", "exit.layer=1"],
    "eagle": ["--config", "configs/medusa_tiny.yaml", "method=eagle", "eagle.draft_vocab=64"],
    "eagle3": ["--config", "configs/medusa_tiny.yaml", "method=eagle3", "eagle.draft_vocab=64",
               "eagle.feature_layers=[0,1]", "eagle.feature_weight=0"],
    "block": ["--config", "configs/block_tiny.yaml"],
    "dflash": ["--config", "configs/medusa_tiny.yaml", "method=dflash", "block.draft_vocab=64",
               "block.feature_layers=[0,1]", "block.block_size=3"],
    "draft_model": ["--config", "configs/draft_model_tiny.yaml"],
}


@pytest.mark.cuda
@pytest.mark.parametrize("method", list(ROUND_TRIP))
def test_train_save_load_decode_on_the_device(tmp_path, method):
    """train.py (accelerate puts it on the GPU where there is one) for 3 steps -> the saved draft loaded by the
    registry onto the target on the device -> greedy decoding token-identical to ``generate`` there."""
    from heads.training.base_model import load_base
    from heads.kinds import kind_for
    from heads.training.recipe import load_config
    from selfspec import registry
    from selfspec.api import SpecModel

    args = [*ROUND_TRIP[method], "optim.max_steps=3", "eval.every=0", "logging.log_with=[]",
            f"output_dir={tmp_path}"]
    done = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    base, tokenizer = load_base(load_config(REPO / args[1], args[2:]).model)
    target = Target(base.to(GPU))
    drafter = registry.build_drafter(registry.parse_draft(str(tmp_path / kind_for(method).final_dir)), target)
    spec = SpecModel(target, tokenizer, drafter)
    ids = spec.encode("Hi there")
    assert ids.device.type == torch.device(GPU).type
    assert spec.generate(ids, max_new_tokens=16).tokens == reference(base, ids, 16), method
