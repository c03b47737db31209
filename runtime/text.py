"""Text for generation: a model directory's tokenizer, its chat template, streamed detokenization,
stop strings and the think-token count. Library code for ``fxsched generate`` and, later, an
OpenAI-compatible server; nothing here prints.

* ``load_tokenizer(dir)`` reads a Hugging Face model directory: ``tokenizer.json`` (the
  ``tokenizers`` library), ``tokenizer_config.json`` (chat template, special tokens, added tokens,
  ``add_bos_token``, kept for information: ``tokenizer.json``'s post-processor decides BOS, as in
  transformers 5), a ``chat_template.jinja`` / ``chat_template.json`` if present (they override
  the config's template, as in transformers 5), and ``generation_config.json`` for the EOS ids
  (``config.json`` as the fallback). No ``tokenizer.json``: ``None`` (the model takes token ids
  only). A file that is there but malformed: ``TokenizerError``, one line naming the file and the
  problem.
* ``TextTokenizer``: ``encode``/``decode``, ``eos_ids`` (generation config first, then the
  tokenizer's ``eos_token``, duplicates dropped), ``think_ids`` and ``apply_chat_template``, which
  renders the template in jinja2's immutable sandbox with the variables transformers passes
  (``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the special tokens, extra
  keyword arguments such as ``enable_thinking``), so its text equals
  ``AutoTokenizer.apply_chat_template(..., tokenize=False)``.
* ``IncrementalDetokenizer``: token ids in, newly completed text out. Invariant: the pieces
  (including ``flush()``'s) concatenate to ``decode(ids)`` (with ``context``: to the text the
  context plus the ids decode to, past the context's text), and no piece ends in a replacement
  character that a later token could still complete. One exception, a property of sentencepiece's
  ``ByteFallback`` decoder: a run of ``<0xXX>`` byte tokens that is not valid UTF-8 (a stray
  byte, or a character cut short by another token or by the end) decodes to one U+FFFD per byte
  token, the run's earlier, complete characters included, so ``decode`` then disagrees with the
  characters already shown. Valid text always streams exactly.
* ``StopMatcher``: streamed text in, text safe to show out; a stop string ends the text before it.
* ``think_count``: the tokens spent inside ``<think> … </think>``.

Decoding follows the ``tokenizers`` library (``Tokenizer.decode``); transformers' optional
``clean_up_tokenization_spaces`` post-pass is not applied. Ids the tokenizer does not know (a
model's padded vocabulary rows) decode to nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
THINK_TOKENS = ("<think>", "</think>")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
REPLACEMENT_CHAR = "\ufffd"
DETOKENIZER_CONTEXT = 5  # context ids kept before the first generated one (see IncrementalDetokenizer)


class TokenizerError(ValueError):
    """A tokenizer file is malformed, or the tokenizer cannot do what was asked; ``str`` is one line."""


class ChatTemplateError(TokenizerError):
    """The model has no chat template, or rendering it failed (``raise_exception`` in the template)."""


def _one_line(text: object) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " ".join(lines) if lines else type(text).__name__


# --- reading the files ----------------------------------------------------------------------------


def _read_json(path: Path, required: bool = False) -> Optional[Any]:
    """The JSON document in ``path``; ``None`` if the file is absent and not required."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise TokenizerError(f"{path}: no such file") from None
        return None
    except UnicodeDecodeError as err:
        raise TokenizerError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise TokenizerError(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path}: invalid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None


def _object(data: Any, path: Path) -> dict:
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, key: str, path: Path) -> Optional[str]:
    """A special-token entry: a string, an AddedToken dict (``{"content": ...}``) or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: {key}: expected a token string or {{\"content\": ...}}, got {value!r}")


def _token_ids(value: Any, key: str, path: Path) -> tuple[int, ...]:
    """``eos_token_id``-style fields: an id, a list of ids, or null."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise TokenizerError(f"{path}: {key}: expected a token id or a list of token ids, got {value!r}")
    return tuple(items)


