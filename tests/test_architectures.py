"""Beyond the five architectures every other test runs on (conftest.ARCHS): 20 more decoder families of transformers,
each a tiny random model, decode token-identically to their own ``generate`` with every kind of draft, and the
families whose trees cannot be verified (ALiBi biases, recurrent layers) are refused up front with the reason.

The families differ where tree verification could go wrong: q/k norms (Qwen3, OLMo-2), fused or partial rotary
(Phi-3, Phi, StableLM, GPT-NeoX, GPT-J), learned positions (OPT, GPT-BigCode, GPT-Neo), mixtures of experts
(Mixtral, Qwen3-MoE, gpt-oss), multi-head latent attention (DeepSeek-V3), attention sinks and eager-only attention
(gpt-oss, Gemma-2), layers that return tuples (Falcon, GPT-Neo), a decoder that ``get_decoder`` does not find
(Llama-4's text model); and five of them again with a sliding window of 16, decoding far beyond it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Recording, random_prompts, reference
from transformers import AutoConfig, AutoModelForCausalLM

from heads.block.config import BlockConfig
from heads.block.drafter import BlockDrafter
from heads.block.model import BlockHead
from heads.eagle.config import EagleConfig
from heads.eagle.drafter import EagleDrafter
from heads.eagle.model import EagleHead
from selfspec import Target, Tree
from selfspec.core.generate import generate
from selfspec.core import hf
from selfspec.drafts.early_exit import EarlyExitDrafter
from selfspec.drafts.layerskip import LayerSkipDrafter
from selfspec.testing import OracleDrafter
from selfspec.core.tree import DynamicTree

VOCAB = 96
NEW = 12
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
SUPPORTED = {
    "qwen3": dict(head_dim=8),
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "phi3": {},
    "phi": {},
    "gemma2": dict(head_dim=8, sliding_window=256),
    "olmo2": {},
    "stablelm": {},
    "gpt_neox": {},
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "cohere": {},
    "starcoder2": {},
    "smollm3": {},
    "gpt_bigcode": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, rotary_dim=4),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=256),
    "llama4_text": dict(head_dim=8, num_local_experts=1, interleave_moe_layer_step=1, intermediate_size_mlp=64),
    "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                        head_dim=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1),
    "gpt_oss": dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=256),
}
ALIBI = {
    "mpt": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=256),
    "bloom": dict(n_layer=2, n_head=4),
    "falcon": dict(alibi=True, new_decoder_architecture=True, num_kv_heads=2),
}
SLIDING = {  # a window of 16 (the models above have 256, beyond any test sequence)
    "gemma2": dict(sliding_window=16),
    "gpt_oss": dict(sliding_window=16),
    "qwen3": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "cohere2": dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(sliding_window=16),
}
RECURRENT = {
    "mamba": dict(state_size=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2, mamba_d_state=8),
    "qwen3_next": dict(head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_ff_dim=64),
    "rwkv": dict(attention_hidden_size=32),
}


def build(model_type: str, overrides: dict) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def eagle(model) -> EagleDrafter:
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_model(model, draft_vocab_size=64), model.get_input_embeddings(),
                     model.get_output_embeddings())
    return EagleDrafter(head.to(model.device).eval(), depth=4, topk=3, budget=10)


def block(model) -> BlockDrafter:
    torch.manual_seed(0)
    head = BlockHead(BlockConfig.for_model(model, block_size=4, draft_vocab_size=64), model.get_input_embeddings(),
                     model.get_output_embeddings())
    return BlockDrafter(head.to(model.device).eval(), DynamicTree(10))


@pytest.mark.parametrize("model_type", sorted(SUPPORTED))
def test_every_kind_of_draft_is_lossless_on_more_architectures(model_type):
    check_every_kind_of_draft(build(model_type, SUPPORTED[model_type]), random_prompts(3, VOCAB, seed=5), NEW)


@pytest.mark.parametrize("model_type", sorted(SLIDING))
def test_decoding_beyond_the_sliding_window_is_lossless_on_more_architectures(model_type):
    """A window of 16, prompts of 12-24 tokens, 30 new ones: far beyond the window, with every kind of draft."""
    model = build(model_type, {**SUPPORTED.get(model_type, {}), **SLIDING[model_type]})
    assert hf.sliding_window(model) == 16 and Target(model).window_limit is None
    check_every_kind_of_draft(model, random_prompts(3, VOCAB, seed=5, min_len=12, max_len=24), 30)


def check_every_kind_of_draft(model, prompts: list[torch.Tensor], new: int) -> None:
    """Greedy decoding of ``prompts`` with a tree, an EAGLE head, a block drafter, early exit (chain and tree) and layer
    skipping equals the model's own ``generate``; the tree's branch is accepted and early exit's work is reused (nothing
    vacuous)."""
    model_type = model.config.model_type
    target = Target(model)
    refs = [reference(model, p, new) for p in prompts]
    exit_chain = EarlyExitDrafter(target, 1, depth=3)
    reusing = exit_chain.verifier()  # verifies the chains with the early layers' drafting work reused
    drafters = {
        "oracle tree": lambda ref: OracleDrafter(Tree.full([2, 2]), VOCAB, ref, branch_rank=1, seed=3),
        "EAGLE head": lambda ref: eagle(model),
        "block drafter": lambda ref: block(model),
        "early exit (chain)": lambda ref: exit_chain,
        "early exit (dynamic tree)": lambda ref: EarlyExitDrafter(target, 1, tree=DynamicTree(6)),
        "layer skip": lambda ref: LayerSkipDrafter(target, (1,), depth=3),
    }
    for name, make in drafters.items():
        for prompt, ref in zip(prompts, refs):
            drafter = make(ref)
            out = generate(reusing if drafter is exit_chain else target, drafter, prompt, new)
            assert out.tokens == ref, f"{model_type}, {name}: differs from generate"
            if name == "oracle tree":  # the tree's rank-1 branch really is verified and kept
                assert all(len(s.tokens) == 3 for s in out.steps[1:-1]), f"{model_type}: oracle branch not accepted"
    assert reusing.reused > 0, f"{model_type}: no early-exit work was reused"


def test_gpt_neo_trees_stay_inside_its_local_window():
    """GPT-Neo's local layers window by index: up to the window decoding is exact, each tree cut to fit inside it."""
    model = build("gpt_neo", {**SUPPORTED["gpt_neo"], "window_size": 32})
    target = Target(model)
    assert target.window_limit == 32
    prompt = random_prompts(2, VOCAB, seed=4, min_len=14, max_len=14)[1]  # (the first repeats a span: longer)
    ref = reference(model, prompt, 17)  # 14 + 17 = 31: the last token the window allows
    rec = Recording(OracleDrafter(Tree.full([3, 2]), VOCAB, ref, branch_rank=1, seed=1))
    assert generate(target, rec, prompt, 17).tokens == ref
    fits = [state.tokens.shape[0] - 1 + len(draft.tree) for state, (draft, _) in zip(rec.states, rec.records)]
    assert max(fits) <= 31 and any(len(draft.tree) < 10 for draft, _ in rec.records[:-1])


