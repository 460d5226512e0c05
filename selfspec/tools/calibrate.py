"""Choosing a self-speculative draft for a target on this machine: measured, on calibration prompts, never guessed.

    infer.py sweep-exit   mean accepted tokens and tokens/s of early exit at each exit layer E (plain early exit, and
                          a trained exit head where one is given for that E), against plain decoding in the same loop
    infer.py search-skip  the greedy layer-skip search (``layerskip_search``), saved as a layer-skip checkpoint that
                          ``--draft DIR`` loads
    infer.py tune-tree    the tree budget and depth of a draft that maximise predicted tokens/s on this machine
                          (``budget``), cached for ``--tree auto``

Both decode the calibration prompts (``layerskip_search.CALIBRATION_PROMPTS``, not the evaluation questions) greedily
through the real loop, so what they report is what decoding will see, on this machine and in this dtype.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence, TextIO

import torch
from tqdm import tqdm

from selfspec import registry, tuned
from selfspec.base_check import check_drafts
from selfspec.core import hf
from selfspec.core.drafter import Drafter, NoDrafter, verifier_for
from selfspec.drafts.early_exit import EarlyExitDrafter, check_exit_layer
from selfspec.core.generate import generate
from selfspec.tools.layerskip_search import CALIBRATION_PROMPTS, Measurement, calibration_inputs, measure, search_skip_layers
from selfspec.core.models import DEFAULT_MODEL, load_model, parse_dtype
from selfspec.drafts.ngram import NGramDrafter
from selfspec.tools import budget, merge_budget
from selfspec.tools.options import integer, integers, probabilities
from selfspec.core.target import Target


@dataclass(frozen=True)
class ExitRow:
    exit_layer: int
    draft: str
    """"early-exit" (no exit head) or the exit-head checkpoint."""
    measured: Measurement
    plain: Measurement

    @property
    def speedup(self) -> float:
        return self.measured.tokens_per_s / self.plain.tokens_per_s


def sweep_exit_layers(target: Target, prompts: Sequence[torch.Tensor], layers: Sequence[int], depth: int = 4,
                      exit_heads: Sequence[tuple[str, Drafter]] = (), max_new_tokens: int = 64,
                      progress: bool = False) -> list[ExitRow]:
    """Plain decoding once, then early exit at each E in ``layers`` and each exit-head checkpoint (its name and its
    drafter, built by the registry), on ``prompts``."""
    num_layers = len(hf.decoder_layers(target.model))
    for e in layers:
        check_exit_layer(e, num_layers)
    generate(target, NoDrafter(), prompts[0], 2)  # warm-up: first-call costs stay out of every measurement
    bar = tqdm(total=1 + len(layers) + len(exit_heads), desc="sweep-exit", unit="draft", disable=not progress,
               leave=False)
    plain = measure(target, NoDrafter(), prompts, max_new_tokens)
    bar.update()
    rows = []
    for e in layers:
        drafter = EarlyExitDrafter(target, e, depth=depth)
        rows.append(ExitRow(e, "early-exit", measure(verifier_for(drafter, target), drafter, prompts, max_new_tokens),
                            plain))
        bar.update()
    for ckpt, drafter in exit_heads:
        if not isinstance(drafter, EarlyExitDrafter):
            raise ValueError(f"{ckpt} is a {type(drafter).__name__} checkpoint; expected an exit head (draft_type "
                             "'exit-head', from train.py with method=exit_head)")
        rows.append(ExitRow(drafter.exit_layer, ckpt,
                            measure(verifier_for(drafter, target), drafter, prompts, max_new_tokens), plain))
        bar.update()
    bar.close()
    return rows


def format_exit_rows(rows: Sequence[ExitRow]) -> str:
    plain = rows[0].plain if rows else None
    lines = ["| exit layer | draft | mean accepted | tokens/s | vs plain |", "|---:|---|---:|---:|---:|"]
    if plain is not None:
        lines.append(f"| — | plain | 1.00 | {plain.tokens_per_s:.1f} | 1.00× |")
    for r in sorted(rows, key=lambda r: (r.exit_layer, r.draft != "early-exit")):
        lines.append(f"| {r.exit_layer} | {r.draft} | {r.measured.mean_accepted:.2f} | {r.measured.tokens_per_s:.1f} | "
                     f"{r.speedup:.2f}× |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- CLIs
def _common(p: argparse.ArgumentParser, dtype_help: str = "the dtype decoding will use (default: %(default)s)") -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="target model (default: the built-in %(default)s)")
    p.add_argument("--revision", default=None, help="Hub revision of --model")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--dtype", default="bfloat16", help=dtype_help)
    p.add_argument("--prompts", type=integer(1), default=None, help="how many calibration prompts (default: 4 of the 8 "
                   "built-in ones, or all of --prompts-file)")
    p.add_argument("--prompts-file", default=None, help="calibrate on prompts like your own workload's instead of the "
                   "built-in generic requests: a text file, one prompt per line, or a .jsonl with a \"prompt\" string, "
                   "Spec-Bench's \"turns\" (its first turn) or chat \"messages\" (a conversation ending with the "
                   "user turn to answer) per line. Drafts that copy (prompt lookup) gain most on prompts that hold "
                   "text to copy, which the built-in ones do not")
    p.add_argument("--max-new-tokens", type=integer(1), default=64, help="per prompt (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_prompts(path: str) -> list[str | list[dict[str, str]]]:
    """The prompts of a --prompts-file: one per non-blank line of a text file, or per line of a .jsonl its "prompt", the
    first of its Spec-Bench "turns", or its chat "messages" (a conversation up to the user turn to answer: later turns
    of a chat quote and repeat earlier ones, which is what prompt lookup drafts from)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"--prompts-file {file} does not exist: expected a text file, one prompt per line, or "
                                "a .jsonl with a \"prompt\", \"turns\" or \"messages\" field per line")
    lines = [(n, line) for n, line in enumerate(file.read_text().splitlines(), 1) if line.strip()]
    if file.suffix != ".jsonl":
        prompts: list[str | list[dict[str, str]]] = [line.strip() for _, line in lines]
    else:
        prompts = []
        for n, line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file} line {n}: expected a JSON object, found {line[:60]!r} ({err})") from None
            if isinstance(row, dict) and "messages" in row:
                prompts.append(_messages(row["messages"], f"{file} line {n}"))
                continue
            turns = row.get("turns") if isinstance(row, dict) else None
            text = row.get("prompt") if isinstance(row, dict) and "prompt" in row else (turns or [None])[0]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{file} line {n}: expected a non-empty \"prompt\" string, \"turns\" list of "
                                 f"strings or \"messages\" list, found {line[:60]!r}")
            prompts.append(text)
    if not prompts:
        raise ValueError(f"--prompts-file {file} holds no prompts (every line is blank)")
    return prompts