def _chat_template(config: dict, config_path: Path, directory: Path) -> Optional[str]:
    """The template: ``chat_template.jinja``, else ``chat_template.json``, else the config's
    ``chat_template`` (a string, or a list of ``{name, template}`` of which "default" is used)."""
    jinja_path = directory / CHAT_TEMPLATE_FILES[0]
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise TokenizerError(f"{jinja_path}: cannot read it ({_one_line(err)})") from None
    json_path = directory / CHAT_TEMPLATE_FILES[1]
    data = _read_json(json_path)
    if data is not None:
        template = _object(data, json_path).get("chat_template")
        if not isinstance(template, str):
            raise TokenizerError(f"{json_path}: chat_template: expected a string, got {template!r}")
        return template
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for entry in value:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(f"{config_path}: chat_template: expected {{\"name\", \"template\"}} "
                                     f"entries, got {entry!r}")
            named[entry["name"]] = entry["template"]
        if "default" in named:
            return named["default"]
        raise TokenizerError(f"{config_path}: chat_template: no template named 'default' "
                             f"(have {', '.join(sorted(named)) or 'none'})")
    raise TokenizerError(f"{config_path}: chat_template: expected a string, got {type(value).__name__}")


def load_tokenizer(model_dir: str | Path) -> Optional["TextTokenizer"]:
    """The tokenizer of a model directory, or ``None`` if it has no ``tokenizer.json``.

    Raises ``TokenizerError`` (one line naming the file) for a directory that does not exist or a
    malformed tokenizer, tokenizer config, generation config or chat template file.
    """
    from tokenizers import AddedToken, Tokenizer

    directory = Path(model_dir)
    if not directory.is_dir():
        raise TokenizerError(f"{directory}: no such directory")
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        return None
    data = _read_json(path, required=True)
    _object(data, path)
    try:
        tok = Tokenizer.from_str(json.dumps(data))
    except Exception as err:  # the tokenizers library raises plain Exceptions
        raise TokenizerError(f"{path}: not a tokenizer the tokenizers library can read ({_one_line(err)})") from None

    config_path = directory / TOKENIZER_CONFIG_FILE
    config = _object(_read_json(config_path) or {}, config_path)
    special = {key: _token_content(config.get(key), key, config_path) for key in SPECIAL_TOKEN_KEYS}
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{config_path}: added_tokens_decoder: expected an object of id -> token")
    for key, entry in decoder.items():
        content = _token_content(entry, f"added_tokens_decoder[{key}]", config_path)
        if not str(key).isdigit() or content is None:
            raise TokenizerError(f"{config_path}: added_tokens_decoder: bad entry {key!r}: {entry!r}")
        have = tok.token_to_id(content)
        if have is None:
            is_special = bool(entry.get("special", False)) if isinstance(entry, dict) else False
            (tok.add_special_tokens if is_special else tok.add_tokens)([AddedToken(content, special=is_special)])
            have = tok.token_to_id(content)
        if have != int(key):
            raise TokenizerError(f"{config_path}: added_tokens_decoder: token {content!r} is declared as id "
                                 f"{key} but {path.name} gives it id {have}")
    for content in special.values():
        if content is not None and tok.token_to_id(content) is None:
            tok.add_special_tokens([AddedToken(content, special=True)])  # as transformers does
    for key in ("add_bos_token", "add_eos_token"):
        if config.get(key) is not None and not isinstance(config.get(key), bool):
            raise TokenizerError(f"{config_path}: {key}: expected true or false, got {config.get(key)!r}")

    eos: list[int] = []
    gen_path = directory / GENERATION_CONFIG_FILE
    gen = _read_json(gen_path)
    if gen is not None:
        eos.extend(_token_ids(_object(gen, gen_path).get("eos_token_id"), "eos_token_id", gen_path))
    if not eos:
        model_path = directory / MODEL_CONFIG_FILE
        model = _read_json(model_path)
        if isinstance(model, dict):
            value = model.get("eos_token_id")
            text_config = model.get("text_config")
            if value is None and isinstance(text_config, dict):
                value = text_config.get("eos_token_id")
            eos.extend(_token_ids(value, "eos_token_id", model_path))
    eos_token = special["eos_token"]
    eos_token_id = tok.token_to_id(eos_token) if eos_token is not None else None  # added above if new
    if eos_token_id is not None:
        eos.append(eos_token_id)
    return TextTokenizer(
        tok, chat_template=_chat_template(config, config_path, directory), special_tokens=special,
        eos_ids=tuple(dict.fromkeys(eos)), add_bos_token=config.get("add_bos_token"), source=str(directory))


