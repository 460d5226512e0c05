"""A target whose forward is compiled by ``torch.compile`` (inductor), for every caller at once.

At batch size 1 a small model's forward is dominated by launching hundreds of small operators, not by arithmetic, so
compiling it pays (measured side by side: docs/benchmarks/log.md, "A compiled target"). ``compile_forward`` replaces the
model's ``forward`` by its compiled version on the instance, so
selfspec's verifier and transformers' own ``generate`` (plain decoding, prompt lookup, ...) run the same compiled
code: a speed-up measured side by side compares like with like, and greedy answers stay those of plain decoding with
that same forward (the lossless guarantee is relative to the forward the target runs).

Shapes are dynamic (``dynamic=True``): the cache length and a tree's node count vary from step to step without
recompiling. selfspec's own loop compiles **one** graph: ``Target.verify`` gives a compiled target every step in one
form, a tree of at least two nodes with its mask (a chain gets a causal mask, a lone root a padding child) over a
contiguous cache (``hf.contiguous``: a crop leaves views whose strides would be guarded), and its prefill runs the
uncompiled forward (``eager``; a prefill is arithmetic, not launches, so compiling it gains nothing).
Each other form (a chain without a mask, one token, another ``logits_to_keep``) would be a graph of its own, and each
graph costs over a minute on a small CPU's first start and ~20 s at every later one (inductor's on-disk cache spares
its code generation, not dynamo's tracing). ``generate``'s own calls (plain decoding, transformers' prompt lookup)
compile their own graphs when first used. Compiling pays for a server or a benchmark, not for one prompt.
Python floats are specialised (``specialize_float``): the model's float attributes are constants, and a symbol for
each would cost a second trace at every start. Before compiling, one small uncompiled forward asking for hidden
states installs transformers' output-capture hooks, which a compiled forward cannot install (a graph break per
forward, docs/benchmarks/log.md §50).
Drafts that run the target's layers themselves (early exit, layer skipping) run them uncompiled.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64
"""graphs torch keeps per compiled function before it silently falls back to uncompiled code. Torch's default, 8, is
too few for two dtypes' targets in one process (bench --dtype fp32,bf16): each compiles a graph of the same
``forward`` for every kind of call (a prefill, one-token steps, chains, trees with their mask, ``generate``'s own)."""


def check_compilable(device: torch.device | str) -> None:
    """Fail now, saying what is missing, where inductor could not build kernels later: on CPU it needs a C++ compiler."""
    if torch.device(device).type != "cpu":
        return
    from torch._inductor import cpp_builder  # heavy: loads inductor (seconds), only when compiling
    try:
        cpp_builder.get_cpp_compiler()
    except Exception as err:  # InvalidCxxCompiler; its class lives in a private module
        raise RuntimeError(
            "compiling the target (--compile / compile=True) on CPU needs a C++ compiler for torch's inductor, and "
            f"none was found ({err}); install g++ or clang++ (or set CXX to one), or decode without --compile"
        ) from None


def compile_forward(model: PreTrainedModel) -> PreTrainedModel:
    """Compile ``model.forward`` in place (idempotent); returns the model."""
    if is_compiled(model):
        return model
    device = next(model.parameters()).device
    check_compilable(device)
    with torch.inference_mode():  # installs the output-capture hooks now, outside any compiled region
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), output_hidden_states=True,
              use_cache=False)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # the modules' float attributes (norm eps, rope and attention scaling, embedding norm_type) are constants: traced
    # as symbols (dynamic=True's default), inductor specialises one later and dynamo restarts the whole trace, which
    # doubled every start's warm-up (docs/benchmarks/log.md §52)
    torch._dynamo.config.specialize_float = True
    model._selfspec_eager_forward = model.forward
    model.forward = torch.compile(model.forward, dynamic=True)
    model._selfspec_compiled = True
    log.warning("the target's forward is compiled on first use: over a minute on a small CPU the first time, ~20 s "
                "once inductor's on-disk cache holds its kernels")
    return model


def is_compiled(model: PreTrainedModel) -> bool:
    return bool(getattr(model, "_selfspec_compiled", False))


@contextmanager
def eager(model: PreTrainedModel) -> Iterator[None]:
    """Inside it a compiled model runs its uncompiled forward (a prefill: nothing to gain, a graph to save); an
    uncompiled model is unchanged."""
    if not is_compiled(model):
        yield
        return
    compiled_forward = model.forward
    model.forward = model._selfspec_eager_forward
    try:
        yield
    finally:
        model.forward = compiled_forward
