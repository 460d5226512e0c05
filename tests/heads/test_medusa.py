"""MedusaHeads: distinct modules per block, zero-init equals the LM head, projections, strict config."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from heads.medusa.config import MedusaConfig
from heads.medusa.model import MedusaHeads


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def make(model, **kwargs) -> MedusaHeads:
    return MedusaHeads(MedusaConfig.for_model(model, **kwargs), model.lm_head)


@pytest.mark.parametrize("projection", ["shared", "own", "lora"])
def test_distinct_parameters_per_block_and_head(llama, projection):
    heads = make(llama, num_heads=3, num_layers=2, projection=projection, lora_rank=4)
    params = list(heads.parameters())
    assert len({id(p) for p in params}) == len(params)
    assert len({p.data_ptr() for p in params}) == len(params)  # no storage shared either
    blocks = [b for h in heads.heads for b in h.blocks]
    assert len(blocks) == 6 and len({id(b) for b in blocks}) == 6
    # training one block changes no other block
    with torch.no_grad():
        blocks[0].linear.weight.fill_(1.0)
    assert all(not b.linear.weight.detach().any() for b in blocks[1:])


@pytest.mark.parametrize("projection", ["shared", "own", "lora"])
def test_new_heads_predict_exactly_what_the_lm_head_predicts(llama, projection):
    heads = make(llama, num_heads=3, num_layers=2, projection=projection, lora_rank=4)
    hidden = torch.randn(2, 5, 32)
    logits = heads(hidden)
    assert logits.shape == (3, 2, 5, 96)
    expected = llama.lm_head(hidden)
    for k in range(3):
        assert torch.equal(logits[k], expected)


def test_state_dict_holds_no_base_weights_and_shared_head_is_never_trained(llama):
    for projection, per_head in (("shared", []), ("own", ["proj.weight"]),
                                 ("lora", ["proj.lora_A.default.weight", "proj.lora_B.default.weight"])):
        heads = make(llama, num_heads=2, num_layers=1, projection=projection, lora_rank=4)
        keys = set(heads.state_dict())
        expected = {f"heads.{k}.{n}" for k in range(2) for n in ["blocks.0.linear.weight", "blocks.0.linear.bias", *per_head]}
        assert keys == expected
    heads = make(llama, num_heads=2, num_layers=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    heads(torch.randn(3, 32)).sum().backward()
    assert llama.lm_head.weight.grad is None
    assert all(p.grad is not None for p in heads.parameters())


def test_own_projection_is_a_copy_not_the_base_weight(llama):
    heads = make(llama, num_heads=1, projection="own")
    assert torch.equal(heads.heads[0].proj.weight, llama.lm_head.weight)
    assert heads.heads[0].proj.weight.data_ptr() != llama.lm_head.weight.data_ptr()


def test_config_is_strict():
    base = dict(base_model="m", base_revision=None, hidden_size=32, vocab_size=96)
    with pytest.raises(ValueError, match=r"unknown MedusaConfig keys \['medusa_num_heads'\]"):
        MedusaConfig.from_dict({**base, "medusa_num_heads": 2})
    with pytest.raises(ValueError, match=r"MedusaConfig.num_heads: expected int, found str"):
        MedusaConfig.from_dict({**base, "num_heads": "4"})
    with pytest.raises(ValueError, match=r"MedusaConfig.hidden_size: expected int, found bool"):
        MedusaConfig.from_dict({**base, "hidden_size": True})
    with pytest.raises(ValueError, match=r"projection: expected one of \['shared', 'own', 'lora'\], found 'mine'"):
        MedusaConfig.from_dict({**base, "projection": "mine"})
    with pytest.raises(ValueError, match="missing required keys \\['vocab_size'\\]"):
        MedusaConfig.from_dict({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="3 levels deep; 2 heads draft at most 2"):
        MedusaConfig.from_dict({**base, "num_heads": 2, "tree": [[0], [0, 0], [0, 0, 0]]})
    with pytest.raises(ValueError, match="head_accuracy has 1 rows, expected one per head \\(2\\)"):
        MedusaConfig.from_dict({**base, "num_heads": 2, "head_accuracy": [[0.5]]})
    assert MedusaConfig.from_dict({**base, "head_accuracy": [[1, 0.5]] * 4}).head_accuracy == [[1, 0.5]] * 4


def test_lm_head_of_another_size_is_refused(llama):
    config = MedusaConfig(base_model="big", base_revision=None, hidden_size=4096, vocab_size=96)
    with pytest.raises(ValueError, match="heads were trained for hidden size 4096, this model has 32"):
        MedusaHeads(config, llama.lm_head)
