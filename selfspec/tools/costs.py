"""What a step costs on the machine at hand: verify-forward time against tree size, and the loop's own overhead.

``verify_costs`` times one verification of an N-node tree (a branching one, so the custom 4D mask is in the
measurement) on top of a cache of a given length, as greedy decoding runs it: the target's forward without its LM
head, then the head on the nodes greedy acceptance needs (``selfspec.core.head_rows``; every node's logits where the
model's logits are not its head's plain output, and with ``greedy=False``, as sampling verifies). ``loop_overhead``
runs the real decoding loop and splits each step into the target's forward and everything else (drafting,
acceptance, cache commit). Medians over repeats, the sizes timed in
rounds; nothing is cached between sizes, the cache is cut back to the prefix after each verification.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from selfspec.core import hf
from selfspec.core.drafter import Drafter
from selfspec.core.generate import generate
from selfspec.core.head_rows import greedy_from_hidden
from selfspec.core.target import Target
from selfspec.core.tree import Tree


@dataclass(frozen=True)
class VerifyCost:
    nodes: int
    median_ms: float
    relative: float
    """median time over the median time of a 1-node verification (one plain decoding step)."""


def verify_costs(
    target: Target, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), context: int = 256, repeats: int = 20,
    warmup: int = 3, seed: int = 0, progress: bool = False, greedy: bool = True,
) -> list[VerifyCost]:
    """Median wall time of ``target.verify`` for a tree of each size over a cache of ``context`` tokens (fewer where
    the model holds fewer positions), and of the LM head greedy acceptance then runs (random tokens: the accepted path
    is the root alone; a real step's longer path adds its nodes' rows, ~0.2 ms each in bf16 on SmolLM2); greedy
    False: every node's logits, as sampling verifies.

    The sizes are timed in rounds (every size once per round, ``warmup`` untimed rounds first), not one after the
    other: on a machine whose speed drifts (a shared VM, a CPU changing clock) the drift then hits every size alike,
    where size-by-size timing once put a 1-node verify above an 8-node one (docs/benchmarks/log.md)."""
    context = max(1, min(context, target.max_length - 2))  # the trees reach position context + 1
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=g).to(target.device)
    cache = target.new_cache()
    target.prefill(prompt, cache)
    # a branching tree (root + n - 1 children) takes the custom-mask path every branching draft takes; 1 and 2 nodes
    # can only be chains, verified like plain decoding
    trees = {n: Tree.chain(n - 1) if n <= 2 else Tree.from_parents([-1] + [0] * (n - 1)) for n in sizes}
    tokens = {n: torch.randint(0, target.vocab_size, (n,), generator=g).to(target.device) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    head = target.plain_head() if greedy else None  # as ``generate.stream`` verifies a greedy step
    for i in tqdm(range(warmup + repeats), desc="verify costs", unit="round", disable=not progress, leave=False):
        for n in sizes:
            t0 = time.perf_counter()
            out = target.verify(trees[n], tokens[n], cache, head is None)
            if head is not None:
                greedy_from_hidden(trees[n], tokens[n], out.hidden, *head)
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            with torch.inference_mode():
                hf.cache_keep(cache, context, torch.empty(0, dtype=torch.long))  # back to the prefix
            if i >= warmup:
                times[n].append(elapsed)
    medians = {n: statistics.median(times[n]) * 1000 for n in sizes}
    base = medians.get(1) or min(medians.values())
    return [VerifyCost(nodes=n, median_ms=ms, relative=ms / base) for n, ms in medians.items()]


@dataclass(frozen=True)
class LoopOverhead:
    steps: int
    verify_ms_per_step: float
    other_ms_per_step: float

    @property
    def overhead_share(self) -> float:
        """Share of a step spent outside the target's forward."""
        return self.other_ms_per_step / (self.verify_ms_per_step + self.other_ms_per_step)


def loop_overhead(target: Target, drafter: Drafter, prompts: list[torch.Tensor], max_new_tokens: int = 64) -> LoopOverhead:
    """Run the loop on each prompt; report mean per-step time in and outside the verify forward (prefill excluded)."""
    verify, other, steps = 0.0, 0.0, 0
    for ids in prompts:
        out = generate(target, drafter, ids, max_new_tokens)
        for s in out.steps[1:]:
            verify += s.verify_s
            other += s.other_s
            steps += 1
    steps = max(steps, 1)
    return LoopOverhead(steps=steps, verify_ms_per_step=1000 * verify / steps, other_ms_per_step=1000 * other / steps)


def format_costs(rows: list[VerifyCost]) -> str:
    lines = ["| tree nodes | verify forward (ms, median) | × one-token step |", "|---:|---:|---:|"]
    lines += [f"| {r.nodes} | {r.median_ms:.1f} | {r.relative:.2f} |" for r in rows]
    return "\n".join(lines)