def test_llama4_chunked_attention_keeps_requests_inside_one_chunk():
    """Llama-4's chunked layers attend within their chunk only (transformers keeps them as sliding layers): inside one
    chunk they attend like full layers, so requests stay inside it."""
    model = build("llama4_text", {**SUPPORTED["llama4_text"], "attention_chunk_size": 32})
    target = Target(model)
    assert target.window_limit == 32 and not any(target.new_cache().is_sliding)
    check_every_kind_of_draft(model, random_prompts(2, VOCAB, seed=5, min_len=10, max_len=12), 12)  # <= 18 + 12 tokens
    with pytest.raises(ValueError, match=r"reaches this model's local attention window \(32\)"):
        generate(target, OracleDrafter(Tree.chain(2), VOCAB, [0] * 30, seed=0), torch.zeros(12, dtype=torch.long), 20)


def test_layers_that_return_tuples_are_recognised():
    """Falcon's and GPT-Neo's decoders read ``outputs[0]`` of each layer: a stand-in layer must answer in kind."""
    for model_type, expected in (("falcon", True), ("gpt_neo", True), ("llama", False), ("gpt2", False)):
        model = build(model_type, SUPPORTED.get(model_type, {}))
        assert hf.layers_return_tuples(type(hf.decoder(model))) is expected, model_type


