"""Pulling from a Hugging Face repo: a GGUF (ollama's hf.co/USER/REPO:TAG) or safetensors. This
machine has no network, so huggingface_hub's calls are replaced by a repo made of local files;
what is tested is nerva's side: which file a tag picks, what a download asks for, the name and
source a model is stored under, and a second `run` finding it without the Hub."""

from __future__ import annotations

import types

import pytest

from nerva_cli.errors import BadInput
from nerva_cli.store.sources.resolve import choose_gguf, gguf_quant, hub_spec, is_source_spec, source_id

FILES = ["README.md", "SmolLM2-135M-Instruct-Q4_K_M.gguf", "SmolLM2-135M-Instruct-Q8_0.gguf",
         "SmolLM2-135M-Instruct.IQ4_XS.gguf", "big/SmolLM2-135M-Instruct-f16-00001-of-00002.gguf",
         "big/SmolLM2-135M-Instruct-f16-00002-of-00002.gguf"]


@pytest.mark.parametrize("spec, want", [
    ("hf.co/bartowski/SmolLM2-GGUF:Q4_K_M", ("bartowski/SmolLM2-GGUF", "Q4_K_M")),
    ("https://huggingface.co/bartowski/SmolLM2-GGUF", ("bartowski/SmolLM2-GGUF", None)),
    ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", None)),
    ("./Qwen/Qwen3-0.6B", None), ("smollm2-135m", None), ("a/b/c", None)])
def test_hub_specs(spec, want):
    assert hub_spec(spec) == want


