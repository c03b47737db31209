"""The embedded default model: a tiny Qwen3.5-family Hugging Face directory, built from seeds.

`build_default_model(out_dir)` writes the directory that ships as `specs/models/default/` (package
data; `default_model_dir()` finds it) and that `fxsched generate` / `fxsched bench generate` load,
through the same loader as any checkpoint, when no `--model` is given. Rebuild it with
`python -m fxsched.runtime.torch_model.default_model OUT_DIR`.

What it holds:

* `config.json`, `model.safetensors`: `Qwen3_5ForCausalLM` with the real family's features at toy
  size (`model_config`): 8 decoder layers in the 3:1 pattern (three gated-DeltaNet layers, then one
  gated attention layer, twice), hidden 64, grouped GDN value heads, q/k norms, partial RoPE
  (rotary_dim 4 of head_dim 16), zero-centred norms, untied embeddings, and one MTP layer under the
  published `mtp.*` names. Written by hf_checkpoint.save_pretrained_dir (the loader's inverse), so
  the loader stays the one place that knows checkpoint names. fp32.
* `tokenizer.json`: byte-level BPE (vocabulary VOCAB_SIZE, the 256 byte symbols included, so any
  text encodes) trained with `tokenizers` on specs/models/default_corpus.txt, then the added tokens
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (special) and `<think>`, `</think>` (not special, as
  in Qwen3), the last five ids. `tokenizer_config.json` has a ChatML template that renders tools as
  Qwen's templates do (a `# Tools` system block listing them in `<tools>`, an assistant's calls as
  `<tool_call>` blocks, tool replies as `<tool_response>` in a user turn; specs/serve.md §12.4);
  `generation_config.json` names `<|im_end|>` and `<|endoftext|>` as EOS.

Target weights (`target_weights`): weights.init_weights of the canonical config (seed SEED: std-1
embeddings, lm_head scaled to logit std 4, fan-in projections, residual branches / sqrt(2 L)); then
every norm weight is drawn as 1 + 0.1 N(0, 1) (so no two norms are alike and a mapping mix-up
shows), the GDN and attention output projections get an extra factor MIXER_SCALE = 0.5, and the
lm_head rows of the five added tokens are zero (logit 0, far below the max of the others: the random
model never emits them, so it never stops early or writes chat markup). The target is random and its
text gibberish. MIXER_SCALE is a modelling choice, measured: with the plain init (1.0) the random
network's next token depends chaotically on its whole context (the most frequent successor of a token
is the greedy next token 55 % of the time), and the distilled MTP then predicts only about half of
the greedy tokens of held-out text (mean accepted length about 1.97, no faster than no speculation on
a CPU); at 0.5 the next token depends mostly on the current one (77 %), as a trained model's output
is mostly predictable, and the same distillation reaches about 80 % (mean accepted length 2.85).

MTP self-distillation (`distill_mtp`, DistillSettings): the target's own greedy continuations of
seeded prompts (corpus windows and random ids, generated through HybridEngine, batched over its
slots) give, per position i, the target's hidden row h_i, the next token t_{i+1}, the target's
greedy token g_j after every prefix and its distribution there. Only the MTP tensors (`mtp.fc`, its
norms, its decoder layer) are trained, with AdamW, on the whole draft chain the scheduler uses
(`mtp_chain_logits`, depth MTP_DRAFTS): depth 1 reads (h_i, t_{i+1}) and predicts g_{i+1}; depth
k >= 2 reads (its own previous output, g_{i+k-1}) at position i+k-1 and predicts g_{i+k}, where the
sequence did continue greedily (elsewhere the row is masked out). The loss is cross-entropy against
the greedy token, mixed with cross-entropy against the target's distribution (`soft`; it
generalises better to unseen text). Fixed seeds, a fixed step budget, a fixed thread count
(DistillSettings.threads); about 15 s of generation and 90-120 s of training on 2 cores.

`mtp_chain_logits` is the differentiable, full-sequence form of hf_drafters.PublishedMtp (whose
K/V-cached form the engine runs), built from the same blocks (attention_qkv / attention_out /
masked_attention, model.mlp_block, ops); tests/test_default_model.py checks that both give the same
drafts on the same weights. Row i at depth k attends the depth-1 rows 0..i and the rows of depths
2..k of the same i: exactly the cache rows PublishedMtp's chain sees when drafts 1..k-1 were right.

Determinism: the same seeds, settings, torch version and thread count give byte-identical files
(tokenizer training is deterministic, JSON is written with sorted keys, safetensors with fixed
metadata). Without distillation (`distill=False`) every file but the MTP tensors equals the shipped
one; tests/test_default_model.py checks that instead of rebuilding (distillation takes minutes).
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import structlog
import torch
import torch.nn.functional as F

from .attention import attention_out, attention_qkv, masked_attention
from .config import ModelConfig
from .hf_checkpoint import save_pretrained_dir
from .model import mlp_block
from .ops import embed_rows, linear, rms_norm
from .weights import Weights, init_weights, param_shapes

log = structlog.get_logger("fxsched.torch_model.default_model")

SEED = 1234
VOCAB_SIZE = 768
MAX_POSITION_EMBEDDINGS = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
ADDED_TOKENS = SPECIAL_TOKENS + THINK_TOKENS
MTP_DRAFTS = 3  # drafts per MTP proposal (runtime/generate.py's MTP_DRAFTS): the chain depth trained
NORM_NOISE = 0.1
MIXER_SCALE = 0.5  # extra factor on the target's GDN / attention output projections (see the module docstring)
DEFAULT_DIR_RESOURCE = ("fxsched.specs", "models/default")
CORPUS_RESOURCE = ("fxsched.specs", "models/default_corpus.txt")
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# Held-out text prompts (none of them in the corpus or the training prompts): `fxsched bench
# generate`'s prompt set for a model with a tokenizer, and the acceptance measurement of the build.
EVAL_PROMPTS = (
    "The lighthouse keeper climbed the stairs",
    "Write a short story about a robot who learns to paint.",
    "In the middle of the night, the phone rang",
    "Explain why the ocean is salty.",
    "My favourite season is autumn because",
    "The train to the mountains leaves at",
    "List three things you would take to an island:",
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

Progress = Optional[Callable[[str], None]]


# --- where it ships --------------------------------------------------------------------------------


def default_model_dir() -> Path:
    """The shipped default model directory (package data `fxsched/specs/models/default`)."""
    package, name = DEFAULT_DIR_RESOURCE
    return Path(str(importlib.resources.files(package).joinpath(name)))


def corpus_text() -> str:
    """The tokenizer's training text (specs/models/default_corpus.txt)."""
    package, name = CORPUS_RESOURCE
    return importlib.resources.files(package).joinpath(name).read_text(encoding="utf-8")


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


