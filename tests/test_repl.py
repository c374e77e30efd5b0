"""The chat's commands and its context handling: ChatSession over a real engine on a tiny model,
and the slash commands of nerva_cli.cli.repl, which must change what the next answer uses."""

from __future__ import annotations

import pytest

from nerva_cli.runtime.chat import ChatSession
from nerva_cli.planes.cpu.engine import Engine
from nerva_cli.errors import NervaError
from nerva_cli.store.pull import pull
from nerva_cli.cli.repl import _precisions, command, info, read_message
from nerva_cli.runtime.sampling import SamplingOptions
from nerva_cli.store.tokenizer import open_tokenizer

# the roles must alternate user/assistant after an optional system message, as many Hub
# templates demand (they raise_exception otherwise): dropping old turns must keep them so
STRICT = ("{% for m in messages %}{% if m['role'] != 'system' and (m['role'] == 'user') != "
          "(loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) %}"
          "{{ raise_exception('roles must alternate') }}{% endif %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
          "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture
def session(tiny_models, tmp_path):
    def make(ctx=96, max_tokens=6, system=None, raw=False):
        model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
        engine = Engine(model, ctx=ctx)
        tok = open_tokenizer(model.path)
        tok.template = STRICT
        notes = []
        s = ChatSession(engine, tok, SamplingOptions(temperature=0), max_tokens=max_tokens, system=system,
                        raw=raw, note=notes.append)
        return s, notes
    return make


def quiet(_text):
    pass


def test_old_turns_are_dropped_whole_and_the_system_message_stays(session):
    s, notes = session(ctx=96, max_tokens=6, system="be brief")
    words = "the quick brown fox jumps over the lazy dog"
    for _ in range(12):
        s.answer(words, quiet)  # renders through STRICT: a broken alternation would raise here
    assert notes, "a 96-token context cannot hold 12 turns: older ones must have been dropped"
    assert s.messages[0] == {"role": "system", "content": "be brief"}
    roles = [m["role"] for m in s.messages[1:]]
    assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) >= 2
    assert s.engine.n_past <= s.engine.ctx


def test_a_message_that_cannot_fit_leaves_the_conversation_as_it_was(session):
    s, _ = session(ctx=160)
    s.answer("the quick brown fox", quiet)
    before = list(s.messages)
    with pytest.raises(NervaError, match="context holds 160: raise --ctx"):
        s.answer("fox " * 200, quiet)
    assert s.messages == before
    s.answer("the lazy dog", quiet)  # and the chat goes on
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]


def test_raw_one_prompt_too_long_says_raise_ctx(session):
    s, _ = session(ctx=32, raw=True)
    with pytest.raises(NervaError, match="the prompt takes .* tokens and the context holds 32: raise --ctx"):
        s.answer("fox " * 100, quiet)


def test_set_parameter_changes_the_sampler_and_rejects_bad_values(session):
    s, _ = session()
    command(s, "/set parameter temperature 0.5", quiet)
    command(s, "/set parameter top_k 7", quiet)
    command(s, "/set parameter seed 11", quiet)
    command(s, "/set parameter min_p 0.05", quiet)
    command(s, "/set parameter num_predict 3", quiet)
    command(s, "/set parameter stop </s> END", quiet)
    assert (s.opts.temperature, s.opts.top_k, s.opts.seed, s.opts.min_p) == (0.5, 7, 11, 0.05)
    assert s.sampler.o is s.opts and s.max_tokens == 3 and s.stops == ["</s>", "END"]
    stats = s.answer("the quick brown fox", quiet)
    assert stats.gen_tokens <= 3
    for bad, why in [("/set parameter temperature -1", "a number >= 0"), ("/set parameter top_k x", "not an integer"),
                     ("/set parameter top_p 2", r"\(0, 1\]"), ("/set parameter min_p 1.5", r"\[0, 1\]"),
                     ("/set parameter temperature nan", "a number >= 0"), ("/set parameter num_predict 0", ">= 1"),
                     ("/set parameter warmth 1", "unknown parameter 'warmth'"), ("/set parameter seed", "one value"),
                     ("/frobnicate", "unknown command"), ("/show", "/show info, parameters, system or template"),
                     ("/set temperature 1", "/set parameter NAME VALUE")]:
        with pytest.raises(NervaError, match=why):
            command(s, bad, quiet)
    assert (s.opts.temperature, s.opts.top_k) == (0.5, 7)  # a refused value changed nothing


def test_set_system_replaces_the_system_message_and_show_tells_it(session):
    s, _ = session(system="first")
    s.answer("the quick brown fox", quiet)
    command(s, "/set system talk like a pirate", quiet)
    assert s.messages[0] == {"role": "system", "content": "talk like a pirate"} and len(s.messages) == 3
    command(s, "/set system", quiet)
    assert s.messages[0]["role"] == "user" and s.system is None
    shown = []
    command(s, "/show parameters", shown.append)
    assert "temperature     0\n" in shown[0] and "seed            random\n" in shown[0]
    command(s, "/set system be brief", quiet)
    command(s, "/show system", shown.append)
    command(s, "/show template", shown.append)
    assert shown[1:] == ["be brief\n", STRICT + "\n"]  # ollama's /show system and /show template
    rows = dict(info(s, "cpu, 2 threads"))
    assert rows["backend"] == "cpu, 2 threads"
    assert rows["context"].startswith(f"{s.engine.n_past} of 96 tokens")
    assert rows["precision"] == f"{s.engine.precision} on all 3 layers"
    assert command(s, "/bye", quiet) == "bye"


