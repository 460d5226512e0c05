"""Re-fit a heads checkpoint's tree to this machine: maximise expected tokens per second, not accepted length.

    python -m heads.retree runs/medusa-smollm2/heads --dtype bf16 [--out DIR] [--max-nodes 64]

Measures the base model's verify-forward time against tree size here (``selfspec.tools.costs.verify_costs``), then picks,
from the accuracy measured at training time, the tree with the best expected accepted tokens per unit of verify time
(``heads.tree_search.fastest_choices``) and saves the checkpoint with that tree (atomically; in place or to --out).
A wide tree pays off where verification is nearly free (bf16 on a CPU with AMX, GPUs); fp32 on a CPU wants a small one.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from heads.checkpoints.contents import check_output, is_draft_checkpoint
from heads.checkpoints.files import resolve
from heads.cli import dtype_name, positive_int, report_errors
from heads.medusa.config import read_config
from heads.medusa.model import MedusaHeads
from heads.tree_search import expected_accept_length, fastest_choices
from selfspec.tools.costs import verify_costs
from selfspec.core.models import load_model
from selfspec.core.target import Target

log = logging.getLogger(__name__)
TAKES = "heads.retree re-fits the tree of Medusa heads"
EPILOG = """Exit status: 0 saved, 1 no tree is predicted to beat one-token decoding here (nothing saved), 2 the
arguments, the checkpoint or --out are wrong (one line says which)."""


@report_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m heads.retree", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a Medusa heads checkpoint directory (with measured head_accuracy)")
    p.add_argument("--model", default=None, help="the base model (default: the checkpoint's base_model)")
    p.add_argument("--dtype", type=dtype_name, default="float32",
                   help="the dtype you will decode in: float32 / bf16 / fp16 (default: %(default)s)")
    p.add_argument("--max-nodes", type=positive_int, default=64,
                   help="largest tree considered, in draft nodes (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=10, help="timing repeats per tree size (default: %(default)s)")
    p.add_argument("--out", default=None, help="save here instead of over the checkpoint: a new or empty directory, or "
                                               "a Medusa heads checkpoint to replace (default: the checkpoint itself)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    directory = resolve(a.checkpoint)
    config = read_config(directory, tool=TAKES)
    if not config.head_accuracy:
        raise ValueError(f"{a.checkpoint} stores no measured head_accuracy; train it with selfspec's train.py")
    if a.out is not None:
        check_output(Path(a.out), lambda d: is_draft_checkpoint(d, "medusa"), "a selfspec medusa checkpoint", "--out")
    model, _ = load_model(a.model or config.base_model, dtype=a.dtype)
    sizes = tuple(n for n in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128) if n <= a.max_nodes + 1) + (a.max_nodes + 1,)
    rows = verify_costs(Target(model), sizes=tuple(sorted(set(sizes))), repeats=a.repeats, progress=True)
    costs = {c.nodes: c.median_ms for c in rows}
    choices, rate = fastest_choices(config.head_accuracy, costs, a.max_nodes)
    if not choices:  # an empty tree would load as "no tree stored" and fall back to a default tree: save nothing
        print(f"error: no tree of 1 to {a.max_nodes} draft nodes is predicted to beat one-token decoding in {a.dtype} "
              f"on this machine (a verify of 2 tokens takes {costs[2]:.1f} ms, of 1 token {costs[1]:.1f} ms); "
              f"{a.out or a.checkpoint} was not written: decode without the heads in {a.dtype} here, or re-fit for "
              "another --dtype or machine", file=sys.stderr)
        return 1
    heads = MedusaHeads.from_pretrained(directory, model)
    old = heads.config.tree or []
    heads.config.tree = choices
    out = heads.save_pretrained(a.out or a.checkpoint)
    print(f"{out}: tree of {len(choices)} draft nodes (was {len(old)}); expected {expected_accept_length(config.head_accuracy, choices):.2f} "
          f"tokens per step, {1000 * rate:.1f} expected tokens/s from verify time alone ({a.dtype}, this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
