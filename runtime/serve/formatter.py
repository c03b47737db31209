"""The OpenAI shapes of a completions or chat completions request's answers (runtime/serve/app.py
serves them): what a response gathers of each choice from its ``ChoiceEvent`` (``_Choice``), and the
whole response bodies and stream chunks made of it (``_Formatter``, ``_first_chunk``): logprobs in
the completions and the chat forms, ``echo`` and vLLM's ``prompt_logprobs`` (specs/serve-fields.md
§13.4), parsed tool calls (specs/serve.md §12.4) and the usage.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Optional, Sequence as Seq

from fxsched.runtime.serve import tools as toolcalls
from fxsched.runtime.serve.choices import ChoiceEvent
from fxsched.runtime.serve.protocol import Plan


class _Choice:
    """What a response has gathered of one choice."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.tokens: list[int] = []
        self.records: list[Optional[dict[str, Any]]] = []
        self.pending_tokens: list[int] = []  # streamed tokens whose text has not been sent yet
        self.pending_records: list[Optional[dict[str, Any]]] = []
        self.offset = 0  # completions logprobs: characters of the tokens already reported
        self.final: Optional[ChoiceEvent] = None
        self.prompt_records: Optional[tuple[Optional[dict[str, Any]], ...]] = None
        self.started = False  # a stream has sent this choice's first chunk (its echo)

    def take(self, event: ChoiceEvent) -> None:
        if event.prompt_logprobs is not None:
            self.prompt_records = event.prompt_logprobs
        self.parts.append(event.text)
        self.tokens.extend(event.tokens)
        self.pending_tokens.extend(event.tokens)
        if event.logprobs is not None:
            self.records.extend(event.logprobs)
            self.pending_records.extend(event.logprobs)
        if event.final:
            self.final = event

    def flush_pending(self) -> tuple[list[int], list[Optional[dict[str, Any]]]]:
        tokens, records = self.pending_tokens, self.pending_records
        self.pending_tokens, self.pending_records = [], []
        return tokens, records

    @property
    def text(self) -> str:
        return "".join(self.parts)


