"""How `nerva run` takes its one prompt: -p (llama.cpp's way) or the words after the model
(ollama's: `nerva run smollm2-135m Why is the sky blue?`)."""

from __future__ import annotations

from nerva_cli.store.pull import pull


def test_the_words_after_the_model_are_the_prompt_as_with_p(tiny_models, cli, tmp_path):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    greedy = ["-n", "6", "--temperature", "0", "--raw", "--no-profile", "--ctx", "64", "--backend", "cpu"]
    code, with_p, err = cli("run", model.path, "-p", "the quick brown fox", *greedy)
    assert code == 0, err
    code, with_words, err = cli("run", model.path, "the", "quick", "brown", "fox", *greedy)
    assert code == 0, err
    code, other, err = cli("run", model.path, "-p", "a license", *greedy)
    assert code == 0, err
    # the same answer, and not one every prompt gets (the tiny model's greedy text depends on it)
    assert with_words == with_p and with_p.strip() and other != with_p


def test_a_ctx_past_the_models_is_cut_to_it_with_a_note(tiny_models, cli, tmp_path):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    most = model.config.max_context
    code, out, err = cli("run", model.path, "-p", "hi", "-n", "2", "--no-profile", "--ctx", str(most + 1), "-v")
    assert code == 0, err
    assert f"note: --ctx {most + 1} is past the {most} tokens" in err and f"using {most}" in err
    assert "loaded in " in err and "answer 2 tok" in err  # --verbose: the load time, then the answer's


def test_piped_text_comes_before_the_words_as_in_ollama_and_p_reads_no_stdin(tiny_models, cli, tmp_path,
                                                                            monkeypatch):
    from nerva_cli.runtime.chat import ChatSession

    asked = []
    answer = ChatSession.answer
    monkeypatch.setattr(ChatSession, "answer",
                        lambda self, text, write: asked.append(text) or answer(self, text, write))
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    args = ["-n", "2", "--no-profile", "--ctx", "128"]
    assert cli("run", model.path, "summarise", "this", *args, stdin="the quick brown fox\n")[0] == 0
    assert cli("run", model.path, "summarise", "this", *args, stdin="")[0] == 0
    assert cli("run", model.path, "-p", "summarise this", *args, stdin="not read")[0] == 0
    assert cli("run", model.path, *args, stdin="all of it\n")[0] == 0
    assert asked == ["the quick brown fox\n\nsummarise this", "summarise this", "summarise this", "all of it\n"]


def test_bytes_that_are_not_utf8_become_replacement_characters(tiny_models, cli, tmp_path):
    """Python keeps undecodable stdin or argv bytes as lone surrogates, which the tokenizer
    refused with a TypeError traceback; they are read as U+FFFD."""
    from nerva_cli.store.tokenizer import open_tokenizer

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    latin1 = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")
    args = ["-n", "2", "--no-profile", "--ctx", "128"]
    assert cli("run", model.path, *args, stdin=latin1)[0] == 0
    assert cli("run", model.path, "-p", latin1, *args)[0] == 0
    tok = open_tokenizer(model.path)
    assert tok.encode(latin1) == tok.encode("caf\ufffd au lait") and tok.encode("a\ud800b") == tok.encode("a\ufffdb")


def test_an_answer_stopped_by_ctrl_c_exits_130_after_what_it_wrote(tiny_models, cli, tmp_path, monkeypatch):
    from nerva_cli.planes.cpu.engine import Engine

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    decode, calls = Engine.decode, []

    def interrupted_at_the_third(self, token):
        calls.append(token)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return decode(self, token)

    monkeypatch.setattr(Engine, "decode", interrupted_at_the_third)
    code, out, err = cli("run", model.path, "-p", "the quick brown fox", "-n", "20", "--no-profile", "--ctx", "128",
                         "-v", "--temperature", "0")
    assert code == 130 and "stop: interrupted" in err and out.strip(), (code, out, err)


