"""The command line behind ``python infer.py``: decode (one prompt or an interactive chat), ``bench`` and ``costs``.

    python infer.py --prompt "Write a haiku"                 # default model, --draft ngram, streamed, then statistics
    python infer.py --draft outputs/heads --compare ...      # also plain `generate`: speed-up and identical or not
    python infer.py                                          # interactive chat (multi-turn, the chat template)
    python infer.py bench --limit 12 --dtype fp32,bf16       # Spec-Bench answers, table and plot
    python infer.py costs                                    # verify-forward time against tree size
    python infer.py fit-policy --bench-dir D --arms A,B --out P   # a per-request draft policy (--draft P)
    python infer.py serve --draft ngram --port 8000          # OpenAI-compatible HTTP endpoint
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable, Sequence, TextIO

from transformers.utils import logging as hf_logging

from selfspec import api, registry

from selfspec.core.models import DEFAULT_MODEL, load_model
from selfspec.core.request import GenerationOptions
from selfspec.core.target import Target
from selfspec.tools import calibrate, policy_fit, serve, specbench
from selfspec.tools.bench import DEFAULT_QUESTIONS, BenchConfig, draft_method, run_bench
from selfspec.tools.costs import format_costs, loop_overhead, verify_costs
from selfspec.tools.options import integer, integers, names, number
from selfspec.tools.specbench import to_markdown

INTERRUPTED = 130


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"target model: a Hub id, a local directory, a .gguf file, or the built-in {DEFAULT_MODEL!r} "
                        "(default; built offline on first use)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")


COMPILE_HELP = ("compile the target's forward with torch.compile (inductor; on CPU it needs g++ or clang++): "
                "~1.15-1.2x faster decoding for a small model here (BENCHMARKS §26), but every start compiles for "
                "minutes on a small CPU (7 min for one draft in bf16 here): for serve and bench, not one prompt")


def _draft_args(p: argparse.ArgumentParser) -> None:
    """The options that choose the draft, its tree and how the target loads: infer.py and infer.py serve."""
    p.add_argument("--draft", default="ngram",
                   help="the draft: 'ngram' (prompt lookup, default; options as 'ngram:depth=8,max_nodes=24'), 'none' "
                        "(plain decoding through the same loop), 'early-exit:layer=E' (the first E layers draft; options "
                        "depth, stop_below), or a draft checkpoint (directory or Hub id: Medusa or Hydra heads, an EAGLE head, an "
                        "exit head, a layer-skip config); 'A+B' verifies the drafts of A and B as one tree each step, e.g. "
                        "'runs/eagle_head+ngram' (a trained head and prompt lookup; --tree applies to the first trained "
                        "checkpoint among the parts, else to A)")
    p.add_argument("--draft-revision", default=None, help="Hub revision of a --draft checkpoint")
    p.add_argument("--tree", default=None,
                   help="candidate tree for checkpoint drafts (default: the checkpoint's own): 'chain:K', "
                        "'full:3,2,1' (children per level), JSON choices '[[0],[0,0],[1]]', a .json file of them, "
                        "'dynamic:N' or 'dynamic:N,depth=D' (heads, early exit, exit heads, layer skipping: N nodes chosen each "
                        "step by cumulative draft probability; prompt lookup: its trie's max_nodes and depth), or 'auto' "
                        "(EAGLE, Medusa and Hydra heads, exit heads, layer-skip configs, prompt lookup: the budget and "
                        "depth infer.py tune-tree measured fastest on this machine); for --draft A+B, the tree of its "
                        "first trained checkpoint")
    p.add_argument("--dtype", default="float32", help="float32/fp32 (default), bfloat16/bf16 or float16/fp16")
    p.add_argument("--allow-other-base", action="store_true",
                   help="accept a draft checkpoint whose base_model names another model (e.g. a local copy of it)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a --model that ships its own Python code (config auto_map) run it; read that code first. "
                        "Without it such a model is refused")
    p.add_argument("--compile", action="store_true",
                   help=COMPILE_HELP + "; plain decoding (--compare) runs the same compiled forward")


def _limit_args(p: argparse.ArgumentParser, scope: str = "") -> None:
    """--stop and --min-new-tokens, for decoding and for bench (scope: to whom they apply, said in the help)."""
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help=f"stop once the output contains TEXT (kept in the output), as generate(stop_strings=...){scope}; "
                        "repeat for several; \\n, \\t, \\r and \\\\ are read as escapes (--stop '\\n\\n': a blank "
                        "line). Default: the model's generation config's stop_strings; --stop '' for none")
    p.add_argument("--min-new-tokens", type=int, default=None,
                   help=f"no end-of-sequence token before this many new tokens{scope} (default: the model's generation "
                        "config's min_new_tokens / min_length)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="infer.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Speculative decoding with a model's own built-in draft: streams text as the target accepts it, "
                    "then prints statistics. Greedy output is token-identical to plain decoding.",
        epilog="subcommands:\n  infer.py bench ...   Spec-Bench answers for selfspec and its peers (infer.py bench --help)\n"
               "  infer.py costs ...   verify-forward time against tree size on this machine (infer.py costs --help)\n"
               "  infer.py sweep-exit ...   early exit's accepted tokens and speed per exit layer (--help)\n"
               "  infer.py search-skip ...  search the layers to skip, save a layer-skip draft (--help)\n"
               "  infer.py tune-tree ...    the tree budget and depth fastest on this machine for a draft (--help)\n"
               "  infer.py fit-policy ...   learn which draft decodes each request fastest, from a bench run (--help)\n"
               "  infer.py serve ...        an OpenAI-compatible HTTP endpoint decoding with the draft (--help)",
    )
    _model_args(p)
    _draft_args(p)
    p.add_argument("--prompt", default=None, help="the prompt; without it, an interactive multi-turn chat starts")
    p.add_argument("--no-chat", action="store_true",
                   help="feed --prompt as plain text instead of wrapping it in the model's chat template")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message before the conversation (--prompt or the interactive chat)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="stop after this many new tokens (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default, exact); > 0 samples, with the same distribution as plain sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep tokens up to this mass (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep only tokens at least this fraction as likely as the most likely one (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="transformers' repetition penalty, greedy or sampled (1.0 = off; default: the model's "
                        "generation config's, as its generate applies it)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's presence penalty: lower every token the answer already holds by this (-2..2, 0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's frequency penalty: lower a token by this for each time the answer holds it "
                        "(-2..2, 0 = off)")
    _limit_args(p)
    p.add_argument("--seed", type=int, default=None, help="random seed, for repeatable sampling")
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding (transformers' generate) on the same prompt; print the speed-up and "
                        "whether the outputs are identical")
    return p


def build_bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="infer.py bench",
        description="Answer Spec-Bench questions with plain decoding, transformers' prompt lookup and early exit, and "
                    "selfspec drafts, per dtype; write Spec-Bench answer files, a table per category and a plot.")
    _model_args(p)
    p.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS,
                   help=f"Spec-Bench question file, one JSON per line (default: {DEFAULT_QUESTIONS})")
    p.add_argument("--out-dir", type=Path, default=Path("outputs/bench"),
                   help="where answers and the summary go (default: %(default)s)")
    p.add_argument("--methods", default="plain,pld,aee,ngram",
                   help="comma-separated: plain, pld[:N] (prompt_lookup_num_tokens, default 10), aee[:E] "
                        "(assistant_early_exit, default half the layers), none, ngram[:opts], draft checkpoints, A+B "
                        "(merged drafts); DRAFT@TREE runs a draft with another --tree (e.g. runs/heads@dynamic:32, "
                        "runs/heads@dynamic:12,depth=3, runs/heads@chain:3, runs/heads@tree.json, "
                        "runs/eagle_head+ngram:depth=6,max_nodes=8@auto; default: %(default)s)")
    p.add_argument("--dtype", default="fp32,bf16",
                   help="comma-separated dtypes, one target load each (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="per turn (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="answer only the first N questions")
    p.add_argument("--per-category", type=int, default=None,
                   help="answer only the first N questions of each category (a balanced subset)")
    p.add_argument("--repeats", type=int, default=1, help="time every turn R times and report the median")
    p.add_argument("--warmup-tokens", type=int, default=32, help="tokens per method in the untimed warm-up (0 = none)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default: answers are compared token for token with plain decoding's); > 0 "
                        "samples, every method and repeat of a turn with the same seed (--seed + 1000 x question id "
                        "+ turn); sampled answers are not compared with plain's (lossless sampling keeps the "
                        "distribution, not the draws)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold, with --temperature (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k cut, with --temperature (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p cut, with --temperature (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="base sampling seed, with --temperature (default: 0)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="repetition penalty for every method, plain decoding included (default: the model's "
                        "generation config's; 1.0 = off)")
    _limit_args(p, " (for every method, plain decoding included)")
    p.add_argument("--draft-revision", default=None, help="Hub revision of the draft checkpoints named by Hub id")
    p.add_argument("--allow-other-base", action="store_true", help="see infer.py --help")
    p.add_argument("--compile", action="store_true",
                   help=COMPILE_HELP + "; every method, plain decoding included, runs the same compiled "
                        "forward, and the warm-up compiles it outside the timing")
    p.add_argument("--resume", action="store_true",
                   help="continue the run logged in --out-dir where it stopped (same options; answers already logged "
                        "are kept, not redone); without it an --out-dir that holds a run is refused")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def build_costs_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infer.py costs", allow_abbrev=False,
                                description="Median time of one tree verification against "
                                "tree size, over a cache of --context tokens: what a bigger tree costs here; then the "
                                "decoding loop's own overhead per step (time outside the target's forward).")
    _model_args(p)
    p.add_argument("--dtype", default="float32",
                   help="comma-separated dtypes, measured one after the other (default: %(default)s)")
    p.add_argument("--sizes", type=integers(1), default=(1, 2, 4, 8, 16, 32, 64),
                   help="tree sizes (nodes), comma-separated (default: 1,2,4,8,16,32,64)")
    p.add_argument("--context", type=integer(1), default=256,
                   help="cached tokens under the tree (default: %(default)s)")
    p.add_argument("--repeats", type=integer(1), default=20,
                   help="timed rounds per size; the median is reported (default: %(default)s)")
    p.add_argument("--loop-prompts", type=integer(0), default=4,
                   help="MT-bench first turns decoded with --loop-draft to measure the loop's overhead (0 = skip; "
                        "default: %(default)s)")
    p.add_argument("--loop-draft", default="ngram",
                   help="the draft used for the overhead measurement: as --draft, or 'DRAFT@TREE' with a --tree value "
                        "(e.g. runs/medusa-smollm2/heads@dynamic:4,depth=2 or HEADS@auto), as bench --methods takes it "
                        "(default: %(default)s)")
    p.add_argument("--loop-tokens", type=integer(1), default=64,
                   help="new tokens per overhead prompt (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def stop_strings(values: Sequence[str] | None) -> list[str] | None:
    """--stop's values: None when not given (the generation config's); '' dropped (--stop '' alone: none); the
    escapes \\n, \\t, \\r and \\\\ read as the characters they stand for, as a shell passes them on unread."""
    if values is None:
        return None
    return [re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], s) for s in values if s]


def _decoding(args: argparse.Namespace) -> GenerationOptions:
    """The generation options of infer.py's flags, for ``stream`` / ``generate_plain``."""
    return GenerationOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, min_p=args.min_p, seed=args.seed, chat=not args.no_chat,
                             repetition_penalty=args.repetition_penalty, stop=stop_strings(args.stop),
                             min_new_tokens=args.min_new_tokens, presence_penalty=args.presence_penalty,
                             frequency_penalty=args.frequency_penalty)


