"""What a draft costs and gains inside llama.cpp, and whether it stays lossless there: the cost model of issue 58.

    python -m selfspec.tools.llamacpp_costs --llama-model exports/smollm2-bf16.gguf \\
        --methods ngram-mod,exports/eagle3-bf16.gguf,n=1:2:3:4,exports/dflash-bf16.gguf,n=1:3:5:7 \\
        --questions 16 --out outputs/llamacpp-costs-bf16

1. verification: ``llama-bench`` times one target forward over K tokens at a context of ``--depth`` tokens
   (``-p K -n 0 -d depth``), for K in ``--lengths``: what a step that verifies K - 1 drafted tokens costs.
2. decoding: for plain decoding and every method (a llama.cpp ``--spec-type`` mode, or a draft GGUF with the draft
   lengths to try, ``n=1:2:3``), one llama-server on the same first turns of MT-bench (selfspec's chat template,
   greedy, ``--max-new-tokens``); from llama.cpp's own timings of the decoding phase (the prompt excluded): ms per
   target step, drafted and accepted tokens per step, tokens per step. A step's time less the verification of its
   1 + drafted tokens is the drafting's cost; the tokens per step a configuration needs to pay is its step time over
   plain decoding's time per token.
3. identity: every answer against plain decoding's, token for token; where one differs, plain decoding's top-2
   probabilities at the first differing token (``n_probs``) say whether it is a near-tie.
4. a prediction (labelled as one): the same drafts and acceptance on a target ``--scale`` times larger (every
   target forward ``scale`` times slower, as memory-bound decoding is; the drafting as measured).

Writes ``out/costs.json`` and ``out/costs.md``; prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoTokenizer

from selfspec.core.files import atomic_write
from selfspec.core.models import DEFAULT_MODEL, resolve
from selfspec.tools import llamacpp, specbench
from selfspec.tools.bench import DEFAULT_QUESTIONS

NEAR_TIE = 0.1
"""a difference starts at a near-tie when plain decoding's top two probabilities there differ by less than this."""


@dataclass
class Config:
    """One llama-server configuration: its label and its speculative flags."""

    label: str
    args: list[str]
    turns: list[dict[str, Any]] = field(default_factory=list)
    """per prompt: tokens, predicted_ms, predicted_n, draft_n, draft_n_accepted (and, for plain, the top-2 probs)."""

    def totals(self) -> dict[str, float]:
        ms = sum(t["predicted_ms"] for t in self.turns)
        tokens = sum(t["predicted_n"] for t in self.turns)
        drafted = sum(t["draft_n"] for t in self.turns)
        accepted = sum(t["draft_n_accepted"] for t in self.turns)
        # the decoding phase: the first token comes from the prompt's forward; each step after adds one token of the
        # target's own after its accepted drafts
        steps = max(sum(t["predicted_n"] - t["draft_n_accepted"] - 1 for t in self.turns), 1)
        return {"tokens_per_s": 1000 * (tokens - len(self.turns)) / ms, "step_ms": ms / steps,
                "drafted_per_step": drafted / steps, "accepted_per_step": accepted / steps,
                "tokens_per_step": (tokens - len(self.turns)) / steps,
                "acceptance": accepted / drafted if drafted else None}


def expand(methods: Sequence[str]) -> list[tuple[str, list[str]]]:
    """'MODE' or 'DRAFT.gguf[,n=1:2:3][,key=value]' -> (label, llama-server flags) per draft length."""
    out = []
    for spec in methods:
        head, *options = spec.split(",")
        lengths = [o for o in options if o.startswith("n=")]
        rest = [o for o in options if not o.startswith("n=")]
        for n in (lengths[0][2:].split(":") if lengths else [None]):
            method = llamacpp.parse_method(llamacpp.PREFIX + ",".join([head, *rest, *([f"n={n}"] if n else [])]))
            out.append((method.label[len(llamacpp.PREFIX):], method.server_args("float32")))
    return out


