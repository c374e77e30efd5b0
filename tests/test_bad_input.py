"""Every malformed source: one line naming the file and the problem, exit 1, nothing left behind;
every bad flag value: one line naming the flag, exit 2 (a usage error, as the README says)."""

from __future__ import annotations

import errno
import json
import shutil
import struct

import numpy as np
import pytest

from nerva_cli.store.catalog import models_root


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_header(path, edit):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])


def first_matrix(header):
    return next(k for k in header if k.endswith("q_proj.weight"))


def assert_refused(cli, args, *needles, code=1):
    """`nerva ARGS` refused with one "error:" line holding every needle, exit `code` (1: a file, a
    model, the machine; 2: the command line itself), and nothing left in the store."""
    expected, (code, out, err) = code, cli(*args)
    assert code == expected, (code, out, err)
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("converting ")]  # progress
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in err
    root = models_root()
    leftovers = list(root.rglob("*")) if root.exists() else []
    assert leftovers == [], leftovers


def test_truncated_safetensors(tmp_path, tiny_models, cli):
    d = copy_model(tiny_models("llama"), tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    assert_refused(cli, ["convert", d], "model.safetensors", "truncated")


def test_safetensors_header_runs_past_file(tmp_path, tiny_models, cli):
    d = copy_model(tiny_models("llama"), tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 10 ** 7) + f.read_bytes()[8:100])
    assert_refused(cli, ["convert", d], "model.safetensors", "runs past")


def test_safetensors_overlapping_offsets(tmp_path, tiny_models, cli):
    d = copy_model(tiny_models("llama"), tmp_path / "m")

    def overlap(h):
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        a, b = names[3], names[4]
        size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        start = h[a]["data_offsets"][0]
        h[b]["data_offsets"] = [start, start + size]

    rewrite_header(d / "model.safetensors", overlap)
    assert_refused(cli, ["convert", d], "model.safetensors", "overlap")


def test_safetensors_unknown_dtype(tmp_path, tiny_models, cli):
    d = copy_model(tiny_models("llama"), tmp_path / "m")
    rewrite_header(d / "model.safetensors", lambda h: h[first_matrix(h)].update(dtype="I32"))
    assert_refused(cli, ["convert", d], "model.safetensors", "I32")


