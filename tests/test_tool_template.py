"""The embedded default model's chat template with tools (specs/serve.md §12.4) renders as
transformers renders it, in Qwen's format, and the server's tool history reaches it."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from fxsched.runtime.text import load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in 東京",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": CALLS},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "tool_call_id": "c2", "content": "rain"}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Let me see.", "tool_calls": CALLS[:1]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "thanks"}],
]


@pytest.fixture(scope="module")
def toks():
    return load_tokenizer(default_model_dir()), transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_default_template_with_tools_renders_like_transformers(toks, messages, tools):
    ours, hf = toks
    got = ours.apply_chat_template(messages, True, tools=tools)
    assert got == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools)
    if tools:
        assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather"' in got
    if any(m.get("tool_calls") for m in messages):
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in got
        assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in got
