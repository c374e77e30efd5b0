"""What a user asks the answer to be, as one llguidance grammar, checked before any token is made:
a schema or grammar the engine cannot hold to is an error naming it, never an answer left
unconstrained (llama.cpp's and ollama's users meet that as an ignored schema and a 200)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from nerva_cli.errors import BadInput, UsageError

# JSON as a small model should write it: one space after ':' and ',', no free whitespace (a
# model left free to indent can run to the token limit on newlines). A schema's own
# "x-guidance" settings override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Format:
    """One grammar the answer must match, and what the user called it (for messages)."""

    grammar: str  # llguidance's grammar, JSON text
    kind: str  # "JSON", "JSON Schema", "Lark grammar", "GBNF grammar"
    where: str  # the flag, file or field it came from
    schema: object = None  # the JSON Schema of the JSON kinds, as ollama's `format` sends it

    def describe(self) -> str:
        return f"{self.kind} from {self.where}"


def _checked(grammar: str, kind: str, where: str, schema=None) -> Format:
    """The grammar as llguidance compiles it without a tokenizer (the tokenizer's part is checked
    when an answer starts: constraint.Constraint)."""
    from llguidance import LLMatcher

    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise BadInput(f"{where}: the {kind} cannot be held to: {_one_line(messages[0])}")
    return Format(grammar, kind, where, schema)


def _one_line(message: str) -> str:
    """llguidance's message on one line: its echo of the source line and the caret under it go
    (the position stays, as "at LINE(COLUMN)")."""
    lines = [ln.strip() for ln in message.splitlines()]
    kept = [ln for ln in lines if ":" in ln and not re.match(r"\d+ \|", ln)] or lines
    return " ".join(" ".join(kept).split())


def json_object(where: str) -> Format:
    """Any JSON object: ollama's `format: "json"`, OpenAI's json_object, llama.cpp's json.gbnf."""
    return json_schema({"type": "object"}, where, kind="JSON")


def json_schema(schema, where: str, kind: str = "JSON Schema") -> Format:
    from llguidance import LLMatcher

    if not isinstance(schema, (dict, bool)):
        raise BadInput(f"{where}: a JSON Schema is an object (or true/false), got {type(schema).__name__}")
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    except ValueError as e:
        raise BadInput(f"{where}: not a JSON Schema ({_one_line(str(e))})") from None
    return _checked(grammar, kind, where, schema)


def grammar_text(text: str, where: str) -> Format:
    """A Lark grammar as llguidance takes it, or a GBNF one (llama.cpp's: rules written `name ::=`)."""
    from llguidance import LLMatcher

    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(text)
        except Exception as e:  # the converter raises plain Exceptions on syntax it cannot read
            raise BadInput(f"{where}: not a GBNF grammar: {_one_line(str(e))}") from None
        return _checked(LLMatcher.grammar_from_lark(lark), "GBNF grammar", where)
    return _checked(LLMatcher.grammar_from_lark(text), "Lark grammar", where)


def tool_calls(calls: list[tuple[str, object, str, str]], trigger: str, trigger_is_special: bool,
               required: bool = False) -> Format:
    """Free text in which a tool call, once its `trigger` is written, is held whole: `calls` holds
    (where, the tool's parameter schema, what the call starts with, what ends it) for each tool,
    every start beginning with the trigger (llguidance's structural tags: the trigger is matched
    lazily in the text, or as the one token it is where the tokenizer has it as a special token).
    `required`: no text, one call to one of them (OpenAI's tool_choice "required" or a named
    tool). A schema the engine cannot hold to is refused by its `where`."""
    from llguidance import LLMatcher, StructTag

    tags = []
    for where, schema, begin, end in calls:
        json_schema(schema, where)  # refused here, by name, rather than as the whole grammar
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**JSON_STYLE, **(schema.get("x-guidance") or {})}}
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    if not required:
        lark = StructTag.to_grammar(tags, assume_special=trigger_is_special)
    else:
        def text(s: str) -> str:
            return json.dumps(s) if s else ""

        opening = trigger if trigger_is_special else ""
        rules = [f"call_{i}: {opening} {text(t.begin[len(opening):])} %json {json.dumps(t.grammar)} {text(t.end)}"
                 for i, t in enumerate(tags)]
        lark = "%llguidance {}\nstart: " + " | ".join(f"call_{i}" for i in range(len(tags))) + "\n" + "\n".join(rules)
    return _checked(LLMatcher.grammar_from_lark(lark), "tool-call grammar", "'tools'")


def from_flags(format_value: str | None, grammar_path: Path | None) -> Format | None:
    """`run`'s and `bench`'s --format (json, a schema file, or a schema inline) and --grammar
    (a Lark or GBNF file); None when neither is given."""
    if format_value is not None and grammar_path is not None:
        raise UsageError("give --format or --grammar, not both: each is the whole answer's shape")
    if grammar_path is not None:
        return grammar_text(_read(grammar_path, "--grammar"), str(grammar_path))
    if format_value is None:
        return None
    if format_value == "json":
        return json_object("--format json")
    if format_value.lstrip().startswith("{"):
        return json_schema(_parse_json(format_value, "--format"), "--format")
    path = Path(format_value).expanduser()
    if not path.exists():
        raise UsageError(f"--format takes json, a JSON Schema file or a schema inline ({{...}}); "
                         f"{format_value!r} is none of them")
    return json_schema(_parse_json(_read(path, "--format"), str(path)), str(path))


def _read(path: Path, flag: str) -> str:
    path = Path(path).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file ({flag})") from None
    except IsADirectoryError:
        raise BadInput(f"{path}: a directory, not a file ({flag})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot be read ({flag}): {e}") from None


def _parse_json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"{where}: not JSON: {e}") from None
