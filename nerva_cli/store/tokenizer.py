"""The tokenizer a store model carries: encode, chat template, streaming decode."""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from nerva_cli.errors import BadInput, NervaError, read_json


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def open_tokenizer(model_dir: Path) -> "TextTokenizer":
    """The model directory's TextTokenizer, built once per process while its files stay the same:
    building SmolLM2's takes 0.1 s, and `nerva run` needs it twice (the key of the MCAP profile
    cache, then the chat)."""
    model_dir = Path(model_dir).resolve()
    stamp = []
    for name in TOKENIZER_FILES:
        try:
            st = os.stat(model_dir / name)
            stamp.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except FileNotFoundError:
            stamp.append(None)
    return _built(model_dir, tuple(stamp))


@lru_cache(maxsize=8)
def _built(model_dir: Path, stamp: tuple) -> "TextTokenizer":
    return TextTokenizer(model_dir)


def valid_utf8(text: str) -> str:
    """`text` with the bytes Python could not decode as UTF-8 (from a terminal, a pipe or argv,
    kept as lone surrogates) as U+FFFD: the tokenizer refuses surrogates with a TypeError."""
    if text.isascii():
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that stands for no byte (JSON's "\ud800", say)
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


class TextTokenizer:
    """tokenizer.json, tokenizer_config.json and (optional) generation_config.json of a model dir."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise BadInput(f"{path}: missing")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise BadInput(f"{path}: not a tokenizer file ({e})") from None
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.config = read_json(model_dir / "tokenizer_config.json")
        gen_path = model_dir / "generation_config.json"
        gen = read_json(gen_path) if gen_path.exists() else {}
        self.special = {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_token, self.eos_token = self.special["bos_token"], self.special["eos_token"]
        self.bos_id = gen.get("bos_token_id")
        if self.bos_id is None and self.bos_token is not None:
            self.bos_id = self.tok.token_to_id(self.bos_token)
        eos = gen.get("eos_token_id")
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            self.eos_ids.add(self.tok.token_to_id(self.eos_token))
        add_bos = self.config.get("add_bos_token")
        if add_bos is None:  # HF repos like Llama 3's say it in tokenizer.json's post-processor instead
            probe = self.tok.encode("", add_special_tokens=True).ids
            add_bos = bool(probe) and probe[0] == self.bos_id
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.template = self.config.get("chat_template")
        if isinstance(self.template, list):  # several named templates: take the default one
            self.template = next((t["template"] for t in self.template if t.get("name") == "default"), None)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; with add_special, a BOS first when the model wants one and the text
        (a rendered chat template, say) does not already start with it."""
        ids = self.tok.encode(valid_utf8(text), add_special_tokens=False).ids
        if add_special and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The chat template rendered as transformers' apply_chat_template(tokenize=False) does
        (`tools` passed to it only where given, as transformers passes them)."""
        if not self.template:
            raise NervaError("this model has no chat template; use --raw to send the prompt as is")
        from jinja2 import TemplateError

        try:
            extra = {"tools": tools} if tools else {}
            return _environment().from_string(self.template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **extra,
                **{k: v for k, v in self.special.items() if v is not None})
        except TemplateError as e:
            raise NervaError(f"chat template: {e}") from None

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


def _environment():
    """A sandbox set up like transformers': templates from the Hub are untrusted code."""
    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}` marks the assistant's part for training masks; rendering keeps the body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes <, >, & and sorts keys; templates expect plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


class StreamDecoder:
    """Turns tokens into text as they come, never splitting a UTF-8 character: byte-level BPE
    can end a token in the middle of one, and its decode then ends in U+FFFD until the rest
    arrives. Decodes a short window (from the last clean boundary), not the whole answer; the
    window keeps the text returned last before the new text, so a decoder that strips a leading space
    (SentencePiece) strips it from text already returned; special tokens, which decode skips, stay
    out of the window for the same reason."""

    def __init__(self, tokenizer: TextTokenizer):
        self.t = tokenizer
        self.ids: list[int] = []
        self.start = 0  # window start: a token boundary that decodes cleanly
        self.done = 0  # tokens of the window already returned as text

    def _new_text(self) -> str:
        before = self.t.decode(self.ids[self.start:self.done]) if self.done > self.start else ""
        return self.t.decode(self.ids[self.start:])[len(before):]

    def push(self, token_id: int) -> str:
        if token_id in self.t.special_ids:
            return ""
        self.ids.append(token_id)
        text = self._new_text()
        if text.endswith("\ufffd"):
            return ""
        self.start, self.done = self.done, len(self.ids)
        return text

    def flush(self) -> str:
        text = self._new_text()
        self.start = self.done = len(self.ids)
        return text
