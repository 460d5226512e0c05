"""A load test of ``infer.py serve``: C concurrent clients ask the MT-bench first turns over HTTP, against the server
decoding one request at a time (``--max-batch 1``, the server before batching) and decoding them together
(``--max-batch``), each draft in the same run -> total tokens/s and per-request latency (p50 / p95) per setting; beside
plain decoding's servers, the peer: transformers' ``generate`` on the same questions in padded batches of C.

    python infer.py serve-load --drafts none ngram --clients 1,2,4,8 --dtype bf16 --max-new-tokens 128

Each server is ``python infer.py serve`` in a process of its own on a free local port (loaded and warmed up before
the clock starts); a draft's servers are up together, and each number of clients runs against one, then the other.
Each client takes the next question from a shared line until all are answered (greedy, ``max_tokens`` each). One
client is measured side by side (``run_paired``): every question goes to each server in turn, in alternating order,
one request in flight at a time, so that the machine's drift over a run (several percent over an hour on a shared
CPU) falls on both servers alike; a server's tokens/s is then its tokens over the time its own requests took.
The peer (``--servers`` 'hf', with draft ``none``) is transformers' static batching as a user of ``model.generate``
gets it: the questions in order, C at a time, left-padded into one batch (``SpecModel.generate_plain`` of a list), in
this process while the servers wait; every question of a batch is answered when its batch ends (its latency), and the
next batch starts then, as C clients that each wait for their answer would see. The table goes to stdout and, with
``--out``, as JSON to a file with a plot beside it (``.png``).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

from selfspec import api
from selfspec.core.models import DEFAULT_MODEL
from selfspec.tools.bench import DEFAULT_QUESTIONS
from selfspec.tools.plots import plot_load
from selfspec.tools.specbench import load_questions

ROOT = Path(__file__).resolve().parents[2]
SERVERS = {"one": "one at a time", "batching": "batching", "hf": "transformers, padded"}
"""--servers' names -> the names in the table."""


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``, linearly interpolated."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@contextmanager
def served(args: list[str]) -> Iterator[int]:
    """``python infer.py serve ARGS`` in a process of its own on a free port, once it has loaded and warmed up -> its
    port; stopped (Ctrl-C) afterwards."""
    cmd = [sys.executable, str(ROOT / "infer.py"), "serve", "--port", "0", "--quiet", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # type: ignore[union-attr]
            seen.append(line)
            found = re.search(r"serving .* at http://[^:]+:(\d+)/v1", line)
            if found:
                break
        else:
            raise RuntimeError(f"infer.py serve {' '.join(args)} stopped before serving:\n{''.join(seen[-20:])}")
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]
        yield int(found.group(1))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def ask(port: int, prompt: str, max_tokens: int) -> tuple[float, int, str]:
    """One chat completion (greedy) -> (seconds it took, completion tokens, the answer)."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as resp:
        reply = json.load(resp)
    return time.perf_counter() - t0, reply["usage"]["completion_tokens"], reply["choices"][0]["message"]["content"]


def run_clients(port: int, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """``clients`` threads answer ``prompts`` (each the next one in line) -> tokens/s, latencies, answers."""
    line, lock = list(range(len(prompts)))[::-1], threading.Lock()
    latencies: list[float] = []
    answers: dict[int, str] = {}
    tokens = [0]

    def client() -> None:
        while True:
            with lock:
                if not line:
                    return
                i = line.pop()
            seconds, used, answer = ask(port, prompts[i], max_tokens)
            with lock:
                latencies.append(seconds)
                tokens[0] += used
                answers[i] = answer

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary(clients, tokens[0], time.perf_counter() - t0, latencies, [answers[i] for i in range(len(prompts))])


def run_padded(model: Any, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """transformers' ``generate`` on ``prompts`` in order, ``clients`` at a time as one left-padded batch (greedy) ->
    as ``run_clients``: each question's latency is its batch's."""
    latencies: list[float] = []
    answers: list[str] = []
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), clients):
        seconds, results = timed(model.generate_plain, prompts[i:i + clients], max_new_tokens=max_tokens,
                                 temperature=0)
        latencies += [seconds] * len(results)
        answers += [r.text for r in results]
        tokens += sum(r.stats.new_tokens for r in results)
    return summary(clients, tokens, time.perf_counter() - t0, latencies, answers)


def ask_padded(model: Any) -> Callable[[str, int], tuple[float, int, str]]:
    """``ask`` of the peer: one question through transformers' ``generate`` (a batch of one)."""
    def ask_one(prompt: str, max_tokens: int) -> tuple[float, int, str]:
        seconds, (r,) = timed(model.generate_plain, [prompt], max_new_tokens=max_tokens, temperature=0)
        return seconds, r.stats.new_tokens, r.text
    return ask_one


