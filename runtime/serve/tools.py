"""Tool calling for ``fxsched serve`` in the Qwen (Hermes) format: the request's ``tools`` reach the
chat template, and the model's ``<tool_call>`` blocks become OpenAI ``tool_calls`` (serve.md §12.4).

Format. Qwen chat templates list the tools in the system turn and ask for each call as

    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

A reply is optional text (the message's ``content``, null when empty) followed by one or more such
blocks; each parsed block is a tool call ``{"id": "chatcmpl-tool-<hex>", "type": "function",
"function": {"name", "arguments": <the arguments as a JSON string>}}`` and the choice finishes with
``"tool_calls"`` (a length cut keeps ``"length"``). A block whose JSON does not parse, or that has
no name, stays in the content; so does everything after an unclosed ``<tool_call>`` when the text
ends (``parse``).

``tool_choice``: ``"auto"`` (the default with tools): the model decides, the reply is parsed;
``"none"``: the tools are not shown to the template and nothing is parsed; ``"required"``: the reply
is constrained to one or more blocks (one with ``parallel_tool_calls: false``) calling the listed functions with arguments that satisfy their
``parameters`` schemas; ``{"type": "function", "function": {"name": N}}``: one block calling N.
The last two are grammars (runtime/serve/structured.py: a Lark grammar whose blocks embed the JSON
schema of ``{"name": const, "arguments": parameters}``), so even a model that never learned the
format answers with a valid call.

Streaming (``ToolStream``), as vLLM's Hermes parser streams: text before a block is ``content``
deltas (a partial ``<tool_call>`` at the end is held back until it is known not to be one); in a
block, once its name is known, one delta ``{"index": i, "id", "type": "function", "function":
{"name": N, "arguments": ""}}``, then deltas ``{"index": i, "function": {"arguments": piece}}``
whose pieces join to the arguments exactly as the model wrote them (the closing brace of the
block's object held back until the arguments value is known to be complete).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from fxsched.runtime.serve.request_models import bad_request

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE) + r"|" + re.escape(OPEN) + r"(.*)$", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's ``tools`` and ``tool_choice`` ask for. ``template_tools``: what the chat
    template gets (None: no tools shown); ``parse``: whether replies are parsed for calls;
    ``forced``: ``"required"`` or the name of the function every reply must call (None: auto)."""

    template_tools: Optional[list[dict[str, Any]]]
    parse: bool
    forced: Optional[str]
    schemas: dict[str, Any] = field(default_factory=dict)  # function name -> parameters schema
    parallel: bool = True  # several calls per reply (``parallel_tool_calls``)