def _start(model: api.SpecModel, prompt: api.Prompt, args: argparse.Namespace) -> api.TextStream:
    return model.stream(prompt, options=_decoding(args))


def _reply(model: api.SpecModel, prompt: api.Prompt, args: argparse.Namespace, out: TextIO, err: TextIO,
           label: str) -> tuple[api.TextStream, bool]:
    """Stream one reply, then its statistics -> (the stream, whether it ran to its end); Ctrl-C stops it, and the
    stream holds what was generated (reported)."""
    stream = _start(model, prompt, args)
    try:
        _show(stream, out)
    except KeyboardInterrupt:
        err.write(f"\n{label} interrupted: {stream.stats}\n")
        return stream, False
    err.write(f"{label} {stream.stats}\n")
    return stream, True


def _show(stream: api.TextStream, out: TextIO) -> None:
    """Write the pieces as they come (a KeyboardInterrupt leaves ``stream`` holding what was generated)."""
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")


def _compare(model: api.SpecModel, prompt: api.Prompt, args: argparse.Namespace, spec: api.TextStream,
             err: TextIO) -> None:
    plain = model.generate_plain(prompt, options=_decoding(args))
    err.write(f"[plain generate] {plain.stats}\n")
    err.write(f"[compare] speed-up {spec.stats.tokens_per_s / plain.stats.tokens_per_s:.2f}x; ")
    if args.temperature > 0:
        err.write("outputs not compared (sampling: both draw from the same distribution, not the same tokens)\n")
    elif plain.tokens == spec.tokens:
        err.write("outputs identical\n")
    else:
        first = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b),
                     min(len(plain.tokens), len(spec.tokens)))
        err.write(f"outputs DIFFER from token {first} on\n")