def test_the_decoder_is_found_where_get_decoder_returns_the_causal_lm():
    model = build("llama4_text", SUPPORTED["llama4_text"])
    assert model.get_decoder() is model  # transformers' lookup misses it (base_model_prefix names no attribute)
    assert hf.decoder(model) is model.model and len(hf.decoder_layers(model)) == 2


def test_an_eagle_head_on_an_architecture_without_sdpa_uses_eager_attention():
    head = eagle(build("gemma2", SUPPORTED["gemma2"])).head
    assert head.decoder.config._attn_implementation == "eager"
    assert eagle(build("qwen3", SUPPORTED["qwen3"])).head.decoder.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("model_type", sorted(ALIBI))
def test_alibi_models_are_refused(model_type):
    model = build(model_type, ALIBI[model_type])
    with pytest.raises(TypeError, match=f"model_type='{model_type}'.*ALiBi.*not be lossless"):
        Target(model)


def test_the_alibi_refusal_is_needed_mpt_trees_decode_other_text(monkeypatch):
    """Without the refusal, MPT's ALiBi biases (from each key's index) make a verified tree's side branches wrong:
    greedy output parts from generate. When transformers computes them from position ids, this test fails: lift the
    refusal then."""
    model = build("mpt", ALIBI["mpt"])
    monkeypatch.setattr(hf, "unverifiable", lambda model: None)
    target = Target(model)
    differ = 0
    for prompt in random_prompts(6, VOCAB, seed=5):
        ref = reference(model, prompt, NEW)
        out = generate(target, OracleDrafter(Tree.full([2, 2]), VOCAB, ref, branch_rank=1, seed=3), prompt, NEW)
        differ += out.tokens != ref
    assert differ >= 1


@pytest.mark.parametrize("model_type", sorted(RECURRENT))
def test_recurrent_models_are_refused(model_type):
    model = build(model_type, RECURRENT[model_type])
    with pytest.raises(TypeError, match=f"model_type='{model_type}'.*recurrent.*cannot be verified"):
        Target(model)


def test_training_drafts_for_a_recurrent_model_is_refused_before_it_starts(tmp_path, capsys):
    import json

    import train

    config = {"model_type": "mamba", **BASE, **RECURRENT["mamba"], "vocab_size": 300}  # the byte tokenizer's 259 fit
    code = train.main(["--config", "configs/medusa_tiny.yaml", f"model.config={json.dumps(config)}",
                       f"output_dir={tmp_path / 'out'}", "logging.log_with=[]"])
    assert code == 2
    assert "model.config (model_type='mamba'): drafts for this model could never be verified" in capsys.readouterr().err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_model_without_sdpa_loads_with_eager_attention(tmp_path):
    """load_model's default, sdpa, falls back to eager where transformers has none (``infer.py --model DIR``)."""
    from transformers import AutoTokenizer

    from selfspec.core.models import DEFAULT_MODEL, load_model, resolve

    build("gemma2", {**SUPPORTED["gemma2"], "vocab_size": 49152}).save_pretrained(tmp_path / "gemma2")
    AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL)[0]).save_pretrained(tmp_path / "gemma2")
    model, _ = load_model(str(tmp_path / "gemma2"))
    assert model.config._attn_implementation == "eager"


OPT_350M = {"word_embed_proj_dim": 32}  # OPT-350m's shape: layers 64 wide, projected to 32 for the LM head (project_out)


