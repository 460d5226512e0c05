"""selfspec.api on a tiny random Llama chat model: lossless against transformers' generate, streaming, statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_chat_model
from selfspec import api

PROMPTS = ["hello café", "write a short story about the sea"]


@pytest.fixture(scope="module")
def ngram(model_dir):
    return api.load(str(model_dir), draft="ngram")


@pytest.mark.parametrize("draft", ["ngram", "ngram:depth=4,max_nodes=8", "none"])
def test_greedy_generate_equals_transformers_generate(model_dir, draft):
    m = api.load(str(model_dir), draft=draft)
    for prompt in PROMPTS:
        ids = m.encode(prompt)
        expected = m.model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                                    max_new_tokens=40)[0, ids.shape[0]:].tolist()
        out = m.generate(prompt, max_new_tokens=40)
        assert out.tokens == expected
        assert out.text == m.tokenizer.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert out.stats.new_tokens == 40 == sum(out.stats.accept_lengths)
        assert out.stats.steps == len(out.stats.accept_lengths)
        assert out.stats.mean_accepted == pytest.approx(40 / out.stats.steps)
        assert out.stats.tokens_per_s == pytest.approx(40 / out.stats.seconds)


def test_stops_at_eos_where_generate_stops(ngram):
    """selfspec stops at its eos_token_id (the generation config's, else the tokenizer's: models whose generation
    config names none), and the plain `generate` it is compared with (--compare, bench's plain) stops there too."""
    full = ngram.generate(PROMPTS[0], max_new_tokens=30).tokens
    eos = full[12]  # a token the model produces mid-answer plays EOS
    stop = full.index(eos)
    saved = ngram.eos_token_id
    ngram.eos_token_id = [eos]
    try:
        out = ngram.generate(PROMPTS[0], max_new_tokens=30)
        plain = ngram.generate_plain(PROMPTS[0], max_new_tokens=30)
    finally:
        ngram.eos_token_id = saved
    assert out.tokens == plain.tokens == full[: stop + 1]


def test_the_model_generation_configs_repetition_penalty_is_applied_as_generate_applies_it(model_dir):
    """A checkpoint whose generation config asks for a repetition penalty (Qwen2.5's instruct models: 1.05):
    selfspec's greedy output is what model.generate(do_sample=False) gives with nothing else passed, and so is the
    plain decoding it is compared with; an explicit repetition_penalty=1.0 turns it off for both."""
    m = api.load(str(model_dir), draft="ngram:depth=4,max_nodes=8")
    ids = m.encode(PROMPTS[1])
    before = m.generate(ids, max_new_tokens=40).tokens
    m.model.generation_config.repetition_penalty = 1.5
    try:
        m = api.SpecModel(m.target, m.tokenizer, m.drafter, str(model_dir))
        expected = m.model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                                    max_new_tokens=40)[0, ids.shape[0]:].tolist()
        out = m.generate(ids, max_new_tokens=40)
        assert out.tokens == expected == m.generate_plain(ids, max_new_tokens=40).tokens
        assert expected != before  # the penalty changes this answer
        assert m.generate(ids, max_new_tokens=40, repetition_penalty=1.0).tokens == before
        assert m.generate_plain(ids, max_new_tokens=40, repetition_penalty=1.0).tokens == before
    finally:
        m.model.generation_config.repetition_penalty = 1.0


def test_generation_config_processors_selfspec_does_not_apply_are_named(ngram, recwarn):
    config = ngram.model.generation_config
    config.top_h, config.min_length, config.no_repeat_ngram_size, config.typical_p = 0.5, 0, 3, 0.9  # 0: neutral
    try:
        with pytest.warns(UserWarning, match=r"asks for top_h=0.5, which selfspec does not apply") as caught:
            api.SpecModel(ngram.target, ngram.tokenizer, ngram.drafter, "m")
        assert "no_repeat_ngram_size" not in str(caught[0].message)  # applied (selfspec.core.processors)
        assert "typical_p" not in str(caught[0].message)  # applied (selfspec.core.sampling)
    finally:
        config.top_h, config.typical_p, config.no_repeat_ngram_size = None, None, None
    api.SpecModel(ngram.target, ngram.tokenizer, ngram.drafter, "m")
    assert not [w for w in recwarn if "selfspec does not apply" in str(w.message)]