def run_decode(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
               read: Callable[[str], str] = input) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    if args.system is not None and args.no_chat:
        err.write("error: --system is a message of the chat template: drop --no-chat, or put it in the prompt\n")
        return 2
    if args.prompt is not None and not args.no_chat:
        api.check_message(args.prompt)  # before the model loads; with --system too
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    model = api.load(args.model, draft=args.draft, dtype=args.dtype, tree=args.tree, device=args.device,
                     revision=args.revision, draft_revision=args.draft_revision, allow_other_base=args.allow_other_base,
                     trust_remote_code=args.trust_remote_code, compile=args.compile)
    label = f"[selfspec {args.draft}]"
    if args.tree == "auto":  # name what it stands for on this machine (tune-tree's cached choice)
        label = f"[selfspec {args.draft} --tree auto: {model.tree.spec}]"
    if args.prompt is not None:
        prompt = system + [{"role": "user", "content": args.prompt}] if system else args.prompt
        if args.compare:  # untimed warm-up of both paths, so neither timing pays for first-call set-up
            model.generate(prompt, max_new_tokens=2, chat=not args.no_chat)
            model.generate_plain(prompt, max_new_tokens=2, chat=not args.no_chat)
        stream, finished = _reply(model, prompt, args, out, err, label)
        if not finished:
            return INTERRUPTED
        if args.compare:
            _compare(model, prompt, args, stream, err)
        return 0
    if args.no_chat:
        err.write("interactive mode is a chat: drop --no-chat, or pass --prompt\n")
        return 2
    err.write(f"chat with {args.model} (--draft {args.draft}); an empty line, Ctrl-D or Ctrl-C here ends, Ctrl-C "
              f"during a reply stops it\n")
    messages: list[dict[str, str]] = list(system)
    while True:
        try:
            text = read("you> ")
        except (EOFError, KeyboardInterrupt):
            err.write("\n")
            return 0
        if not text.strip():
            return 0
        messages.append({"role": "user", "content": text})
        out.write("assistant> ")
        stream, _ = _reply(model, messages, args, out, err, label)
        messages.append({"role": "assistant", "content": stream.text})  # a stopped reply: what it had generated


