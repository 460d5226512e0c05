"""Self-distillation: regenerate the assistant turns of a conversation dataset with the target itself (the command;
the work is heads/training/distill.py).

    python -m heads.distill --model smollm2-135m-instruct --source sharegpt --out runs/distill --max-conversations 2000
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from heads.cli import check_source, dtype_name, positive_float, positive_int, report_errors
from heads.training.data import DataConfig
from heads.training.distill import DistillConfig, distill
from selfspec.core.models import load_model


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
"""the sampling options (with --do-sample) and their values when not given."""


@report_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="python -m heads.distill",
        description="Self-distillation: regenerate the assistant turns of a conversation dataset with the target model "
                    "itself, so that draft heads learn what the target would say. Resumable: rerun the same command "
                    "after an interruption and finished shards are skipped. The result is a datasets directory "
                    "usable as the data source of training (DataConfig source=OUT).",
        epilog="Exit status: 0 done (or stopped by --max-shards), 2 the arguments, the model or the data are wrong "
               "(one line says which).")
    p.add_argument("--model", required=True, help="target model: a Hub id, a local directory, a .gguf file, or "
                                                   "'smollm2-135m-instruct' (the offline default)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model")
    p.add_argument("--source", default="sharegpt",
                   help="conversations: 'sharegpt', a .json/.jsonl/.parquet file, a save_to_disk directory "
                        "or a Hub dataset id (default: sharegpt)")
    p.add_argument("--split", default="train", help="split of a Hub dataset (default: train)")
    p.add_argument("--out", required=True, help="output directory (created; also holds the resumable shards)")
    p.add_argument("--max-conversations", type=positive_int, default=None,
                   help="regenerate only the first N conversations")
    p.add_argument("--max-new-tokens", type=positive_int, default=DistillConfig.max_new_tokens,
                   help="per reply (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=DistillConfig.batch_size,
                   help="prompts per generate call (default: %(default)s)")
    p.add_argument("--shard-size", type=positive_int, default=DistillConfig.shard_size,
                   help="conversations per saved shard (default: %(default)s)")
    p.add_argument("--max-prompt-length", type=positive_int, default=DistillConfig.max_prompt_length,
                   help="stop a conversation once its next prompt is longer than this many tokens "
                        "(default: %(default)s)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=positive_float, default=None,
                   help="sampling temperature; only with --do-sample (default: 1.0)")
    p.add_argument("--top-p", type=positive_float, default=None,
                   help="nucleus sampling threshold; only with --do-sample (default: 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="top-k cut, 0 for none; only with --do-sample (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (each shard uses seed + shard index)")
    p.add_argument("--dtype", type=dtype_name, default="float32",
                   help="model dtype: float32, bfloat16, float16 (default: float32)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--max-shards", type=positive_int, default=None,
                   help="stop after writing this many new shards (resume later)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is faster on a CPU shared with other jobs)")
    args = p.parse_args(argv)
    given = {k: getattr(args, k) for k in SAMPLING if getattr(args, k) is not None}
    if given and not args.do_sample:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
        they, them = ("they", "them") if len(given) > 1 else ("it", "it")
        raise ValueError(f"{flags}: sampling only, but without --do-sample the replies are greedy and {they} would be "
                         f"ignored; add --do-sample, or drop {them}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    check_source(args.source)
    data = DataConfig(source=args.source, split=args.split, max_conversations=args.max_conversations)
    cfg = DistillConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, shard_size=args.shard_size,
                        do_sample=args.do_sample, max_prompt_length=args.max_prompt_length, seed=args.seed,
                        **{**SAMPLING, **given})
    model, tokenizer = load_model(args.model, dtype=args.dtype, revision=args.revision, device=args.device)
    result = distill(model, tokenizer, data, args.out, cfg, max_shards=args.max_shards, model_name=args.model,
                     revision=args.revision)
    print(f"distilled dataset: {result}" if result
          else f"stopped after --max-shards {args.max_shards}; rerun to resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
