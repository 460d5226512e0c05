"""The command line behind ``python infer.py``: decode (one prompt or an interactive chat), ``bench``, ``costs`` and
``serve`` run here; the other subcommands are dispatched to the tools that own them. What each command takes on the
command line: ``selfspec.tools.cli_parsers``.

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
import io
import re
import sys
from typing import Callable, Sequence, TextIO

from transformers.utils import logging as hf_logging

from selfspec import api, registry

from selfspec.core.models import load_model
from selfspec.core.request import GenerationOptions
from selfspec.core.target import Target
from selfspec.tools import calibrate, llamacpp, load, main_job, policy_fit, serve, specbench
from selfspec.tools.bench import DEFAULT_QUESTIONS, BenchConfig, bench_options, draft_method, run_bench
from selfspec.tools.cli_parsers import build_bench_parser, build_costs_parser, build_parser, build_serve_parser
from selfspec.tools.costs import format_costs, loop_overhead, verify_costs
from selfspec.tools.options import names
from selfspec.tools.specbench import to_markdown

INTERRUPTED = 130

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
    for flag, text in (("--prompt", args.prompt), ("--system", args.system)):
        if text is not None:  # before the model loads: bytes that are not UTF-8 arrive as lone surrogates
            api.check_unicode(text, flag)
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
    if read is input and isinstance(sys.stdin, io.TextIOWrapper):  # a line that is not UTF-8: refused below, not a
        sys.stdin.reconfigure(errors="surrogateescape")  # UnicodeDecodeError that loses what was read with it
    while True:
        try:
            text = read("you> ")
        except (EOFError, KeyboardInterrupt):
            err.write("\n")
            return 0
        if not text.strip():
            return 0
        if (problem := api.unicode_problem(text)) is not None:  # the line is dropped; the conversation goes on
            err.write(f"error: this line: {problem}; the conversation goes on without it\n")
            continue
        messages.append({"role": "user", "content": text})
        out.write("assistant> ")
        stream, _ = _reply(model, messages, args, out, err, label)
        messages.append({"role": "assistant", "content": stream.text})  # a stopped reply: what it had generated


def run_bench_cli(argv: Sequence[str], out: TextIO | None = None) -> int:
    out = out or sys.stdout
    a = build_bench_parser().parse_args(argv)
    methods = llamacpp.join_options(registry.split_drafts(a.methods))  # 'llamacpp:ngram-mod,ngram-n=4': one method
    cfg = BenchConfig(questions=a.questions, out_dir=a.out_dir, methods=methods,
                      dtypes=names(a.dtype), model=a.model, revision=a.revision, draft_revision=a.draft_revision,
                      limit=a.limit, per_category=a.per_category, skip_per_category=a.skip_per_category,
                      repeats=a.repeats, warmup_tokens=a.warmup_tokens, device=a.device,
                      allow_other_base=a.allow_other_base, progress=not a.no_progress, resume=a.resume,
                      options=bench_options(a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                            min_p=a.min_p, seed=a.seed, repetition_penalty=a.repetition_penalty,
                                            stop=stop_strings(a.stop), min_new_tokens=a.min_new_tokens),
                      compile=a.compile is not None, compile_both=a.compile == "both", llama_model=a.llama_model,
                      llama_server=a.llama_server)
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


def run_serve_cli(argv: Sequence[str], err: TextIO | None = None) -> int:
    err = err or sys.stderr
    a = build_serve_parser().parse_args(argv)
    serve.check_exposure(a.host, a.api_key, a.insecure)  # before the address is bound
    try:  # the address first: a port in use fails at once, not after the model has loaded
        server = serve.make_server(None, a.host, a.port, verbose=not a.quiet, max_body_bytes=a.max_body_bytes,
                                   read_timeout=a.read_timeout, max_connections=a.max_connections)
    except OSError as e:
        raise ValueError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}; pick another --port (0: any free "
                         f"port) or --host") from None
    try:
        model = api.load(a.model, draft=a.draft, dtype=a.dtype, tree=a.tree, device=a.device, revision=a.revision,
                         draft_revision=a.draft_revision, allow_other_base=a.allow_other_base,
                         trust_remote_code=a.trust_remote_code, compile=a.compile)
        session = serve.Session(model, a.name or a.model, default_temperature=a.temperature,
                                default_max_tokens=a.max_tokens, api_key=a.api_key or None, max_batch=a.max_batch,
                                batch_nodes=a.batch_nodes, max_choices=a.max_choices,
                                max_prompt_chars=a.max_prompt_chars)
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
        if argv[:1] == ["serve-load"]:
            return load.main(argv[1:])
        if argv[:1] == ["main-job"]:
            return main_job.main(argv[1:])
        if argv[:1] == ["fit-policy"]:
            return policy_fit.run_cli(argv[1:], sys.stdout)
        if argv[:1] in (["sweep-exit"], ["search-skip"], ["tune-tree"]):
            run = {"sweep-exit": calibrate.run_sweep_cli, "search-skip": calibrate.run_search_cli,
                   "tune-tree": calibrate.run_tune_cli}[argv[0]]
            return run(argv[1:], sys.stdout)
        return run_decode(build_parser().parse_args(argv))
    except (FileNotFoundError, FileExistsError, ValueError, TypeError, ImportError, llamacpp.ServerError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
