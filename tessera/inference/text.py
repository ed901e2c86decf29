"""Text in and out of the engine: tokenizers, chat templates, streaming detokenization, stop strings.

The engine works on token ids; `tessera generate` and `tessera serve` work on text. This
module is the layer between them that both share:

- `load_tokenizer` finds the tokenizer: the --tokenizer-type/--tokenizer-model flags, else the
  tokenizer files of the HF or checkpoint directory, else the tokenizer the checkpoint was
  trained with (its config.yaml). Hugging Face tokenizers go through `transformers` (BOS as the
  tokenizer adds it, as `generate()` does; chat templates), the others through tessera's own.
- `RequestText` turns one request's engine outputs into text deltas that can be streamed:
  a token is shown once it decodes to whole characters, and text that may be the start of a
  stop string is held back until it is known not to be one. A stop string ends the request
  (the caller's `abort`) with finish_reason "stop"; the stop string itself is not returned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tessera.config import ConfigError, DataConfig

# Files whose presence makes a directory a Hugging Face tokenizer directory.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Prompt tokens decoded ahead of the generated ones: tokenizers that drop a leading space
# (sentencepiece) then decode a continuation as they would inside the whole text.
_CONTEXT_TOKENS = 5


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, or the messages do not fit it."""


class TextTokenizer:
    """What generation needs of a tokenizer: ids from text and back, EOS ids, chat prompts."""

    name: str
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (the `tokens` of log-probs)."""
        return self.decode([token_id])

    def render_chat(self, messages: list[dict]) -> str:
        raise ChatTemplateError(f"the tokenizer ({self.name}) has no chat template; pass --chat-template FILE")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The prompt of a chat: its template rendered with the assistant's turn opened, then tokenized.

        The template writes the special tokens it wants (BOS included), so none are added.
        """
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class TransformersTokenizer(TextTokenizer):
    """A Hugging Face tokenizer directory (or tokenizer.json) through `transformers`."""

    def __init__(self, path: str | Path, chat_template: str | None = None):
        import transformers

        path = Path(path)
        try:
            if path.is_dir():
                self._tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
            else:
                self._tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        except Exception as exc:  # noqa: BLE001 -- the tokenizers library raises a bare Exception for a bad file
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"--tokenizer-model {path}: cannot load a Hugging Face tokenizer ({first_line})") from None
        self.name = str(path)
        self._chat_template = chat_template
        eos = self._tokenizer.eos_token_id
        self.eos_token_ids = (int(eos),) if eos is not None else _end_of_document(path)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def render_chat(self, messages: list[dict]) -> str:
        if self._chat_template is None and self._tokenizer.chat_template is None:
            return super().render_chat(messages)
        try:
            return self._tokenizer.apply_chat_template(messages, chat_template=self._chat_template, tokenize=False,
                                                       add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 -- a template raises what its author chose (jinja errors)
            raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from None


class MegatronTokenizer(TextTokenizer):
    """One of tessera's own tokenizers (sentencepiece, tiktoken, GPT-2 BPE files, bytes, ids)."""

    def __init__(self, data: DataConfig):
        from tessera.data.tokenizers import build_tokenizer

        self._tokenizer = build_tokenizer(data)
        self.name = f"{data.tokenizer_type} {data.tokenizer_model or ''}".strip()
        self.eos_token_ids = (int(self._tokenizer.eod),)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(i) for i in self._tokenizer.tokenize(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.detokenize(ids)


def _end_of_document(path: Path) -> tuple[int, ...]:
    """A tokenizer.json without a configured EOS (`tessera train-tokenizer`'s): the end-of-document
    token that preprocessing appended (<|endoftext|>, </s>, ...), as training saw it."""
    from tessera.data.tokenizers import HuggingFaceTokenizer

    try:
        return (HuggingFaceTokenizer(str(path)).eod,)
    except ConfigError:
        return ()


def _is_hf_tokenizer_dir(directory: Path) -> bool:
    return directory.is_dir() and any((directory / name).is_file() for name in HF_TOKENIZER_FILES)


def saved_tokenizer_config(checkpoint_config: dict) -> DataConfig | None:
    """The tokenizer flags in a tessera checkpoint's config.yaml (a dict), if it has them."""
    data = checkpoint_config.get("data") or {}
    if not data.get("tokenizer_type"):
        return None
    keys = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "tiktoken_pattern",
            "tiktoken_num_special_tokens")
    return DataConfig(**{key: data[key] for key in keys if key in data})


def load_tokenizer(*, tokenizer_type: str | None = None, tokenizer_model: str | None = None,
                   vocab_file: str | None = None, merge_file: str | None = None,
                   search_dirs: Sequence[str | Path] = (), checkpoint_config: dict | None = None,
                   chat_template: str | None = None) -> TextTokenizer:
    """The tokenizer of a model, looked for in this order:

    1. --tokenizer-type (and --tokenizer-model or the GPT-2 files);
    2. Hugging Face tokenizer files in `search_dirs` (the HF directory, the checkpoint's);
    3. the tokenizer flags of `checkpoint_config` (a checkpoint's config.yaml, read as a dict).
    `chat_template` (a Jinja template's text) replaces the tokenizer's own.
    """
    if tokenizer_type is None and tokenizer_model is not None:
        tokenizer_type = "HuggingFaceTokenizer"
    data = None
    if tokenizer_type is not None:
        data = DataConfig(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, vocab_file=vocab_file,
                          merge_file=merge_file)
    else:
        for directory in map(Path, search_dirs):
            if _is_hf_tokenizer_dir(directory):
                return TransformersTokenizer(directory, chat_template)
        data = saved_tokenizer_config(checkpoint_config) if checkpoint_config else None
    if data is None:
        looked = ", ".join(str(d) for d in search_dirs) or "nowhere"
        raise ConfigError(f"no tokenizer found (looked in {looked}): pass --tokenizer-type and --tokenizer-model")
    if data.tokenizer_type == "HuggingFaceTokenizer":
        if data.tokenizer_model is None or not Path(data.tokenizer_model).exists():
            raise ConfigError(f"--tokenizer-model {data.tokenizer_model}: no such file or directory "
                              "(a tokenizer.json or its directory is needed)")
        return TransformersTokenizer(data.tokenizer_model, chat_template)
    if chat_template is not None:
        raise ConfigError(f"--chat-template needs a Hugging Face tokenizer, not {data.tokenizer_type}")
    return MegatronTokenizer(data)


def read_chat_template(path: str | None) -> str | None:
    """--chat-template: a Jinja file, or a tokenizer_config.json/chat_template.json holding one."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--chat-template {path}: {exc.strerror}") from None
    if path.endswith(".json"):
        try:
            template = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            template = None
        if not isinstance(template, str):
            raise ConfigError(f"--chat-template {path}: no \"chat_template\" string in this JSON file")
        return template
    return text


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text, one whole-character delta at a time.

    Decoding each token alone would split multi-byte characters (byte-level BPE) and lose
    the spaces that sentencepiece attaches to the next piece; instead a short window of
    recent tokens is decoded with and without the new ones, and the difference is new
    text once it no longer ends in a partial character (U+FFFD).
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self._ids = [int(i) for i in prompt_ids[-_CONTEXT_TOKENS:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """What is left at the end, partial characters included (as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        before = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._tokenizer.decode(self._ids[self._prefix_offset:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return after[len(before):]


@dataclass
class TextDelta:
    """What one engine output added to a request, as text and tokens."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None   # "stop" (EOS, stop token or stop string), "length", "abort"


class RequestText:
    """The text of one request as its engine outputs arrive; ends it at a stop string.

    `skip_token_ids` (EOS and stop tokens) count as generated tokens but are not shown as
    text. `abort` is called once, when a stop string ends the request before the engine did.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int], *, stop: Sequence[str] = (),
                 skip_token_ids: Sequence[int] = (), abort: Callable[[], None] = lambda: None):
        self.prompt_ids = [int(i) for i in prompt_ids]
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1   # chars that may start a stop string
        self._skip = set(skip_token_ids)
        self._abort = abort
        self._text = ""
        self._sent = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []             # every generated token, those of text cut off included
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def text(self) -> str:
        """All the text so far (a stop string and what followed it cut off)."""
        return self._text

    def update(self, output) -> TextDelta | None:
        """The delta of one `RequestOutput`; None once the request is over (the outputs of its abort)."""
        if self.finished:
            return None
        tokens = list(output.token_ids)
        kept = len(tokens)
        # Token by token: an output may carry several (greedy steps run back to back), and the
        # request ends with the token that completes a stop string, as it would one step at a time.
        for index, token in enumerate(tokens):
            searched_from = max(0, len(self._text) - self._hold)
            if token not in self._skip:
                self._text += self._detokenizer.push([token])
            if output.finished and index == len(tokens) - 1:
                self._text += self._detokenizer.flush()
            stopped_at = self._find_stop(searched_from)
            if stopped_at is not None:
                self._text, kept = self._text[:stopped_at], index + 1
                self.finished, self.finish_reason = True, "stop"
                break
        if output.finished and not tokens:
            self._text += self._detokenizer.flush()
        logprobs = None if output.logprobs is None else output.logprobs[:kept]
        top = None if output.top_logprobs is None else output.top_logprobs[:kept]
        self.token_ids += tokens[:kept]
        self.logprobs += logprobs or []
        self.top_logprobs += top or []
        if self.finished and not output.finished:
            self._abort()
        elif output.finished and not self.finished:
            self.finished, self.finish_reason = True, output.finish_reason
        limit = len(self._text) if self.finished else len(self._text) - self._hold
        delta = self._text[self._sent:limit] if limit > self._sent else ""
        self._sent = max(self._sent, limit)
        return TextDelta(delta, tokens[:kept], logprobs, top, self.finished, self.finish_reason)

    def _find_stop(self, start: int) -> int | None:
        found = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None


def generate_texts(engine, tokenizer: TextTokenizer, prompts: Sequence[list[int]], params: Sequence, *,
                   stop: Sequence[str] = (),
                   on_finished: Callable[[int, RequestText], None] = lambda index, text: None) -> list[RequestText]:
    """Run prompts to their end on a synchronous `Engine`, as text (in prompt order).

    All are queued at once (the engine runs what fits and keeps the rest waiting);
    `on_finished(index, text)` is called as each one ends (progress bars). The tokens the
    engine stops on (its EOS ids, each request's stop tokens) are not shown as text.
    """
    texts: dict[str, tuple[int, RequestText]] = {}
    eos = set(engine.eos_token_ids) | set(tokenizer.eos_token_ids)
    for index, (prompt, request_params) in enumerate(zip(prompts, params)):
        request_id = str(index)
        engine.add_request(request_id, list(prompt), request_params)
        hidden = eos | set(request_params.stop_token_ids)
        texts[request_id] = (index, RequestText(tokenizer, prompt, stop=stop, skip_token_ids=hidden,
                                                abort=lambda request_id=request_id: engine.abort_request(request_id)))
    while engine.has_unfinished_requests():
        for output in engine.step():
            index, text = texts[output.request_id]
            delta = text.update(output)
            if delta is not None and delta.finished:
                on_finished(index, text)
    return [text for _, text in sorted(texts.values(), key=lambda item: item[0])]