def _messages(messages, where: str) -> list[dict[str, str]]:
    """A chat prompt: {"role", "content"} strings, ending with the user turn to answer."""
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok or messages[-1]["role"] != "user":
        found = json.dumps(messages)[:80]
        raise ValueError(f"{where}: expected \"messages\" as a list of {{\"role\", \"content\"}} strings ending "
                         f"with a \"user\" turn (the one to answer), found {found}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _parse(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse, and read the calibration prompts (``a.texts``, their count ``a.prompts``) before any model loads."""
    a = p.parse_args(argv)
    a.texts = read_prompts(a.prompts_file) if a.prompts_file else CALIBRATION_PROMPTS
    a.prompts = a.prompts if a.prompts is not None else (len(a.texts) if a.prompts_file else 4)
    if not 1 <= a.prompts <= len(a.texts):
        raise ValueError(f"--prompts must be in 1..{len(a.texts)} (the prompts {a.prompts_file or 'built in'} holds), "
                         f"found {a.prompts}")
    return a


def _source(a: argparse.Namespace) -> str:
    return f" from {a.prompts_file}" if a.prompts_file else ""


def _calibration(a: argparse.Namespace, tokenizer, device) -> list[torch.Tensor]:
    """The calibration prompts the options name, as token ids [T] on ``device``."""
    return [p.to(device) for p in calibration_inputs(tokenizer, a.prompts, a.texts)]


def _allow_other_base(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-other-base", action="store_true",
                   help="accept a draft checkpoint whose base_model names another model (e.g. a local copy of it)")


def _chain_parser(command: str, description: str) -> argparse.ArgumentParser:
    """The parser of a subcommand that measures a chain drafted by the target's own layers: the flags every
    calibration takes (``_common``) and the chain's --depth."""
    p = argparse.ArgumentParser(prog=f"infer.py {command}", allow_abbrev=False, description=description)
    _common(p)
    p.add_argument("--depth", type=integer(1), default=4, help="draft tokens per step (default: %(default)s)")
    return p


def build_sweep_parser() -> argparse.ArgumentParser:
    p = _chain_parser("sweep-exit", "Early exit at each exit layer E: mean accepted tokens and tokens/s against plain "
                      "decoding, on calibration prompts, in one run; trained exit heads (--exit-heads) are measured "
                      "beside plain early exit.")
    p.add_argument("--layers", type=integers(1), default=None,
                   help="comma-separated exit layers (default: every 4th layer)")
    p.add_argument("--exit-heads", default="", help="comma-separated exit-head checkpoints to measure too")
    p.add_argument("--draft-revision", default=None, help="Hub revision of the --exit-heads named by Hub id")
    _allow_other_base(p)
    p.add_argument("--out", default=None, help="also write the table (markdown) and the rows (JSON) here")
    return p


def run_sweep_cli(argv: Sequence[str], out: TextIO) -> int:
    a = _parse(build_sweep_parser(), argv)
    heads = registry.split_drafts(a.exit_heads)
    specs = [registry.parse_draft(h, a.draft_revision) for h in heads]
    check_drafts(a.model, specs, a.revision, a.allow_other_base)  # before any weights load, as by infer.py
    model, tokenizer = load_model(a.model, dtype=a.dtype, revision=a.revision, device=a.device)
    num_layers = len(hf.decoder_layers(model))
    layers = list(a.layers) if a.layers else list(range(4, num_layers, 4))
    target = Target(model)
    rows = sweep_exit_layers(target, _calibration(a, tokenizer, target.device), layers, depth=a.depth,
                             exit_heads=[(h, registry.build(s, target, a.model)) for h, s in zip(heads, specs)],
                             max_new_tokens=a.max_new_tokens, progress=not a.no_progress)
    table = format_exit_rows(rows)
    out.write(f"{a.model} {a.dtype}, {a.prompts} calibration prompts{_source(a)} x {a.max_new_tokens} tokens, chain of {a.depth}:\n"
              f"{table}\n")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "sweep.md").write_text(table + "\n")
        (Path(a.out) / "sweep.json").write_text(json.dumps([
            {"exit_layer": r.exit_layer, "draft": r.draft, "mean_accepted": r.measured.mean_accepted,
             "tokens_per_s": r.measured.tokens_per_s, "plain_tokens_per_s": r.plain.tokens_per_s,
             "speedup": r.speedup} for r in rows], indent=2) + "\n")
    return 0


