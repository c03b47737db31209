"""The embedded default model: a small Qwen3.5-family model trained on Jane Austen's novels.

`default_model_dir()` is the shipped directory `specs/models/default/` (package data) that `fxsched
generate`, `serve` and `bench` load, through the same loader as any checkpoint, when no `--model`
is given; `default_drafter_dir()` is its DFlash drafter, `specs/models/default/dflash/`, which
`--spec dflash` takes when no `--draft-model` is given. Rebuild both with
`python -m fxsched.runtime.torch_model.training train OUT_DIR` (training/build.py) and measure
them with `... training evaluate DIR` (training/evaluate.py). What the model is, its corpus,
its training and its figures: specs/default-model.md.

What the directory holds:

* `config.json`, `model.safetensors`: `Qwen3_5ForCausalLM` (`model_config`): 4 decoder layers in
  the family's 3:1 pattern (three gated-DeltaNet layers, then one gated attention layer), hidden
  256, grouped GDN value heads, q/k norms, partial RoPE (rotary_dim 16 of head_dim 64), zero-centred
  norms, tied embeddings, and one MTP layer under the published `mtp.*` names; fp32, written by
  hf_export.save_pretrained_dir (the loader's inverse).
* `tokenizer.json`: byte-level BPE (VOCAB_SIZE ids, the 256 byte symbols included, so any text
  encodes) trained with `tokenizers` on the training part of the corpus, then the added tokens
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (special) and `<think>`, `</think>` (not special, as
  in Qwen3), the last five ids. `tokenizer_config.json` has a ChatML template that renders tools as
  Qwen's templates do (specs/serve.md §12.4); `generation_config.json` names `<|im_end|>` and
  `<|endoftext|>` as EOS. The model was trained on prose, not on chat: it continues text.
* `dflash/`: its DFlash drafter (config.json, model.safetensors in the public DFlash format).
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ModelConfig

SEED = 1234
VOCAB_SIZE = 3072
MAX_POSITION_EMBEDDINGS = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
ADDED_TOKENS = SPECIAL_TOKENS + THINK_TOKENS
DEFAULT_DIR_RESOURCE = ("fxsched.specs", "models/default")
DRAFTER_SUBDIR = "dflash"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
DRAFTER_FILES = ("config.json", "model.safetensors")

# Held-out prose prompts: `fxsched bench generate`'s prompt set for a model with a tokenizer, and the
# acceptance figures of specs/default-model.md. The first eight open paragraphs of the
# held-out part of the corpus (training/austen.py: the last 5 % of each novel); the last four were
# written for this project. None of them is in the training text.
EVAL_PROMPTS = (
    "In a moment she perceived that the others were",
    "Edward was now fixed at the cottage at least for a week;",
    "The evening passed quietly, unmarked by anything extraordinary.",
    "There is nothing like employment, active indispensable employment,",
    "Fanny watched him with never-failing solicitude, and",
    "Isabella sent quite as good an account of her visitor as",
    "Catherine coloured as she warmly answered,",
    "At last Anne was at home again, and",
    "The lighthouse keeper climbed the stairs",
    "In the middle of the night, the letter arrived",
    "My favourite season is autumn because",
    "Once the rain stopped, the children",
)
# Repetitive prompts: what n-gram (prompt-lookup) drafting is for. A labelled, separate set.
REPETITIVE_PROMPTS = (
    "red green blue, red green blue, red green blue, red green blue, red green blue,",
    "one two three four five, one two three four five, one two three four five, one two three",
    "to be or not to be, to be or not to be, to be or not to be, to be or not",
)

CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' + (tool | tojson) }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('unknown role: ' + message.role) }}\n"
    "    {%- endif %}\n"
    "    {%- if message.role == 'system' and tools and loop.first %}\n"
    "    {%- elif message.role == 'assistant' and message.tool_calls %}\n"
    "        {{- '<|im_start|>assistant\\n' + (message.content or '') }}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- set call = tool_call.function if tool_call.function else tool_call %}\n"
    "            {%- if (loop.first and message.content) or not loop.first %}\n"
    "                {{- '\\n' }}\n"
    "            {%- endif %}\n"
    "            {{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}\n"
    "            {%- if call.arguments is string %}\n"
    "                {{- call.arguments }}\n"
    "            {%- else %}\n"
    "                {{- call.arguments | tojson }}\n"
    "            {%- endif %}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- else %}\n"
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


# --- where it ships --------------------------------------------------------------------------------


def default_model_dir() -> Path:
    """The shipped default model directory (package data `fxsched/specs/models/default`)."""
    package, name = DEFAULT_DIR_RESOURCE
    return Path(str(importlib.resources.files(package).joinpath(name)))


def default_drafter_dir() -> Path:
    """The shipped default model's DFlash drafter (`specs/models/default/dflash`)."""
    return default_model_dir() / DRAFTER_SUBDIR


