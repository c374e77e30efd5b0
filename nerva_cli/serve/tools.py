"""Tool calling: the request's tools handed to a chat template that takes them, and the calls a
model writes read back out of its answer, in the two ways the templates nerva knows define them:
Hermes' `<tool_call>{json}</tool_call>` blocks (Qwen2.5, Qwen3) and Llama 3.x's bare JSON object
(`{"name": ..., "parameters": ...}`, after `<|python_tag|>` or alone). A template that takes no
tools, or writes calls some other way, is refused by name: tools are never silently dropped."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from nerva_cli.serve.errors import bad

HERMES, LLAMA3 = "hermes", "llama3"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def openai(self) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}

    def ollama(self) -> dict:
        return {"function": {"name": self.name, "arguments": self.arguments}}


def takes_tools(template: str | None) -> bool:
    """Whether the chat template reads a `tools` variable (jinja2's own parse of it)."""
    if not template:
        return False
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return "tools" in meta.find_undeclared_variables(Environment().parse(template))
    except TemplateSyntaxError:  # (rendering it says what is wrong)
        return False


def call_style(template: str | None) -> str | None:
    """How the template's model writes a call: HERMES, LLAMA3, or None where nerva does not know."""
    if not takes_tools(template):
        return None
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or ("<|eot_id|>" in template and "parameters" in template):
        return LLAMA3
    return None


def check(model: str, template: str | None) -> str:
    """The template's call style, or a 400 naming the model when it has none nerva reads."""
    style = call_style(template)
    if style is None:
        why = "takes no tools" if not takes_tools(template) else \
            "takes tools, but writes calls in a way nerva does not read yet (it reads Qwen's and Llama 3's)"
        raise bad(f"{model}'s chat template {why}: send the request without 'tools'", param="tools")
    return style


def parse(text: str, style: str) -> tuple[str | None, list[ToolCall]]:
    """The answer's text outside its calls (None where nothing is left) and the calls, in order.
    Text that only looks like a call (JSON that does not parse, no name) stays text."""
    if style == HERMES:
        calls = []
        for body in _HERMES_CALL.findall(text):
            call = _call(body)
            if call is None:
                return text, []
            calls.append(call)
        rest = _HERMES_CALL.sub("", text).strip() if calls else text
        return (rest or None), calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(part) for part in body.split(";")] if ";" in body and _call(body) is None else [_call(body)]
    if any(c is None for c in calls):
        return text, []
    return None, calls


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def held_calls(offered: list[dict], style: str, tokenizer, required: bool = False):
    """The answer's structured.Format where tools are offered: text as the model likes, in which a
    call, once begun, names one of the tools and holds its arguments to that tool's parameter
    schema, written the way `style` reads them back (parse); `required`: one call and nothing
    else. A schema nerva cannot hold to is a 400 naming the tool: never a call left unchecked."""
    from nerva_cli.errors import NervaError
    from nerva_cli.structured.formats import tool_calls

    # Hermes' block, or Llama 3's bare object (its trigger the object's start up to the name)
    trigger = "<tool_call>" if style == HERMES else '{"name": '
    calls = []
    for i, t in enumerate(offered):
        f = t["function"]
        name, schema = json.dumps(f["name"]), f.get("parameters")
        schema = {"type": "object"} if schema is None else schema
        if style == HERMES:
            begin, end = f'<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"
        else:
            begin, end = f'{{"name": {name}, "parameters": ', "}"
        calls.append((f"'tools[{i}].function.parameters'", schema, begin, end))
    special = tokenizer.tok.token_to_id(trigger) in tokenizer.special_ids
    try:
        return tool_calls(calls, trigger, special, required)
    except NervaError as e:
        where = str(e).split(":", 1)[0].strip("'")
        raise bad(str(e), param=where if where.startswith("tools[") else "tools") from None


def tool_list(value, where: str = "tools") -> list[dict] | None:
    """The request's tools as the templates take them (OpenAI's shape, which ollama's shares):
    [{"type": "function", "function": {"name", "description", "parameters"}}]."""
    if value in (None, []):
        return None
    if not isinstance(value, list):
        raise bad(f"'{where}' must be an array of tools", param=where)
    tools = []
    for i, t in enumerate(value):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad(f"'{where}[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                      f"\"parameters\": ...}}}}", param=f"{where}[{i}]")
        if t.get("type", "function") != "function":
            raise bad(f"'{where}[{i}].type' must be \"function\"", param=f"{where}[{i}].type")
        tools.append({"type": "function", "function": f})
    return tools


def message_calls(value, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, as templates take them: arguments an object
    (OpenAI's clients send them as a JSON string)."""
    if not isinstance(value, list):
        raise bad(f"'{where}' must be an array of tool calls", param=where)
    calls = []
    for i, c in enumerate(value):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad(f"'{where}[{i}]' must hold a function with a name", param=f"{where}[{i}]")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad(f"'{where}[{i}].function.arguments' is not valid JSON", param=f"{where}[{i}]") from None
        if not isinstance(args, dict):
            raise bad(f"'{where}[{i}].function.arguments' must be an object", param=f"{where}[{i}]")
        call = {"type": "function", "function": {"name": f["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        calls.append(call)
    return calls
