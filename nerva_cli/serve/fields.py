"""A request's JSON fields, each read with its type and range checked: a wrong one is one 400
naming the field, the value's type and what was expected. JSON's null counts as absent (OpenAI's
clients send null for what they leave unset)."""

from __future__ import annotations

import math

from nerva_cli.serve.errors import bad

MAX_STOPS = 64  # stop strings a request may give; each is searched for after every token
MAX_STOP_CHARS = 1000


def json_type(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


class Fields:
    def __init__(self, data, where: str = ""):
        self.where = where
        if not isinstance(data, dict):
            raise bad(f"'{where}' must be an object, got {json_type(data)}" if where else
                      f"the body must be a JSON object, got {json_type(data)}", param=where or None)
        self.data = data

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _typed(self, key: str, kinds: tuple, what: str):
        value = self.data.get(key)
        if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            raise bad(f"'{self.name(key)}' must be {what}, got {json_type(value)}", param=self.name(key))
        return value

    def _range(self, key: str, value, low, high, low_open: bool, what: str):
        if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
            bounds = (f"> {low}" if low_open else f">= {low}") if high is None else \
                (f"in ({low}, {high}]" if low_open else f"from {low} to {high}")
            raise bad(f"'{self.name(key)}' must be {what} {bounds}, got {value}", param=self.name(key))
        return value

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self._typed(key, (str,), "a string")
        return default if value is None else value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._typed(key, (bool,), "true or false")
        return default if value is None else value

    def integer(self, key: str, default: int | None = None, low=None, high=None) -> int | None:
        value = self._typed(key, (int,), "an integer")
        return default if value is None else self._range(key, value, low, high, False, "an integer")

    def number(self, key: str, default: float | None = None, low=None, high=None, low_open=False) -> float | None:
        value = self._typed(key, (int, float), "a number")
        if value is None:
            return default
        if not math.isfinite(value):
            raise bad(f"'{self.name(key)}' must be a finite number, got {value}", param=self.name(key))
        return float(self._range(key, value, low, high, low_open, "a number"))

    def object(self, key: str) -> "Fields | None":
        value = self.data.get(key)
        return None if value is None else Fields(value, self.name(key))

    def array(self, key: str) -> list | None:
        return self._typed(key, (list,), "an array")

    def stops(self, key: str) -> list[str]:
        """A stop string or a list of them."""
        value = self.data.get(key)
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad(f"'{self.name(key)}' must be a string or an array of strings", param=self.name(key))
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise bad(f"'{self.name(key)}': at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters "
                      f"each, got {len(stops)}", param=self.name(key))
        return [s for s in stops if s]

    def refuse(self, key: str, why: str, allowed=(None,)) -> None:
        """A field nerva does not do yet: refused by name, never silently ignored."""
        if self.data.get(key, None) not in allowed:
            raise bad(f"'{self.name(key)}' is not supported: {why}", param=self.name(key))