# --- the tokenizer ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenIds:
    """Ids of the added tokens."""

    endoftext: int
    im_start: int
    im_end: int
    think: int
    think_end: int

    @property
    def all(self) -> tuple[int, ...]:
        return (self.endoftext, self.im_start, self.im_end, self.think, self.think_end)


def build_tokenizer(corpus: str, vocab_size: int = VOCAB_SIZE) -> tuple[Any, TokenIds]:
    """(tokenizers.Tokenizer, the added tokens' ids): byte-level BPE over the full byte alphabet,
    trained on the corpus lines in order, then the five added tokens (the last five ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(ADDED_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(f"the corpus gives a vocabulary of {tok.get_vocab_size(with_added_tokens=True)} ids, "
                         f"not {vocab_size} (too few merges with min_frequency 2)")
    return tok, token_ids(tok)


def token_ids(tokenizer: Any) -> TokenIds:
    """The added tokens' ids in a `tokenizers.Tokenizer` (ValueError if one is missing)."""
    ids = [tokenizer.token_to_id(t) for t in ADDED_TOKENS]
    missing = [t for t, i in zip(ADDED_TOKENS, ids, strict=True) if i is None]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)}")
    return TokenIds(*[int(i) for i in ids])


def _tokenizer_config(ids: TokenIds) -> dict[str, Any]:
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": t in SPECIAL_TOKENS} for i, t in zip(ids.all, ADDED_TOKENS, strict=True)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": decoder,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "clean_up_tokenization_spaces": False, "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(out_dir: Path, tok: Any, ids: TokenIds) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json of a trained tokenizer into out_dir."""
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(ids))
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": None, "do_sample": False, "eos_token_id": [ids.im_end, ids.endoftext],
                 "pad_token_id": ids.endoftext})


# --- the model -------------------------------------------------------------------------------------


def model_config(ids: TokenIds, *, seed: int = SEED, max_seq_len: int = MAX_POSITION_EMBEDDINGS,
                 max_slots: int = 16) -> ModelConfig:
    """The canonical config of the default model (what load_pretrained reads back, up to runtime sizes)."""
    layers = ("gdn", "gdn", "gdn", "attn")
    block_size = 16
    return ModelConfig(
        architecture="Qwen3_5ForCausalLM", vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=640,
        num_layers=len(layers), layer_pattern=layers, num_attention_heads=4, num_kv_heads=2, head_dim=64,
        rope_theta=10000.0, partial_rotary_factor=0.25, attn_output_gate=True, qk_norm=True,
        gdn_num_heads=2, gdn_num_v_heads=4, gdn_key_dim=64, gdn_value_dim=64, conv_width=4,
        rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32", mtp=False, dflash_gamma=0, mtp_layers=1,
        eos_id=ids.im_end, eos_ids=(ids.endoftext,), seed=seed, max_seq_len=max_seq_len, max_slots=max_slots,
        block_size=block_size, num_blocks=max_slots * -(-max_seq_len // block_size))