def test_a_local_source_is_known_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    (tmp_path / "f.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert source_id("m/model.safetensors") == source_id("./m") == str(tmp_path / "m")  # open_source's directory
    assert source_id("f.gguf") == str(tmp_path / "f.gguf") and source_id("smollm2-135m") is None


def test_a_tag_picks_its_file_in_any_case_and_no_tag_takes_q4_k_m_first():
    assert [gguf_quant(f) for f in FILES[1:4]] == ["Q4_K_M", "Q8_0", "IQ4_XS"]
    assert choose_gguf("r", FILES, "q8_0") == ["SmolLM2-135M-Instruct-Q8_0.gguf"]
    assert choose_gguf("r", FILES, "IQ4_XS") == ["SmolLM2-135M-Instruct.IQ4_XS.gguf"]
    assert choose_gguf("r", FILES, None) == ["SmolLM2-135M-Instruct-Q4_K_M.gguf"]
    assert choose_gguf("r", ["only-IQ2_XXS.gguf"], None) == ["only-IQ2_XXS.gguf"]
    phi = ["Phi-3-mini-4k-instruct-fp16.gguf", "Phi-3-mini-4k-instruct-q4.gguf"]  # microsoft/...-gguf
    assert choose_gguf("r", phi, None) == phi[1:] and choose_gguf("r", phi, "fp16") == phi[:1]
    with pytest.raises(BadInput, match=r"r: no GGUF file for the tag :Q3_K_S \(the repo has :F16, :IQ4_XS, "
                                       r":Q4_K_M, :Q8_0\)"):
        choose_gguf("r", FILES, "Q3_K_S")
    assert choose_gguf("r", FILES, "f16") == FILES[4:6]  # a split one: its parts, in order
    with pytest.raises(BadInput, match=r"part 1 of 2, and the repo lacks big/SmolLM2-135M-Instruct-f16-00002"):
        choose_gguf("r", FILES[:5], "f16")
    with pytest.raises(BadInput, match=r"several GGUF files and none of"):
        choose_gguf("r", ["a-IQ2_XXS.gguf", "a-IQ3_S.gguf"], None)


@pytest.fixture
def hub(monkeypatch, tmp_path, tiny_models):
    """A repo 'me/tiny-GGUF' holding one Q4_K GGUF of the tiny llama, and the calls made to it."""
    import huggingface_hub
    from test_convert import write_q4_gguf

    path = tmp_path / "tiny-k-Q4_K.gguf"
    write_q4_gguf(path, tiny_models("llama"), hidden=256, inter=512, kind="Q4_K")
    calls = []

    def model_info(repo_id, revision=None):
        calls.append(("info", repo_id))
        if repo_id != "me/tiny-GGUF":  # the Hub's 404 (built bare: its constructor wants an HTTP response)
            cls = huggingface_hub.errors.RepositoryNotFoundError
            missing = cls.__new__(cls)
            Exception.__init__(missing, f"404: {repo_id}")
            raise missing
        return types.SimpleNamespace(siblings=[types.SimpleNamespace(rfilename=f)
                                               for f in ("README.md", path.name)])

    def hf_hub_download(repo_id, filename, revision=None):
        calls.append(("download", filename))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    return calls


def test_run_pulls_a_hub_gguf_once_and_finds_it_again_without_the_hub(hub, cli):
    spec = "hf.co/me/tiny-GGUF:q4_k"
    assert is_source_spec(spec) and source_id(spec) == source_id("me/tiny-GGUF:Q4_K") == "me/tiny-GGUF:Q4_K"
    args = ["-p", "the quick brown fox", "--raw", "-n", "2", "--temperature", "0", "--no-profile", "--ctx", "64"]
    code, first, err = cli("run", spec, *args)
    assert code == 0 and "not in the store yet: pulling it" in err, err
    assert "source tensors are Q4_K" in err and "tiny-k:q4_1" in err, err  # auto: a K-quant becomes q4_1
    assert hub == [("info", "me/tiny-GGUF"), ("download", "tiny-k-Q4_K.gguf")]
    code, again, err = cli("run", spec.upper().replace("HF.CO/ME/TINY-GGUF", "hf.co/me/tiny-GGUF"), *args)
    assert code == 0 and again == first and "pulling" not in err, err
    assert len(hub) == 2  # the second run asked the Hub nothing
    code, out, err = cli("show", "tiny-k", "--json")
    assert code == 0 and '"id": "me/tiny-GGUF:Q4_K"' in out and '"kind": "hf-gguf"' in out, out


def test_hub_errors_are_one_line(hub, cli):
    code, out, err = cli("pull", "hf.co/me/tiny-GGUF:Q6_K")
    assert code == 1 and err.strip() == "error: me/tiny-GGUF: no GGUF file for the tag :Q6_K (the repo has :Q4_K)"
    code, out, err = cli("pull", "hf.co/me/nothing-here")
    assert code == 1 and err.strip() == ("error: me/nothing-here: no such repository on the Hugging Face Hub "
                                         "(or it is gated)"), err


def test_a_safetensors_repo_downloads_transformers_weights_only(monkeypatch, tiny_models, cli):
    """A repo with both transformers' shards and Mistral's consolidated.safetensors: the download
    asks for the shards and the configs, not the second copy; a repo of other names takes all."""
    import huggingface_hub

    src = tiny_models("llama")
    asked = []
    files = ["config.json", "tokenizer.json", "model.safetensors", "consolidated.safetensors", "params.json"]
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, revision=None: types.SimpleNamespace(
        siblings=[types.SimpleNamespace(rfilename=f) for f in files]))

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        asked.append(allow_patterns)
        return str(src)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    code, out, err = cli("pull", "me/tiny-llama", "--quant", "f16")
    assert code == 0, err
    assert "model*.safetensors" in asked[0] and "*.safetensors" not in asked[0] and "config.json" in asked[0]
    from fnmatch import fnmatch
    assert not any(fnmatch("consolidated.safetensors", p) for p in asked[0])
    files[2] = "weights.safetensors"
    assert cli("pull", "me/tiny-llama", "--quant", "f16", "--force")[0] == 0
    assert "*.safetensors" in asked[1]


def test_a_split_hub_gguf_downloads_every_part(monkeypatch, tmp_path, tiny_models, cli):
    import huggingface_hub
    from test_convert import write_q4_gguf

    write_q4_gguf(tmp_path / "tiny-sp-Q4_0.gguf", tiny_models("llama"), split_max_tensors=7)
    names = sorted(p.name for p in tmp_path.glob("tiny-sp-Q4_0-*.gguf"))
    fetched = []
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, revision=None: types.SimpleNamespace(
        siblings=[types.SimpleNamespace(rfilename=f) for f in names]))

    def hf_hub_download(repo_id, filename, revision=None):
        fetched.append(filename)
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    code, out, err = cli("pull", "hf.co/me/split-GGUF:Q4_0")
    assert code == 0 and fetched == names == [f"tiny-sp-Q4_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)], err
    assert "tiny-sp:q4_0" in out, out
