"""Export drafts for serving engines, each checked by loading it back.

    python -m heads.export runs/medusa-smollm2 exports/medusa-smollm2-vllm [--model BASE] [--original-lm-head]
    python -m heads.export DRAFT exports/eagle3-vllm --format speculators [--verifier HUB_ID] [--model BASE]

--format vllm (the default): Medusa heads in vLLM's Medusa format (heads/medusa/vllm.py).
--format speculators: an EAGLE-3 or DFlash draft in the format of vLLM's speculators library (heads/speculators_export.py);
selfspec's own EAGLE and block heads are refused, saying which parts of them the format cannot express.

    python -m heads.export DRAFT exports/eagle3-bf16.gguf --format gguf --target-gguf exports/smollm2-bf16.gguf
    python -m heads.export smollm2-135m-instruct exports/smollm2-bf16.gguf --format gguf --llama-cpp LLAMA_CPP_DIR

--format gguf: for llama.cpp (heads/gguf_export.py). A speculators EAGLE-3 or DFlash draft becomes the file
``llama-server -md`` loads, its tokenizer the target's (--target-gguf; a path that does not exist yet is made first
from the draft's target by llama.cpp's converter); a model becomes the target GGUF, by llama.cpp's own
``convert_hf_to_gguf.py`` (--llama-cpp DIR or $LLAMA_CPP_DIR: a llama.cpp source tree).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from huggingface_hub import snapshot_download

from heads.checkpoints.contents import check_output, describe
from heads.checkpoints.files import CONFIG, resolve
from heads.cli import report_errors
from heads import gguf_export
from heads.eagle.speculators_config import Eagle3Config
from heads.speculators_export import FORMATS, differences, export_speculators, instead_of, refuse, vllm_caveats
from heads.medusa.config import read_config
from heads.medusa.model import load_heads
from heads.medusa.vllm import export_vllm
from selfspec.core.files import read_json_object
from selfspec.core.models import BUILTIN, load_model, resolve as resolve_model


def is_vllm_export(directory: Path) -> bool:
    """A directory an earlier export wrote (its config.json is vLLM's Medusa config): exporting over it is allowed."""
    return describe(directory) == "a vLLM Medusa export"


def is_speculators_export(directory: Path) -> bool:
    """A directory holding a speculators EAGLE-3 or DFlash checkpoint (an earlier export): exporting over it is
    allowed."""
    return describe(directory) in {f"a speculators {kind} checkpoint" for kind in FORMATS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m heads.export", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Exit status: 0 exported and checked, 2 the arguments, the checkpoint or "
                                            "the output directory are wrong, or the format cannot express the draft "
                                            "(one line says which).")
    parser.add_argument("heads", help="a draft checkpoint: local directory or Hub id (--format gguf: or a model, "
                                      "converted to the target GGUF)")
    parser.add_argument("out_dir", type=Path, help="where to write the export: a new or empty directory, or an "
                                                   "earlier export to replace (--format gguf: a .gguf file)")
    parser.add_argument("--format", choices=["vllm", "speculators", "gguf"], default="vllm",
                        help="vllm: vLLM's Medusa format (Medusa heads); speculators: the speculators library's "
                             "format (EAGLE-3 and DFlash drafts), which vLLM loads; gguf: llama.cpp's format (a "
                             "speculators EAGLE-3 or DFlash draft, or the target model) (default vllm)")
    parser.add_argument("--model", default=None, help="the base model (default: the one the draft names)")
    parser.add_argument("--revision", default=None, help="Hub revision of the draft")
    parser.add_argument("--original-lm-head", action="store_true",
                        help="vllm: write the shared LM head once (vLLM's original_lm_head); 'shared' projection only")
    parser.add_argument("--verifier", default=None,
                        help="speculators: the target the export names (speculators_config.verifier.name_or_path, "
                             "e.g. its Hub id); default: the one the draft names")
    parser.add_argument("--target-gguf", type=Path, default=None, metavar="PATH",
                        help="gguf, a draft: the target's GGUF, whose tokenizer the draft's file carries (llama.cpp "
                             "refuses a draft whose vocabulary differs); made first by llama.cpp's converter when the "
                             "path does not exist yet")
    parser.add_argument("--outtype", choices=sorted(gguf_export.OUTTYPES), default="bf16",
                        help="gguf: the type of the 2-D tensors, as llama.cpp's converter's --outtype (norms stay "
                             "f32) (default %(default)s)")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR",
                        help="gguf: a llama.cpp source tree holding convert_hf_to_gguf.py, to convert a model "
                             "(default: $LLAMA_CPP_DIR)")
    return parser


@report_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = args.out_dir.expanduser()
    if args.format == "gguf":
        return gguf_main(args, out_dir)
    source = resolve(args.heads, args.revision)
    if out_dir.is_dir() and out_dir.resolve() == source.resolve():
        raise ValueError(f"{out_dir} is the checkpoint being exported: exporting onto it would overwrite its "
                         "config.json and model.safetensors; choose another output path")
    if args.format == "speculators":
        return speculators_main(args, source, out_dir)
    check_output(out_dir, is_vllm_export, "a vLLM Medusa export")
    config = read_config(source, tool="heads.export exports Medusa heads (vLLM's Medusa format)")
    model, _ = load_model(args.model or config.base_model)
    heads = load_heads(source, model)
    out = export_vllm(heads, out_dir, original_lm_head=args.original_lm_head)
    print(f"exported {args.heads} ({heads.config.num_heads} heads) in vLLM's Medusa format to {out}; "
          "checked by loading it back")
    return 0


