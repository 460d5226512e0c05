"""What ``python infer.py`` and its subcommands take on the command line: the argparse parsers of decoding
(``build_parser``), ``bench``, ``costs`` and ``serve``, and the flag groups they share (the model, the draft and its
tree, the stop conditions). ``selfspec.tools.cli`` runs what they parse."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from selfspec.core.models import DEFAULT_MODEL
from selfspec.tools.bench import DEFAULT_QUESTIONS
from selfspec.tools.options import integer, integers, number
from selfspec.tools.serve.connections import MAX_CONNECTIONS, READ_TIMEOUT_S
from selfspec.tools.serve.server import MAX_BODY_BYTES
from selfspec.tools.serve.session import MAX_CHOICES


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"target model: a Hub id, a local directory, a .gguf file, or the built-in {DEFAULT_MODEL!r} "
                        "(default; built offline on first use)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")


COMPILE_HELP = ("compile the target's forward with torch.compile (inductor; on CPU it needs g++ or clang++): "
                "faster steps at batch size 1 (measured: docs/benchmarks/log.md, 'A compiled target'), but the first "
                "start on a machine compiles for minutes on a small CPU (later ones ~20 s): for serve and bench, not "
                "one prompt")


def _draft_args(p: argparse.ArgumentParser) -> None:
    """The options that choose the draft, its tree and how the target loads: infer.py and infer.py serve."""
    p.add_argument("--draft", default="ngram",
                   help="the draft: 'ngram' (prompt lookup, default; options as 'ngram:depth=8,max_nodes=24'), 'none' "
                        "(plain decoding through the same loop), 'early-exit:layer=E' (the first E layers draft; options "
                        "depth, stop_below), 'model:DIR' (a separate draft model with the target's tokenizer, a "
                        "directory or Hub id, e.g. one train.py distilled: method draft_model), or a draft checkpoint (directory or Hub id: Medusa or Hydra heads, an EAGLE head, an "
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
               "  infer.py serve ...        an OpenAI-compatible HTTP endpoint decoding with the draft (--help)\n"
               "  infer.py serve-load ...   concurrent clients against serve, one at a time and batched (--help)",
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
                        "(assistant_early_exit, default half the layers), assisted:DIR (transformers' assistant_model= "
                        "with the draft model DIR), none, ngram[:opts], model:DIR (a separate draft model), draft "
                        "checkpoints, A+B "
                        "(merged drafts); DRAFT@TREE runs a draft with another --tree (e.g. runs/heads@dynamic:32, "
                        "runs/heads@dynamic:12,depth=3, runs/heads@chain:3, runs/heads@tree.json, "
                        "runs/eagle_head+ngram:depth=6,max_nodes=8@auto), and llama.cpp's llama-server on "
                        "--llama-model: llamacpp:plain, llamacpp:PART[+PART][,key=value...] with PART a mode "
                        "(ngram-mod, ngram-simple, ngram-map-k, ngram-map-k4v, ngram-cache) or a draft GGUF path "
                        "(its --spec-type from its general.architecture; {dtype} in a path: f32, bf16, f16), keys n, "
                        "n-min, p-min (a draft GGUF's), ngram-n, ngram-m, ngram-min (the modes'), e.g. "
                        "llamacpp:ngram-mod,ngram-n=12 or llamacpp:exports/eagle3-{dtype}.gguf,n=3 "
                        "(default: %(default)s)")
    p.add_argument("--dtype", default="fp32,bf16",
                   help="comma-separated dtypes, one target load each (default: %(default)s)")
    p.add_argument("--llama-model", default=None, metavar="PATH",
                   help="the target as a GGUF file, for the llamacpp: methods; may hold {dtype} (f32, bf16, f16 per "
                        "--dtype). python -m heads.export MODEL OUT.gguf --format gguf makes one")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary, for the llamacpp: methods (default: $LLAMA_SERVER, else "
                        "llama-server on PATH); each method and dtype runs its own on 127.0.0.1 with torch's thread "
                        "count")
    p.add_argument("--max-new-tokens", type=int, default=192, help="per turn (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="answer only the first N questions")
    p.add_argument("--per-category", type=int, default=None,
                   help="answer only the first N questions of each category (a balanced subset)")
    p.add_argument("--skip-per-category", type=int, default=0, metavar="K",
                   help="skip the first K questions of each category, before --per-category: measure a choice on "
                   "questions it was not tuned or looked at on (--skip-per-category 4 --per-category 4: the 5th to "
                   "8th of each)")
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
    p.add_argument("--compile", nargs="?", const="on", choices=("on", "both"), default=None,
                   help=COMPILE_HELP + "; every method, plain decoding included, runs the same compiled "
                        "forward, and the warm-up compiles it outside the timing (its seconds: run.json, "
                        "'warmup_s'). '--compile both': each dtype's target twice, uncompiled and compiled (rows "
                        "'bfloat16' and 'bfloat16-compiled'), side by side in one run; llama.cpp's methods run "
                        "once, beside the uncompiled target")
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



def build_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="infer.py serve",
        description="Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models), every "
                    "answer decoded with the draft, losslessly; requests that arrive together decode together in "
                    "one batch (continuous batching: a new request joins the running batch at its next step; beyond "
                    "--max-batch it waits in line). "
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
                        "A --host beyond this machine needs one, or --insecure")
    p.add_argument("--insecure", action="store_true",
                   help="serve on a --host beyond this machine without an API key (otherwise refused: anyone who can "
                        "reach it could use it)")
    p.add_argument("--max-choices", type=integer(1), default=MAX_CHOICES,
                   help="the most answers one request may ask for, its prompts x n (default: %(default)s); more is "
                        "refused with 400")
    p.add_argument("--max-prompt-chars", type=integer(1), default=None,
                   help="the most characters of one prompt (a chat's messages together), refused with 400 before it is "
                        "tokenized (default: the model's context x its longest token's characters, the longest prompt "
                        "that could fit)")
    p.add_argument("--max-body-bytes", type=integer(1), default=MAX_BODY_BYTES,
                   help="the most bytes of a request body; a larger one is answered 413 before it is read (default: "
                        "%(default)s, 16 MiB)")
    p.add_argument("--read-timeout", type=number(0.001, 86400.0), default=READ_TIMEOUT_S, metavar="SECONDS",
                   help="the time a client has to send one whole request (request line, headers and body), however "
                        "slowly its bytes come; late headers or body are answered 408 and the connection closed, a "
                        "connection without a request line by then (idle) is closed (default: %(default)g)")
    p.add_argument("--max-connections", type=integer(1), default=MAX_CONNECTIONS,
                   help="the most connections served at once, a thread each, whether decoding, waiting in line or "
                        "still arriving; one more is answered 503 at once (default: %(default)s)")
    p.add_argument("--max-batch", type=integer(1), default=8,
                   help="the most requests decoding together (default: 8; 1: one at a time, the others wait). A draft "
                        "that runs the target's own layers (early exit, layer skipping) decodes one at a time")
    p.add_argument("--batch-nodes", type=integer(1), default=8,
                   help="the most tree nodes one step verifies for a batch of two or more requests: every request's "
                        "root, then what is left shared among the requests that drafted (default: 8, measured on a "
                        "2-core CPU, where a forward's cost grows with every row's nodes; raise it on a GPU). One "
                        "request alone drafts its whole tree")
    p.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    return p