def test_generate_plain_peers_and_step_counts(ngram):
    plain = ngram.generate_plain(PROMPTS[0], max_new_tokens=24)
    assert plain.stats.accept_lengths == (1,) * 24
    for kwargs in ({"prompt_lookup_num_tokens": 10}, {"assistant_early_exit": 1}):
        peer = ngram.generate_plain(PROMPTS[0], max_new_tokens=24, **kwargs)
        assert peer.tokens == plain.tokens
        assert sum(peer.stats.accept_lengths) == 24
        assert peer.stats.steps < 24  # the model repeats itself: lookup and early exit each accept something


def test_stream_concatenates_to_generate_text(ngram):
    for prompt in PROMPTS:
        expected = ngram.generate(prompt, max_new_tokens=40)
        stream = ngram.stream(prompt, max_new_tokens=40)
        pieces = list(stream)
        assert "".join(pieces) == expected.text == stream.text
        assert stream.tokens == expected.tokens
        assert stream.stats.accept_lengths == expected.stats.accept_lengths


def test_incremental_decoder_holds_back_split_characters(ngram):
    tok = ngram.tokenizer
    text = "café → naïve résumé"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    decoder = api.IncrementalDecoder(tok)
    pieces = [decoder.push([i]) for i in ids] + [decoder.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert any(p == "" for p in pieces[:-1])  # at least one token ended inside a character and was held back


def test_prompt_forms(ngram):
    chat = ngram.encode("hi there")
    template = ngram.tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                                   add_generation_prompt=True)
    assert chat.tolist() == ngram.tokenizer(template, add_special_tokens=False).input_ids
    assert chat[0] == ngram.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ngram.encode("hi there", chat=False).tolist() == ngram.tokenizer("hi there").input_ids
    assert ngram.encode([5, 6, 7]).tolist() == [5, 6, 7]
    assert ngram.encode(torch.tensor([[5, 6, 7]])).tolist() == [5, 6, 7]
    assert ngram.encode((5, 6, 7)).tolist() == ngram.encode(np.array([5, 6, 7])).tolist() == [5, 6, 7]
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert ngram.generate(messages, max_new_tokens=5).tokens == ngram.generate(ngram.encode(messages), max_new_tokens=5).tokens


PROMPT_FORMS = "expected a prompt as text (str), chat messages (a list of {'role', 'content'} dicts) or token ids"


@pytest.mark.parametrize("call, error, message", [
    (dict(prompt=torch.tensor([[[5, 6, 7], [8, 9, 10]]])), ValueError, "expected token ids of shape [T] or [1, T], found (1, 2, 3)"),
    (dict(prompt=torch.tensor([1.0, 2.0])), TypeError, "expected token ids (an integer tensor), found a torch.float32"),
    (dict(prompt=b"hello"), TypeError, f"{PROMPT_FORMS} (a list of ints, or a tensor), found bytes b'hello'"),
    (dict(prompt=[1.7, 2.2]), TypeError, "found 1.7 (float) among its items"),
    (dict(prompt=None), TypeError, "found NoneType None"),
    (dict(prompt=[{"role": "user"}]), ValueError, "message 0: expected {'role': str, 'content': str}, found {'role'"),
    (dict(prompt=[1, 99999]), ValueError, "token id 99999 is outside this model's vocabulary (0..318)"),
    (dict(prompt=[1, -5]), ValueError, "token id -5 is outside this model's vocabulary"),
    (dict(logprobs=True), ValueError, "logprobs: expected None or 0..20 alternatives per token (an int), found True"),
    (dict(max_new_tokens="5"), TypeError, "max_new_tokens: expected an int >= 1, found '5' (str)"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens: expected an int >= 1, found 2.5 (float)"),
    (dict(min_new_tokens="2"), ValueError, "min_new_tokens must be an int >= 0, found '2'"),
    (dict(stop=5), TypeError, "stop: expected a string or a list of strings, found 5"),
])
@pytest.mark.parametrize("method", ["generate", "generate_plain"])
def test_a_bad_argument_is_refused_in_selfspecs_words(ngram, call, error, message, method):
    """A batch is not merged into one prompt, bytes and floats are not read as token ids, and a wrong type or value
    says what was expected, before anything decodes; generate_plain (transformers' generate) refuses alike."""
    kwargs = {"prompt": "hi", "max_new_tokens": 3, **call}
    with pytest.raises(error) as err:
        getattr(ngram, method)(kwargs.pop("prompt"), **kwargs)
    assert message in str(err.value)


def test_a_tree_of_the_wrong_type_is_refused(model_dir):
    with pytest.raises(TypeError, match="tree: expected a --tree string .*, found int 3"):
        api.load(str(model_dir), draft="early-exit:layer=1", tree=3)


def test_sampling_with_seed_repeats(ngram):
    a = ngram.generate(PROMPTS[0], max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=3)
    b = ngram.generate(PROMPTS[0], max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) == 20
    with pytest.raises(ValueError, match="top_p must be in"):
        ngram.generate(PROMPTS[0], temperature=0.8, top_p=0.0)


def test_no_chat_template_is_a_clear_error(ngram):
    template = ngram.tokenizer.chat_template
    ngram.tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match=r"no chat template \(a base model\?\): feed the prompt as plain text "
                                             r"\(infer.py --no-chat"):
            ngram.encode("hi")
    finally:
        ngram.tokenizer.chat_template = template


