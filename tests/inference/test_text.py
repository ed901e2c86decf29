"""The text layer: tokenizer resolution, streaming detokenization, stop strings, chat prompts.

Oracles: the tokenizer's own `decode` of all the ids (what streamed deltas must add up to)
and `transformers`' `apply_chat_template`.
"""

from types import SimpleNamespace

import pytest

from tessera.config import ConfigError
from tessera.inference.text import (
    ChatTemplateError, IncrementalDetokenizer, MegatronTokenizer, RequestText, TransformersTokenizer, load_tokenizer,
)
from tests.inference.tiny_text_model import CORPUS, hf_dir, tokenizer  # noqa: F401 -- fixtures

MULTIBYTE = "héllo wörld, ünïcode façade — naïve café 你好，世界。こんにちは"


def _output(ids, finished=False, reason=None, logprobs=None):
    return SimpleNamespace(token_ids=list(ids), logprobs=logprobs, top_logprobs=None, finished=finished,
                           finish_reason=reason)


def _feed(text: RequestText, ids, reason="length"):
    deltas = []
    for i, token in enumerate(ids):
        delta = text.update(_output([token], finished=i == len(ids) - 1, reason=reason))
        if delta is not None:
            deltas.append(delta)
    return deltas


def test_streamed_deltas_add_up_to_the_decoded_text_and_never_split_a_character(tokenizer):
    prompt = tokenizer.encode("The quick")
    ids = tokenizer.encode(MULTIBYTE)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)   # characters do span tokens here
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detokenizer.push([i]) for i in ids] + [detokenizer.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in delta for delta in deltas)
    assert sum(1 for delta in deltas if delta) > 10   # streamed, not all at the end


def test_a_partial_character_at_the_end_is_flushed_as_a_replacement(tokenizer):
    ids = tokenizer.encode("你")
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.push(ids[:-1]) == ""
    assert detokenizer.flush() == tokenizer.decode(ids[:-1])


def test_stop_string_cuts_the_text_aborts_once_and_is_never_streamed(tokenizer):
    aborted = []
    text = RequestText(tokenizer, [], stop=["brown fox", "never"], abort=lambda: aborted.append(1))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    deltas = _feed(text, ids)
    assert text.text == "The quick "
    assert "".join(d.text for d in deltas) == "The quick "
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop" and text.finish_reason == "stop"
    assert aborted == [1]
    # the outputs after the stop (the engine's abort) are dropped; the tokens up to it are counted
    assert text.update(_output([], finished=True, reason="abort")) is None
    assert 0 < text.completion_tokens < len(ids)


def test_a_stop_string_inside_a_burst_of_tokens_ends_the_request_at_its_token(tokenizer):
    """Outputs of several tokens (greedy steps run back to back) give the text, the kept tokens and
    their log-probs of one token at a time: the request ends with the token completing the stop."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    one_at_a_time = RequestText(tokenizer, [], stop=["brown fox"])
    _feed(one_at_a_time, ids)
    aborted = []
    bursts = RequestText(tokenizer, [], stop=["brown fox"], abort=lambda: aborted.append(1))
    deltas = [bursts.update(_output(ids[i:i + 4], logprobs=[-float(t) for t in ids[i:i + 4]]))
              for i in range(0, len(ids), 4)]
    kept = one_at_a_time.completion_tokens
    assert kept < len(ids) and kept % 4 != 0   # the stop completes inside a burst
    assert bursts.text == one_at_a_time.text == "The quick "
    assert bursts.token_ids == ids[:kept] and bursts.logprobs == [-float(t) for t in ids[:kept]]
    assert bursts.finish_reason == "stop" and aborted == [1]
    assert [d for d in deltas if d is not None][-1].token_ids == ids[kept // 4 * 4:kept]


def test_text_that_only_starts_like_a_stop_string_is_released(tokenizer):
    text = RequestText(tokenizer, [], stop=["quick brown cat"])
    ids = tokenizer.encode("The quick brown fox")
    deltas = _feed(text, ids)
    assert "".join(d.text for d in deltas) == "The quick brown fox" == text.text
    assert text.finish_reason == "length"


def test_end_of_sequence_tokens_count_but_are_not_shown(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    text = RequestText(tokenizer, [], skip_token_ids=[eos])
    deltas = _feed(text, tokenizer.encode("café") + [eos], reason="stop")
    assert "".join(d.text for d in deltas) == "café" and text.finish_reason == "stop"
    assert text.token_ids[-1] == eos and text.completion_tokens == len(tokenizer.encode("café")) + 1


def test_log_probs_are_kept_with_their_tokens(tokenizer):
    text = RequestText(tokenizer, [])
    text.update(_output([5, 6], logprobs=[-1.0, -2.0]))
    text.update(_output([7], finished=True, reason="length", logprobs=[-3.0]))
    assert text.token_ids == [5, 6, 7] and text.logprobs == [-1.0, -2.0, -3.0]


def test_chat_prompt_is_the_templates_rendering_tokenized_without_added_tokens(hf_dir, tokenizer):
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<assistant>")
    assert tokenizer.encode_chat(messages) == reference(rendered, add_special_tokens=False).input_ids


def test_chat_template_flag_replaces_the_tokenizers_and_a_tokenizer_without_one_refuses_chat(hf_dir, tmp_path):
    own = load_tokenizer(search_dirs=[hf_dir], chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert own.render_chat([{"role": "user", "content": "hi"}]) == "[hi]"
    plain = load_tokenizer(tokenizer_model=str(hf_dir / "tokenizer.json"))
    # a bare tokenizer.json (as `tessera train-tokenizer` writes): its end-of-document token ends generation
    assert isinstance(plain, TransformersTokenizer) and plain.eos_token_ids == (0,)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_tokenizer(tokenizer_type="ByteTokenizer").encode_chat([{"role": "user", "content": "hi"}])


def test_tokenizer_is_found_flags_first_then_files_then_the_checkpoints_training_flags(hf_dir, tmp_path):
    by_flags = load_tokenizer(tokenizer_type="ByteTokenizer", search_dirs=[hf_dir])
    assert isinstance(by_flags, MegatronTokenizer) and by_flags.encode("é") == [0xC3, 0xA9]
    assert isinstance(load_tokenizer(search_dirs=[tmp_path, hf_dir]), TransformersTokenizer)
    trained_with = {"model": {}, "data": {"tokenizer_type": "HuggingFaceTokenizer",
                                          "tokenizer_model": str(hf_dir / "tokenizer.json")}}
    saved = load_tokenizer(search_dirs=[tmp_path], checkpoint_config=trained_with)
    assert saved.encode(CORPUS[0]) == load_tokenizer(search_dirs=[hf_dir]).encode(CORPUS[0])
    with pytest.raises(ConfigError, match="--tokenizer-type"):
        load_tokenizer(search_dirs=[tmp_path], checkpoint_config={"model": {}, "data": {"tokenizer_type": None}})
    with pytest.raises(ConfigError, match="--tokenizer-model /nonexistent"):
        load_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent")