class _Formatter:
    """The OpenAI shapes of one request's responses and chunks."""

    def __init__(self, plan: Plan, created: int, token_text: Callable[[int], str],
                 tools: Optional[toolcalls.ToolPlan] = None):
        self.plan = plan
        self.chat = plan.kind == "chat"
        self.parse_tools = self.chat and tools is not None and tools.parse
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = created
        self.token_text = token_text

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.plan.model}

    def usage(self, choices: list[_Choice]) -> dict[str, Any]:
        completion = sum(c.final.completion_tokens for c in choices if c.final is not None)
        # the prefix cache serves each prompt once per choice; report the most any choice of a prompt got
        cached = max((c.final.cached_tokens for c in choices if c.final is not None), default=0)
        return {"prompt_tokens": self.plan.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.plan.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # logprobs --------------------------------------------------------------------------------

    def logprobs(self, choice: _Choice, tokens: list[int], records: list[Optional[dict[str, Any]]]
                 ) -> Optional[dict[str, Any]]:
        top = self.plan.logprobs
        if top is None:
            return None
        records = records + [None] * (len(tokens) - len(records))
        if self.chat:
            return {"content": [self._chat_entry(t, r, top) for t, r in zip(tokens, records, strict=True)]}
        strings = [self.token_text(t) for t in tokens]
        offsets = []
        for s in strings:
            offsets.append(choice.offset)
            choice.offset += len(s)
        return {
            "tokens": strings,
            "token_logprobs": [r["logprob"] if r else None for r in records],
            "top_logprobs": [({self.token_text(e["token_id"]): e["logprob"] for e in r["top_logprobs"][:top]}
                              if r and top else None) for r in records],
            "text_offset": offsets,
        }

    def echo_logprobs(self, choice: _Choice, prompt: Seq[int]) -> Optional[dict[str, Any]]:
        """Completions ``echo`` + ``logprobs``: the prompt tokens' entries (the first one null)."""
        records = list(choice.prompt_records or ())
        return self.logprobs(choice, list(prompt), records + [None] * (len(prompt) - len(records)))

    def prompt_logprobs(self, choice: _Choice) -> Optional[list[Optional[dict[str, Any]]]]:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {id: {logprob, rank,
        decoded_token}} for the token itself and the top entries."""
        width = self.plan.prompt_logprobs
        if width is None or choice.prompt_records is None:
            return None
        out: list[Optional[dict[str, Any]]] = []
        for r in choice.prompt_records:
            if r is None:
                out.append(None)
                continue
            entry = {str(r["token_id"]): {"logprob": r["logprob"], "rank": r["rank"],
                                          "decoded_token": self.token_text(r["token_id"])}}
            for rank, e in enumerate(r["top_logprobs"][:width], start=1):
                entry.setdefault(str(e["token_id"]), {"logprob": e["logprob"], "rank": rank,
                                                      "decoded_token": self.token_text(e["token_id"])})
            out.append(entry)
        return out

    def _merge(self, head: Optional[dict[str, Any]], tail: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if head is None or tail is None:
            return head or tail
        return {k: head[k] + tail[k] for k in head}

    def _chat_entry(self, token: int, record: Optional[dict[str, Any]], top: int) -> dict[str, Any]:
        text = self.token_text(token)
        entries = record["top_logprobs"][:top] if record else []
        return {"token": text, "logprob": record["logprob"] if record else None, "bytes": list(text.encode()),
                "top_logprobs": [{"token": self.token_text(e["token_id"]), "logprob": e["logprob"],
                                  "bytes": list(self.token_text(e["token_id"]).encode())} for e in entries]}

    # whole responses ------------------------------------------------------------------------

    def echo(self, index: int) -> str:
        return self.plan.echo[index] if self.plan.echo is not None else ""

    def response(self, choices: list[_Choice]) -> dict[str, Any]:
        out = []
        for index, c in enumerate(choices):
            assert c.final is not None
            head = self.echo_logprobs(c, self.plan.choices[index].prompt) if self.plan.echo_logprobs else None
            lp = self._merge(head, self.logprobs(c, c.tokens, c.records))
            text = self.echo(index) + c.text
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                reason = c.final.finish_reason
                if self.parse_tools:  # the generated text only: an echoed turn is never a call
                    content, calls = toolcalls.parse(c.text)
                    if calls:
                        message = {"role": "assistant", "content": (self.echo(index) + (content or "")) or None,
                                   "tool_calls": calls}
                        reason = "tool_calls" if reason == "stop" else reason
                entry = {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}
            else:
                entry = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.final.finish_reason}
            entry["stop_reason"] = c.final.stop_reason
            if self.plan.prompt_logprobs is not None and not self.chat:
                entry["prompt_logprobs"] = self.prompt_logprobs(c)
            out.append(entry)
        body = {**self._head("chat.completion" if self.chat else "text_completion"), "choices": out}
        if self.plan.prompt_logprobs is not None and self.chat:
            body["prompt_logprobs"] = self.prompt_logprobs(choices[0])
        return {**body, "usage": self.usage(choices)}

    # chunks ----------------------------------------------------------------------------------

    def chunk(self, index: int, text: Optional[str], logprobs: Optional[dict[str, Any]],
              finish_reason: Optional[str] = None, role: bool = False, **extra: Any) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        choice.update(extra)
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.plan.include_usage:
            out["usage"] = None
        return out

    def delta_chunk(self, index: int, delta: dict[str, Any], logprobs: Optional[dict[str, Any]]) -> dict[str, Any]:
        """A chat chunk with a given delta (tool-call parsing: runtime/serve/tools.py)."""
        out = {**self._head("chat.completion.chunk"),
               "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]}
        if self.plan.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, choices: list[_Choice]) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage(choices)}


def _first_chunk(fmt: _Formatter, choice: _Choice, index: int) -> Optional[dict[str, Any]]:
    """A stream's first chunk of a choice with ``echo`` or ``prompt_logprobs``: the echoed text
    (with its prompt logprobs) and vLLM's ``prompt_logprobs``; None without either."""
    plan = fmt.plan
    if plan.echo is None and plan.prompt_logprobs is None:
        return None
    extra: dict[str, Any] = {}
    if plan.prompt_logprobs is not None:
        extra["prompt_logprobs"] = fmt.prompt_logprobs(choice)
    lp = fmt.echo_logprobs(choice, plan.choices[index].prompt) if plan.echo_logprobs else None
    return fmt.chunk(index, fmt.echo(index), lp, **extra)