def tool_plan(tools: Optional[list[Any]], tool_choice: Any, parallel: Any = None) -> Optional[ToolPlan]:
    """The plan of the request's ``tools`` / ``tool_choice`` (None: no tools); 400 naming a bad field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    schemas: dict[str, Any] = {}
    shown: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise bad_request("must be {\"type\": \"function\", \"function\": {...}}", f"tools[{i}]")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise bad_request("must be an object with a name", f"tools[{i}].function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("must be a non-empty string", f"tools[{i}].function.name")
        if name in schemas:
            raise bad_request(f"the function {name!r} is listed twice", f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, Mapping):
            raise bad_request("must be a JSON schema (an object)", f"tools[{i}].function.parameters")
        schemas[name] = dict(params)
        shown.append({"type": "function", "function": dict(fn)})
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("must be a boolean", "parallel_tool_calls")
    many = parallel is not False
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(None, False, None, schemas, many)
    if choice == "auto":
        return ToolPlan(shown, True, None, schemas, many)
    if choice == "required":
        return ToolPlan(shown, True, "required", schemas, many)
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        if name not in schemas:
            raise bad_request(f"names the function {json.dumps(name)[:60]}, which is not in tools",
                              "tool_choice.function.name")
        return ToolPlan(shown, True, name, schemas, many)
    raise bad_request("must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")


def tool_grammar(plan: ToolPlan) -> Optional[str]:
    """The llguidance grammar of a forced reply (None for auto): one block calling the named function,
    or one or more blocks calling any listed function."""
    from llguidance import LLMatcher

    if plan.forced is None:
        return None
    names = list(plan.schemas) if plan.forced == "required" else [plan.forced]
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": plan.schemas[n]},
              "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    schema = {"anyOf": calls, "x-guidance": {"whitespace_flexible": False}}
    more = ' ("\\n" call)*' if plan.forced == "required" and plan.parallel else ""
    lark = (f'start: call{more}\n'
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f'body: %json {json.dumps(schema)}\n')
    return LLMatcher.grammar_from_lark(lark)


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(body: str) -> Optional[tuple[str, str]]:
    """(name, arguments JSON) of a block's body, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse(text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
    """The content and the tool calls of a whole reply (see the module docstring)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    at = 0
    for m in _BLOCK.finditer(text):
        body = m.group(1) if m.group(1) is not None else m.group(2)
        got = _call(body.strip())
        kept.append(text[at:m.start()])
        if got is None:
            kept.append(m.group(0))
        else:
            calls.append({"id": call_id(), "type": "function", "function": {"name": got[0], "arguments": got[1]}})
        at = m.end()
    kept.append(text[at:])
    content = "".join(kept) if calls else text
    if calls:
        content = content.strip()
    return (content or None), calls


def _partial_open(text: str) -> int:
    """Characters at the end of ``text`` that could start ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolStream:
    """Turns a reply's text pieces into chat deltas (``push``; ``finish`` at the end)."""

    def __init__(self) -> None:
        self.buffer = ""  # text not yet turned into deltas: content held back, or the open block
        self.in_block = False
        self.calls = 0  # blocks whose name was sent
        self._name_sent = False
        self._args_sent = 0  # characters of the current block's arguments sent

    def push(self, piece: str) -> list[dict[str, Any]]:
        self.buffer += piece
        out: list[dict[str, Any]] = []
        while True:
            if not self.in_block:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = _partial_open(self.buffer)
                    text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    if text:
                        out.append({"content": text})
                    return out
                if at:
                    out.append({"content": self.buffer[:at]})
                self.buffer = self.buffer[at + len(OPEN):]
                self.in_block, self._name_sent, self._args_sent = True, False, 0
                continue
            end = self.buffer.find(CLOSE)
            body = self.buffer if end < 0 else self.buffer[:end]
            out.extend(self._block(body, closed=end >= 0))
            if end < 0:
                return out
            self.buffer = self.buffer[end + len(CLOSE):].lstrip("\n")
            self.in_block = False

    def _block(self, body: str, closed: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self._name_sent:
            m = _NAME.search(body)
            if m is None:
                return out
            try:
                name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                return out
            out.append({"tool_calls": [{"index": self.calls, "id": call_id(), "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            self._name_sent = True
            self.calls += 1
        m = _ARGS.search(body)
        if m is None:
            return out
        args = body[m.end():]
        try:
            _, end = json.JSONDecoder().raw_decode(args)
            ready = args[:end]  # the whole value: send it all
        except json.JSONDecodeError:
            ready = args if closed else args.rstrip().rstrip("}").rstrip()
            if closed:
                ready = ready.rstrip().removesuffix("}").rstrip()
        piece = ready[self._args_sent:]
        if piece:
            out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": piece}}]})
            self._args_sent = len(ready)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """What is left when the reply ends: held-back text as content (an unclosed block's text too,
        unless its call was already started: then the rest of its arguments)."""
        out: list[dict[str, Any]] = []
        if self.in_block and not self._name_sent:
            out.append({"content": OPEN + self.buffer})
        elif self.in_block:  # a started call cut short: the rest of its arguments as written
            out.extend(self._block(self.buffer, closed=True))
        elif self.buffer:
            out.append({"content": self.buffer})
        self.buffer = ""
        return out


def template_message_fields(message: Any) -> dict[str, Any]:
    """The tool fields of a chat message as a chat template reads them: an assistant's
    ``tool_calls`` (arguments as objects, as Qwen templates expect) and a tool reply's ``tool_call_id``."""
    out: dict[str, Any] = {}
    calls = getattr(message, "tool_calls", None)
    if isinstance(calls, list):
        fixed = []
        for call in calls:
            if not isinstance(call, Mapping):
                continue
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            fixed.append({**call, "function": fn})
        out["tool_calls"] = fixed
    call_id = getattr(message, "tool_call_id", None)
    if isinstance(call_id, str):
        out["tool_call_id"] = call_id
    return out