# --- the tokenizer ------------------------------------------------------------------------------------


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus what the model directory says around it."""

    def __init__(self, tokenizer: Any, *, chat_template: Optional[str] = None,
                 special_tokens: Optional[Mapping[str, Optional[str]]] = None, eos_ids: Sequence[int] = (),
                 add_bos_token: Optional[bool] = None, source: str = "tokenizer") -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.eos_ids: tuple[int, ...] = tuple(eos_ids)
        self.add_bos_token = add_bos_token
        self.source = source
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        bos = self.special_tokens.get("bos_token")
        self.bos_id: Optional[int] = tokenizer.token_to_id(bos) if bos is not None else None
        opening, closing = (tokenizer.token_to_id(t) for t in THINK_TOKENS)
        self.think_ids: Optional[tuple[int, int]] = (
            (opening, closing) if opening is not None and closing is not None else None)
        self._template: Any = None

    def token_id(self, token: str) -> Optional[int]:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the tokenizer's post-processor runs
        (a BOS where it adds one). ``add_bos_token`` in the config changes nothing: as in
        transformers 5, ``tokenizer.json``'s post-processor decides. Rendered chat templates carry
        their own special tokens: encode those with ``add_special_tokens=False``."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; ids outside the tokenizer's vocabulary are left out."""
        known = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.tokenizer.decode(known, skip_special_tokens=skip_special_tokens)

    # --- chat template --------------------------------------------------------------------------

    def _compiled_template(self) -> Any:
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source}: the model has no chat template "
                                    f"(no chat_template in {TOKENIZER_CONFIG_FILE} or {CHAT_TEMPLATE_FILES[0]})")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template, self.source)
        return self._template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[Sequence[Mapping[str, Any]]] = None, **kwargs: Any) -> str:
        """The conversation rendered by the model's chat template (not tokenized).

        Messages are dicts with at least ``role``; extra keyword arguments reach the template
        (``enable_thinking=False``, ...). Raises ``ChatTemplateError`` when the model has no
        template or the template fails (its ``raise_exception``, an undefined operation)."""
        import jinja2

        template = self._compiled_template()
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ChatTemplateError(f"message {i + 1}: expected a dict with a 'role', got {message!r}")
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(kwargs)
        variables.update(messages=_plain(list(messages)), add_generation_prompt=add_generation_prompt,
                         tools=_plain(list(tools)) if tools is not None else None,
                         documents=_plain(variables.get("documents")))
        try:
            return str(template.render(**variables))
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"{self.source}: chat template: {_one_line(err)}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            raise ChatTemplateError(f"{self.source}: chat template failed: {type(err).__name__}: "
                                    f"{_one_line(err)}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """The ids of the rendered conversation (the template supplies the special tokens)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _plain(value: Any) -> Any:
    """A copy made of JSON types only, so the sandboxed template sees no foreign objects."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def compile_chat_template(source: str, where: str = "chat template") -> Any:
    """A jinja2 template compiled in ``ImmutableSandboxedEnvironment`` with what chat templates on
    the Hub expect: ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that keeps
    non-ASCII text, ``raise_exception(message)``, ``strftime_now(format)``, and ``namespace``."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: object) -> None:
        raise jinja2.TemplateError(str(message))

    def tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
               separators: Optional[tuple[str, str]] = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"{where}: chat template syntax error at line {err.lineno}: {_one_line(err.message)}"
                                ) from None


