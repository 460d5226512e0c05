"""An OpenAI-compatible HTTP endpoint over one SpecModel: ``python infer.py serve``.

    POST /v1/chat/completions   {"messages": [...], "max_tokens": 64, "stream": true, ...}
    POST /v1/completions        {"prompt": "...", ...}                  (plain text, no chat template)
    GET  /v1/models             the one model served
    GET  /health
    POST /tokenize, /detokenize, GET /tokenizer_info    vLLM's tokenizer endpoints (lm-eval's tokenizer_backend=remote)

Clients of OpenAI's API (its Python client, chat UIs, evaluation harnesses) talk to it unchanged; every answer is
decoded speculatively and losslessly, and says how (``usage.selfspec``: steps and mean accepted tokens per step).

Requests decode together: up to ``--max-batch`` (default 8) in one batch, one target forward a step for all of them;
a request that arrives joins the running batch at its next step, beyond that it waits in line, and a client that goes
away, streamed or not, frees its place at the next step (``batcher``, ``server.Handler.gone``). With ``--max-batch 1``, or a draft that runs the target's own
layers (early exit, layer skipping), requests decode one at a time. Sampling fields are
OpenAI's (``temperature``, ``top_p``, ``seed``, ``stop``, ``max_tokens`` / ``max_completion_tokens``) and the common
extensions of OpenAI-compatible servers (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``); a request
without ``temperature`` decodes with the server's (``--temperature``, default 0: greedy, token-identical to
``generate``). As in OpenAI's API a stop string ends the answer and is not part of it.

Log-probabilities as OpenAI reports them (chat: ``logprobs: true`` and ``top_logprobs``; completions: ``logprobs: k``
and ``echo`` for the prompt's own, what evaluation harnesses score multiple-choice questions with): the target's own,
before sampling and penalties (``selfspec.core.logprobs``), with each token's own ``bytes`` (a piece of a character split
across tokens included, ``selfspec.tools.token_bytes``). A completion's ``prompt`` may be text, token ids, or a list of
either (one choice per prompt); ``n`` answers each (the choices decode together in the batch, in turn with
``--max-batch 1``). ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` apply as OpenAI applies them. Fields the server cannot honour (tools,
structured output, suffixes) and unknown fields are refused with a 400 that names them, as OpenAI refuses unknown
arguments; a ``model`` other than the served one with a 404, as OpenAI and vLLM answer it.

One request cannot take the server over: its answers (prompts x n) are capped (``--max-choices``, default 64), a
prompt's characters too, before it is tokenized (``--max-prompt-chars``; default: the longest prompt the context could
hold), and its body's bytes before it is read (``--max-body-bytes``, default 16 MiB: 413); the API key is checked from
the headers first. Nor can a slow one hold a thread: each request must arrive whole within ``--read-timeout``
(default 30 s; late headers or body: 408), and at most ``--max-connections`` (default 64) are served at once (one
more: 503). Bound beyond this machine (``--host``), the server refuses to start without ``--api-key`` unless told
``--insecure``.

The package, by question: ``protocol`` (a request body -> ``Request``), ``session`` (how requests decode and an
answer's pieces), ``batcher`` (the worker that decodes requests together), ``responses`` (OpenAI's response objects and stream chunks), ``tokenizer_endpoints`` (vLLM's) and
``server`` (the HTTP handler and ``make_server``), ``connections`` (what a connection may hold: the read deadline and
the cap on connections); ``infer.py serve`` (``selfspec.tools.cli``) starts it.
"""

from selfspec.tools.serve.protocol import Request, RequestError, parse_request
from selfspec.tools.serve.responses import chunks, complete
from selfspec.tools.serve.server import Handler, check_exposure, make_server
from selfspec.tools.serve.session import ClientGone, Piece, Scored, Session, cut_at_stop, text_starts
from selfspec.tools.serve.tokenizer_endpoints import detokenize, tokenize, tokenizer_info

__all__ = ["ClientGone", "Handler", "Piece", "Request", "RequestError", "Scored", "Session", "check_exposure", "chunks",
           "complete", "cut_at_stop", "detokenize", "make_server", "parse_request", "text_starts", "tokenize",
           "tokenizer_info"]