def build_search_parser() -> argparse.ArgumentParser:
    p = _chain_parser("search-skip", "Search the set of layers whose skipping drafts fastest (greedy, SWIFT-style "
                      "random candidates per round), measured through the decoding loop on calibration prompts; save "
                      "it as a layer-skip checkpoint for --draft DIR.")
    p.add_argument("--out", required=True, help="checkpoint directory to write (config.json)")
    p.add_argument("--per-round", type=int, default=6, help="random candidate layers tried per round (default: "
                                                             "%(default)s; 0 = all)")
    p.add_argument("--patience", type=int, default=2, help="rounds without a new best before stopping")
    p.add_argument("--stop-below", type=float, default=0.0, help="stop a draft once its top probability falls below")
    p.add_argument("--seed", type=int, default=0)
    return p


def run_search_cli(argv: Sequence[str], out: TextIO) -> int:
    a = _parse(build_search_parser(), argv)
    model, tokenizer = load_model(a.model, dtype=a.dtype, revision=a.revision, device=a.device)
    target = Target(model)
    prompts = _calibration(a, tokenizer, target.device)
    result = search_skip_layers(target, prompts, depth=a.depth, stop_below=a.stop_below,
                                max_new_tokens=a.max_new_tokens, per_round=a.per_round or None, patience=a.patience,
                                seed=a.seed, progress=not a.no_progress)
    name = Path(a.model.rstrip("/")).name if Path(a.model).expanduser().is_dir() else a.model
    config = result.config(name, len(hf.decoder_layers(model)), a.depth, a.stop_below)
    config.save(a.out)
    out.write(f"skip layers {list(result.skip_layers)}: {result.best.tokens_per_s:.1f} tokens/s, mean accepted "
              f"{result.best.mean_accepted:.2f}, {result.best.tokens_per_s / result.plain.tokens_per_s:.2f}x plain "
              f"({result.plain.tokens_per_s:.1f} tokens/s), {len(result.trials)} trials; saved to {a.out}\n")
    return 0