def test_shape_disagrees_with_config(tmp_path, tiny_models, cli):
    d = copy_model(tiny_models("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    assert_refused(cli, ["convert", d], "gate", "shape")


def test_unsupported_architecture(tmp_path, tiny_models, cli):
    d = copy_model(tiny_models("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    assert_refused(cli, ["convert", d], "config.json", "gpt_neox", "supported: llama")


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json"])
def test_missing_config_or_tokenizer(tmp_path, tiny_models, cli, missing):
    d = copy_model(tiny_models("llama"), tmp_path / "m")
    (d / missing).unlink()
    assert_refused(cli, ["convert", d], missing, "missing")


def test_gguf_bad_magic(tmp_path, cli):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"GGML" + bytes(100))
    assert_refused(cli, ["convert", f], "bad.gguf", "magic")


def test_gguf_tensor_in_a_type_nerva_cannot_read(tmp_path, tiny_models, cli):
    """A layer matrix of float64 (a GGUF type no llama.cpp quantiser writes): the tensor and its type."""
    from test_convert import write_q4_gguf

    f = tmp_path / "odd.gguf"
    write_q4_gguf(f, tiny_models("llama"), as_given={"blk.0.attn_q.weight": np.ones((64, 64))})
    assert_refused(cli, ["convert", f], "odd.gguf", "'blk.0.attn_q.weight' has type F64", "supported: ")


def test_gguf_whose_tokenizer_does_not_build(tmp_path, tiny_models, cli):
    """A merge naming a token the vocabulary lacks (a damaged header): the file, one line."""
    from test_convert import write_q4_gguf

    f = tmp_path / "damaged.gguf"
    write_q4_gguf(f, tiny_models("llama"))
    data = bytearray(f.read_bytes())
    tok = json.loads((tiny_models("llama") / "tokenizer.json").read_text())
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    merge = next(m for m in merges if m.isascii() and m[0].isalpha())
    at = data.index(merge.encode(), data.index(b"tokenizer.ggml.merges"))
    data[at] = 0x7F  # DEL: byte-level vocabularies spell that byte otherwise, so no token starts with it
    f.write_bytes(bytes(data))
    assert_refused(cli, ["convert", f], "damaged.gguf", "tokenizer does not build")


def test_gguf_cut_short(tmp_path, cli):
    from conftest import smollm2_gguf

    f = tmp_path / "short.gguf"
    with open(smollm2_gguf(), "rb") as src:
        f.write_bytes(src.read(5_000_000))
    assert_refused(cli, ["convert", f], "short.gguf", "cut short")


def test_unknown_quant(tiny_models, cli):
    assert_refused(cli, ["convert", tiny_models("llama"), "--quant", "q5_0"], "--quant q5_0", "auto, q4_0, q4_1", code=2)


def test_unknown_kv_cache_type(tiny_models, cli, tmp_path):
    from nerva_cli.store.pull import pull

    model = pull(str(tiny_models("llama")), variant="f16", out=tmp_path / "m")
    assert_refused(cli, ["run", model.path, "-p", "hi", "--kv-cache", "q8", "--backend", "cpu"],
                   "--kv-cache q8", "f16, f32", code=2)


def test_a_prompt_given_twice(tiny_models, cli, tmp_path):
    from nerva_cli.store.pull import pull

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    assert_refused(cli, ["run", model.path, "why", "blue", "-p", "hi", "--no-profile"], "-p", "'why blue'", code=2)


@pytest.mark.parametrize("option,needle", [
    (["--ctx", "0"], "--ctx must be >= 1"), (["--ctx", "-5"], "--ctx must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"), (["--threads", "100000"], "--threads must be at most"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--temperature", "inf"], "--temperature must be a number >= 0"),
    (["--repeat-penalty", "nan"], "--repeat-penalty must be a number > 0"),
    (["--min-p", "-0.1"], "--min-p must be in [0, 1]"), (["--repeat-last-n", "-1"], "--repeat-last-n must be >= 0"),
    (["--max-tokens", "-1"], "--max-tokens must be >= 1"), (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--tau", "2"], "--tau must be between 0 and 1"), (["--active-fraction", "0"], "--active-fraction must be in"),
    (["--mode", "cold"], "--mode cold: choose full or hot-only"), (["--precision", "w8a8"], "--precision w8a8"),
    (["--mode", "hot-only"], "--mode hot-only picks layers by their MCAP score"),
    (["--backend", "tpu"], "--backend tpu: choose one of"), (["--policy", "fifo"], "--policy fifo: choose one of"),
    (["--ram-budget", "lots"], "--ram-budget 'lots': expected a size"),
    (["--vram-budget", "-2G"], "--vram-budget '-2G': expected a size"),
    (["--ledger-every", "0"], "--ledger-every must be >= 1"),
    (["--raw", "--system", "be brief"], "--system goes into the chat template")])
def test_run_refuses_an_out_of_range_option(tiny_models, cli, tmp_path, option, needle):
    """A bad flag value is a usage error: exit 2, as for a flag typer cannot parse, one line naming it."""
    from nerva_cli.store.pull import pull

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    assert_refused(cli, ["run", model.path, "-p", "hi", "--no-profile", *option], needle, code=2)


def test_run_with_no_prompt_on_an_empty_stdin_is_an_input_error(tiny_models, cli, tmp_path):
    """Not a flag's value but the input (stdin, the fixture's, empty): exit 1."""
    from nerva_cli.store.pull import pull

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    assert_refused(cli, ["run", model.path, "--no-profile"], "held no prompt")


def test_a_flag_typer_cannot_parse_exits_2_too(cli):
    code, _, err = cli("run", "smollm2-135m", "-p", "hi", "--max-tokens", "many")
    assert code == 2 and "--max-tokens" in err, err


@pytest.mark.parametrize("args,needle", [
    (["--keep-alive", "soon"], "--keep-alive 'soon': not a duration"), (["--parallel", "0"], "--parallel must be >= 1"),
    (["--port", "70000"], "--port must be from 0 to 65535"), (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--cors", "example.com"], "--cors 'example.com'"), (["--api-key", " "], "--api-key is empty"),
    (["--ctx", "0"], "--ctx must be >= 1"), (["--threads", "0"], "--threads must be >= 1"),
    (["--ram-budget", "lots"], "--ram-budget 'lots'"), (["--prompt-cache", "auto"], "--prompt-cache 'auto'"),
    (["--prompt-cache", "-1G"], "--prompt-cache '-1G'")])
def test_serve_refuses_a_bad_flag_value_before_it_listens(cli, args, needle):
    assert_refused(cli, ["serve", *args], needle, code=2)


@pytest.mark.parametrize("args,needle", [
    (["pull", "smollm2-135m:f16", "--quant", "q4_0"], "name two variants"),
    (["pull", "smollm2-135m", "--quant", "q5_0"], "--quant q5_0"),
    (["profile", "smollm2-135m", "--backend", "tpu"], "--backend tpu"),
    (["topology", "--tau", "-1"], "--tau must be between 0 and 1"),
    (["bench", "smollm2-135m", "--repeat", "0"], "--repeat must be >= 1")])
def test_other_commands_refuse_a_bad_flag_value_with_2(cli, args, needle):
    assert_refused(cli, args, needle, code=2)


@pytest.mark.parametrize("option,needle", [
    (["--ppl-ctx", "1", "--ppl", "TEXT"], "--ppl-ctx must be >= 2"),
    (["--ppl", "MISSING"], "No such file"), (["--ppl", "EMPTY"], "no text for a perplexity"),
    (["--repeat", "0"], "must be >= 1"), (["--concurrency", "0"], "--concurrency must be >= 1")])
def test_bench_refuses_bad_options_before_it_runs(tiny_models, cli, tmp_path, option, needle):
    """A bad value exits 2, a file that is missing or holds no text 1."""
    from nerva_cli.store.pull import pull

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    files = {"TEXT": tmp_path / "t.txt", "MISSING": tmp_path / "none.txt", "EMPTY": tmp_path / "e.txt"}
    files["TEXT"].write_text("the quick brown fox jumps over the lazy dog " * 20)
    files["EMPTY"].write_text("")
    args = [str(files.get(a, a)) for a in option]
    by_file = option[-1] in ("MISSING", "EMPTY")
    assert_refused(cli, ["bench", model.path, "--no-profile", "--prompt-tokens", "8", "--gen-tokens", "4", *args],
                   needle, *([str(files[option[-1]])] if by_file else []), code=1 if by_file else 2)


def test_target_exists_needs_force(tiny_models, cli):
    src = tiny_models("llama")
    assert cli("convert", src, "--name", "tiny", "--quant", "f16")[0] == 0
    before = (models_root() / "tiny" / "f16" / "metadata.json").read_text()
    code, _, err = cli("convert", src, "--name", "tiny", "--quant", "f16")
    assert code == 1 and "already exists" in err and "--force" in err
    assert (models_root() / "tiny" / "f16" / "metadata.json").read_text() == before
    assert cli("convert", src, "--name", "tiny", "--quant", "f16", "--force")[0] == 0
    assert sorted(p.name for p in (models_root() / "tiny").iterdir()) == ["f16"]


def test_pull_keeps_a_model_already_in_the_store_and_force_converts_it_again(tiny_models, cli):
    src = tiny_models("llama")
    assert cli("pull", src, "--name", "tiny", "--quant", "q4_0")[0] == 0
    meta = models_root() / "tiny" / "q4_0" / "metadata.json"
    before = meta.stat().st_mtime_ns
    code, out, err = cli("pull", src, "--name", "tiny", "--quant", "q4_0")  # a script's pull before each run
    assert code == 0 and "already in the store: kept" in err and "tiny:q4_0" in out
    assert meta.stat().st_mtime_ns == before
    assert cli("pull", src, "--name", "tiny", "--quant", "q4_0", "--force")[0] == 0
    assert meta.stat().st_mtime_ns != before


def test_a_relative_source_is_named_in_full_and_a_variant_in_any_case(tiny_models, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no config.json here
    assert_refused(cli, ["convert", "."], f"{tmp_path.resolve()}/config.json: missing")
    assert cli("pull", tiny_models("llama"), "--name", "tiny", "--quant", "q4_0")[0] == 0
    code, out, _ = cli("show", "tiny:Q4_0", "--json")
    assert code == 0 and '"variant": "q4_0"' in out


def test_no_space_left(tiny_models, cli, monkeypatch):
    from nerva_cli.store import catalog as store

    real = store.LayerFileWriter._write
    calls = {"n": 0}

    def full_disk(self, data):
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(store.LayerFileWriter, "_write", full_disk)
    assert_refused(cli, ["convert", tiny_models("llama"), "--name", "tiny"], "no space left")


def test_interrupted_convert_leaves_nothing(tiny_models, monkeypatch):
    from nerva_cli.store import convert as convert_mod
    from nerva_cli.store.pull import pull

    def interrupt(what, done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull(str(tiny_models("llama")), name="tiny", progress=interrupt)
    assert not (models_root() / "tiny").exists()
    assert convert_mod  # the module under test


def test_a_convert_that_another_process_finished_first_keeps_its_copy(tiny_models, cli):
    """Two `pull`s of one model at once both find it missing; the one that finishes second keeps
    the first's directory (a run may be reading it) and drops its own."""
    from nerva_cli.store.pull import pull

    assert cli("pull", tiny_models("llama"), "--name", "first", "--quant", "q4_0")[0] == 0
    target = models_root() / "tiny" / "q4_0"

    def the_other_process_finishes(what, done, total):
        if what == "done":
            shutil.copytree(models_root() / "first" / "q4_0", target)
            (target / "theirs").write_text("")

    model = pull(str(tiny_models("llama")), name="tiny", variant="q4_0", progress=the_other_process_finishes,
                 keep_existing=True)
    assert (target / "theirs").exists() and model.path == target
    assert sorted(p.name for p in target.parent.iterdir()) == ["q4_0"]  # no temporary directory left


def test_a_broken_store_entry_is_reported_not_pulled_over(tiny_models, cli):
    """An alias whose store entry's metadata.json is broken: the file and the way out, where the
    run once took the entry for missing and pulled, to fail on the directory it found."""
    assert cli("convert", tiny_models("llama"), "--name", "smollm2-135m", "--quant", "q4_0")[0] == 0
    meta = models_root() / "smollm2-135m" / "q4_0" / "metadata.json"
    meta.write_text("{bad")
    code, out, err = cli("run", "smollm2-135m:q4_0", "-p", "hi", "-n", "1", "--no-profile")
    assert code == 1 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert str(meta) in err and "not valid JSON" in err and "`nerva rm smollm2-135m:q4_0`" in err, err
    assert meta.read_text() == "{bad" and sorted(p.name for p in meta.parent.parent.iterdir()) == ["q4_0"]


def test_a_config_the_model_checks_refuse_names_its_file(tmp_path, tiny_models, cli):
    """ModelConfig's own checks (here num_heads not a multiple of num_kv_heads) name config.json."""
    d = copy_model(tiny_models("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    code, _, err = cli("convert", d)
    assert code == 1 and f"{d / 'config.json'}: num_heads 4 is not a multiple of num_kv_heads 3" in err, err


# -- filesystem errors on a path the user gave: one line naming it (issue 49.5) --------------------
@pytest.mark.parametrize("where", ["directory", "missing directory"])
def test_a_ledger_file_that_cannot_be_written(tiny_models, cli, tmp_path, where):
    from nerva_cli.store.pull import pull

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    path = tmp_path if where == "directory" else tmp_path / "no-such-dir" / "ledger.jsonl"
    why = "is a directory" if where == "directory" else f"no directory {tmp_path / 'no-such-dir'}"
    assert_refused(cli, ["run", model.path, "-p", "hi", "-n", "2", "--no-profile", "--backend", "ref",
                         "--ledger-file", path], f"--ledger-file {path}: {why}")
    assert not (tmp_path / "no-such-dir").exists()


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_convert_out_to_a_place_that_cannot_be_made(tiny_models, cli, tmp_path, where):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "model" if where == "under a file" else "/proc/nerva-test/model"
    assert_refused(cli, ["convert", tiny_models("llama"), "--out", out], f"{out}: cannot write the model there")
    assert (tmp_path / "a-file").read_text() == ""


@pytest.mark.parametrize("command", ["pull", "list", "rm", "run"])
def test_nerva_home_that_is_a_file(tiny_models, cli, tmp_path, monkeypatch, command):
    home = tmp_path / "home-file"
    home.write_text("not a directory")
    monkeypatch.setenv("NERVA_HOME", str(home))
    args = {"pull": ["pull", tiny_models("llama"), "--name", "tiny"], "list": ["list"], "rm": ["rm", "tiny"],
            "run": ["run", "tiny", "-p", "hi", "--no-profile"]}[command]
    assert_refused(cli, args, str(home), "NERVA_HOME")
    assert home.read_text() == "not a directory"


def test_nerva_home_where_nothing_can_be_made(tiny_models, cli, monkeypatch):
    monkeypatch.setenv("NERVA_HOME", "/proc/nerva-home")  # not even root makes a directory there
    assert_refused(cli, ["pull", tiny_models("llama"), "--name", "tiny"], "/proc/nerva-home", "NERVA_HOME")


# -- the user's text printed as written (issue 49.6) ------------------------------------------------
def test_emoji_codes_in_names_and_paths_stay_text(cli):
    code, _, err = cli("run", "smollm2-135m:banana", "-p", "hi")
    assert code == 1 and "smollm2-135m:banana" in err and "\N{BANANA}" not in err, err
    code, _, err = cli("convert", "a:fire:b.gguf")
    assert code == 1 and "a:fire:b.gguf" in err and "\N{FIRE}" not in err, err


def test_markup_in_a_name_is_printed_as_written(tiny_models, cli):
    src, name = tiny_models("llama"), "[red]x"
    code, out, _ = cli("pull", src, "--name", name, "--quant", "q4_0")
    assert code == 0 and out.startswith(f"{name}:q4_0  llama"), out
    code, _, err = cli("pull", src, "--name", name, "--quant", "q4_0")
    assert code == 0 and f"{models_root() / name / 'q4_0'} is already in the store: kept" in err, err
    code, out, _ = cli("show", name)
    assert code == 0 and out.startswith(f"{name}:q4_0  {models_root() / name / 'q4_0'}"), out
    code, out, _ = cli("rm", name)
    assert code == 0 and out == f"deleted {name}:q4_0\n", out