def timed(fn: Callable, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def run_paired(asks: dict[str, Callable[[str, int], tuple[float, int, str]]], prompts: list[str],
               max_tokens: int) -> dict[str, dict]:
    """One client against every server side by side (``asks``: per server, a question and max tokens -> seconds,
    tokens, answer): question i goes to each server in turn, the order reversed for every other question -> per
    server, its tokens over the time its own requests took, latencies and answers."""
    names = list(asks)
    seen: dict[str, list[tuple[float, int, str]]] = {name: [] for name in names}
    for i, prompt in enumerate(prompts):
        for name in names if i % 2 == 0 else names[::-1]:
            seen[name].append(asks[name](prompt, max_tokens))
    return {name: summary(1, sum(r[1] for r in rs), sum(r[0] for r in rs), [r[0] for r in rs], [r[2] for r in rs])
            for name, rs in seen.items()}


def summary(clients: int, tokens: int, seconds: float, latencies: list[float], answers: list[str]) -> dict:
    return {"clients": clients, "requests": len(answers), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 2), "p50_s": round(percentile(latencies, 50), 2),
            "p95_s": round(percentile(latencies, 95), 2), "mean_s": round(statistics.mean(latencies), 2),
            "answers": answers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infer.py serve-load", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tree", default=None, help="every server's --tree (default: each draft's own)")
    p.add_argument("--drafts", nargs="+", default=["none", "ngram"],  # not kinds: the drafts run by default
                   help="--draft specs (default: none ngram)")
    p.add_argument("--dtype", default="bf16", help="bf16 or fp32 (default: bf16)")
    p.add_argument("--clients", default="1,2,4,8", help="concurrent clients per setting (default: 1,2,4,8)")
    p.add_argument("--max-batch", type=int, default=8, help="the batching server's --max-batch (default: 8)")
    p.add_argument("--batch-nodes", type=int, default=None,
                   help="the batching server's --batch-nodes (default: the server's own default)")
    p.add_argument("--servers", default="one,batching,hf",
                   help="which servers, separated by commas: 'one' (one request at a time, --max-batch 1), "
                        "'batching', 'hf' (transformers' generate on padded batches, the peer: with draft none only) "
                        "(default: all three)")
    p.add_argument("--questions", type=int, default=80, help="the first N MT-bench questions (default: all 80)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    try:
        clients = [int(c) for c in a.clients.split(",")]
    except ValueError:
        clients = []
    if not clients or min(clients) < 1:
        p.error(f"--clients: expected counts >= 1 separated by commas (e.g. 1,2,4,8), found {a.clients!r}")
    if a.dtype not in ("bf16", "fp32"):
        p.error(f"--dtype: expected bf16 or fp32, found {a.dtype!r}")
    chosen = a.servers.split(",")
    if not chosen or set(chosen) - set(SERVERS):
        p.error(f"--servers: expected some of {', '.join(SERVERS)} separated by commas, found {a.servers!r}")
    prompts = [q.turns[0] for q in load_questions(DEFAULT_QUESTIONS, limit=a.questions)]
    peer = None
    if "hf" in chosen and "none" in a.drafts:
        peer = api.load(a.model, draft="none", dtype=a.dtype)
        peer.generate_plain(prompts[:2], max_new_tokens=2)  # warmed up, as the servers are
    rows = []
    for draft in a.drafts:
        with ExitStack() as stack:
            ports = {}
            for key in ("one", "batching"):
                if key in chosen:
                    args = ["--model", a.model, "--draft", draft, "--dtype", a.dtype,
                            "--max-batch", str(1 if key == "one" else a.max_batch)]
                    args += [] if a.tree is None else ["--tree", a.tree]
                    args += [] if a.batch_nodes is None else ["--batch-nodes", str(a.batch_nodes)]
                    ports[SERVERS[key]] = stack.enter_context(served(args))
            hf = peer if draft == "none" else None
            for n in clients:
                if n == 1:
                    asks = {mode: partial(ask, port) for mode, port in ports.items()}
                    results = run_paired({**asks, **({SERVERS["hf"]: ask_padded(hf)} if hf else {})}, prompts,
                                         a.max_new_tokens)
                else:
                    results = {mode: run_clients(port, prompts, n, a.max_new_tokens) for mode, port in ports.items()}
                    if hf is not None:
                        results[SERVERS["hf"]] = run_padded(hf, prompts, n, a.max_new_tokens)
                for mode, r in results.items():
                    rows.append({"draft": draft, "server": mode, **r})
                    print(f"{draft:>24} {mode:>22} {n:>2} clients: {r['tokens_per_s']:7.1f} tokens/s, "
                          f"p50 {r['p50_s']:6.2f} s, p95 {r['p95_s']:6.2f} s", flush=True)
    order = list(SERVERS.values())
    rows.sort(key=lambda r: (a.drafts.index(r["draft"]), order.index(r["server"]), r["clients"]))
    for row in rows:  # the same answers from either server (greedy)
        alone = next((r for r in rows if r["draft"] == row["draft"] and r["server"] == "one at a time"), None)
        if alone is not None:
            row["answers_as_one_at_a_time"] = sum(x == y for x, y in zip(row["answers"], alone["answers"]))
    print(to_markdown(rows))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=1))
        print(f"wrote {a.out} and {plot_load(rows, a.out.with_suffix('.png'))}")
    return 0


def to_markdown(rows: list[dict]) -> str:
    """The results as a table: one line per draft, server and number of clients."""
    lines = ["| draft | server | clients | total tokens/s | p50 latency (s) | p95 latency (s) | answers as one at a time |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        same = r.get("answers_as_one_at_a_time")
        same_text = "-" if same is None else f"{same}/{r['requests']}"
        lines.append(f"| `{r['draft']}` | {r['server']} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['p50_s']:.2f} | "
                     f"{r['p95_s']:.2f} | {same_text} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
