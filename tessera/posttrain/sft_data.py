"""Conversations for supervised fine-tuning: JSONL rows, chat-template tokens and loss masks.

A row is `{"messages": [{"role": ..., "content": ...}, ...]}` (roles system, user,
assistant, tool) or `{"prompt": ..., "completion": ...}` (one user turn, one assistant
turn). A `system` message starts a new conversation, so one row may hold several, as in
Megatron-LM's SFTDataset (megatron/training/datasets/sft_dataset.py).

`tokenize_conversation` turns one conversation into token ids and a per-token mask that
is 1 on exactly the tokens the model learns to produce: each assistant turn's tokens and
its end-of-turn token. System, user and tool turns, and the text the template puts
before an assistant's answer (e.g. "<|im_start|>assistant\\n"), are 0. Two formats
(--sft-tokenizer-prompt-format):

- `default`: the tokenizer's own chat template (transformers' `apply_chat_template`). The
  mask comes from rendering each turn alone: the conversation must tokenize as the
  concatenation of its turns' tokens (Megatron-LM's SFTTokenizer.tokenize_conversation
  asserts the same), and an assistant turn must begin with the template's generation
  prompt (what `add_generation_prompt=True` appends), which is masked. A template for
  which either fails is an error naming the turn, never a mask of all ones.
- `identity`: no template; each turn's text is tokenized on its own (so the property
  holds by construction) and every assistant turn is followed by the tokenizer's
  end-of-document token (EOS), its end-of-turn. Works with any --tokenizer-type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from tessera.config import ConfigError, DataConfig
from tessera.data.encode import EncodedBlock, EncodedKey, read_json_object
from tessera.data.indexed import optimal_dtype
from tessera.data.tokenizers import Tokenizer, build_tokenizer

ROLES = ("system", "user", "assistant", "tool")
PROMPT_FORMATS = ("default", "identity")
# The user turn whose rendering with and without add_generation_prompt shows the assistant prefix.
_PROBE = [{"role": "user", "content": "x"}]

Message = dict
Conversation = list[Message]


class ConversationError(ConfigError):
    """A conversation that cannot be trained on; the message says why (readers add file:line)."""


@dataclass
class ChatTokenizer:
    """What tokenizes conversations: tessera's tokenizer for plain text (`identity`), and for the
    `default` format the transformers tokenizer whose chat template renders the turns."""

    text: Tokenizer
    template: object | None = None   # a transformers PreTrainedTokenizerBase with a chat_template
    _assistant_prefix: list[int] | None = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        """Token ids are below this: the model's vocabulary must hold at least as many."""
        return max(self.text.vocab_size, len(self.template) if self.template is not None else 0)

    @property
    def eod(self) -> int:
        return self.text.eod

    @property
    def pad(self) -> int:
        """The id of padding (never trained): the template tokenizer's pad token, else EOD."""
        pad = getattr(self.template, "pad_token_id", None)
        return self.eod if pad is None else int(pad)

    def encode(self, text: str) -> list[int]:
        """Ids of rendered template text, with no special tokens added (as apply_chat_template does)."""
        return list(self.template.encode(text, add_special_tokens=False))

    def render(self, messages: Sequence[Message], generation_prompt: bool = False) -> list[int]:
        """Ids of the template's text for `messages`."""
        text = self.template.apply_chat_template(list(messages), tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        return self.encode(text)

    def assistant_prefix(self) -> list[int]:
        """The ids the template puts before an assistant's answer: its generation prompt."""
        if self._assistant_prefix is None:
            plain, prompted = self.render(_PROBE), self.render(_PROBE, generation_prompt=True)
            if prompted[:len(plain)] != plain:
                raise ConversationError("--sft-tokenizer-prompt-format default: the chat template's generation "
                                        "prompt is not appended after the conversation, so the assistant prefix "
                                        "cannot be found and masked")
            self._assistant_prefix = prompted[len(plain):]
        return self._assistant_prefix


def build_chat_tokenizer(data: DataConfig, prompt_format: str, vocab_size: int | None = None) -> ChatTokenizer:
    """The ChatTokenizer of --tokenizer-type/--tokenizer-model for a prompt format (local files only)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ConfigError(f"--sft-tokenizer-prompt-format {prompt_format}: expected one of {', '.join(PROMPT_FORMATS)}")
    text = build_tokenizer(data, vocab_size)
    if prompt_format == "identity":
        return ChatTokenizer(text)
    if data.tokenizer_type != "HuggingFaceTokenizer":
        raise ConfigError("--sft-tokenizer-prompt-format default uses the tokenizer's chat template: it needs "
                          "--tokenizer-type HuggingFaceTokenizer (or give --sft-tokenizer-prompt-format identity)")
    from transformers import AutoTokenizer

    path = Path(data.tokenizer_model)
    directory = path if path.is_dir() else path.parent
    try:
        template = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 -- transformers raises many kinds for a directory it cannot read
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"--tokenizer-model {data.tokenizer_model}: transformers cannot load a tokenizer from "
                          f"{directory} ({reason})") from None
    if not getattr(template, "chat_template", None):
        raise ConfigError(f"--tokenizer-model {data.tokenizer_model}: no chat template in {directory} "
                          "(tokenizer_config.json's chat_template or chat_template.jinja); add one, or give "
                          "--sft-tokenizer-prompt-format identity")
    return ChatTokenizer(text, template)


def check_messages(messages: object) -> None:
    """Roles known, contents strings, no empty assistant turn; else a ConversationError."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError('"messages" must be a non-empty list of {"role", "content"} objects')
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise ConversationError(f"message {number} is a JSON {type(message).__name__}, not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ConversationError(f"message {number}: unknown role {role!r} (expected {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise ConversationError(f"message {number} ({role}): content is {type(content).__name__}, not a string")
        if role == "assistant" and not content.strip():
            raise ConversationError(f"message {number}: empty assistant turn")


def tokenize_conversation(messages: Conversation, tokenizer: ChatTokenizer, prompt_format: str
                          ) -> tuple[np.ndarray, np.ndarray]:
    """(int64 token ids, uint8 loss mask) of one conversation: the mask is 1 on each assistant
    turn's tokens and its end-of-turn, 0 elsewhere. Raises ConversationError naming the turn."""
    check_messages(messages)
    try:
        if prompt_format == "identity":
            ids, mask = _identity(messages, tokenizer)
        elif prompt_format == "default":
            ids, mask = _templated(messages, tokenizer)
        else:
            raise ConfigError(f"--sft-tokenizer-prompt-format {prompt_format}: expected one of "
                              f"{', '.join(PROMPT_FORMATS)}")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a template's raise_exception, a tokenizer rejecting a text
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConversationError(f"the tokenizer or its chat template rejects it ({reason})") from None
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def _identity(messages: Conversation, tokenizer: ChatTokenizer) -> tuple[list[int], list[int]]:
    ids, mask = [], []
    for message in messages:
        turn = [int(i) for i in tokenizer.text.tokenize(message["content"])]
        trained = message["role"] == "assistant"
        if trained:
            turn.append(tokenizer.eod)
        ids += turn
        mask += [int(trained)] * len(turn)
    return ids, mask


def _templated(messages: Conversation, tokenizer: ChatTokenizer) -> tuple[list[int], list[int]]:
    if tokenizer.template is None:
        raise ConfigError("--sft-tokenizer-prompt-format default needs a ChatTokenizer with a chat template "
                          "(build_chat_tokenizer)")
    ids = tokenizer.render(messages)
    mask = [0] * len(ids)
    prefix = tokenizer.assistant_prefix()
    bos = getattr(tokenizer.template, "bos_token_id", None)
    position = 0
    for number, message in enumerate(messages, 1):
        turn = tokenizer.render([message])
        # A template that opens with BOS does so for every turn rendered alone; inside the
        # conversation only the first keeps it.
        if position > 0 and bos is not None and turn[:1] == [bos] and ids[position:position + 1] != [bos]:
            turn = turn[1:]
        role = message["role"]
        if ids[position:position + len(turn)] != turn:
            raise ConversationError(
                f"message {number} ({role}): the chat template tokenizes this turn differently alone than inside "
                "the conversation, so its tokens cannot be told apart and masked (the conversation must be the "
                "concatenation of its turns); use a template without cross-turn text, or "
                "--sft-tokenizer-prompt-format identity")
        if role == "assistant":
            if turn[:len(prefix)] != prefix or len(turn) == len(prefix):
                raise ConversationError(
                    f"message {number} (assistant): the chat template's assistant turn does not start with its "
                    "generation prompt followed by the answer, so the answer's tokens cannot be marked; use "
                    "--sft-tokenizer-prompt-format identity")
            mask[position + len(prefix):position + len(turn)] = [1] * (len(turn) - len(prefix))
        position += len(turn)
    if position != len(ids):
        raise ConversationError("the chat template adds tokens after the last turn, so the conversation is not the "
                                "concatenation of its turns; use --sft-tokenizer-prompt-format identity")
    return ids, mask


def split_conversations(messages: Conversation) -> list[Conversation]:
    """The conversations of one row: a system message starts a new one."""
    conversations: list[Conversation] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def row_conversations(row: dict) -> list[Conversation]:
    """The conversations of one JSONL row ("messages", or "prompt" and "completion")."""
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row or "completion" in row:
        for key in ("prompt", "completion"):
            if not isinstance(row.get(key), str):
                raise ConversationError(f'"{key}" must be a string, got {type(row.get(key)).__name__}')
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    else:
        raise ConversationError('no "messages" list, nor "prompt" and "completion" strings')
    check_messages(messages)
    conversations = split_conversations(messages)
    for number, conversation in enumerate(conversations, 1):
        if not any(message["role"] == "assistant" for message in conversation):
            raise ConversationError(f"conversation {number} has no assistant turn: nothing to train on")
    return conversations


class ConversationEncoder:
    """Lines of JSONL to conversations' tokens and loss masks: the encoder of `tessera preprocess
    --sft`'s workers and of a JSONL read at training time, so both give the same arrays.

    Output keys: "tokens" and "loss_mask", one sequence per conversation, one document per row.
    """

    def __init__(self, tokenizer: ChatTokenizer, prompt_format: str):
        self.tokenizer, self.prompt_format = tokenizer, prompt_format
        self.dtype = optimal_dtype(tokenizer.vocab_size)

    def encode_row(self, raw: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) of each conversation of one line; ValueError (ConversationError) if it is bad."""
        conversations = row_conversations(read_json_object(raw))
        encoded = []
        for number, conversation in enumerate(conversations, 1):
            try:
                encoded.append(tokenize_conversation(conversation, self.tokenizer, self.prompt_format))
            except ConversationError as exc:
                if len(conversations) == 1:
                    raise
                raise ConversationError(f"conversation {number}: {exc}") from None
        return encoded

    def __call__(self, lines: list[bytes], first_line: int) -> EncodedBlock:
        ids, masks, per_row, bad = [], [], [], []
        for number, raw in enumerate(lines, first_line):
            if not raw.strip():
                continue
            try:
                row = self.encode_row(raw)
            except ValueError as exc:
                bad.append((number, str(exc)))
                continue
            ids += [i for i, _ in row]
            masks += [m for _, m in row]
            per_row.append(len(row))
        lengths = np.asarray([len(i) for i in ids], dtype=np.int32)
        per_document = np.asarray(per_row, dtype=np.int64)

        def key(arrays: list[np.ndarray], dtype) -> EncodedKey:
            return EncodedKey(np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype), lengths,
                              per_document)

        return EncodedBlock({"tokens": key(ids, self.dtype), "loss_mask": key(masks, np.uint8)},
                            documents=len(per_row), bad_lines=bad)


def conversation_encoder(data: DataConfig, prompt_format: str, vocab_size: int | None = None) -> ConversationEncoder:
    """A ConversationEncoder with its own tokenizer (what each preprocessing worker builds)."""
    return ConversationEncoder(build_chat_tokenizer(data, prompt_format, vocab_size), prompt_format)
