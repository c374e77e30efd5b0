"""The tokenizer a store model carries: encode, chat template, streaming decode."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from nerva_cli.errors import BadInput, NervaError


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class TextTokenizer:
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
        self.config = _read_json(model_dir / "tokenizer_config.json")
        gen_path = model_dir / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.exists() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_id = gen.get("bos_token_id")
        if self.bos_id is None and self.bos_token is not None:
            self.bos_id = self.tok.token_to_id(self.bos_token)
        eos = gen.get("eos_token_id")
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            self.eos_ids.add(self.tok.token_to_id(self.eos_token))
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_id is not None
        self.template = self.config.get("chat_template")
        if isinstance(self.template, list):  # several named templates: take the default one
            self.template = next((t["template"] for t in self.template if t.get("name") == "default"), None)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.template:
            raise NervaError("this model has no chat template; use --raw to send the prompt as is")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            return env.from_string(self.template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise NervaError(f"chat template: {e}") from None

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns tokens into text as they come, never splitting a UTF-8 character: byte-level BPE
    can end a token in the middle of one, and its decode then ends in U+FFFD until the rest
    arrives. Decodes a short window (from the last clean boundary), not the whole answer."""

    def __init__(self, tokenizer: TextTokenizer):
        self.t = tokenizer
        self.ids: list[int] = []
        self.start = 0  # window start: a token boundary that decodes cleanly
        self.done = 0  # tokens of the window already returned as text

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.t.decode(self.ids[self.start:self.done]) if self.done > self.start else ""
        now = self.t.decode(self.ids[self.start:])
        if now.endswith("\ufffd"):
            return ""
        self.start, self.done = self.done, len(self.ids)
        return now[len(before):]

    def flush(self) -> str:
        before = self.t.decode(self.ids[self.start:self.done]) if self.done > self.start else ""
        rest = self.t.decode(self.ids[self.start:])[len(before):]
        self.start = self.done = len(self.ids)
        return rest