@pytest.mark.parametrize("draft", ["ngram:depth=4,max_nodes=8", "none"])
def test_stop_strings_end_decoding_where_generate_stops(model_dir, draft):
    """A stop string from the middle of the answer, spanning tokens (the byte-level tokenizer splits words): selfspec
    stops where generate(stop_strings=..., tokenizer=...) stops, the string kept in the output, and so does the plain
    decoding it is compared with; a stop string that spans the prompt's end stops after the first token."""
    m = api.load(str(model_dir), draft=draft)
    ids = m.encode(PROMPTS[1])
    full = m.generate(ids, max_new_tokens=40)
    stop = tiny_chat_model.spanning_stop(m.tokenizer, full.tokens, start=10)
    expected = m.model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                                max_new_tokens=40, stop_strings=stop, tokenizer=m.tokenizer)[0, ids.shape[0]:].tolist()
    assert len(expected) < 40 and expected == full.tokens[: len(expected)]
    out = m.generate(ids, max_new_tokens=40, stop=stop)
    assert out.tokens == expected == m.generate_plain(ids, max_new_tokens=40, stop=stop).tokens
    assert stop in out.text and stop not in m.tokenizer.decode(expected[:-1], clean_up_tokenization_spaces=False)
    assert "".join(m.stream(ids, max_new_tokens=40, stop=[stop, "never said"])) == out.text
    across = m.tokenizer.decode(ids[-1:].tolist() + full.tokens[:1], clean_up_tokenization_spaces=False)
    assert m.generate(ids, max_new_tokens=40, stop=across).tokens == full.tokens[:1]


def test_the_generation_configs_stop_strings_and_min_new_tokens_apply_unless_overridden(model_dir):
    """As generate applies a generation config's stop_strings (given the tokenizer) and min_new_tokens, selfspec does,
    and the plain decoding it is compared with too; stop=[] and min_new_tokens=0 turn them off for both."""
    m = api.load(str(model_dir), draft="ngram:depth=4,max_nodes=8")
    ids = m.encode(PROMPTS[1])
    full = m.generate(ids, max_new_tokens=30).tokens
    stop = tiny_chat_model.spanning_stop(m.tokenizer, full, start=4)
    config = m.model.generation_config
    config.stop_strings = [stop]
    try:
        m2 = api.SpecModel(m.target, m.tokenizer, m.drafter, str(model_dir))
        expected = m.model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                                    max_new_tokens=30, tokenizer=m.tokenizer)[0, ids.shape[0]:].tolist()
        assert len(expected) < 30
        assert m2.generate(ids, max_new_tokens=30).tokens == expected
        assert m2.generate_plain(ids, max_new_tokens=30).tokens == expected
        assert m2.generate(ids, max_new_tokens=30, stop=[]).tokens == full
        assert m2.generate_plain(ids, max_new_tokens=30, stop=[]).tokens == full
    finally:
        config.stop_strings = None
    eos = full[5]  # a token of the answer plays EOS: min_new_tokens keeps decoding past it
    saved, config.min_new_tokens = m.eos_token_id, 12
    try:
        m2 = api.SpecModel(m.target, m.tokenizer, m.drafter, str(model_dir))
        m2.eos_token_id = [eos]
        out = m2.generate(ids, max_new_tokens=30).tokens
        assert len(out) > 12 and eos not in out[:12]
        assert out == m2.generate_plain(ids, max_new_tokens=30).tokens
        assert m2.generate(ids, max_new_tokens=30, min_new_tokens=0).tokens == full[: full.index(eos) + 1]
    finally:
        config.min_new_tokens = None
        m.eos_token_id = saved


