"""Conversations to tokens and loss masks, checked against transformers' own chat templating.

The oracle for the mask is transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`,
which marks what a template wraps in {% generation %}: here each answer and its "<|im_end|>\\n".
The tokenizers are tiny BPEs trained here, saved with a tokenizer_config.json as a model
directory would hold them, and read offline.
"""

import json

import pytest

from tessera.config import ConfigError, DataConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.data.tokenizers import ByteTokenizer, build_tokenizer
from tessera.posttrain.sft_data import (ChatTokenizer, ConversationError, build_chat_tokenizer, row_conversations,
                                        tokenize_conversation)
from tessera.posttrain.sft_dataset import build_sft_datasets

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
TURN = ("<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
        "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}")
PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
CHATML = "{% for m in messages %}" + TURN + "{% endfor %}" + PROMPT
LLAMA_LIKE = "{{ bos_token }}" + CHATML   # a BOS before the conversation, as Llama-3's template has
# Qwen-2.5-like: a default system prompt when the conversation does not open with one, so a
# turn rendered alone is not the turn inside the conversation.
DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
                  + CHATML)
# The generation prompt names the assistant "bot", its turns "assistant": the prefix cannot be found.
MISNAMED_PROMPT = ("{% for m in messages %}" + TURN + "{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>bot\n{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "hello, how are you?"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "what is the weather?"},
    {"role": "assistant", "content": "Let me look."},
    {"role": "tool", "content": "sunny, 21 degrees"},
    {"role": "assistant", "content": "It is sunny."},
]


def make_hf_tokenizer(directory, chat_template: str | None = CHATML):
    """A byte-level BPE of ~300 tokens with ChatML's special tokens, saved as a model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = [m["content"] for m in CONVERSATION] + ["system user assistant tool", "hello world I am fine"]
    tokenizer.train_from_iterator(words * 10, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": "<s>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> ChatTokenizer:
    return build_chat_tokenizer(make_hf_tokenizer(tmp_path_factory.mktemp("chatml")), "default")


def hf_ids_and_mask(tokenizer: ChatTokenizer, messages) -> tuple[list[int], list[int]]:
    encoded = tokenizer.template.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
    return list(encoded["input_ids"]), list(encoded["assistant_masks"])


def test_a_conversation_tokenizes_as_transformers_and_as_its_turns_concatenated(chatml):
    ids, _ = tokenize_conversation(CONVERSATION, chatml, "default")
    expected, _ = hf_ids_and_mask(chatml, CONVERSATION)
    assert ids.tolist() == expected
    turns = [hf_ids_and_mask(chatml, [turn])[0] for turn in CONVERSATION]
    assert ids.tolist() == [i for turn in turns for i in turn]


@pytest.mark.parametrize("template", [CHATML, LLAMA_LIKE], ids=["chatml", "bos"])
def test_the_mask_is_the_assistant_answers_and_their_end_of_turn(tmp_path, template):
    tokenizer = build_chat_tokenizer(make_hf_tokenizer(tmp_path, template), "default")
    ids, mask = tokenize_conversation(CONVERSATION, tokenizer, "default")
    expected_ids, expected_mask = hf_ids_and_mask(tokenizer, CONVERSATION)
    assert ids.tolist() == expected_ids and mask.tolist() == expected_mask
    assert (template == LLAMA_LIKE) == (ids[0] == tokenizer.template.bos_token_id)
    trained = tokenizer.template.decode(ids[mask == 1].tolist())
    assert trained == "I am fine, thank you.<|im_end|>\nLet me look.<|im_end|>\nIt is sunny.<|im_end|>\n"


def test_the_conversation_of_dpo_ends_with_the_answer(chatml):
    """A prompt and one answer (DPO's chosen or rejected): the mask is that answer alone."""
    answer = {"role": "assistant", "content": "I am fine."}
    ids, mask = tokenize_conversation(CONVERSATION[:2] + [answer], chatml, "default")
    prompt_ids = chatml.render(CONVERSATION[:2], generation_prompt=True)
    assert ids[:len(prompt_ids)].tolist() == prompt_ids and not mask[:len(prompt_ids)].any()
    assert chatml.template.decode(ids[len(prompt_ids):].tolist()) == "I am fine.<|im_end|>\n"
    assert mask[len(prompt_ids):].all()


@pytest.mark.parametrize("template, message", [
    (DEFAULT_SYSTEM, "message 2 (user): the chat template tokenizes this turn differently alone than inside"),
    (MISNAMED_PROMPT, "message 3 (assistant): the chat template's assistant turn does not start with its "
                      "generation prompt"),
], ids=["cross-turn text", "unknown assistant prefix"])
def test_a_template_that_cannot_mark_the_answers_is_an_error_naming_file_and_line(tmp_path, template, message):
    data = make_hf_tokenizer(tmp_path / "tokenizer", template)
    path = tmp_path / "chats.jsonl"
    path.write_text("\n" + json.dumps({"messages": CONVERSATION}) + "\n")
    data.data_path, data.split = [str(path)], "1"
    with pytest.raises(ConversationError) as error:
        build_sft_datasets(data, PostTrainConfig(sft=True), seq_length=64, seed=1, train_samples=1, valid_samples=0)
    assert str(error.value).startswith(f"{path}:2: {message}")
    assert "\n" not in str(error.value)


def test_identity_is_each_turn_tokenized_alone_with_eod_after_every_answer():
    tokenizer = build_chat_tokenizer(DataConfig(tokenizer_type="ByteTokenizer"), "identity")
    ids, mask = tokenize_conversation(CONVERSATION, tokenizer, "identity")
    expected_ids, expected_mask = [], []
    for turn in CONVERSATION:
        answer = turn["role"] == "assistant"
        expected_ids += list(turn["content"].encode()) + [ByteTokenizer.eod] * answer
        expected_mask += [int(answer)] * (len(turn["content"].encode()) + answer)
    assert ids.tolist() == expected_ids and mask.tolist() == expected_mask


def test_identity_with_a_hugging_face_tokenizer_ends_answers_with_its_eos(tmp_path):
    data = make_hf_tokenizer(tmp_path, chat_template=None)   # no template needed
    tokenizer = build_chat_tokenizer(data, "identity")
    ids, mask = tokenize_conversation(CONVERSATION[1:3], tokenizer, "identity")
    text = build_tokenizer(data)
    user, answer = text.tokenize(CONVERSATION[1]["content"]), text.tokenize(CONVERSATION[2]["content"])
    eos = text.backend.token_to_id("<|im_end|>")
    assert ids.tolist() == user + answer + [eos]
    assert mask.tolist() == [0] * len(user) + [1] * (len(answer) + 1)


def test_rows_split_into_conversations_at_each_system_message():
    second = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
              {"role": "assistant", "content": "a"}]
    assert row_conversations({"messages": CONVERSATION + second}) == [CONVERSATION, second]
    assert row_conversations({"messages": CONVERSATION[1:3]}) == [CONVERSATION[1:3]]
    assert row_conversations({"prompt": "p", "completion": "c"}) == [
        [{"role": "user", "content": "p"}, {"role": "assistant", "content": "c"}]]