def verify_costs(bench: Path, model: Path, lengths: Sequence[int], depth: int, threads: int) -> dict[int, float]:
    """llama-bench: ms of one target forward over K tokens at a context of ``depth``, per K (median of 5)."""
    command = [str(bench), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, lengths)), "-n", "0", "-d",
               str(depth), "-r", "5", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise llamacpp.ServerError(f"{' '.join(command)}: exit code {done.returncode}: {done.stderr[-1000:]}")
    rows = json.loads(done.stdout)
    return {int(r["n_prompt"]): r["avg_ns"] / 1e6 for r in rows}


def interpolate(costs: dict[int, float], k: float) -> float:
    """The verification cost of ``k`` tokens (linear between the measured lengths)."""
    keys = sorted(costs)
    if k <= keys[0]:
        return costs[keys[0]]
    for a, b in zip(keys, keys[1:]):
        if k <= b:
            return costs[a] + (costs[b] - costs[a]) * (k - a) / (b - a)
    return costs[keys[-1]] * k / keys[-1]


def top2(response: dict[str, Any]) -> list[list[float]]:
    """Per token, the target's two largest probabilities there (``n_probs``), as long as llama.cpp's list follows
    the tokens one for one: where a character spans several byte tokens it may report them as one entry, and from
    there on the list is not the tokens' (those positions get [])."""
    out: list[list[float]] = []
    for step, token in zip(response.get("completion_probabilities", []), response["tokens"]):
        if step.get("id") != token:
            break
        out.append([math.exp(p["logprob"]) for p in step["top_logprobs"][:2]])
    return out + [[] for _ in response["tokens"][len(out):]]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(a: argparse.Namespace) -> dict[str, Any]:
    server = llamacpp.find_server(a.llama_server)
    bench = Path(a.llama_bench) if a.llama_bench else server.with_name("llama-bench")
    model = Path(a.llama_model)
    llamacpp.check_gguf(model, "--llama-model")
    configs = [Config("plain", [])] + [Config(label, args) for label, args in expand(a.methods)]
    tokenizer = AutoTokenizer.from_pretrained(resolve(a.model)[0])
    questions = specbench.load_questions(a.questions_file, limit=a.questions)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q.turns[0]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in questions]
    threads = str(a.threads)
    base = ["-m", str(model), "-t", threads, "-tb", threads, "-c", "4096", "--parallel", "1", "--no-webui",
            "--cache-ram", "0"]
    for config in configs:
        with llamacpp.LlamaServer(server, base + config.args) as s:
            s.complete({"prompt": prompts[0], "n_predict": 8, "temperature": 0, "cache_prompt": False})  # warm-up
            for prompt in prompts:
                payload = {"prompt": prompt, "n_predict": a.max_new_tokens, "temperature": 0, "cache_prompt": False,
                           "return_tokens": True, **({"n_probs": 2} if config.label == "plain" else {})}
                r = s.complete(payload)
                t = r["timings"]
                turn = {"tokens": r["tokens"], "predicted_ms": t["predicted_ms"], "predicted_n": t["predicted_n"],
                        "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0)}
                if config.label == "plain":
                    turn["top2"] = top2(r)
                config.turns.append(turn)
        print(f"llamacpp_costs: {config.label}: {config.totals()['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    verify = verify_costs(bench, model, a.lengths, a.depth, a.threads)
    return report(configs, verify, a)


def report(configs: list[Config], verify: dict[int, float], a: argparse.Namespace) -> dict[str, Any]:
    plain = configs[0]
    plain_ms = 1000 / plain.totals()["tokens_per_s"]
    rows = []
    for c in configs:
        t = c.totals()
        # the step less its verification (llama-bench's forward over 1 + drafted tokens): what drafting costs
        draft_ms = 0.0 if c is plain else max(t["step_ms"] - interpolate(verify, 1 + t["drafted_per_step"]), 0.0)
        diffs = []
        for i, (mine, ref) in enumerate(zip(c.turns, plain.turns)):
            at = first_difference(mine["tokens"], ref["tokens"])
            if at is not None:
                pair = ref["top2"][at] if at < len(ref["top2"]) else []
                margin = pair[0] - pair[1] if len(pair) == 2 else None
                diffs.append({"prompt": i, "token": at, "plain_top2": pair,
                              "near_tie": None if margin is None else margin < NEAR_TIE})
        needed = t["step_ms"] / plain_ms
        # a target `s` times larger: its forwards (the step less the drafting) `s` times slower, the drafting as here
        predicted = {str(s): s * plain_ms * t["tokens_per_step"] / (s * (t["step_ms"] - draft_ms) + draft_ms)
                     for s in a.scale}
        rows.append({"config": c.label, **t, "speedup": t["tokens_per_s"] * plain_ms / 1000,
                     "draft_ms_per_step": draft_ms, "tokens_per_step_to_pay": needed,
                     "identical": len(c.turns) - len(diffs), "of": len(c.turns), "differences": diffs,
                     "predicted_speedup": predicted})
    return {"model": a.llama_model, "questions": a.questions, "max_new_tokens": a.max_new_tokens, "depth": a.depth,
            "threads": a.threads, "verify_ms": verify, "plain_ms_per_token": plain_ms, "rows": rows}


def to_markdown(result: dict[str, Any]) -> str:
    v = result["verify_ms"]
    lines = [f"Target forward over K tokens at a context of {result['depth']} (llama-bench, ms): "
             + ", ".join(f"K={k}: {ms:.2f}" for k, ms in sorted(v.items())), "",
             f"Decoding {result['questions']} first turns, {result['max_new_tokens']} new tokens, "
             f"{result['threads']} threads; plain: {result['plain_ms_per_token']:.2f} ms a token.", "",
             "| config | tokens/s | speed-up | ms/step | drafted/step | accepted/step | tokens/step | draft ms/step | "
             "tokens/step to pay | identical | predicted " + " / ".join(f"{s}x" for s in result['rows'][0]
                                                                         ['predicted_speedup']) + " (prediction) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ties = sum(d["near_tie"] is True for d in r["differences"])
        unknown = sum(d["near_tie"] is None for d in r["differences"])
        ident = f"{r['identical']}/{r['of']}" + (f" ({ties} of {len(r['differences'])} differences at near-ties"
                                                 + (f", {unknown} where llama.cpp's probabilities do not follow the "
                                                    f"tokens" if unknown else "") + ")" if r["differences"] else "")
        lines.append(f"| {r['config']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['drafted_per_step']:.2f} | {r['accepted_per_step']:.2f} | {r['tokens_per_step']:.2f} | "
                     f"{r['draft_ms_per_step']:.2f} | {r['tokens_per_step_to_pay']:.2f} | {ident} | "
                     + " / ".join(f"{x:.2f}" for x in r["predicted_speedup"].values()) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m selfspec.tools.llamacpp_costs", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--llama-model", required=True, help="the target GGUF")
    p.add_argument("--methods", default="ngram-mod", help="comma-separated: llama.cpp modes and draft GGUFs, a draft "
                   "with n=1:2:3 (the draft lengths to try) and other llamacpp: options (default %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target's transformers model, for its tokenizer and "
                   "chat template (default %(default)s)")
    p.add_argument("--questions-file", default=str(DEFAULT_QUESTIONS), help="Spec-Bench questions")
    p.add_argument("--questions", type=int, default=16, help="first turns of the first N questions (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4, 5, 6, 8, 12, 16],
                   help="verification lengths K for llama-bench (default 1,2,3,4,5,6,8,12,16)")
    p.add_argument("--depth", type=int, default=256, help="context length of the verification timings (default 256)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--scale", type=lambda s: [int(x) for x in s.split(",")], default=[10, 50],
                   help="target sizes, as multiples, of the prediction (default 10,50)")
    p.add_argument("--llama-server", default=None, help="default: $LLAMA_SERVER, else llama-server on PATH")
    p.add_argument("--llama-bench", default=None, help="default: llama-bench beside llama-server")
    p.add_argument("--out", type=Path, required=True, help="directory for costs.json and costs.md")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.methods = _join_lengths([m for m in a.methods.split(",") if m])
    result = run(a)
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write(a.out / "costs.json", json.dumps(result, indent=1))
    text = to_markdown(result)
    atomic_write(a.out / "costs.md", text)
    print(text)
    return 0


def _join_lengths(pieces: Sequence[str]) -> list[str]:
    """'X.gguf', 'n=1:2' -> 'X.gguf,n=1:2' (and any key=value piece back to its method)."""
    out: list[str] = []
    for piece in pieces:
        if out and "=" in piece.split(",")[0]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


if __name__ == "__main__":
    sys.exit(main())