def build_tune_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infer.py tune-tree", allow_abbrev=False,
                                description="Choose the tree budget (nodes) and depth of a "
                                "draft that maximise tokens per second on this machine, not accepted length: the verify "
                                "cost against tree size is measured once per model, dtype and machine (cached), the "
                                "accepted lengths at every budget come from greedy decoding of calibration prompts. "
                                "The best is cached for --tree auto.")
    _common(p, dtype_help="the dtype decoding will use, or several, comma-separated (fp32,bf16: each tuned and cached "
            "in turn, as infer.py bench --dtype fp32,bf16 decodes; default: %(default)s)")
    p.add_argument("--draft", required=True, help="the draft checkpoint whose dynamic tree to tune: an EAGLE head, "
                   "a block drafter, Medusa or Hydra heads, an exit head or a layer-skip config; prompt lookup ('ngram', or with "
                   "options other than depth and max_nodes, which are what it tunes; calibrate it with --prompts-file "
                   "on prompts like your workload's); or a merged draft such as "
                   "'ngram+DIR+skip_after=3', whose checkpoint part is tuned with the other parts drafting beside it "
                   "(cached for that merge; --tree auto on the merge prefers it to the part's own tuning), and the "
                   "merge tuned for every skip_after (1, 2, 3, 4, 6, never) with every skip_match (2, 3, never) "
                   "besides its own, each cached")
    p.add_argument("--draft-revision", default=None, help="Hub revision of a --draft checkpoint (each revision is "
                   "tuned on its own; --tree auto with the same --draft-revision uses it)")
    p.add_argument("--depths", type=integers(1), default=(3, 4, 5, 6, 8),
                   help="depths to try, comma-separated (default: 3,4,5,6,8)")
    p.add_argument("--budgets", type=integers(1), default=(4, 8, 12, 16, 24, 32, 48, 64),
                   help="node budgets to try, comma-separated (default: 4,8,12,16,24,32,48,64)")
    p.add_argument("--min-probs", type=probabilities, default=budget.MIN_PROBS,
                   help="the adaptive length's cuts to try, comma-separated: a tree leaves out every node whose "
                        "cumulative draft probability is below the cut, so each step sends as many nodes as the draft "
                        "is sure of (0 = none left out; default: "
                        f"{','.join(f'{p:g}' for p in budget.MIN_PROBS)}); the best becomes --tree auto's min_prob")
    p.add_argument("--refresh-costs", action="store_true", help="measure the verify costs again")
    p.add_argument("--compile", action="store_true",
                   help="tune for a compiled target (infer.py --compile): its verify costs and tuned trees are cached "
                        "apart from the uncompiled target's, and --tree auto with --compile reads them")
    _allow_other_base(p)
    return p