def test_generate_plain_samples_with_min_p_as_generate_does(ngram):
    """min_p reaches generate_plain's model.generate (the same global seed draws the same tokens), and changes them."""
    ids = ngram.encode(PROMPTS[1])
    kwargs = dict(attention_mask=torch.ones_like(ids[None]), do_sample=True, temperature=1.5, top_k=0, top_p=1.0,
                  max_new_tokens=30)
    torch.manual_seed(3)
    expected = ngram.model.generate(ids[None], min_p=0.3, **kwargs)[0, ids.shape[0]:].tolist()
    torch.manual_seed(3)
    without = ngram.model.generate(ids[None], **kwargs)[0, ids.shape[0]:].tolist()
    plain = ngram.generate_plain(ids, max_new_tokens=30, temperature=1.5, min_p=0.3, seed=3)
    assert plain.tokens == expected != without


def test_stop_string_criteria_are_built_once_and_only_the_latest_few_kept(ngram):
    """Building a criterion reads the whole vocabulary; a server's clients may each send their own stop strings."""
    ngram._criteria.clear()
    for i in range(20):
        ngram.generate(PROMPTS[0], max_new_tokens=2, stop=[f"never {i}"])
    assert len(ngram._criteria) == 16 and ("never 19",) in ngram._criteria and ("never 0",) not in ngram._criteria
    kept = ngram._criteria[("never 19",)]
    ngram.generate(PROMPTS[0], max_new_tokens=2, stop="never 19")
    assert ngram._criteria[("never 19",)] is kept


def test_logprobs_of_the_answer_and_the_prompt_equal_plain_decodings(ngram):
    """generate / stream / generate_plain(logprobs=k, prompt_logprobs=k): the same tokens, log-probabilities and
    alternatives, whichever way the answer was decoded; None asks for none."""
    steps = 0
    for prompt in PROMPTS:
        spec = ngram.generate(prompt, max_new_tokens=40, logprobs=3, prompt_logprobs=2)
        plain = ngram.generate_plain(prompt, max_new_tokens=40, logprobs=3, prompt_logprobs=2)
        assert spec.tokens == plain.tokens
        steps += spec.stats.steps
        assert [t.token for t in spec.logprobs] == spec.tokens == [t.token for t in plain.logprobs]
        for a, b in [(spec.logprobs, plain.logprobs), (spec.prompt_logprobs, plain.prompt_logprobs)]:
            assert [t.token for t in a] == [t.token for t in b]
            assert torch.allclose(torch.tensor([t.logprob for t in a]), torch.tensor([t.logprob for t in b]),
                                  atol=1e-4)
            assert [[i for i, _ in t.top] for t in a] == [[i for i, _ in t.top] for t in b]
        assert [t.token for t in spec.prompt_logprobs] == ngram.encode(prompt)[1:].tolist()
        stream = ngram.stream(prompt, max_new_tokens=40, logprobs=3, prompt_logprobs=2)
        list(stream)
        assert stream.logprobs == spec.logprobs and stream.prompt_logprobs == spec.prompt_logprobs
    assert steps < 2 * 40  # drafts were accepted: some steps added several tokens
    plain = ngram.generate(PROMPTS[0], max_new_tokens=8)
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert ngram.generate_plain(PROMPTS[0], max_new_tokens=8).logprobs is None


