"""The prompts of ``fxsched generate``, read from the command line or a prompt file and turned into
token ids.

Prompts: ``--prompt TEXT`` / ``--prompt-file FILE`` (text, one prompt per non-blank line,
encoded with the tokenizer; ``--chat`` wraps each as one user message through the chat
template) or ``--prompt-ids "1 2 3"`` / ``--prompt-ids-file FILE`` (token ids).

Prompt files are read with a bound (runtime/cli/bounds.py: at most 64 MiB, so ``/dev/zero`` is one
line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fxsched.runtime.cli.usage import UsageError

PROMPT_OPTIONS = ("--prompt", "--prompt-ids", "--prompt-file", "--prompt-ids-file")


@dataclass
class Prompt:
    source: str  # what an error names: "--prompt", "--prompt-file F line 3", ...
    tokens: list[int]
    text: Optional[str] = None


def _prompt_option(args) -> tuple[str, str]:
    values = [(name, getattr(args, name[2:].replace("-", "_"), None)) for name in PROMPT_OPTIONS]
    given = [(name, str(value)) for name, value in values if value is not None]
    if len(given) > 1:
        raise UsageError(f"{given[0][0]} and {given[1][0]}: give one of them, not both")
    if not given:
        raise UsageError('no prompt: give --prompt TEXT, --prompt-ids "1 2 3", --prompt-file FILE '
                         'or --prompt-ids-file FILE')
    return given[0]


def _lines(option: str, name: str) -> list[tuple[str, str]]:
    from fxsched.runtime.cli.bounds import MAX_PROMPT_FILE_BYTES, UserFileError, read_user_text

    path = Path(name)
    try:
        text = read_user_text(path, option, MAX_PROMPT_FILE_BYTES)
    except UserFileError as err:
        raise UsageError(str(err)) from None
    out = [(f"{option} {path} line {number}", line) for number, line in enumerate(text.splitlines(), 1)
           if line.strip()]
    if not out:
        raise UsageError(f"{option} {path}: no prompts (the file is empty)")
    return out


def _prompts(args, tokenizer=None) -> list[Prompt]:
    """The prompts of the command line, as token ids (text encoded with ``tokenizer``)."""
    from fxsched.runtime.generate import GenerateError, parse_prompt
    from fxsched.runtime.text import TokenizerError

    option, value = _prompt_option(args)
    chat = getattr(args, "chat", False)
    is_text = option in ("--prompt", "--prompt-file")
    if chat and not is_text:
        raise UsageError(f"--chat: needs text prompts (--prompt or --prompt-file), not {option}")
    if is_text and tokenizer is None:
        ids_option = "--prompt-ids" if option == "--prompt" else "--prompt-ids-file"
        raise UsageError(f"{option}: the model has no tokenizer (no tokenizer.json), so it takes token ids: "
                         f"use {ids_option} (or --tokenizer DIR)")
    if option in ("--prompt", "--prompt-ids"):
        items = [(option, value)]
    else:
        items = getattr(args, "prompt_lines", None) or _lines(option, value)
    out = []
    try:
        for source, item in items:
            if not is_text:
                out.append(Prompt(source, parse_prompt(item, source)))
                continue
            if not item.strip():
                raise UsageError(f"{source}: the prompt is empty")
            if chat:
                tokens = tokenizer.encode_chat([{"role": "user", "content": item}])
            else:
                tokens = tokenizer.encode(item)
            if not tokens:
                raise UsageError(f"{source}: the prompt encodes to no tokens")
            out.append(Prompt(source, tokens, item))
    except GenerateError as err:
        raise UsageError(str(err)) from None
    except TokenizerError as err:
        raise UsageError(f"{'--chat' if chat else option}: {err}") from None
    return out