def write_tokenizer(out_dir: Path, corpus: str) -> TokenIds:
    """tokenizer.json, tokenizer_config.json and generation_config.json into out_dir."""
    tok, ids = build_tokenizer(corpus)
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(ids))
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": None, "do_sample": False, "eos_token_id": [ids.im_end, ids.endoftext],
                 "pad_token_id": ids.endoftext})
    return ids


# --- the model -------------------------------------------------------------------------------------


def model_config(ids: TokenIds, *, seed: int = SEED, max_seq_len: int = MAX_POSITION_EMBEDDINGS,
                 max_slots: int = 16) -> ModelConfig:
    """The canonical config of the default model (what load_pretrained reads back, up to runtime sizes)."""
    layers = ("gdn", "gdn", "gdn", "attn") * 2
    block_size = 16
    return ModelConfig(
        architecture="Qwen3_5ForCausalLM", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_layers=len(layers), layer_pattern=layers, num_attention_heads=4, num_kv_heads=2, head_dim=16,
        rope_theta=10000.0, partial_rotary_factor=0.25, attn_output_gate=True, qk_norm=True,
        gdn_num_heads=2, gdn_num_v_heads=4, gdn_key_dim=16, gdn_value_dim=16, conv_width=4,
        rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32", mtp=False, dflash_gamma=0, mtp_layers=1,
        eos_id=ids.im_end, eos_ids=(ids.endoftext,), seed=seed, max_seq_len=max_seq_len, max_slots=max_slots,
        block_size=block_size, num_blocks=max_slots * -(-max_seq_len // block_size))


def target_weights(cfg: ModelConfig, ids: TokenIds) -> Weights:
    """The seeded weights (target and untrained MTP) described in the module docstring."""
    w = init_weights(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    for name in sorted(w):
        if name.rsplit(".", 1)[-1].endswith("norm"):
            noise = torch.randn(w[name].shape, generator=gen) * NORM_NOISE
            w[name] = (1.0 + noise.clamp(-0.4, 0.4)).to(w[name].dtype)  # in [0.6, 1.4]: c - 1 is exact
    for name in sorted(w):
        if name.startswith("layers.") and name.endswith(("gdn.o_proj", "attn.o_proj")):
            w[name] = w[name] * MIXER_SCALE
    head = w["lm_head"].clone()
    head[list(ids.all)] = 0.0
    w["lm_head"] = head
    return w


MTP_PREFIX = "mtp."


def mtp_parameter_names(cfg: ModelConfig) -> list[str]:
    """The canonical tensors distillation trains: every `mtp.*` tensor (fc, its norms, its layer)."""
    return [n for n in param_shapes(cfg) if n.startswith(MTP_PREFIX)]


def mtp_chain_logits(cfg: ModelConfig, w: Weights, next_tokens: torch.Tensor, hidden: torch.Tensor,
                     chain_tokens: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Logits [B, T, V] of the published MTP module at depths 1..1+len(chain_tokens), differentiably.

    Row i (position i) at depth 1 reads the target's hidden row hidden[:, i] (pre final norm, as
    engine.hidden_history) and the token next_tokens[:, i] = t_{i+1}; at depth k >= 2 it reads its
    own depth k-1 output and chain_tokens[k-2][:, i] at position i+k-1. Attention: depth-1 rows are
    causal among themselves; a depth-k row i also sees the depth 2..k rows of the same i (see the
    module docstring). PublishedMtp.propose_logits at an anchor row n-1 with drafts d equals row
    n-1 here with chain_tokens[k-2][:, n-1] = d_{k-1}.
    """
    eps, p = cfg.rms_norm_eps, "mtp.layers.0"
    b, t = next_tokens.shape
    device = next_tokens.device
    rows = torch.arange(t, device=device)
    causal = rows[None, :] <= rows[:, None]  # [T, T]: depth-1 keys of query row i
    same = torch.eye(t, dtype=torch.bool, device=device)  # deeper keys: the query's own row i
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    cond = rms_norm(hidden, w["final_norm"], eps)
    out: list[torch.Tensor] = []
    for depth, tokens in enumerate([next_tokens, *chain_tokens]):
        positions = (rows + depth)[None, :].expand(b, t)
        z = linear(torch.cat([rms_norm(embed_rows(w["embed"], tokens), w["mtp.embed_norm"], eps),
                              rms_norm(cond, w["mtp.hidden_norm"], eps)], dim=-1), w["mtp.fc"])
        q, k, v, gate = attention_qkv(rms_norm(z, w[f"{p}.input_norm"], eps), w, f"{p}.attn", cfg, positions)
        keys.append(k)
        values.append(v)
        allowed = torch.cat([causal] + [same] * depth, dim=1)[None].expand(b, t, t * (depth + 1))
        attn = masked_attention(q, torch.cat(keys, dim=1), torch.cat(values, dim=1), allowed)
        h = z + attention_out(attn, gate, w, f"{p}.attn")
        h = h + mlp_block(rms_norm(h, w[f"{p}.post_norm"], eps), w, p, cfg, 0)
        cond = rms_norm(h, w["mtp.final_norm"], eps)
        out.append(linear(cond, w["lm_head"]))
    return out


# --- self-distillation -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DistillSettings:
    """The budget and seeds of the MTP self-distillation (defaults: what the shipped model used)."""

    sequences: int = 1024  # training sequences (prompt + the target's greedy continuation)
    seq_len: int = 64  # tokens per sequence
    min_prompt: int = 4
    max_prompt: int = 24
    corpus_share: float = 0.5  # share of prompts that are corpus windows (the rest: random ids)
    slots: int = 128  # engine slots decoding at once while generating them
    steps: int = 800
    batch: int = 32  # sequences per step
    lr: float = 1e-2  # peak (after `warmup` steps), cosine decay to a tenth
    warmup: int = 50
    depth: int = MTP_DRAFTS
    soft: float = 0.7  # weight of the soft cross-entropy against the target's distribution (rest: greedy token)
    seed: int = 4321
    threads: int = 2


@dataclass
class DistillReport:
    """What distillation saw and reached (the loss per depth at the end, on the training batches)."""

    settings: dict[str, Any]
    positions: int
    seconds_generate: float
    seconds_train: float
    first_loss: float
    final_loss: float
    final_accuracy: list[float] = field(default_factory=list)  # per depth, last 50 steps


def _prompts(tokenizer: Any, ids: TokenIds, count: int, settings: DistillSettings, gen: torch.Generator,
             corpus: str) -> list[list[int]]:
    """Seeded training prompts: windows of the tokenized corpus and random non-added ids."""
    stream = tokenizer.encode(corpus).ids
    allowed = torch.tensor([i for i in range(VOCAB_SIZE) if i not in ids.all])
    out: list[list[int]] = []
    for _ in range(count):
        n = int(torch.randint(settings.min_prompt, settings.max_prompt + 1, (1,), generator=gen))
        if float(torch.rand((), generator=gen)) < settings.corpus_share:
            start = int(torch.randint(0, len(stream) - n, (1,), generator=gen))
            out.append(stream[start:start + n])
        else:
            out.append(allowed[torch.randint(0, len(allowed), (n,), generator=gen)].tolist())
    return out


@torch.no_grad()
def greedy_rows(engine: Any, prompts: Sequence[Sequence[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, seq_len], hidden [N, seq_len, D]): each prompt continued greedily to seq_len
    tokens through the engine (batched over its slots), with the target's hidden rows of them all."""
    slots = list(range(engine.cfg.max_slots))
    tokens = torch.zeros(len(prompts), seq_len, dtype=torch.long)
    hidden = torch.zeros(len(prompts), seq_len, engine.cfg.hidden_size)
    for first in range(0, len(prompts), len(slots)):
        chunk = list(prompts[first:first + len(slots)])
        used = slots[:len(chunk)]
        nxt: dict[int, int] = {}
        for slot, prompt in zip(used, chunk, strict=True):
            engine.alloc(slot)
            nxt[slot] = int(engine.prefill(slot, prompt).argmax())
        while True:
            live = [s for s in used if engine.seq_len(s) < seq_len]
            if not live:
                break
            logits = engine.decode_batch(live, [nxt[s] for s in live])
            for s, row in zip(live, logits.argmax(-1).tolist(), strict=True):
                nxt[s] = int(row)
        for j, slot in enumerate(used):
            tokens[first + j] = torch.tensor(engine.tokens(slot))
            hidden[first + j] = engine.hidden_history[slot, :seq_len].float()
            engine.free(slot)
    return tokens, hidden


@dataclass
class ChainData:
    """Training rows of the MTP chain for N sequences of L tokens (T = L - 1 rows each)."""

    next_tokens: torch.Tensor  # [N, T]: t_{i+1}
    hidden: torch.Tensor  # [N, T, D]: h_i
    chain_tokens: list[torch.Tensor]  # per depth k >= 2: [N, T] g_{i+k-1}
    labels: list[torch.Tensor]  # per depth k >= 1: [N, T] g_{i+k}
    valid: list[torch.Tensor]  # per depth: [N, T] rows with a label of a greedy continuation
    all_hidden: torch.Tensor  # [N, L, D]: every hidden row (the teacher's distribution at i+k is row i+k's)


def chain_data(tokens: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor, depth: int) -> ChainData:
    """The rows of `mtp_chain_logits` training: greedy[:, j] is the target's token after t_0..t_j."""
    n, length = tokens.shape
    t = length - 1
    pad = torch.zeros(n, depth + 1, dtype=torch.long)
    g = torch.cat([greedy, pad], dim=1)
    nxt = torch.cat([tokens, pad], dim=1)
    rows = torch.arange(t)
    chain, labels, valid = [], [], []
    ok = torch.ones(n, t, dtype=torch.bool)
    for k in range(1, depth + 1):
        if k >= 2:
            chain.append(g[:, rows + k - 1])
            ok = ok & (nxt[:, rows + k] == g[:, rows + k - 1])  # the sequence went on as drafted
        labels.append(g[:, rows + k])
        valid.append(ok & (rows + k <= length - 1)[None, :])
    return ChainData(tokens[:, 1:].clone(), hidden[:, :t].clone(), chain, labels, valid, hidden)


def distill_mtp(model_dir: Path, settings: DistillSettings = DistillSettings(), progress: Progress = None,
                corpus: Optional[str] = None) -> tuple[Weights, DistillReport]:
    """Train the MTP tensors of the checkpoint in model_dir on the target's own greedy output.

    Returns the full canonical weights with the trained MTP tensors and a report; the directory is
    not changed (build_default_model rewrites it).
    """
    from tokenizers import Tokenizer

    from .engine import HybridEngine

    say = progress or (lambda message: None)
    corpus = corpus if corpus is not None else corpus_text()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = token_ids(tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        engine = HybridEngine.from_pretrained(model_dir, max_seq_len=settings.seq_len + 8, max_slots=settings.slots)
        cfg, w = engine.cfg, engine.model.w
        gen = torch.Generator().manual_seed(settings.seed)
        prompts = _prompts(tokenizer, ids, settings.sequences, settings, gen, corpus)
        start = time.perf_counter()
        say(f"generating {len(prompts)} greedy continuations of {settings.seq_len} tokens")
        tokens, hidden = greedy_rows(engine, prompts, settings.seq_len)
        with torch.no_grad():
            greedy = engine.model.lm_head(hidden).argmax(-1)
        data = chain_data(tokens, hidden, greedy, settings.depth)
        seconds_generate = time.perf_counter() - start
        params = {n: w[n].detach().clone().float().requires_grad_(True) for n in mtp_parameter_names(cfg)}
        report = _train(cfg, w, params, data, settings, gen, say)
        report.seconds_generate = seconds_generate
        trained = dict(w)
        trained.update({n: p.detach().to(w[n].dtype) for n, p in params.items()})
        return trained, report
    finally:
        torch.set_num_threads(threads)


def _train(cfg: ModelConfig, w: Weights, params: dict[str, torch.Tensor], data: ChainData,
           settings: DistillSettings, gen: torch.Generator, say: Callable[[str], None]) -> DistillReport:
    frozen = {n: w[n] for n in ("embed", "lm_head", "final_norm")}
    opt = torch.optim.AdamW(list(params.values()), lr=settings.lr, betas=(0.9, 0.98), weight_decay=0.0)
    n = data.next_tokens.shape[0]
    start = time.perf_counter()
    first_loss = final_loss = math.nan
    hits = [0.0] * settings.depth
    counts = [0.0] * settings.depth
    tail = max(1, min(50, settings.steps))
    for step in range(settings.steps):
        lr = settings.lr * min(1.0, (step + 1) / settings.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / settings.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        pick = torch.randint(0, n, (settings.batch,), generator=gen)
        logits = mtp_chain_logits(cfg, {**frozen, **params}, data.next_tokens[pick], data.hidden[pick],
                                  [c[pick] for c in data.chain_tokens])
        loss = torch.zeros(())
        for k, out in enumerate(logits):
            mask = data.valid[k][pick]
            if mask.any():
                loss = loss + (1 - settings.soft) * F.cross_entropy(out[mask], data.labels[k][pick][mask])
                if settings.soft:
                    at = torch.clamp(torch.arange(out.shape[1]) + k + 1, max=data.all_hidden.shape[1] - 1)
                    with torch.no_grad():
                        teacher = linear(rms_norm(data.all_hidden[pick][:, at], w["final_norm"], cfg.rms_norm_eps),
                                         w["lm_head"]).softmax(-1)
                    soft = -(teacher[mask] * out[mask].log_softmax(-1)).sum(-1).mean()
                    loss = loss + settings.soft * soft
                if step >= settings.steps - tail:
                    hits[k] += float((out[mask].argmax(-1) == data.labels[k][pick][mask]).sum())
                    counts[k] += float(mask.sum())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())
        first_loss = value if step == 0 else first_loss
        final_loss = value
        if step % 100 == 0 or step == settings.steps - 1:
            say(f"step {step + 1}/{settings.steps}: loss {value:.3f} ({time.perf_counter() - start:.0f}s)")
    return DistillReport(settings=asdict(settings), positions=int(data.valid[0].sum()), seconds_generate=0.0,
                         seconds_train=time.perf_counter() - start, first_loss=first_loss, final_loss=final_loss,
                         final_accuracy=[h / c if c else 0.0 for h, c in zip(hits, counts, strict=True)])


# --- the build -------------------------------------------------------------------------------------


@dataclass
class BuildReport:
    """What build_default_model wrote and measured."""

    out_dir: str
    files: dict[str, int]  # name -> bytes
    distill: Optional[DistillReport] = None


def build_default_model(out_dir: str | Path, *, progress: Progress = None, distill: bool = True,
                        settings: DistillSettings = DistillSettings(), seed: int = SEED) -> BuildReport:
    """Write the default model directory into out_dir (created; its files are replaced).

    distill=False stops before the MTP self-distillation (the MTP tensors keep their seeded init).
    """
    say = progress or (lambda message: None)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus_text()
    say("training the tokenizer")
    ids = write_tokenizer(out, corpus)
    cfg = model_config(ids, seed=seed)
    weights = target_weights(cfg, ids)
    save_pretrained_dir(cfg, weights, out, max_position_embeddings=MAX_POSITION_EMBEDDINGS)
    report = BuildReport(str(out), {})
    if distill:
        trained, report.distill = distill_mtp(out, settings, progress, corpus)
        save_pretrained_dir(cfg, {**weights, **{n: trained[n] for n in mtp_parameter_names(cfg)}}, out,
                            max_position_embeddings=MAX_POSITION_EMBEDDINGS)
    report.files = {name: (out / name).stat().st_size for name in FILES}
    log.info("built_default_model", path=str(out), distilled=distill, bytes=sum(report.files.values()))
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m fxsched.runtime.torch_model.default_model OUT_DIR [--no-distill]`: (re)build the
    default model; progress on stderr, a one-line JSON report on stdout; a bad OUT_DIR exits 2."""
    parser = argparse.ArgumentParser(prog="python -m fxsched.runtime.torch_model.default_model",
                                     description="Build the embedded default model directory (deterministic).")
    parser.add_argument("out_dir", help="directory to write (specs/models/default to refresh the shipped one)")
    parser.add_argument("--no-distill", action="store_true", help="skip the MTP self-distillation")
    args = parser.parse_args(argv)

    def progress(message: str) -> None:
        sys.stderr.write(f"default model: {message}\n")
        sys.stderr.flush()

    try:
        report = build_default_model(args.out_dir, progress=progress, distill=not args.no_distill)
    except (ValueError, OSError) as err:
        sys.stderr.write(f"default model: {args.out_dir}: {err}\n")
        return 2
    sys.stdout.write(json.dumps(asdict(report), sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