# --- streaming ---------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Token ids one at a time in, newly completed text out.

    Two offsets into the ids (the idea vLLM's detokenizer and HF's ``TextStreamer`` use): text is
    decoded over a window starting at ``prefix`` (ids already shown, kept as context so
    sentencepiece-style leading spaces and byte-level merges come out as in the whole decode), and
    what the window decodes to beyond the text of ``ids[prefix:read]`` is new. New text is held
    back while it ends in U+FFFD (a multi-byte character whose remaining bytes are still to come);
    once it is shown, ``prefix`` moves to ``read`` and ``read`` to the end. Because a window
    always starts where shown text ended on a whole character, each window's text continues the
    whole decode, so the pieces concatenate to ``decode(ids)`` (for byte-level BPE always; for
    byte-fallback tokenizers while every run of byte tokens is valid UTF-8: see the module
    docstring); ``flush()`` gives what is still held (a replacement
    character that never resolved, at the end).

    ``context`` (e.g. the prompt's ids) is decoded but never returned: the output is then the text
    of ``context + ids`` past the text of the context.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context[-DETOKENIZER_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _pending(self) -> str:
        shown = self._decode(self.ids[self.prefix:self.read])
        return self._decode(self.ids[self.prefix:])[len(shown):]

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (often "", sometimes several characters)."""
        self.ids.append(int(token_id))
        new = self._pending()
        if not new or new.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return new

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """The text still held back (when no more ids will come)."""
        new = self._pending()
        self.prefix, self.read = self.read, len(self.ids)
        return new


@dataclass(frozen=True)
class StopMatch:
    """What ``StopMatcher.push`` returns: ``text`` safe to show now; ``stop`` the stop string that
    ended the text (``text`` then ends just before it), or ``None``."""

    text: str
    stop: Optional[str] = None


class StopMatcher:
    """Finds stop strings in streamed text, across piece boundaries.

    ``push(piece)`` returns the text that can be shown: everything except a held-back tail that
    could still be the start of a stop string. The first stop string to complete in the stream
    ends it (of several completing at the same character, the one starting first): the text up to
    (not including) it is returned with ``stop`` set, and every later push returns nothing.
    ``flush()`` gives the held tail when the stream ends without a stop. What is shown does not
    depend on how the text was cut into pieces.
    """

    def __init__(self, stop_strings: Iterable[str]):
        stops = tuple(dict.fromkeys(stop_strings))
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        self.stops = stops
        self._held = ""
        self.stopped: Optional[str] = None

    def push(self, piece: str) -> StopMatch:
        if self.stopped is not None:
            return StopMatch("", self.stopped)
        text = self._held + piece
        if not self.stops:
            self._held = ""
            return StopMatch(text)
        found = [(i + len(s), i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            _, index, stop = min(found)
            self._held, self.stopped = "", stop
            return StopMatch(text[:index], stop)
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return StopMatch(text[:len(text) - keep])

    def _partial_tail(self, text: str) -> int:
        """The length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped is not None else held


# --- thinking ------------------------------------------------------------------------------------------


def opens_thinking(ids: Sequence[int], think_ids: Optional[tuple[int, int]]) -> bool:
    """Whether ``ids`` (a prompt) ends inside a think block: its last think marker is ``<think>``
    (templates such as DeepSeek-R1's open the block in the generation prompt)."""
    if think_ids is None:
        return False
    for token in reversed(ids):
        if token == think_ids[0]:
            return True
        if token == think_ids[1]:
            return False
    return False


def think_count(ids: Sequence[int], think_ids: Optional[tuple[int, int]], inside: bool = False) -> int:
    """How many of the generated ``ids`` were spent thinking.

    Convention: the tokens strictly between ``<think>`` and the next ``</think>``; the markers
    themselves are not counted (they are control tokens, and a model answering with an empty block
    ``<think>\\n\\n</think>`` counts only its newlines). A block still open at the end counts to
    the end. ``inside``: generation starts inside a block the prompt opened
    (``opens_thinking(prompt, think_ids)``). Without think tokens in the vocabulary: 0.
    """
    if think_ids is None:
        return 0
    opening, closing = think_ids
    count = 0
    for token in ids:
        if token == opening:
            inside = True
        elif token == closing:
            inside = False
        elif inside:
            count += 1
    return count