def run_bench_cli(argv: Sequence[str], out: TextIO | None = None) -> int:
    out = out or sys.stdout
    a = build_bench_parser().parse_args(argv)
    cfg = BenchConfig(questions=a.questions, out_dir=a.out_dir, methods=registry.split_drafts(a.methods),
                      dtypes=names(a.dtype), model=a.model, revision=a.revision, draft_revision=a.draft_revision,
                      max_new_tokens=a.max_new_tokens, limit=a.limit, per_category=a.per_category, repeats=a.repeats,
                      warmup_tokens=a.warmup_tokens, device=a.device, allow_other_base=a.allow_other_base,
                      progress=not a.no_progress, resume=a.resume, temperature=a.temperature, top_p=a.top_p,
                      top_k=a.top_k, min_p=a.min_p, seed=a.seed, repetition_penalty=a.repetition_penalty,
                      stop=stop if (stop := stop_strings(a.stop)) is None else tuple(stop),
                      min_new_tokens=a.min_new_tokens, compile=a.compile)
    try:
        summary = run_bench(cfg)
    except KeyboardInterrupt:
        sys.stderr.write(f"\ninterrupted: every finished answer is logged in {cfg.out_dir}; the same command with "
                         f"--resume continues where this stopped\n")
        return INTERRUPTED
    out.write(to_markdown(summary))
    out.write(f"\nanswers, summary.md, summary.json and summary.png in {cfg.out_dir}\n")
    return 0


