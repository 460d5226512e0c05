"""Export drafts for serving engines, each checked by loading it back.

    python -m heads.export runs/medusa-smollm2 exports/medusa-smollm2-vllm [--model BASE] [--original-lm-head]
    python -m heads.export DRAFT exports/eagle3-vllm --format speculators [--verifier HUB_ID] [--model BASE]

--format vllm (the default): Medusa heads in vLLM's Medusa format (heads/medusa/vllm.py).
--format speculators: an EAGLE-3 or DFlash draft in the format of vLLM's speculators library (heads/speculators_export.py);
selfspec's own EAGLE and block heads are refused, saying which parts of them the format cannot express.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from heads.checkpoints.contents import check_output, describe
from heads.checkpoints.files import CONFIG, resolve
from heads.cli import report_errors
from heads.eagle.speculators_config import Eagle3Config
from heads.speculators_export import FORMATS, export_speculators, refuse, vllm_caveats
from heads.medusa.config import read_config
from heads.medusa.model import load_heads
from heads.medusa.vllm import export_vllm
from selfspec.core.files import read_json_object
from selfspec.core.models import load_model


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
    parser.add_argument("heads", help="a draft checkpoint: local directory or Hub id")
    parser.add_argument("out_dir", type=Path, help="where to write the export: a new or empty directory, or an "
                                                   "earlier export to replace")
    parser.add_argument("--format", choices=["vllm", "speculators"], default="vllm",
                        help="vllm: vLLM's Medusa format (Medusa heads); speculators: the speculators library's "
                             "format (EAGLE-3 and DFlash drafts), which vLLM loads (default vllm)")
    parser.add_argument("--model", default=None, help="the base model (default: the one the draft names)")
    parser.add_argument("--revision", default=None, help="Hub revision of the draft")
    parser.add_argument("--original-lm-head", action="store_true",
                        help="vllm: write the shared LM head once (vLLM's original_lm_head); 'shared' projection only")
    parser.add_argument("--verifier", default=None,
                        help="speculators: the target the export names (speculators_config.verifier.name_or_path, "
                             "e.g. its Hub id); default: the one the draft names")
    return parser


@report_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    source = resolve(args.heads, args.revision)
    out_dir = args.out_dir.expanduser()
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


if __name__ == "__main__":
    sys.exit(main())