def run_tune_cli(argv: Sequence[str], out: TextIO) -> int:
    a = _parse(build_tune_parser(), argv)
    merge = registry.parse_draft(a.draft, a.draft_revision)
    spec = registry.tree_part(merge) if merge.parts else merge  # the part whose budget is tuned
    if spec.kind == "ngram" and not merge.parts:  # prompt lookup alone: its depth and max_nodes
        tuned.check_untuned(spec, "tune-tree")
    elif not spec.capabilities.tunable:  # the drafter is asked (Drafter.resized) once built; this is before
        within = f" (the part of {a.draft} that --tree applies to)" if merge.parts else ""
        raise ValueError(f"tune-tree tunes drafts that grow their tree by score (their kind declares it: "
                         f"DraftKind.tunable) and prompt lookup alone (ngram); {spec.text}{within} is a {spec.kind!r} "
                         "draft, which does not")
    depths, budgets = list(a.depths), list(a.budgets)
    dtypes = [d.strip() for d in a.dtype.split(",")]
    for d in dtypes:
        parse_dtype(d)  # an unknown dtype fails before anything loads
    check_drafts(a.model, [merge], a.revision, a.allow_other_base)  # before any weights load, as by infer.py
    return max(_tune_one(a, merge, spec, dtype, depths, budgets, out) for dtype in dtypes)


def _tune_one(a: argparse.Namespace, merge: registry.DraftSpec, spec: registry.DraftSpec, dtype: str,
              depths: list[int], budgets: list[int], out: TextIO) -> int:
    """tune-tree in one dtype: load the target in it, calibrate, print the table, cache the best. Returns 0, or 1 when
    the machine was too busy to cache the result."""
    model, tokenizer = load_model(a.model, dtype=dtype, revision=a.revision, device=a.device, compile=a.compile)
    target = Target(model)
    drafter = registry.build(spec, target, a.model)
    lookup = isinstance(drafter, NGramDrafter)
    if not lookup and drafter.resized(1, 1) is None:
        raise TypeError(f"{a.draft} built a {type(drafter).__name__}, which does not grow its tree by score under a "
                        "budget (Drafter.resized); tune-tree tunes EAGLE, Medusa or Hydra heads, an exit head, a "
                        "layer-skip draft or prompt lookup")
    if not lookup and drafter.max_depth is not None:  # no deeper than the drafter can draft (Medusa / Hydra: heads)
        depths = [d for d in depths if d <= drafter.max_depth] or [drafter.max_depth]
    curve = budget.cached_verify_costs(target, a.model, refresh=a.refresh_costs, progress=not a.no_progress)
    prompts = _calibration(a, tokenizer, target.device)
    if merge.parts:
        tunings = _tune_merge(a, merge, spec, target, drafter, prompts, curve, depths, budgets)
        tuning = tunings[_gate(merge)]
    elif lookup:
        tuning = budget.tune_lookup(target, drafter, prompts, curve, depths, budgets, a.max_new_tokens,
                                    progress=not a.no_progress)
    else:  # the same draft at each depth and budget
        tuning = budget.tune(target, drafter.resized, prompts, curve, depths, budgets, a.max_new_tokens,
                             progress=not a.no_progress, min_probs=a.min_probs)
    if tuning.busy:
        out.write(f"{budget.format_tuning(tuning)}\n\nerror: nothing cached for --tree auto. This run's verifications "
                  f"took {tuning.verify_ratio:.1f}x the time the cached verify costs say (one-token step "
                  f"{tuning.plain_ms:.1f} ms): the machine is busier than when those were measured, and a tree fitted to "
                  f"a loaded machine is not the one to decode with on a quiet one. Run tune-tree "
                  f"again with nothing else running (or with --refresh-costs if the machine itself changed)\n")
        return 1
    location = tuned.lookup_name(spec) if lookup else spec.location
    path = tuned.save_tuned(location, target, a.model, tuning, a.draft_revision,
                            merged=tuned.merge_stamp(merge, spec) if merge.parts else None)
    b = tuning.best
    within = f" inside {a.draft}" if merge.parts else ""
    best = (f"--draft {tuned.with_options('ngram', {**spec.config, 'depth': b.depth, 'max_nodes': b.budget})}"
            if lookup else f"--tree {b.tree.spec}{within}")
    out.write(f"{a.model} {dtype}, {a.prompts} calibration prompts{_source(a)} x {a.max_new_tokens} tokens, one-token step "
              f"{tuning.plain_ms:.1f} ms (this run's verifications: {tuning.verify_ratio:.2f}x the cached costs):\n"
              f"{budget.format_tuning(tuning)}\n\nbest: {best} (mean accepted {b.accepted:.2f}, predicted "
              f"{b.tokens_per_s:.1f} tokens/s); cached in {path} for --draft {a.draft} --tree auto\n")
    if lookup and not a.prompts_file:
        out.write("note: prompt lookup gains where the text repeats what came before, and the built-in calibration "
                  "prompts are generic requests that hold little to copy: tune it on prompts like your workload's "
                  "(--prompts-file)\n")
    if merge.parts:
        _report_skips(a, merge, spec, target, tunings, out)
    return 0