def test_a_model_whose_lm_head_reads_a_projected_state_decodes_with_every_draft():
    """OPT-350m's decoder projects its last layer's output (64 wide here) to the LM head's width (32): an EAGLE head
    works at the LM head's width, early exit and layer skipping run the model's own project_out."""
    model = build("opt", {**SUPPORTED["opt"], "hidden_size": 64, **OPT_350M})
    assert model.model.decoder.project_out is not None and Target(model).hidden_size == 32
    check_every_kind_of_draft(model, random_prompts(3, VOCAB, seed=5), NEW)


@pytest.mark.parametrize("model_type,overrides", [("opt", {"hidden_size": 64, **OPT_350M}), ("gpt_neox", {}),
                                                  ("falcon", {})])
def test_what_an_exit_head_feeds_the_lm_head_is_what_the_decoder_does_after_its_last_layer(model_type, overrides):
    """heads.exit_head.final_norm (the final norm, and OPT-350m's project_out) applied to the last layer's output is
    the decoder's own final hidden state, exactly."""
    from heads.exit_head.model import final_norm
    from heads.training.base_model import final_hidden

    model = build(model_type, {**SUPPORTED[model_type], **overrides})
    ids = random_prompts(1, VOCAB, seed=1)[0][None]
    with torch.no_grad(), hf.captured_output(hf.decoder_layers(model)[-1]) as outputs:
        final = final_hidden(model, ids, torch.ones_like(ids))
    assert torch.equal(final_norm(model)(outputs[-1]), final)


def test_eagle3_features_of_another_width_than_the_lm_heads_are_refused():
    model = build("opt", {**SUPPORTED["opt"], "hidden_size": 64, **OPT_350M})
    with pytest.raises(ValueError, match=r"layers are 64 wide but its LM head reads 32 .* only its final state \(2\)"):
        EagleConfig.for_model(model, feature_layers=[0, 2])
    assert EagleConfig.for_model(model, feature_layers=[2]).hidden_size == 32


def test_an_eagle_unroll_longer_than_gpt_neos_causal_buffer_is_refused_with_what_fits():
    """GPT-Neo's attention slices a causal-bias buffer of max_position_embeddings (here 256) by the key length; the
    unroll attends over unroll x (T - 1) keys."""
    model = build("gpt_neo", SUPPORTED["gpt_neo"])
    head = EagleHead(EagleConfig.for_model(model), model.get_input_embeddings(), model.get_output_embeddings())
    ids = torch.randint(0, VOCAB, (1, 101))
    features = torch.randn(1, 101, 32)
    with pytest.raises(ValueError, match=r"attends over 3 x 100 keys.*at most 256.*max_length to 86 or eagle.unroll to 2"):
        head(features, ids, torch.tensor([101]), unroll=3)
    assert head(features, ids, torch.tensor([101]), unroll=2).shape == (2, 1, 100, 32)