def run_costs_cli(argv: Sequence[str], out: TextIO | None = None) -> int:
    out = out or sys.stdout
    a = build_costs_parser().parse_args(argv)
    loop = draft_method(a.loop_draft)  # 'DRAFT' or 'DRAFT@TREE', checked before any model loads
    questions = specbench.load_questions(DEFAULT_QUESTIONS, per_category=1)[: a.loop_prompts] if a.loop_prompts else []
    for dtype in names(a.dtype):
        model, tokenizer = load_model(a.model, dtype=dtype, revision=a.revision, device=a.device)
        target = Target(model)
        out.write(f"\n{a.model} {dtype}, cache of {a.context} tokens, median of {a.repeats}:\n")
        costs = verify_costs(target, sizes=a.sizes, context=a.context, repeats=a.repeats, progress=not a.no_progress)
        out.write(format_costs(costs) + "\n")
        if questions:
            drafter = registry.build(loop.draft, target, a.model)
            spec_model = api.SpecModel(target, tokenizer, drafter, a.model)
            prompts = [spec_model.encode(q.turns[0]) for q in questions]
            loop_overhead(target, drafter, prompts[:1], max_new_tokens=8)  # warm-up
            o = loop_overhead(target, drafter, prompts, max_new_tokens=a.loop_tokens)
            out.write(f"loop with --draft {a.loop_draft} over {len(prompts)} prompts ({o.steps} steps): "
                      f"{o.verify_ms_per_step:.1f} ms in the target's forward + {o.other_ms_per_step:.1f} ms outside "
                      f"it per step = {100 * o.overhead_share:.1f}% overhead\n")
    return 0


def build_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="infer.py serve",
        description="Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models), every "
                    "answer decoded with the draft, losslessly; one request at a time, the others wait in line. "
                    "Example: python infer.py serve --draft ngram --port 8000, then point an OpenAI client at "
                    "http://127.0.0.1:8000/v1 (any API key).")
    _model_args(p)
    _draft_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="port (default: 8000; 0 = any free port)")
    p.add_argument("--name", default=None, help="the model id clients see (default: --model)")
    p.add_argument("--temperature", type=number(0.0, 2.0), default=0.0,
                   help="for requests that give none, 0 to 2 as a request's (default 0: greedy, token-identical to "
                        "generate)")
    p.add_argument("--max-tokens", type=integer(1), default=256,
                   help="for requests that give no max_tokens, capped at what the context holds after the prompt "
                        "(default: 256)")
    p.add_argument("--api-key", default=os.environ.get("SELFSPEC_API_KEY"),
                   help="requests must send 'Authorization: Bearer KEY' (default: $SELFSPEC_API_KEY; unset: no check). "
                        "Set one before --host opens the server beyond this machine")
    p.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    return p


def run_serve_cli(argv: Sequence[str], err: TextIO | None = None) -> int:
    err = err or sys.stderr
    a = build_serve_parser().parse_args(argv)
    try:  # the address first: a port in use fails at once, not after the model has loaded
        server = serve.make_server(None, a.host, a.port, verbose=not a.quiet)
    except OSError as e:
        raise ValueError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}; pick another --port (0: any free "
                         f"port) or --host") from None
    try:
        model = api.load(a.model, draft=a.draft, dtype=a.dtype, tree=a.tree, device=a.device, revision=a.revision,
                         draft_revision=a.draft_revision, allow_other_base=a.allow_other_base,
                         trust_remote_code=a.trust_remote_code, compile=a.compile)
        session = serve.Session(model, a.name or a.model, default_temperature=a.temperature,
                                default_max_tokens=a.max_tokens, api_key=a.api_key or None)
        session.warm_up()
        server.RequestHandlerClass.session = session  # type: ignore[attr-defined]
        host, port = server.server_address[:2]
        err.write(f"serving {session.name} (--draft {a.draft}) at http://{host}:{port}/v1; Ctrl-C stops\n")
        err.flush()
        server.serve_forever()
    except KeyboardInterrupt:
        err.write("\nstopped\n")
    finally:
        server.server_close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    hf_logging.disable_progress_bar()  # the weight-loading bar would interleave with streamed text
    try:
        if argv[:1] == ["bench"]:
            return run_bench_cli(argv[1:])
        if argv[:1] == ["costs"]:
            return run_costs_cli(argv[1:])
        if argv[:1] == ["serve"]:
            return run_serve_cli(argv[1:])
        if argv[:1] == ["fit-policy"]:
            return policy_fit.run_cli(argv[1:], sys.stdout)
        if argv[:1] in (["sweep-exit"], ["search-skip"], ["tune-tree"]):
            run = {"sweep-exit": calibrate.run_sweep_cli, "search-skip": calibrate.run_search_cli,
                   "tune-tree": calibrate.run_tune_cli}[argv[0]]
            return run(argv[1:], sys.stdout)
        return run_decode(build_parser().parse_args(argv))
    except (FileNotFoundError, FileExistsError, ValueError, TypeError, ImportError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