def _gate(merge: registry.DraftSpec) -> merge_budget.Gate:
    """The merge's own (skip_after, skip_match)."""
    return tuple(merge.config.get(k) for k in merge_budget.GATE_KEYS)


def _skip_variants(merge: registry.DraftSpec) -> dict[merge_budget.Gate, registry.DraftSpec]:
    """The same merge with each gate (skip_after, skip_match) tune-tree tunes (its own first, then
    ``merge_budget.GATES``)."""
    kept = {k: v for k, v in merge.config.items() if k not in merge_budget.GATE_KEYS}  # skip_unpaid: not replayed

    def variant(gate: merge_budget.Gate) -> registry.DraftSpec:
        config = kept | {k: v for k, v in zip(merge_budget.GATE_KEYS, gate) if v is not None}
        return replace(merge, config=dict(sorted(config.items())))
    return {g: variant(g) for g in dict.fromkeys([_gate(merge), *merge_budget.GATES])}


def _tune_merge(a: argparse.Namespace, merge: registry.DraftSpec, spec: registry.DraftSpec, target: Target,
                drafter: Drafter, prompts: list[torch.Tensor], curve: dict[int, float], depths: list[int],
                budgets: list[int]) -> dict[merge_budget.Gate, budget.Tuning]:
    """The part ``spec`` of ``merge`` (built: ``drafter``) tuned with the other parts drafting beside it, each depth's
    merge built afresh, for every gate of ``_skip_variants``."""
    tuned_at = merge.parts.index(spec)

    def make_parts(d: int, n: int) -> list[Drafter]:
        return [drafter.resized(d, n) if k == tuned_at else registry.build(p, target, a.model)
                for k, p in enumerate(merge.parts)]
    return merge_budget.tune_merged(target, make_parts, tuned_at, prompts, curve, depths, budgets,
                                    list(_skip_variants(merge)), a.max_new_tokens, progress=not a.no_progress,
                                    min_probs=a.min_probs)


def _report_skips(a: argparse.Namespace, merge: registry.DraftSpec, spec: registry.DraftSpec, target: Target,
                  tunings: dict[merge_budget.Gate, budget.Tuning], out: TextIO) -> None:
    """Every gate's best, each cached for its own merge; the fastest named where it beats the merge's own."""
    own = _gate(merge)
    variants = _skip_variants(merge)
    for k, variant in variants.items():
        if k != own:
            tuned.save_tuned(spec.location, target, a.model, tunings[k], a.draft_revision,
                             merged=tuned.merge_stamp(variant, spec))
    out.write(f"\n{merge_budget.format_skips(tunings, own)}\n")
    fastest = max(tunings, key=lambda k: tunings[k].best.tokens_per_s)
    gain = tunings[fastest].best.tokens_per_s / tunings[own].best.tokens_per_s
    if fastest != own and gain > 1.01:
        out.write(f"\npredicted {gain:.2f}x faster than {a.draft}: --draft {variants[fastest].text} --tree auto "
                  f"(its tree is cached too)\n")