@pytest.mark.parametrize("model_type,method,overrides,args", [
    ("gemma2", "eagle", {"sliding_window": 16}, []),  # eager attention, training rows far longer than the window
    ("falcon", "exit_head", {}, []),  # layers that return tuples
    ("gptj", "medusa", {}, ["heads.projection=own"]),  # an LM head with a bias: own projections copy and train it
    ("gpt_neox", "exit_head", {}, []),  # the final norm is final_layer_norm
    ("opt", "hydra", OPT_350M, ["hidden_cache.enabled=true"]),  # heads and cache at the LM head's width (32)
    ("opt", "eagle", OPT_350M, []),  # the head's decoder at the LM head's width
    ("opt", "exit_head", OPT_350M, []),  # layer E's input (64) -> final norm -> project_out -> LM head
])
def test_train_py_trains_drafts_for_other_architectures(tmp_path, model_type, method, overrides, args):
    """train.py on a tiny random target of another family (``model.config``), then the trained draft loads strictly
    and decodes token-identically to that target's own generate."""
    import json

    from conftest import train_losses

    from heads.training.base_model import load_base
    from heads.training.config import ModelConfig
    from selfspec import registry

    config = {**BASE, **SUPPORTED[model_type], **overrides, "model_type": model_type, "vocab_size": 300,
              "hidden_size": 64, "initializer_range": 0.02}
    args = ["--config", "configs/medusa_tiny.yaml", f"method={method}", f"model.config={json.dumps(config)}",
            "optim.max_steps=4", "eval.every=4", "checkpoint.every=0", "logging.log_with=[]", "exit.layer=1", *args]
    losses = train_losses(tmp_path / "out", args)
    assert len(losses) == 4 and all(loss == loss for loss in losses.values())  # 4 logged steps, no NaN
    checkpoint = tmp_path / "out" / {"eagle": "eagle_head", "exit_head": "exit_head", "medusa": "heads",
                                     "hydra": "hydra_heads"}[method]
    model, tokenizer = load_base(ModelConfig(config=config))
    stored = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    assert stored == (64 if method == "exit_head" or model_type != "opt" else 32)  # the width the draft reads
    target = Target(model)
    drafter = registry.build_drafter(registry.parse_draft(str(checkpoint)), target)
    prompt = torch.tensor(tokenizer("Hi there, how are you today?")["input_ids"])
    out = generate(drafter.verifier() or target, drafter, prompt, 40)
    assert out.tokens == reference(model, prompt, 40)


VLM_TEXT = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
VLMS = {  # vision-language models that transformers has no causal-LM class for
    "qwen2_5_vl": dict(text_config=dict(VLM_TEXT, model_type="qwen2_5_vl_text",
                                        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
                       vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)),
    "mistral3": dict(text_config=dict(VLM_TEXT, model_type="mistral"),
                     vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=32, patch_size=8, head_dim=16)),
    "llava": dict(text_config=dict(VLM_TEXT, model_type="llama"), image_token_id=299,
                  vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
                                     projection_dim=32)),
}


def save_vlm(model_type: str, directory) -> str:
    """A tiny random vision-language model and a byte-level chat tokenizer saved to ``directory``."""
    from transformers import AutoModelForImageTextToText

    from heads.training.base_model import byte_tokenizer

    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **VLMS[model_type])).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("model_type", sorted(VLMS))
def test_vision_language_models_decode_text_prompts(tmp_path, model_type):
    """``--model`` a Qwen2.5-VL / Mistral-3 / LLaVA directory (no causal-LM class in transformers): loaded as its
    image-text-to-text model, it decodes text prompts token-identically to its own generate (n-gram and early-exit
    drafts; greedy, and sampling runs)."""
    from selfspec import api

    location = save_vlm(model_type, tmp_path / model_type)
    for draft in ("ngram", "early-exit:layer=1"):
        m = api.load(location, draft=draft)
        assert type(m.model).__name__.endswith("ForConditionalGeneration")
        prompt = "Hi there, tell me about the sea."
        assert m.generate(prompt, max_new_tokens=24).tokens == m.generate_plain(prompt, max_new_tokens=24).tokens
        assert len(m.generate(prompt, max_new_tokens=8, temperature=0.8, seed=0).tokens) == 8


def test_train_py_trains_an_eagle_head_for_a_vision_language_model(tmp_path):
    """train.py with ``model.name`` a Qwen2.5-VL directory: the head's decoder is its text model's layer; the trained
    head decodes token-identically."""
    from conftest import train_losses

    from selfspec import api

    location = save_vlm("qwen2_5_vl", tmp_path / "vlm")
    args = ["--config", "configs/medusa_tiny.yaml", "method=eagle", f"model.name={location}", "optim.max_steps=3",
            "eval.every=3", "checkpoint.every=0", "logging.log_with=[]"]
    assert len(train_losses(tmp_path / "out", args)) == 3
    m = api.load(location, draft=str(tmp_path / "out" / "eagle_head"))
    prompt = "Hi there, tell me about the sea."
    assert m.generate(prompt, max_new_tokens=24).tokens == m.generate_plain(prompt, max_new_tokens=24).tokens