def test_set_format_holds_the_next_answers_and_noformat_frees_them(session):
    """ollama's /set format json (here any --format value) and /set noformat: each answer after
    the command, and only those, held to the format; a bad one is refused and changes nothing."""
    import json

    s, _ = session(max_tokens=40)
    command(s, '/set format {"enum": ["yes", "no"]}', quiet)
    out = []
    stats = s.answer("the quick brown fox", out.append)
    assert stats.stop_reason == "eos" and json.loads("".join(out)) in ("yes", "no")
    shown = []
    command(s, "/show parameters", shown.append)
    assert "format          JSON Schema from --format" in shown[0]
    with pytest.raises(NervaError, match="the JSON Schema cannot be held to"):
        command(s, '/set format {"type": "strnig"}', quiet)
    assert s.format is not None and s.format.schema == {"enum": ["yes", "no"]}
    command(s, "/set noformat", quiet)
    out.clear()
    s.answer("the quick brown fox", out.append)
    assert s.format is None and s.sampler.constraint is None


@pytest.mark.parametrize("lines,want", [
    (['"""one', "two", 'three"""'], "one\ntwo\nthree"),
    (['"""', "a", '"""'], "a"),
    (['"""single"""'], "single"),
    (["plain line"], "plain line"),
])
def test_read_message_joins_a_triple_quoted_block(lines, want):
    feed = iter(lines)
    assert read_message(lambda prompt: next(feed)) == want


def test_precisions_names_the_smaller_groups_layer_by_layer():
    assert _precisions({0: "w4a8", 1: "w4a16", 2: "w4a8", 3: "w4a8"}, 4) == "w4a16 on 1; w4a8 on the other 3"
    assert (_precisions({0: "w4a8", 2: "w4a16", 3: "w4a16"}, 5)
            == "w4a8 on 0; w4a16 on the other 2; 2 layers skipped (hot-only)")


def _mark_warm(engine):
    marker = engine.k.warm_marker(engine.kernel_kinds())
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def test_the_warm_up_while_typing_leaves_the_first_answer_as_it_was(session):
    """The chat's warm-up runs the engine in a thread of its own before the first message; the
    answer after it must be the one an engine that never warmed up gives, token for token."""
    from nerva_cli.cli.run_command import _warm_up_while_typing

    first, _ = session()
    texts = []
    for warm in (False, True):
        s = ChatSession(Engine(first.engine.model, ctx=first.engine.ctx), first.tok, SamplingOptions(temperature=0),
                        max_tokens=6)
        if warm:
            _mark_warm(s.engine)  # as the CLI's compile-ahead leaves it
            ready = _warm_up_while_typing(s.engine, s.tok, 1, template=True)
            assert ready is not None
            ready()
            assert s.engine.n_past == 0
        answer = []
        s.answer("the quick brown fox", answer.append)
        texts.append("".join(answer))
    assert texts[0] == texts[1] and texts[0]


def test_the_warm_up_while_typing_raises_its_failure_once(session, monkeypatch):
    from nerva_cli.cli.run_command import _warm_up_while_typing

    s, _ = session()

    def broken(**_):
        raise NervaError("warm-up failed")

    monkeypatch.setattr(s.engine, "warm_up", broken)
    _mark_warm(s.engine)
    ready = _warm_up_while_typing(s.engine, s.tok, 1, template=False)
    ready(quiet=True)  # leaving the chat never raises
    with pytest.raises(NervaError, match="warm-up failed"):
        ready()
    ready()  # the chat goes on after the one error line


def test_no_warm_up_while_typing_for_a_paged_engine(tiny_models, tmp_path):
    from nerva_cli.cli.run_command import _warm_up_while_typing

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    fixed = sum(b.nbytes for b in Engine(model, ctx=64).plan.fixed)  # plus two staging slots: every layer paged
    engine = Engine(model, ctx=64, ram_budget=fixed + 2 * model.meta["files"]["layer_000.bin"]["size"])
    assert engine.plan.paged_layers
    try:
        assert _warm_up_while_typing(engine, open_tokenizer(model.path), 1, template=False) is None
    finally:
        engine.weights.close()


def test_no_warm_up_while_typing_where_it_would_compile(session, monkeypatch, tmp_path):
    """Without the warm marker (a `-n 1` chat's first run compiled no decode kernels) the warm-up
    would compile them while the first message waits: there is none."""
    from nerva_cli.cli.run_command import _warm_up_while_typing

    s, _ = session()
    monkeypatch.setattr(s.engine.k, "warm_marker", lambda kinds: tmp_path / "never-warmed")
    assert _warm_up_while_typing(s.engine, s.tok, 1, template=False) is None