def test_a_model_without_a_chat_template_takes_the_prompt_as_it_is(tiny_models, cli, tmp_path):
    import json
    import shutil

    src = tmp_path / "base"
    shutil.copytree(tiny_models("llama"), src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    model = pull(str(src), variant="q4_0", out=tmp_path / "m")
    greedy = ["-n", "4", "--temperature", "0", "--no-profile", "--ctx", "64"]
    code, out, err = cli("run", model.path, "-p", "the quick brown fox", *greedy)
    assert code == 0 and "has no chat template: prompts go to it as they are (--raw)" in err, err
    assert out == cli("run", model.path, "-p", "the quick brown fox", "--raw", *greedy)[1]


def test_an_alias_with_a_variant_is_pulled_at_that_variant(monkeypatch):
    import pytest

    from nerva_cli.errors import NervaError
    from nerva_cli.runtime import open_engine as runtime

    pulled = []
    monkeypatch.setattr(runtime, "_pull_reported", lambda *args, **kw: pulled.append(args[:2]) or "pulled")
    assert runtime.find_or_pull("smollm2-135m:F16") == "pulled"  # the store is empty
    assert pulled == [("smollm2-135m", "f16")]
    with pytest.raises(NervaError, match="unknown variant 'q9'"):
        runtime.find_or_pull("smollm2-135m:q9")
    with pytest.raises(NervaError, match="model 'elsewhere' is not in the store"):
        runtime.find_or_pull("elsewhere:q4_0")


def test_pull_takes_an_alias_variant_as_a_tag(monkeypatch, cli):
    from nerva_cli.cli import store_commands

    pulled = []
    monkeypatch.setattr(store_commands, "_pull", lambda *args, **kw: pulled.append(args[:2]))
    assert cli("pull", "smollm2-135m:F16")[0] == 0 and pulled == [("smollm2-135m", "f16")]
    code, _, err = cli("pull", "smollm2-135m:f16", "--quant", "q4_0")
    assert code == 2 and "name two variants" in err and len(pulled) == 1


def test_kernels_compile_ahead_once_for_each_kind_of_model(tiny_models, cli, tmp_path, monkeypatch):
    """A decode's kernels compile before the answer (Engine.warm_up) the first time a kind of
    model runs here (its variant, precisions, paging, KV cache type), not on every run."""
    import shutil
    from pathlib import Path

    import numba

    from nerva_cli.planes.cpu import kernels as cpu
    from nerva_cli.planes.cpu.engine import Engine

    shutil.rmtree(cpu.warm_marker("x").parent, ignore_errors=True)  # markers of earlier tests
    warmed, warm_up = [], Engine.warm_up
    monkeypatch.setattr(Engine, "warm_up",
                        lambda self, aside, also, **kw: warmed.append(self.kernel_kinds()) or warm_up(self, aside, also, **kw))
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    exact = pull(str(tiny_models("llama")), variant="f16", out=tmp_path / "f16")  # exact: kernels of its own kinds
    args = ["-p", "hi", "-n", "2", "--no-profile", "--ctx", "64"]
    for path, extra in ((model.path, []), (model.path, []), (model.path, ["--kv-cache", "f32"]),
                        (model.path, ["--kv-cache", "f32"]), (model.path, ["--precision", "w4a8"]),
                        (exact.path, []), (exact.path, [])):
        assert cli("run", path, *args, *extra)[0] == 0
    assert len(warmed) == 4 and len(set(warmed)) == 4, warmed
    assert cpu.warm_marker("x").parent.parent == Path(numba.config.CACHE_DIR)  # cleared with numba's cache


def test_an_answer_the_context_cuts_short_says_so_and_one_max_tokens_cuts_does_not(tiny_models, cli, tmp_path):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    args = ["-p", "the quick brown fox", "--raw", "--temperature", "0", "--no-profile", "--ctx", "32", "-v"]
    code, out, err = cli("run", model.path, *args, "-n", "40")
    assert code == 0, err
    assert "stop: context" in err and "note: the answer stopped at the end of the context (32 tokens)" in err, err
    code, out, err = cli("run", model.path, *args, "-n", "3")
    assert code == 0 and "stop: length" in err and "end of the context" not in err, err


def test_running_a_gguf_path_converts_it_once_and_again_when_it_changes(tiny_models, cli, tmp_path):
    from test_convert import write_q4_gguf

    from nerva_cli.store.catalog import list_models

    path = tmp_path / "tiny-run.Q4_0.gguf"
    write_q4_gguf(path, tiny_models("llama"))
    args = ["-p", "the quick brown fox", "--raw", "-n", "2", "--temperature", "0", "--no-profile", "--ctx", "64"]
    code, first, err = cli("run", path, *args)
    assert code == 0 and "not in the store yet: pulling it" in err, err
    code, again, err = cli("run", path, *args)
    assert code == 0 and again == first and "pulling" not in err and "converting" not in err, err
    write_q4_gguf(path, tiny_models("llama"), seed=2)  # other weights, same path
    code, out, err = cli("run", path, *args)
    assert code == 0 and "changed since tiny-run:q4_0 was converted from it: converting it again" in err, err
    assert [f"{m.name}:{m.variant}" for m in list_models()] == ["tiny-run:q4_0"]
    code, last, err = cli("run", path, *args)
    assert code == 0 and last == out and "converting" not in err, err