def speculators_main(args: argparse.Namespace, source: Path, out_dir: Path) -> int:
    """--format speculators: refused from config.json alone where the format cannot express the draft, before any
    model loads."""
    if args.original_lm_head:
        raise ValueError("--original-lm-head is an option of the vllm format (Medusa heads)")
    data = read_json_object(source / CONFIG, "the draft's config")
    refuse(data, args.heads)
    check_output(out_dir, is_speculators_export, "a speculators export")
    kind = data["speculators_model_type"]
    config = FORMATS[kind][0].from_json({k: v for k, v in data.items() if k != "selfspec_version"})
    if not (args.model or config.verifier):
        raise ValueError(f"{source / CONFIG} names no verifier: pass the target it drafts for as --model")
    model, _ = load_model(args.model or config.verifier)
    out = export_speculators(source, out_dir, model, verifier=args.verifier)
    shape = (f"EAGLE-3, {config.num_layers} layer(s)" if kind == "eagle3" else
             f"DFlash, {config.num_layers} layer(s), blocks of {config.block_size}")
    print(f"exported {args.heads} ({shape}, draft vocabulary {config.draft_vocab_size}) in the speculators format to "
          f"{out}; checked by loading it back")
    for note in vllm_caveats(config) if isinstance(config, Eagle3Config) else []:
        print(f"note: speculators loads it as written, but {note}: vLLM would draft differently", file=sys.stderr)
    return 0


def gguf_main(args: argparse.Namespace, out: Path) -> int:
    """--format gguf: a speculators draft -> its llama.cpp GGUF (the target GGUF made first where missing); a model ->
    the target GGUF, by llama.cpp's converter. selfspec's own drafts are refused from config.json alone."""
    if args.original_lm_head or args.verifier:
        raise ValueError("--original-lm-head and --verifier are options of the vllm and speculators formats")
    if out.suffix != ".gguf" or out.is_dir():
        raise ValueError(f"--format gguf writes one file: expected an output path ending in .gguf, found {out}")
    draft = _draft_config(args.heads, args.revision)
    if draft is None:  # a model: the target
        if args.target_gguf is not None:
            raise ValueError(f"{args.heads} is a model, not a draft: --target-gguf names a draft's target")
        path = _convert(args.heads, out, args.outtype, args.llama_cpp)
        print(f"converted {args.heads} to {path} ({args.outtype}) with llama.cpp's convert_hf_to_gguf.py")
        return 0
    source, data = draft
    if found := differences(data):
        parts = "\n".join(f"  - {line}" for line in found)
        instead = instead_of(data)
        raise ValueError(f"{args.heads} cannot be exported for llama.cpp: llama.cpp loads speculators' EAGLE-3 and "
                         f"DFlash drafts (--spec-type draft-eagle3, draft-dflash), and this draft differs from them:\n"
                         f"{parts}" + (f"\nInstead: {instead}" if instead else ""))
    model = args.model or ((data.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if args.target_gguf is None:
        raise ValueError(f"--format gguf needs the target's GGUF for {args.heads}'s tokenizer: pass --target-gguf PATH "
                         f"(a path that does not exist yet is made from {model or 'the target (--model)'} by "
                         f"llama.cpp's converter)")
    target = args.target_gguf.expanduser()
    if not target.exists():
        if not model:
            raise ValueError(f"{source / CONFIG} names no verifier: pass the target it drafts for as --model")
        _convert(model, target, args.outtype, args.llama_cpp)
        print(f"converted {model} to {target} ({args.outtype}) with llama.cpp's convert_hf_to_gguf.py")
    path = gguf_export.write_draft_gguf(source, out, target, args.outtype)
    kind, spec_type = gguf_export.ARCHITECTURES[data["speculators_model_type"]]
    print(f"exported {args.heads} ({kind}, {args.outtype}) for llama.cpp to {path}; checked by reading it back. "
          f"Serve: llama-server -m {target} -md {path} --spec-type {spec_type}")
    return 0


def _draft_config(name: str, revision: str | None) -> tuple[Path, dict] | None:
    """(directory, config.json) when ``name`` is a draft checkpoint (selfspec's or speculators'); None for a model."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / CONFIG).is_file():
        data = read_json_object(path / CONFIG, "the checkpoint's config")
        return (path, data) if "draft_type" in data or "speculators_model_type" in data else None
    if path.suffix == ".gguf" or name in BUILTIN or path.exists():
        return None
    source = resolve(name, revision, files=(CONFIG,))  # a Hub id: a draft there, or a model
    data = read_json_object(source / CONFIG, "the checkpoint's config")
    return (source, data) if "draft_type" in data or "speculators_model_type" in data else None


def _convert(model: str, out: Path, outtype: str, llama_cpp: str | None) -> Path:
    """A model (built-in name, directory or Hub id) -> GGUF at ``out`` by llama.cpp's converter."""
    where, gguf_file = resolve_model(model)
    if gguf_file is not None:
        raise ValueError(f"{model} is a GGUF file already: llama.cpp loads it as it is")
    directory = Path(where)
    if not directory.is_dir():  # a Hub id: the converter reads a directory
        directory = Path(snapshot_download(where))
    return gguf_export.convert_model(directory, out, outtype, llama_cpp)


if __name__ == "__main__":
    sys.exit(main())
