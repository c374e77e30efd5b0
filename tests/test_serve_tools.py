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


CALLABLE = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("style, opening", [(tools.HERMES, "Let me look that up. <tool_call>"),
                                            (tools.LLAMA3, '{"name": ')])
def test_a_call_once_begun_names_a_tool_and_holds_to_its_schema(smol_tokenizer, style, opening):
    """With tools offered, the text is free until a call begins; from there a random walk (random
    logits: no model's preference) can only name an offered tool and write arguments that
    validate against its parameters, closed the way `parse` reads calls back."""
    import numpy as np

    jsonschema = pytest.importorskip("jsonschema")
    from nerva_cli.runtime.sampling import Sampler, SamplingOptions
    from nerva_cli.structured.constraint import Constraint

    fmt = tools.held_calls(CALLABLE, style, smol_tokenizer)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in CALLABLE}
    names = set()
    for seed in range(8):
        constraint = Constraint(fmt, smol_tokenizer, 49152)
        for token in smol_tokenizer.encode(opening, add_special=False):  # the text so far, free
            constraint.take(token)
        sampler = Sampler(SamplingOptions(temperature=2.0, top_k=0, seed=seed), 49152, constraint)
        rng = np.random.default_rng(seed)
        made = []
        while True:
            made.append(sampler(rng.standard_normal(49152).astype(np.float32) * 4))
            text = opening + smol_tokenizer.decode(made)
            closed = "</tool_call>" in text if style == tools.HERMES else \
                text.count("{") == text.count("}") > 0
            if closed:
                break
            assert len(made) < 300, text
        if style == tools.LLAMA3:  # the closing token may bring free text after the call
            text = text[:text.rindex("}") + 1]
        _, calls = tools.parse(text, style)
        assert len(calls) == 1, text
        jsonschema.validate(calls[0].arguments, schemas[calls[0].name])
        names.add(calls[0].name)
    assert names == set(schemas)  # either tool can be called


def test_a_tool_schema_nerva_cannot_hold_to_is_refused_by_name(smol_tokenizer):
    bad_tools = CALLABLE + [{"type": "function", "function": {"name": "tag", "parameters": {
        "type": "array", "uniqueItems": True}}}]
    with pytest.raises(ApiError, match=r"'tools\[2\].function.parameters': the JSON Schema cannot be held to") as e:
        tools.held_calls(bad_tools, tools.HERMES, smol_tokenizer)
    assert e.value.status == 400 and "uniqueItems" in str(e.value)


@pytest.mark.parametrize("style", [tools.HERMES, tools.LLAMA3])
def test_a_required_call_is_the_whole_answer(smol_tokenizer, style):
    """tool_choice "required" or by name: no text, one call, to the tool named, then the end."""
    import numpy as np

    from nerva_cli.runtime.sampling import Sampler, SamplingOptions
    from nerva_cli.structured.constraint import Constraint

    fmt = tools.held_calls(CALLABLE[1:], style, smol_tokenizer, required=True)  # "add" alone
    for seed in range(4):
        sampler = Sampler(SamplingOptions(temperature=2.0, top_k=0, seed=seed), 49152,
                          Constraint(fmt, smol_tokenizer, 49152))
        rng = np.random.default_rng(seed)
        made = []
        while (token := sampler(rng.standard_normal(49152).astype(np.float32) * 4)) not in smol_tokenizer.eos_ids:
            made.append(token)
            assert len(made) < 200
        content, calls = tools.parse(smol_tokenizer.decode(made), style)
        assert content is None and [c.name for c in calls] == ["add"]
        assert set(calls[0].arguments) == {"a", "b"} and all(isinstance(v, int) for v in calls[0].arguments.values())
