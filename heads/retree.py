"""Re-fit a heads checkpoint's tree to this machine: maximise expected tokens per second, not accepted length.

    python -m heads.retree runs/medusa-smollm2/heads --dtype bf16 [--out DIR] [--max-nodes 64]

Measures the base model's verify-forward time against tree size here (``selfspec.costs.verify_costs``), then picks,
from the accuracy measured at training time, the tree with the best expected accepted tokens per unit of verify time
(``heads.tree_search.fastest_choices``) and saves the checkpoint with that tree (atomically; in place or to --out).
A wide tree pays off where verification is nearly free (bf16 on a CPU with AMX, GPUs); fp32 on a CPU wants a small one.
"""

from __future__ import annotations

import argparse
import logging
import sys

from heads.medusa import MedusaHeads
from heads.tree_search import expected_accept_length, fastest_choices
from selfspec.costs import verify_costs
from selfspec.models import load_model
from selfspec.target import Target

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m heads.retree", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a heads checkpoint directory (with measured head_accuracy)")
    p.add_argument("--model", default=None, help="the base model (default: the checkpoint's base_model)")
    p.add_argument("--dtype", default="float32", help="the dtype you will decode in (float32 / bf16)")
    p.add_argument("--max-nodes", type=int, default=64, help="largest tree considered (draft nodes)")
    p.add_argument("--repeats", type=int, default=10, help="timing repeats per tree size")
    p.add_argument("--out", default=None, help="save here instead of over the checkpoint")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from heads.checkpoint import read_config, resolve

    config = read_config(resolve(a.checkpoint))
    if not config.head_accuracy:
        print(f"error: {a.checkpoint} stores no measured head_accuracy; train it with selfspec's train.py", file=sys.stderr)
        return 2
    model, _ = load_model(a.model or config.base_model, dtype=a.dtype)
    sizes = tuple(n for n in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128) if n <= a.max_nodes + 1) + (a.max_nodes + 1,)
    rows = verify_costs(Target(model), sizes=tuple(sorted(set(sizes))), repeats=a.repeats, progress=True)
    costs = {c.nodes: c.median_ms for c in rows}
    choices, rate = fastest_choices(config.head_accuracy, costs, a.max_nodes)
    heads = MedusaHeads.from_pretrained(a.checkpoint, model)
    old = heads.config.tree or []
    heads.config.tree = choices
    out = heads.save_pretrained(a.out or a.checkpoint)
    print(f"{out}: tree of {len(choices)} draft nodes (was {len(old)}); expected {expected_accept_length(config.head_accuracy, choices):.2f} "
          f"tokens per step, {1000 * rate:.1f} expected tokens/s from verify time alone ({a.dtype}, this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
