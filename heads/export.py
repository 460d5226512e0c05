"""Export Medusa heads for serving engines: vLLM's Medusa format, checked by loading it back.

    python -m heads.export runs/medusa-smollm2 exports/medusa-smollm2-vllm [--model BASE] [--original-lm-head]

The format and the check: heads/medusa/vllm.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from heads.checkpoints.contents import check_output, describe
from heads.checkpoints.files import resolve
from heads.cli import report_errors
from heads.medusa.config import read_config
from heads.medusa.model import load_heads
from heads.medusa.vllm import export_vllm
from selfspec.core.models import load_model


def is_vllm_export(directory: Path) -> bool:
    """A directory an earlier export wrote (its config.json is vLLM's Medusa config): exporting over it is allowed."""
    return describe(directory) == "a vLLM Medusa export"


@report_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m heads.export", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Exit status: 0 exported and checked, 2 the arguments, the checkpoint or "
                                            "the output directory are wrong (one line says which).")
    parser.add_argument("heads", help="a selfspec heads checkpoint: local directory or Hub id")
    parser.add_argument("out_dir", type=Path, help="where to write the export: a new or empty directory, or an "
                                                   "earlier export to replace")
    parser.add_argument("--format", choices=["vllm"], default="vllm", help="the serving engine's format (default vllm)")
    parser.add_argument("--model", default=None, help="the base model (default: the one the heads name)")
    parser.add_argument("--revision", default=None, help="Hub revision of the heads")
    parser.add_argument("--original-lm-head", action="store_true",
                        help="write the shared LM head once (vLLM's original_lm_head); 'shared' projection only")
    args = parser.parse_args(argv)
    source = resolve(args.heads, args.revision)
    out_dir = args.out_dir.expanduser()
    if out_dir.is_dir() and out_dir.resolve() == source.resolve():
        raise ValueError(f"{out_dir} is the checkpoint being exported: exporting onto it would overwrite its "
                         "config.json and model.safetensors; choose another output path")
    check_output(out_dir, is_vllm_export, "a vLLM Medusa export")
    config = read_config(source, tool="heads.export exports Medusa heads (vLLM's Medusa format)")
    model, _ = load_model(args.model or config.base_model)
    heads = load_heads(source, model)
    out = export_vllm(heads, out_dir, original_lm_head=args.original_lm_head)
    print(f"exported {args.heads} ({heads.config.num_heads} heads) in vLLM's Medusa format to {out}; "
          "checked by loading it back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
