"""The target's log-probabilities of the tokens it produced, and of its most likely alternatives.

Speculative decoding leaves them as plain decoding has them: a new token's log-probability is read from the logits of
the tree node it follows, which is the position plain decoding's forward would have computed them at (the same values
up to the rounding of a wider forward). They are the model's own distribution, log-softmax of its logits before any
sampling processing (temperature, top-k / top-p / min-p, a repetition penalty, the EOS block of min_new_tokens), as
vLLM reports by default and as ``generate(output_logits=True)`` holds them.

Shapes: A tokens, V vocabulary, K alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20
"""the most alternatives a token reports (OpenAI's limit for top_logprobs)."""
CHUNK = 256
"""rows turned into log-probabilities at a time."""


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    """log p(token | everything before it) under the target."""
    top: tuple[tuple[int, float], ...] = ()
    """the K most likely tokens at that position and their log-probabilities, most likely first."""


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int = 0) -> list[TokenLogprob]:
    """logits [A, V] (row a: the target's logits for the position of tokens[a]), tokens long [A] -> one TokenLogprob
    per token, with its K = k most likely alternatives (0 <= k <= MAX_TOP)."""
    if not 0 <= k <= MAX_TOP:
        raise ValueError(f"expected between 0 and {MAX_TOP} alternatives per token, found {k}")
    if logits.dim() != 2 or tokens.shape != (logits.shape[0],):
        raise ValueError(f"expected logits [A, V] and tokens [A], found {tuple(logits.shape)} and {tuple(tokens.shape)}")
    out: list[TokenLogprob] = []
    for a in range(0, logits.shape[0], CHUNK):  # a long prompt's [T, V] in float32 would be large
        lp = torch.log_softmax(logits[a: a + CHUNK].float(), dim=-1)  # [C, V]
        ts = tokens[a: a + CHUNK].to(lp.device)
        chosen = lp.gather(-1, ts[:, None])[:, 0].tolist()  # [C]
        if k == 0:
            out += [TokenLogprob(int(t), c) for t, c in zip(ts.tolist(), chosen)]
            continue
        values, ids = lp.topk(k, dim=-1)  # [C, K], most likely first
        out += [TokenLogprob(int(t), c, tuple(zip(i, v)))
                for t, c, i, v in zip(ts.tolist(), chosen, ids.tolist(), values.tolist())]
    return out
