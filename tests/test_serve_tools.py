"""Tool calling's two halves without a server: the tools and calls handed to a chat template as
transformers hands them, and calls read back out of answers written in Hermes' way (Qwen2.5,
Qwen3) and Llama 3.x's. (test_serve.py sends tools through the running server.)"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import TOOL_TEMPLATE
from nerva_cli.serve import tools
from nerva_cli.serve.errors import ApiError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LLAMA3_LIKE = ("{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}Respond with JSON "
               "{\"name\": function name, \"parameters\": arguments}<|eot_id|>{% endif %}"
               "{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}")


def test_hermes_calls_are_read_out_of_the_answer():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')
    content, calls = tools.parse(text, tools.HERMES)
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                      ("get_weather", {"city": "Oslo"})]
    openai_call = calls[0].openai()
    assert openai_call["type"] == "function" and openai_call["id"].startswith("call_")
    assert json.loads(openai_call["function"]["arguments"]) == {"city": "Paris"}
    assert calls[1].ollama() == {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    # an answer cut short inside its call still gives the call where its JSON is whole
    assert tools.parse('<tool_call>{"name": "f", "arguments": {}}', tools.HERMES)[1][0].name == "f"
    for plain in ("No call here.", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert tools.parse(plain, tools.HERMES) == (plain, [])


def test_llama3_calls_are_read_out_of_the_answer():
    content, calls = tools.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
                                 tools.LLAMA3)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Rome"})]
    _, calls = tools.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', tools.LLAMA3)
    assert [c.name for c in calls] == ["a", "b"]
    for plain in ("Rome is sunny.", '{"city": "Rome"}', "{broken"):
        assert tools.parse(plain, tools.LLAMA3) == (plain, [])


def test_which_templates_take_tools():
    assert tools.call_style(TOOL_TEMPLATE) == tools.HERMES
    assert tools.call_style(LLAMA3_LIKE) == tools.LLAMA3
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ApiError, match="takes no tools"):
        tools.check("m:q4_0", plain)
    with pytest.raises(ApiError, match="does not read yet"):
        tools.check("m:q4_0", "{% for t in tools %}{{ t }}{% endfor %}")


def test_tools_and_calls_render_as_transformers_renders_them(tiny_models, tmp_path):
    transformers = pytest.importorskip("transformers")
    from nerva_cli.serve.pipeline import message_list
    from nerva_cli.store.tokenizer import TextTokenizer

    d = shutil.copytree(tiny_models("llama"), tmp_path / "m")
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    sent = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}]
    messages = message_list(sent, lambda content, where: content)  # as the server reads them
    offered = tools.tool_list([WEATHER])
    ours = TextTokenizer(d).render_chat(messages, tools=offered)
    hf_messages = [dict(m) for m in messages]
    theirs = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        hf_messages, tools=offered, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in ours and "18 C, clear" in ours
