"""Structured output (nerva_cli/structured): what is refused before any token, the mask kernel
against NumPy, random walks of the grammar that must always end in valid JSON, and SmolLM2's own
answers at several seeds checked with `jsonschema` (a validator nerva did not write). The server's
side is in test_serve.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nerva_cli.errors import BadInput, UsageError
from nerva_cli.planes import ref
from nerva_cli.runtime.sampling import Sampler, SamplingOptions
from nerva_cli.structured import formats
from nerva_cli.structured.constraint import Constraint
from test_kernels import randn

jsonschema = pytest.importorskip("jsonschema")

# The JSON Schema test suite's simple kinds: types, enums, required properties, nested objects,
# arrays with bounds, string patterns, numbers with bounds, const, anyOf, $ref. Strings are
# bounded so that a random walk (which picks a closing quote by chance) ends.
SCHEMAS = {
    "types": {"type": "object", "properties": {
        "s": {"type": "string", "maxLength": 12}, "i": {"type": "integer"}, "n": {"type": "number"},
        "b": {"type": "boolean"}, "z": {"type": "null"}}, "required": ["s", "i", "n", "b", "z"],
        "additionalProperties": False},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
             "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_bounds": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "number_bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99}, "score": {"type": "number", "minimum": 0,
                                                                           "maximum": 1}},
        "required": ["age", "score"], "additionalProperties": False},
    "any_of_ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                         "y": {"type": "integer"}},
                                       "required": ["x", "y"], "additionalProperties": False}},
                   "anyOf": [{"$ref": "#/$defs/point"}, {"const": "none"}]},
}

# what llguidance cannot hold to: refused, never dropped
REFUSED = {
    "a misspelt type": ({"type": "strnig"}, "Invalid type: strnig"),
    "a keyword it does not do": ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    "a pattern that is no regex": ({"type": "string", "pattern": "(["}, "unclosed character class"),
    "no value can match": ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) is greater than maximum"),
    "a reference to nothing": ({"$ref": "#/$defs/nope"}, "/$defs/nope"),
    "not an object": ([1, 2], "a JSON Schema is an object"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_schemas_the_engine_cannot_hold_to_are_refused_by_name(case):
    schema, says = REFUSED[case]
    with pytest.raises(BadInput, match="^schema.json: ") as e:
        formats.json_schema(schema, "schema.json")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_grammars_lark_and_gbnf_and_their_refusals(tmp_path):
    good = tmp_path / "yn.gbnf"
    good.write_text('root ::= answer\nanswer ::= "yes" | "no"\n')
    assert formats.from_flags(None, good).kind == "GBNF grammar"
    lark = tmp_path / "yn.lark"
    lark.write_text('start: "yes" | "no"\n')
    assert formats.from_flags(None, lark).kind == "Lark grammar"
    for text, says in (('start: "a" | b\n', 'at 1(8): unknown name: "b"'), ('root ::= other\n', "not a GBNF grammar: Rule 'other' not found"),
                       ("start: /([/\n", "unclosed character class")):
        bad = tmp_path / "bad.g"
        bad.write_text(text)
        with pytest.raises(BadInput, match=f"^{bad}: ") as e:
            formats.from_flags(None, bad)
        assert says in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(BadInput, match="no such file"):
        formats.from_flags(None, tmp_path / "missing.lark")


def test_format_flag_values():
    assert formats.from_flags(None, None) is None
    assert formats.from_flags("json", None).kind == "JSON"
    inline = formats.from_flags('{"type": "integer"}', None)
    assert (inline.kind, inline.schema) == ("JSON Schema", {"type": "integer"})
    with pytest.raises(UsageError, match="--format takes json, a JSON Schema file"):
        formats.from_flags("xml", None)
    with pytest.raises(BadInput, match="--format: not JSON"):
        formats.from_flags("{nope", None)
    with pytest.raises(UsageError, match="not both"):
        formats.from_flags("json", "g.lark")


def test_the_mask_kernel_against_numpy(rng):
    from nerva_cli.planes.cpu.kernels.sampling import allow_only

    for vocab in (1, 31, 32, 33, 49152, 151936):
        logits = randn(rng, vocab)
        allowed = rng.integers(0, 2**32, (vocab + 31) // 32, dtype=np.uint64).astype(np.uint32)
        allowed[rng.random(len(allowed)) < 0.3] = 0  # whole words forbidden too
        bits = np.unpackbits(allowed.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        want = np.where(bits, logits, -np.inf).astype(np.float32)
        out = np.empty_like(logits)
        allow_only(logits, allowed, out)
        np.testing.assert_array_equal(out, want)
        allow_only(logits, allowed, logits)  # in place
        np.testing.assert_array_equal(logits, want)


@pytest.mark.parametrize("top_k, top_p", [(40, 0.95), (0, 1.0), (0, 0.5), (3, 1.0)])
def test_forbidden_tokens_are_never_candidates(rng, top_k, top_p):
    """-inf logits (the mask's) are out of ref's candidates and never drawn by the CPU sampler,
    even where top_k reaches past the tokens allowed."""
    vocab = 5000
    for trial in range(20):
        logits = randn(rng, vocab) * np.float32(3)
        allowed = rng.choice(vocab, size=int(rng.integers(1, 6)), replace=False)
        masked = np.full(vocab, -np.inf, np.float32)
        masked[allowed] = logits[allowed]
        top, w = ref.sampling_candidates(masked, 0.8, top_k, top_p)
        assert set(top) <= set(allowed) and np.all(w > 0)
        sampler = Sampler(SamplingOptions(temperature=0.8, top_k=top_k, top_p=top_p, seed=trial), vocab)
        assert all(sampler(masked) in allowed for _ in range(10))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_walks_of_a_schema_end_in_json_that_validates(smol_tokenizer, rng, name):
    """Random logits at temperature 2 (nothing like a model's preferences) drawn under the mask
    until the end of sequence: every walk ends, within the steps allowed, in text that parses and
    validates with jsonschema, through SmolLM2's own tokens."""
    schema = SCHEMAS[name]
    fmt = formats.json_schema(schema, name)
    vocab = 49152
    for seed in range(6):
        sampler = Sampler(SamplingOptions(temperature=2.0, top_k=0, seed=seed), vocab,
                          Constraint(fmt, smol_tokenizer, vocab))
        tokens = []
        for _ in range(400):
            token = sampler(randn(rng, vocab) * np.float32(4))
            if token in smol_tokenizer.eos_ids:
                break
            tokens.append(token)
        else:
            pytest.fail(f"{name}, seed {seed}: no end of sequence in 400 steps: {smol_tokenizer.decode(tokens)!r}")
        assert sampler.constraint.complete
        jsonschema.validate(json.loads(smol_tokenizer.decode(tokens)), schema)


def test_a_token_against_the_grammar_is_an_error_not_text(smol_tokenizer):
    from nerva_cli.errors import NervaError

    constraint = Constraint(formats.json_object("--format json"), smol_tokenizer, 49152)
    with pytest.raises(NervaError, match="sampled against the grammar"):
        constraint.take(smol_tokenizer.tok.token_to_id("hello"))


# -- SmolLM2's own answers ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_engine(smollm2_store):
    from nerva_cli.runtime.open_engine import open_engine
    from nerva_cli.runtime.options import EngineOptions

    engine, tokenizer = open_engine(str(smollm2_store["q4_1"].path), EngineOptions(backend="cpu", ctx=1024))
    yield engine, tokenizer
    engine.close()


PROMPTS = {"types": "Give an example record with a string, numbers, a boolean and a null.",
           "enum": "What colour is the sky? Answer in JSON.", "nested": "Where does Ada live? Answer in JSON.",
           "array_bounds": "Tag this text: cats are great pets.", "number_bounds": "A player and their score.",
           "any_of_ref": "A point on a grid, as JSON."}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_smollm2_answers_validate_at_every_seed(smol_engine, name):
    from nerva_cli.runtime.chat import ChatSession

    engine, tokenizer = smol_engine
    schema = SCHEMAS[name]
    fmt = formats.json_schema(schema, name)
    for seed in (1, 2, 3):
        session = ChatSession(engine, tokenizer, SamplingOptions(seed=seed), max_tokens=200, fmt=fmt)
        parts = []
        stats = session.answer(PROMPTS[name], parts.append)
        text = "".join(parts)
        assert stats.stop_reason == "eos" and not stats.cut_short, (seed, stats.stop_reason, text)
        jsonschema.validate(json.loads(text), schema)


def test_a_seed_repeats_its_constrained_answer(smol_engine):
    from nerva_cli.runtime.chat import ChatSession

    engine, tokenizer = smol_engine
    fmt = formats.json_object("--format json")
    answers = []
    for _ in range(2):
        session = ChatSession(engine, tokenizer, SamplingOptions(seed=7), max_tokens=60, fmt=fmt)
        parts = []
        session.answer("Describe a cat as JSON.", parts.append)
        answers.append("".join(parts))
    assert answers[0] == answers[1] and answers[0].startswith("{")


def test_run_format_and_grammar_from_the_command_line(smollm2_store, cli, tmp_path):
    model = str(smollm2_store["q4_1"].path)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMAS["nested"]))
    code, out, err = cli("run", model, "-p", "Where does Ada live?", "--format", str(schema), "--seed", "1",
                         "--no-server")
    assert code == 0, err
    jsonschema.validate(json.loads(out), SCHEMAS["nested"])
    yes_no = tmp_path / "yn.gbnf"
    yes_no.write_text('root ::= "yes" | "no"\n')
    code, out, err = cli("run", model, "-p", "Is water wet?", "--grammar", str(yes_no), "--no-server")
    assert code == 0 and out.strip() in ("yes", "no"), (out, err)
    # fails closed: before any token, exit 1 for what the engine refuses, 2 for a flag's bad value
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "strnig"}')
    code, out, err = cli("run", model, "-p", "Hi", "--format", str(bad), "--no-server")
    assert (code, out) == (1, "") and err.strip() == f"error: {bad}: the JSON Schema cannot be held to: Invalid type: strnig"
    code, out, err = cli("run", model, "-p", "Hi", "--format", "xml", "--no-server")
    assert (code, out) == (2, "") and "--format takes json" in err
    # cut by --max-tokens inside a value: said, and exit 1, never taken for JSON
    story = tmp_path / "story.json"
    story.write_text(json.dumps({"type": "object", "properties": {"story": {"type": "string", "minLength": 300}},
                                 "required": ["story"]}))
    code, out, err = cli("run", model, "-p", "Tell a story", "--format", str(story), "-n", "8", "--no-server")
    assert code == 1 and out.startswith('{"story": "')
    assert "stopped at --max-tokens (8) before its JSON Schema was complete" in err


def test_the_ledger_shows_the_masks_time(smollm2_store, cli, tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    code, _, err = cli("run", str(smollm2_store["q4_1"].path), "-p", "A cat as JSON", "--format", "json", "-n", "12",
                       "--ledger-file", str(ledger), "--seed", "1")
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert rows and all(r["mask_us"] is not None and 0 < r["mask_us"] <= r["sample_us"] for r in rows), err
    code, _, _ = cli("run", str(smollm2_store["q4_1"].path), "-p", "Hi", "-n", "3", "--ledger-file", str(ledger))
    assert all(json.loads(line)["mask_us"] is None for line in ledger.read_text().splitlines())
