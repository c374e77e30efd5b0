"""MCAP profile: the score's formula against transformers, streaming memory, a deterministic and
fingerprinted cache, mixed precision's perplexity on SmolLM2, and hot-only mode."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from nerva_cli.runtime import mcap
from nerva_cli.store.pull import pull


def hf_scores(src, model, prompts):
    """The formula computed by transformers in float32 on the f16-rounded weights: hooks take
    q_proj, v_proj and mlp outputs; mean over every token of sqrt(|q|^2 + |v|^2) + |mlp|."""
    import torch
    import transformers

    from nerva_cli.store.tokenizer import TextTokenizer

    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():  # the f16 variant stores matrices rounded to f16: give HF the same
        for p in hf.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    taps, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        for name, mod in (("q", layer.self_attn.q_proj), ("v", layer.self_attn.v_proj), ("mlp", layer.mlp)):
            hooks.append(mod.register_forward_hook(
                lambda m, a, out, key=(i, name): taps.__setitem__(key, out[0].double().numpy())))
    tok = TextTokenizer(model.path)
    sums, count = np.zeros(len(hf.model.layers)), 0
    with torch.no_grad():
        for text in prompts:
            ids = tok.encode(text, add_special=True)
            hf(torch.tensor([ids]))
            count += len(ids)
            for i in range(len(sums)):
                attn = np.sqrt((taps[i, "q"] ** 2).sum(1) + (taps[i, "v"] ** 2).sum(1))
                sums[i] += (attn + np.linalg.norm(taps[i, "mlp"], axis=1)).sum()
    for h in hooks:
        h.remove()
    return sums / count


# smollm3 and gemma3: layers whose RoPE differs from the first's (none; a base of their own); gemma2: capped scores
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3", "gemma2", "gemma3"])
def test_score_equals_the_formula_computed_by_transformers(family, tiny_models, tmp_path):
    src = tiny_models(family)
    model = pull(str(src), variant="f16", out=tmp_path / "f16")
    got = mcap.measure(model, mcap.PROMPTS).scores()
    want = hf_scores(src, model, mcap.PROMPTS)
    # Same f16-rounded weights on both sides, f32 arithmetic in both: only the order of the
    # sums differs (BLAS vs torch), ~6e-8 relative per op; the per-token errors average out
    # over the mean (2e-8 measured). 1e-6 leaves room for other BLAS builds and thread counts,
    # while a wrong term (k for v, x instead of FFN(x')) moves a score by whole percents.
    np.testing.assert_allclose(got, want, rtol=1e-6)
    profile = mcap.get_profile(model).profile
    np.testing.assert_allclose(profile["scores"], want, rtol=6e-5)  # stored to 5 digits: <= 5e-5
    assert min(profile["normalized"]) == 0.0 and max(profile["normalized"]) == 1.0


MEASURE = r"""
import json, sys
from nerva_cli.runtime import mcap
from pathlib import Path
from nerva_cli.store.catalog import load_metadata
def rss_now():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
# warm-up on a tiny model: numba's runtime and kernel loading are not the profile's memory
mcap.measure(load_metadata(Path(sys.argv[1])), mcap.PROMPTS)
before = rss_now()
mcap.measure(load_metadata(Path(sys.argv[2])), mcap.PROMPTS)
# VmHWM, not ru_maxrss: after fork+exec ru_maxrss still holds the parent's (pytest's) peak;
# the warm-up's own peak is below `before` plus its small model, so this only overestimates
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"before": before, "peak": peak}))
"""


@pytest.mark.parametrize("variant", ["q4_0", "f16"])
def test_profiling_holds_about_one_layer(variant, tiny_models, tmp_path):
    import nerva_cli.planes.cpu.kernels  # noqa: F401  (sets NUMBA_CACHE_DIR: the child reuses what compiled here)
    from conftest import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "llama", layers=16, hidden=256, intermediate=1024, vocab=1024)
    big = pull(str(src), variant=variant, out=tmp_path / variant)
    warm = pull(str(tiny_models("llama")), variant=variant, out=tmp_path / "warm")
    res = subprocess.run([sys.executable, "-c", MEASURE, str(warm.path), str(big.path)],
                         capture_output=True, text=True, check=True)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    # Layer and embedding in f32, as in the source: prefill computes a q4_0 layer by
    # dequantising each matrix into an f32 scratch as wide as the widest one (gate/up, 2/3 of
    # the layer), so no q4_0 profiler holds less than ~5 q4_0 layers. Loading all 16 layers
    # would add 8.8 MiB of q4_0 planes and cross the bound.
    layer_bytes = 4 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 1024)
    embed_bytes = 4 * 1024 * 256
    assert (src / "model.safetensors").stat().st_size >= 8 * layer_bytes
    print("profiling held", (m["peak"] - m["before"]) / 2**20, "MiB; bound", (3 * layer_bytes + embed_bytes) / 2**20)
    assert m["peak"] - m["before"] < 3 * layer_bytes + embed_bytes, m


def test_profile_is_byte_identical_and_follows_the_weights(tiny_models, tmp_path, cli, nerva_home):
    import safetensors.numpy

    src = tiny_models("llama")
    model = pull(str(src), variant="q4_0", out=tmp_path / "m")
    code, out, err = cli("profile", model.path)
    assert code == 0, err
    path = nerva_home / "profiles" / f"{model.meta['arch_hash']}.json"
    first = path.read_bytes()
    assert len(first) < 2048 and b"\n" not in first[:-1]
    assert "(computed)" in out and "split-half top-1 overlap" in out
    path.unlink()
    assert cli("profile", model.path)[0] == 0
    assert path.read_bytes() == first
    code, out, _ = cli("profile", model.path)
    assert "(cached)" in out and path.read_bytes() == first

    # one layer's weights change: a new fingerprint, so the cache no longer counts
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in src.iterdir():
        (changed / f.name).write_bytes(f.read_bytes())
    tensors = safetensors.numpy.load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] *= 2
    safetensors.numpy.save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    model2 = pull(str(changed), variant="q4_0", out=tmp_path / "m", force=True)
    assert model2.meta["arch_hash"] == model.meta["arch_hash"]
    assert model2.meta["weights_fingerprint"] != model.meta["weights_fingerprint"]
    code, out, _ = cli("profile", model2.path, "--json")
    again = json.loads(out)
    assert again["origin"] == "computed" and again["weights_fingerprint"] == model2.meta["weights_fingerprint"]
    assert again["scores"][1] != json.loads(first)["scores"][1]
    assert again["scores"][0] == json.loads(first)["scores"][0]  # layer 0 saw the same weights


def test_prompts_file_and_shipped_profile_lookup(tiny_models, tmp_path, cli, nerva_home, monkeypatch):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    prompts = tmp_path / "p.txt"
    prompts.write_text("first prompt about rivers\n\nsecond prompt about mountains\nthird one\n")
    code, out, err = cli("profile", model.path, "--prompts", prompts, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["prompts"] == 3 and got["prompts_hash"] == mcap.prompts_hash(mcap.calibration_ids(
        model, ["first prompt about rivers", "second prompt about mountains", "third one"]))
    # the built-in prompts differ from the cached profile's: profiled again
    assert json.loads(cli("profile", model.path, "--json")[1])["origin"] == "computed"
    # a shipped profile for these weights is used before the cache
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    cached = nerva_home / "profiles" / f"{model.meta['arch_hash']}.json"
    cached.rename(shipped / cached.name)
    monkeypatch.setattr(mcap, "SHIPPED_DIR", shipped)
    assert json.loads(cli("profile", model.path, "--json")[1])["origin"] == "shipped"
    assert not cached.exists()


def test_shipped_smollm2_profile_matches_the_bundled_conversion(smollm2_store):
    found = mcap.find_profile(smollm2_store["q4_1"])  # the variant `pull smollm2-135m` makes
    assert found is not None and found.origin == "shipped"
    assert len(found.profile["scores"]) == 30


def assert_refused(cli, args, *needles, code=1):
    expected, (code, out, err) = code, cli(*args)
    assert code == expected, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_bad_input_is_one_line(tiny_models, tmp_path, cli):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert_refused(cli, ["profile", model.path, "--prompts", tmp_path / "nope.txt"], "nope.txt", "no such file")
    assert_refused(cli, ["profile", model.path, "--prompts", empty], "empty.txt", "0 prompt")
    for cmd in (["run", model.path, "-p", "hi"], ["bench", model.path]):  # bad flag values: usage errors
        assert_refused(cli, [*cmd, "--tau", "1.5"], "--tau", code=2)
        assert_refused(cli, [*cmd, "--tau", "-0.1"], "--tau", code=2)
        assert_refused(cli, [*cmd, "--mode", "hot-only", "--active-fraction", "0"], "--active-fraction", code=2)
        assert_refused(cli, [*cmd, "--mode", "hot-only", "--active-fraction", "1.5"], "--active-fraction", code=2)
        assert_refused(cli, [*cmd, "--mode", "fast"], "--mode", code=2)
        assert_refused(cli, [*cmd, "--mode", "hot-only", "--no-profile"], "--no-profile", code=2)


def bench(cli, path, *extra):
    code, out, err = cli("bench", path, "--gen-tokens", "4", "--prompt-tokens", "16", "--repeat", "1",
                         "--ctx", "512", *extra)
    assert code == 0, err
    return json.loads(out), err


def test_mixed_dispatch_and_hot_only_follow_the_profile(tiny_models, tmp_path, cli):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    prof = mcap.get_profile(model).profile
    norm = prof["normalized"]
    tau = sorted(norm)[1]  # the two highest layers at or above it, the lowest below
    got, err = bench(cli, model.path, "--tau", str(tau))
    assert got["w4a16_layers"] == sum(s >= tau for s in norm) == 2 and got["w4a8_layers"] == 1
    got, err = bench(cli, model.path, "--no-profile")
    assert got["w4a16_layers"] == 3 and "--no-profile" in err
    got, _ = bench(cli, model.path, "--precision", "w4a8")
    assert got["w4a8_layers"] == 3
    got, err = bench(cli, model.path, "--mode", "hot-only", "--active-fraction", "0.5")
    assert got["active_layers"] == 2 and "differ from the full model" in err
    assert mcap.hot_layers(prof, 0.5) == sorted(np.argsort(prof["scores"])[-2:].tolist())
    assert mcap.hot_layers(prof, 0.01) == [int(np.argmax(prof["scores"]))]  # at least one


def test_the_mixed_precision_line_is_verbose_s_the_ledger_s_and_show_s(tiny_models, tmp_path, cli):
    """Which layers run W4A16 holds on every run: --verbose says it, the ledger and `show` too, a
    plain answer does not (issue 49.11)."""
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    prof = mcap.get_profile(model).profile
    hi = [i for i, p in enumerate(mcap.layer_precisions(prof, 0.5)) if p == "w4a16"]
    line = (f"W4A16 on layer(s) {', '.join(map(str, hi))}, W4A8 on the other {3 - len(hi)}" if 0 < len(hi) < 3
            else f"{'W4A16' if hi else 'W4A8'} on all 3 layers")
    args = ["run", model.path, "-p", "hi", "-n", "2", "--backend", "ref", "--seed", "1", "--tau", "0.5"]
    code, out, err = cli(*args)
    assert code == 0 and "precision" not in out + err, err
    code, out, err = cli(*args, "--verbose")
    assert code == 0 and f"mixed precision (tau 0.5): {line}" in err.splitlines(), err
    code, out, err = cli(*args, "--ledger")
    assert code == 0 and f"precision: {line}" in err.splitlines() and "mixed precision" not in err, err
    code, out, err = cli("show", model.path)  # at the default tau, which a run without --tau takes
    shown = mcap.precision_line(dict(enumerate(mcap.layer_precisions(prof, mcap.DEFAULT_TAU))), mcap.DEFAULT_TAU)
    assert code == 0 and shown.startswith("mixed precision (tau 0.7): W4A") and shown in out.splitlines(), out
    code, out, err = cli("run", model.path, "-p", "hi", "-n", "2", "--backend", "ref", "--precision", "w4a8", "-v")
    assert code == 0 and "mixed precision" not in err, err  # a precision forced on every layer is no mix


def test_smollm2_mixed_perplexity_within_1_percent_of_w4a16(smollm2_store, tmp_path, cli):
    from test_smollm2 import ppl_text

    text = ppl_text(tmp_path)
    ppl = {}
    for precision in ("mixed", "w4a16"):
        got, _ = bench(cli, smollm2_store["q4_1"].path, "--ppl", text, "--precision", precision)
        ppl[precision] = got["perplexity"]
        if precision == "mixed":
            assert got["w4a16_layers"] >= 1 and got["w4a8_layers"] >= 1, got
    print("perplexity", ppl)
    assert abs(ppl["mixed"] / ppl["w4a16"] - 1) < 0.01, ppl
