"""A tiny Hugging Face tokenizer written into a directory, for tests that need text.

``write_tiny_tokenizer(dir)`` trains a byte-level BPE (GPT-2 / Qwen style: ``ByteLevel``
pre-tokenizer and decoder) on a few sentences that include multi-byte UTF-8 ("héllo 東京 🙂"),
then appends the added tokens Qwen's tokenizers have: the special ``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>`` and the non-special ``<think>`` / ``</think>`` (non-special as
in Qwen3, so ``skip_special_tokens`` keeps them). It writes ``tokenizer.json`` and a
``tokenizer_config.json`` with a ChatML chat template in Qwen's style (optional system message,
tools rendered with ``tojson``, ``enable_thinking=False`` adds an empty think block,
``raise_exception`` on an unknown role), ``eos_token = <|im_end|>``, ``pad_token =
<|endoftext|>`` and no BOS. ``generation_config=True`` also writes a ``generation_config.json``
naming both end tokens as EOS (model builders that write their own leave it False).

The base alphabet is only the bytes the sentences use (unless ``full_alphabet``), so the whole
vocabulary fits small test models (default 128 ids); text outside that alphabet cannot be encoded,
but every id decodes, and random ids give partial multi-byte characters. Training is
deterministic: the same arguments give the same files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SENTENCES = (
    "héllo 東京 🙂 hello world",
    "the quick brown fox jumps over the lazy dog",
    "Hello, World! héllo again, 東京 is a city.",
    "numbers 0123456789 and symbols: ()[]{}<>=+-*/_.,;?!'\"#%&@",
    "café naïve résumé 🙂🙂 東京タワー",
    "<think> is how a model starts to think </think> and then it answers.",
    "The answer is 42.\nNew lines\tand tabs too.",
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")

CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '# Tools\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' }}{{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- elif messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('unknown role ' + message.role) }}\n"
    "    {%- endif %}\n"
    "    {%- if message.role != 'system' or not loop.first %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)


@dataclass(frozen=True)
class TinyTokenizer:
    """What ``write_tiny_tokenizer`` wrote: the directory, the vocabulary size and named ids."""

    path: Path
    vocab_size: int
    endoftext: int
    im_start: int
    im_end: int
    think: int
    think_end: int


def write_tiny_tokenizer(directory: str | Path, vocab_size: int = 128, *, full_alphabet: bool = False,
                         generation_config: bool = False, chat_template: str | None = CHATML_TEMPLATE) -> TinyTokenizer:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (and ``generation_config.json`` if
    asked) into ``directory`` (created if needed). ``vocab_size`` counts every id, the five added
    tokens included (they are the last five ids); ``chat_template=None`` writes no template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - added, show_progress=False, min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if full_alphabet else [])
    tok.train_from_iterator(list(SENTENCES) * 3, trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(THINK_TOKENS))
    tok.save(str(out / "tokenizer.json"))

    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS + THINK_TOKENS:
        token_id = tok.token_to_id(t)
        assert token_id is not None
        ids[t] = token_id
    decoder = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": t in SPECIAL_TOKENS}
        for t in SPECIAL_TOKENS + THINK_TOKENS
    }
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    if generation_config:
        gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return TinyTokenizer(out, tok.get_vocab_size(with_added_tokens=True), ids["<|endoftext|>"],
                         ids["<|im_start|>"], ids["<|im_end|>"], ids["<think>"], ids["</think>"])
