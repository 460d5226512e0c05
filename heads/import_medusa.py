"""Import Medusa heads saved by FasterDecoding/Medusa (Medusa-1: heads on a frozen base) as a selfspec checkpoint.

    python -m heads.import_medusa FasterDecoding/medusa-vicuna-7b-v1.3 runs/medusa-vicuna [--base-model ID]

The format and the conversion: heads/medusa/fasterdecoding.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from heads.cli import report_errors
from heads.medusa.fasterdecoding import import_medusa


@report_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m heads.import_medusa", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Exit status: 0 imported, 2 the arguments, the source or the output "
                                            "directory are wrong (one line says which).")
    parser.add_argument("source", help="a FasterDecoding Medusa checkpoint: local directory or Hub id")
    parser.add_argument("out_dir", type=Path, help="where to write the selfspec checkpoint: a new or empty directory, "
                                                   "or a selfspec Medusa checkpoint to replace")
    parser.add_argument("--base-model", default=None,
                        help="the base model (default: base_model_name_or_path in config.json)")
    parser.add_argument("--revision", default=None, help="Hub revision of the source")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    out = import_medusa(args.source, args.out_dir, base_model=args.base_model, revision=args.revision)
    print(f"imported {args.source} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