def test_the_vocabulary_is_the_tokenizers_and_transformers_agree(chatml):
    assert chatml.vocab_size == len(chatml.template) == chatml.text.vocab_size
    assert chatml.pad == chatml.template.convert_tokens_to_ids("<|endoftext|>")


def test_the_default_format_needs_a_chat_template(tmp_path):
    with pytest.raises(ConfigError, match="no chat template .* --sft-tokenizer-prompt-format identity"):
        build_chat_tokenizer(make_hf_tokenizer(tmp_path, chat_template=None), "default")
    with pytest.raises(ConfigError, match="needs --tokenizer-type HuggingFaceTokenizer"):
        build_chat_tokenizer(DataConfig(tokenizer_type="ByteTokenizer"), "default")


BAD_LINES = [
    (json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}),
     "message 2: empty assistant turn"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}),
     "message 2: unknown role 'bot' (expected system, user, assistant, tool)"),
    (json.dumps({"text": "hello"}), 'no "messages" list, nor "prompt" and "completion" strings'),
    ('{"messages": [', "malformed JSON"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}]}),
     "conversation 1 has no assistant turn: nothing to train on"),
    (json.dumps({"prompt": "q", "completion": 3}), '"completion" must be a string, got int'),
]


@pytest.mark.parametrize("line, reason", BAD_LINES,
                         ids=["empty answer", "unknown role", "no messages", "bad JSON", "no answer", "not text"])
def test_bad_rows_are_one_line_naming_file_and_line(tmp_path, line, reason):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"prompt": "hello", "completion": "fine"}) + "\n\n" + line + "\n")
    data = DataConfig(tokenizer_type="ByteTokenizer", data_path=[str(path)], split="1")
    posttrain = PostTrainConfig(sft=True, sft_tokenizer_prompt_format="identity")
    with pytest.raises(ConversationError) as error:
        build_sft_datasets(data, posttrain, seq_length=32, seed=1, train_samples=1, valid_samples=0)
    assert str(error.value).startswith(f"{path}:3: ") and reason in str(error.value)
    assert "\n" not in str(error.value)