def test_presence_frequency_and_logit_bias_equal_generate_plains(ngram):
    """OpenAI's penalties and logit bias, through selfspec (greedy with drafts, and sampled) and through transformers'
    generate (its sequence_bias and selfspec.core.sampling.PresencePenalty as a logits processor): the same tokens."""
    base = ngram.generate(PROMPTS[1], max_new_tokens=30)
    bias = {base.tokens[3]: -50.0, 33: 3.0}
    kw = dict(max_new_tokens=30, presence_penalty=0.8, frequency_penalty=0.6, logit_bias=bias)
    spec, plain = ngram.generate(PROMPTS[1], **kw), ngram.generate_plain(PROMPTS[1], **kw)
    assert spec.tokens == plain.tokens != base.tokens and base.tokens[3] not in spec.tokens
    spec = ngram.generate(PROMPTS[1], temperature=0.9, seed=3, **kw)
    assert spec.tokens == ngram.generate(PROMPTS[1], temperature=0.9, seed=3, **kw).tokens
    with pytest.raises(ValueError, match="logit_bias names token 99999; this model's vocabulary has"):
        ngram.generate(PROMPTS[1], logit_bias={99999: 1.0})
    with pytest.raises(ValueError, match=r"frequency_penalty must be in \[-2, 2\]"):
        ngram.generate(PROMPTS[1], frequency_penalty=3.0)


def test_the_generation_configs_sampling_warpers_apply_as_generate_applies_them(model_dir):
    """typical_p / epsilon_cutoff / eta_cutoff from the model's generation config: sampled without drafts from the same
    global seed, selfspec draws generate_plain's tokens; and they change what is drawn."""
    m = api.load(str(model_dir), draft="none")
    before = [None, None]
    torch.manual_seed(5)
    before[0] = m.generate(PROMPTS[1], max_new_tokens=24, temperature=1.4).tokens
    config = m.model.generation_config
    config.typical_p, config.eta_cutoff = 0.5, 0.01
    try:
        torch.manual_seed(5)
        spec = m.generate(PROMPTS[1], max_new_tokens=24, temperature=1.4).tokens
        torch.manual_seed(5)
        plain = m.generate_plain(PROMPTS[1], max_new_tokens=24, temperature=1.4).tokens
    finally:
        config.typical_p, config.eta_cutoff = None, None
    assert spec == plain != before[0]


def test_generation_options_are_one_object_checked_once(ngram):
    """A request's options are one frozen object (GenerationOptions): checked when made, taken whole or as keyword
    overrides of its fields by generate / stream / generate_plain alike, and copied with replace (checked again)."""
    options = api.GenerationOptions(max_new_tokens=12, temperature=0.8, top_k=20, seed=3, stop="\n\n")
    assert options.stop == ("\n\n",) and options.sampled
    by_object = ngram.generate(PROMPTS[0], options)
    assert by_object.tokens == ngram.generate(PROMPTS[0], max_new_tokens=12, temperature=0.8, top_k=20, seed=3,
                                              stop="\n\n").tokens
    stream = ngram.stream(PROMPTS[0], options)
    assert "".join(stream) == by_object.text and stream.tokens == by_object.tokens
    greedy = ngram.generate(PROMPTS[0], options, temperature=0.0)  # keywords replace the object's fields
    assert greedy.tokens == ngram.generate_plain(PROMPTS[0], options.replace(temperature=0.0)).tokens
    assert options.replace(seed=4) == api.GenerationOptions(max_new_tokens=12, temperature=0.8, top_k=20, seed=4,
                                                            stop=["\n\n"])
    with pytest.raises(ValueError, match="top_p must be in"):
        api.GenerationOptions(temperature=0.8, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, found 0"):
        options.replace(max_new_tokens=0)
    with pytest.raises(TypeError, match="unknown generation option.s. top_n: expected some of"):
        options.replace(top_n=5)
    with pytest.raises(TypeError, match="options: expected a GenerationOptions, found int 64"):
        ngram.generate(PROMPTS[0], 64)
    with pytest.raises(TypeError, match="seed: expected an int or None, found '3'"):
        api.GenerationOptions(seed="3")
