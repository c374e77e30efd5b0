"""Mixtures of experts (OLMoE, Qwen3-MoE, Mixtral, Qwen2-MoE) against transformers on tiny random
models: router choices, logits and greedy tokens; their layer files; what they refuse."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import hf_greedy
from test_engine import LOGIT_RTOL, W4A16_RTOL, hf_model, rel_err
from nerva_cli.errors import BadInput, NervaError
from nerva_cli.model.layout import expert_span, layer_file
from nerva_cli.planes.cpu.engine import Engine
from nerva_cli.store.catalog import ALIGN
from nerva_cli.store.pull import pull

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MOE = ("olmoe", "qwen3moe", "mixtral", "qwen2moe")
PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 300, 12]
N_TOKENS = 64


def hf_routes(hf, ids) -> list[np.ndarray]:
    """transformers' experts for each token of ids, per MoE layer in order: [tokens, k] sorted."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    return [np.sort(torch.topk(torch.softmax(r.float(), dim=-1), k, dim=-1).indices.numpy(), axis=1)
            for r in out.router_logits]


@pytest.mark.parametrize("family,backend", [(f, "cpu") for f in MOE] + [("qwen3moe", "ref"), ("qwen2moe", "ref")])
def test_moe_routes_logits_and_greedy_tokens_equal_transformers(family, backend, tiny_models, tmp_path):
    """The f16 variant against transformers on the same (f16-exact) weights: every token's
    experts in every MoE layer the same (the issue asks >= 99.9% of (token, layer) pairs: at
    these sizes that is all of them), the logits within LOGIT_RTOL at the prompt and each of 64
    decode steps (f32 noise: 2e-6 to 7e-6 measured), and the greedy continuation equal."""
    src = tiny_models(family)
    model = pull(str(src), variant="f16", out=tmp_path / "m")
    engine = Engine(model, backend=backend, ctx=256, kv_cache="f32")
    hf = hf_model(src)
    want = hf_greedy(hf, PROMPT, N_TOKENS)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([want])).logits[0].numpy()
    engine.expert_trace = []
    engine.prefill(want)
    moe_layers = model.config.moe_layers
    assert [i for i, _ in engine.expert_trace] == moe_layers
    for (i, ids), theirs in zip(engine.expert_trace, hf_routes(hf, want), strict=True):
        same = (np.sort(ids, axis=1) == theirs).all(axis=1)
        assert same.mean() >= 0.999, (i, np.nonzero(~same))
    engine.reset()
    engine.expert_trace = None
    logits, got = engine.prefill(PROMPT), []
    assert rel_err(logits, hf_logits[len(PROMPT) - 1]) < LOGIT_RTOL
    for step in range(N_TOKENS):
        got.append(int(np.argmax(logits)))
        logits = engine.decode(want[len(PROMPT) + step])
        assert rel_err(logits, hf_logits[len(PROMPT) + step]) < LOGIT_RTOL, step
    assert got == want[len(PROMPT):]
    assert len(set(got)) > 10


def routes(trace: list) -> np.ndarray:
    """An engine's expert_trace as [tokens, MoE layers, k], each token's experts sorted."""
    layers: dict[int, list] = {}
    for i, ids in trace:
        layers.setdefault(i, []).append(ids)
    return np.sort(np.stack([np.concatenate(v) for v in layers.values()], axis=1), axis=2)


@pytest.mark.parametrize("family,variant", [("olmoe", "q4_0"), ("qwen2moe", "q4_1"), ("mixtral", "q4_0")])
@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
def test_moe_q4_decode_matches_prefill_and_ref(precision, family, variant, tiny_models, tmp_path, rng):
    """A Q4 mixture decoded token by token on the cpu and ref planes against the cpu's prefill of
    the same sequences (each chunk's tokens grouped by expert, through the GEMMs). Two paths'
    f32 noise (and, at W4A8, an activation on a rounding boundary landing on another int8 code in
    one path: test_engine's test_q4_decode_matches_prefill_and_ref) can swap two experts of
    nearly equal probability, which moves the MLP's output by a part of its own size, and through
    the KV cache every later position. So: where both paths chose the same experts for every
    token so far, the logits agree as a dense model's do (W4A16_RTOL; W4A8 0.15); where they
    did not, within 1 (two unrelated logit vectors are sqrt(2) apart, and a wiring fault moves
    every position); and most positions are of the first kind. Measured over 12 seeds and both
    planes a family (1104 positions): same experts, W4A16 at most 1.3e-3, W4A8 6.5e-2; swapped
    experts only at W4A8 on Mixtral, 16 positions, at most 0.50."""
    model = pull(str(tiny_models(family)), variant=variant, out=tmp_path / "m")
    sequences = [[int(t) for t in rng.integers(0, 384, size=24)] for _ in range(3)]
    batches = []
    for ids in sequences:
        e = Engine(model, precision=precision, ctx=64, kv_cache="f32")
        e.expert_trace = []
        batches.append((e.prefill(ids, all_logits=True), routes(e.expert_trace)))
    bound = W4A16_RTOL if precision == "w4a16" else 0.15
    for backend in ("cpu", "ref"):
        same_routes, other_routes = [], []
        for ids, (batch, prefill_routes) in zip(sequences, batches):
            e = Engine(model, backend=backend, precision=precision, ctx=64, kv_cache="f32")
            e.expert_trace = []
            e.prefill(ids[:1])
            errs = [rel_err(e.decode(t), batch[i]) for i, t in enumerate(ids[1:], start=1)]
            agree = np.cumprod((routes(e.expert_trace) == prefill_routes).all(axis=(1, 2)))[1:]
            same_routes += [err for err, a in zip(errs, agree) if a]
            other_routes += [err for err, a in zip(errs, agree) if not a]
        assert len(same_routes) > len(other_routes), (backend, same_routes, other_routes)
        assert max(same_routes) < bound and max(other_routes, default=0) < 1, (backend, same_routes, other_routes)


@pytest.mark.parametrize("variant", ["f16", "q4_0"])
def test_each_expert_is_one_aligned_span_after_the_dense_part(variant, tiny_models, tmp_path):
    """A MoE layer's file: norms, attention and router first, then expert by expert its gate, up
    and down, each expert one 4 KB-aligned span that no other tensor enters (one read loads it)."""
    model = pull(str(tiny_models("qwen2moe")), variant=variant, out=tmp_path / "m")
    cfg = model.config
    for i in cfg.moe_layers:
        tensors = model.meta["files"][layer_file(i)]["tensors"]
        spans = [expert_span(tensors, e) for e in range(cfg.num_experts)]
        dense_end = max(t["offset"] + t["nbytes"] for n, t in tensors.items() if not n.startswith("experts."))
        assert spans[0][0] >= dense_end
        for (lo, n), (next_lo, _) in zip(spans, spans[1:] + [(model.meta["files"][layer_file(i)]["size"], 0)]):
            assert lo % ALIGN == 0 and lo + n <= next_lo
            inside = [name for name, t in tensors.items() if lo <= t["offset"] < lo + n]
            assert all(name.startswith(inside[0].rsplit(".", 2)[0] + ".") for name in inside)
            assert len(inside) == (3 if variant == "f16" else 6)  # gate, up, down (codes and scales)


def test_stacked_expert_tensors_convert_to_the_same_blocks(tiny_models, tmp_path):
    """A checkpoint holding every expert in fused 3-D tensors (mlp.experts.gate_up_proj
    [experts, 2 f, hidden] and down_proj, transformers 5's layout in memory) converts to the
    very files the per-expert names give."""
    from safetensors.numpy import load_file, save_file

    src = tiny_models("qwen3moe")
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (fused_dir / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    fused = {}
    for name, value in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = value
    for i in range(cfg["num_hidden_layers"]):
        e = [f"model.layers.{i}.mlp.experts.{x}" for x in range(cfg.get("num_experts") or cfg["num_local_experts"])]
        if f"{e[0]}.gate_proj.weight" not in tensors:
            continue  # a dense layer
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([tensors[f"{p}.gate_proj.weight"], tensors[f"{p}.up_proj.weight"]]) for p in e])
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack([tensors[f"{p}.down_proj.weight"] for p in e])
    save_file(fused, str(fused_dir / "model.safetensors"))
    for variant in ("f16", "q4_0"):
        apart = pull(str(src), variant=variant, out=tmp_path / f"apart-{variant}")
        together = pull(str(fused_dir), variant=variant, out=tmp_path / f"together-{variant}")
        for i in range(cfg["num_hidden_layers"]):
            assert apart.meta["files"][layer_file(i)]["sha256"] == together.meta["files"][layer_file(i)]["sha256"], i


def test_moe_refusals(tiny_models, tmp_path, cli):
    """What a mixture cannot do yet says so in one line, naming it: a MoE architecture not built
    (DeepSeek's), OLMoE's clip_qkv, hot-only mode, and the cuda plane (on its CPU emulation);
    a RAM budget caches experts instead (test_expert_cache.py)."""
    from cuda_emu.device import EmuDevice

    from nerva_cli.model.config import from_hf_config
    from nerva_cli.planes.cuda.engine import CudaEngine

    with pytest.raises(BadInput, match="mixture-of-experts architecture 'deepseek_v3' is not supported yet"):
        from_hf_config({"model_type": "deepseek_v3"}, "config.json")
    olmoe = json.loads((tiny_models("olmoe") / "config.json").read_text())
    with pytest.raises(BadInput, match="clip_qkv"):
        from_hf_config({**olmoe, "clip_qkv": 8.0}, "config.json")
    model = pull(str(tiny_models("olmoe")), variant="q4_0", out=tmp_path / "m")
    with pytest.raises(NervaError, match="is a mixture of experts, which the cuda backend does not run yet"):
        CudaEngine(model, ctx=64, device=EmuDevice())
    code, out, err = cli("run", str(model.path), "hello", "-n", "2", "--mode", "hot-only")
    assert code == 2 and "mixture of" in err and len(err.strip().splitlines()) == 1, err


def test_show_gives_the_expert_plan(tiny_models, tmp_path, cli):
    """show: the experts a layer and a token, the shared one, and the bytes an expert and a
    token's experts take; --json the same figures."""
    model = pull(str(tiny_models("qwen2moe")), variant="q4_0", out=tmp_path / "m")
    code, out, _ = cli("show", str(model.path), "--json")
    assert code == 0
    experts = json.loads(out)["experts"]
    span = expert_span(model.meta["files"][layer_file(0)]["tensors"], 0)[1]
    assert experts == {"per_layer": 8, "per_token": 2, "layers": 3, "shared_expert": True, "renormalised": False,
                       "active_parameters": experts["active_parameters"], "expert_bytes": span,
                       "expert_bytes_per_token": span * 2 * 3}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_models("qwen2moe"))
    idle = 3 * 6 * 3 * 64 * 32  # layers, experts not chosen, matrices, hidden x expert width
    assert experts["active_parameters"] == hf.num_parameters() - idle
    code, out, _ = cli("show", str(model.path))
    assert "8 in each of 3 layers, 2 a token plus a shared one" in out


def test_a_q4_0_gguf_imports_each_stacked_expert_bit_for_bit(tiny_models, tmp_path):
    """A Q4_0 GGUF of a mixture (experts stacked in ffn_*_exps, quantised by gguf-py as llama.cpp's
    quantiser lays them out; the router F32, as llama.cpp keeps it): each expert's blocks land in
    its span of the layer file byte for byte, read a row range at a time from the stacked tensor."""
    from gguf import GGMLQuantizationType, quants
    from safetensors.numpy import load_file

    from test_convert import hf_to_gguf
    from nerva_cli.model.quant import join_blocks

    src = tiny_models("qwen2moe")
    path = tmp_path / "moe.Q4_0.gguf"
    hf_to_gguf(src, path, layer_quant=GGMLQuantizationType.Q4_0)
    model = pull(str(path), out=tmp_path / "m")
    assert model.variant == "q4_0"
    hf = load_file(str(src / "model.safetensors"))
    for i in model.config.moe_layers:
        t = model.read_file(layer_file(i))
        assert t["router"].dtype == np.float32
        np.testing.assert_array_equal(t["router"], hf[f"model.layers.{i}.mlp.gate.weight"])
        for e in range(model.config.num_experts):
            for part in ("gate", "up", "down"):
                want = quants.quantize(hf[f"model.layers.{i}.mlp.experts.{e}.{part}_proj.weight"],
                                       GGMLQuantizationType.Q4_0)
                got = join_blocks(t[f"experts.{e}.{part}.qs"], t[f"experts.{e}.{part}.d"])
                np.testing.assert_array_equal(got, want, err_msg=f"layer {i} expert {e} {part}")


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
@pytest.mark.parametrize("precision", ["w4a8", "w4a16"])
def test_experts_matvec_equals_each_experts_matvec(kind, precision, rng):
    """matvec_q4_experts_*: the chosen experts' rows of a stacked matrix in one call. On the cpu
    each output row equals, bit for bit, that expert's own matvec (matvec_q4_w4a8 on x's Q8
    codes, or matvec_q4_w4a16), with one input for all (gate/up) and one each (down). Against
    ref's definition: W4A8 within f32 summation noise, 1e-5 relative (the integer dots are exact,
    their f32 combine runs in another order); W4A16 within 1e-4 (on hosts without AVX-512F its Q16
    codes round x by up to 2^-16 of a group's largest value)."""
    from nerva_cli.model.quant import quantize_blocks
    from nerva_cli.planes import get_backend

    cpu, ref = get_backend("cpu"), get_backend("ref")
    experts, rows, cols, k = 6, 64, 96, 3
    qs, d, m = quantize_blocks(rng.standard_normal((experts * rows, cols)).astype(np.float32), kind)
    chosen = np.array(sorted(rng.choice(experts, size=k, replace=False)), dtype=np.int64)
    for x in (rng.standard_normal((1, cols)).astype(np.float32), rng.standard_normal((k, cols)).astype(np.float32)):
        got, want = np.empty((k, rows), np.float32), np.empty((k, rows), np.float32)
        getattr(cpu, f"matvec_q4_experts_{precision}")(qs, d, m, chosen, x, got)
        getattr(ref, f"matvec_q4_experts_{precision}")(qs, d, m, chosen, x, want)
        for j, e in enumerate(chosen):
            part = slice(e * rows, (e + 1) * rows)
            one, a = np.empty(rows, np.float32), x[0 if len(x) == 1 else j]
            if precision == "w4a8":
                xq, xd, xs = np.empty(cols, np.int8), np.empty(cols // 32, np.float32), np.empty(cols // 32, np.int32)
                cpu.quantize_act_q8(a, xq, xd, xs)
                cpu.matvec_q4_w4a8(qs[part], d[part], None if m is None else m[part], xq, xd, xs, one)
            else:
                cpu.matvec_q4_w4a16(qs[part], d[part], None if m is None else m[part], a, one)
            np.testing.assert_array_equal(got[j], one)
        assert rel_err(got, want) < (1e-5 if precision == "w4a8" else 1e-4), rel_err(got, want)


def test_topology_plans_a_mixture_with_the_experts_a_token_reads(tiny_models, tmp_path, cli):
    """topology --model: a mixture's experts in the plan, and the bytes a token reads from RAM
    counting the k experts it runs in each MoE layer, not all of them."""
    model = pull(str(tiny_models("qwen3moe")), variant="q4_0", out=tmp_path / "m")
    code, out, _ = cli("topology", "--model", str(model.path), "--no-profile", "--json")
    assert code == 0
    plan = json.loads(out)["plan"]
    span = expert_span(model.meta["files"][layer_file(0)]["tensors"], 0)[1]
    assert plan["experts"]["per_token"] == 2 and plan["experts"]["expert_bytes"] == span
    assert plan["experts"]["read_bytes_per_token"] == 2 * span * 2  # two MoE layers (layer 1 is dense)
    files = model.meta["files"]
    whole = sum(files[layer_file(i)]["size"] for i in range(3)) + files["lm_head.bin"]["size"] + \
        files["final_norm.bin"]["size"]
    assert plan["tiers"]["host"]["read_bytes_per_token"] == whole - 2 * 6 * span
    code, out, _ = cli("topology", "--model", str(model.path), "--no-profile")
    assert "experts: 8 in each of 2 layers, all in RAM; 2 a token read" in out


def test_profile_gives_each_layers_expert_frequencies_and_reuse(tiny_models, tmp_path, cli):
    """profile: a mixture's per-layer expert frequencies, token-to-token reuse and the share of
    the most chosen eighth, over the calibration prompts, as transformers' routers choose on the
    same tokens (the f16 variant profiles exact: the same experts for every token, as above)."""
    from nerva_cli.runtime import mcap

    src = tiny_models("qwen2moe")
    model = pull(str(src), variant="f16", out=tmp_path / "m")
    code, out, _ = cli("profile", str(model.path), "--json")
    assert code == 0
    got = json.loads(out)["experts"]
    hf = hf_model(src)
    per_prompt = [hf_routes(hf, ids) for ids in mcap.calibration_ids(model, mcap.PROMPTS)]
    for n, i in enumerate(model.config.moe_layers):
        ids = [routes[n] for routes in per_prompt]
        counts = np.bincount(np.concatenate(ids).ravel(), minlength=8)
        np.testing.assert_allclose(got["layers"][str(i)]["frequency"], counts / counts.sum(), atol=1e-5)
        again = [len(set(a) & set(b)) for p in ids for a, b in zip(p[1:], p[:-1])]
        assert got["layers"][str(i)]["reuse"] == pytest.approx(sum(again) / (2 * len(again)), abs=1e-4)
        assert got["layers"][str(i)]["top_eighth_share"] == pytest.approx(counts.max() / counts.sum(), abs=1e-4)
    code, out, _ = cli("profile", str(model.path))
    assert "experts: a token re-chooses" in out


@pytest.mark.parametrize("renormalise", [False, True])
def test_route_experts_picks_the_top_k_as_ref_defines_it(renormalise, rng):
    """route_experts on the cpu against ref's NumPy definition: the same experts, ascending, for
    every row of random logits (and for tied ones: the lower index), weights within 1e-6 (numba's
    and NumPy's exp may differ in the last bit); the weights sum to 1 where renormalised. On the
    cpu it allocates nothing (a decode step's router)."""
    import tracemalloc

    from nerva_cli.planes import get_backend

    cpu, ref = get_backend("cpu"), get_backend("ref")
    logits = rng.standard_normal((9, 64)).astype(np.float32)
    logits[8] = 0.5  # every expert tied: the first k
    got = np.empty((9, 8), np.int64), np.empty((9, 8), np.float32)
    want = np.empty((9, 8), np.int64), np.empty((9, 8), np.float32)
    cpu.route_experts(logits, renormalise, *got)
    ref.route_experts(logits, renormalise, *want)
    np.testing.assert_array_equal(got[0], want[0])
    assert (np.diff(got[0], axis=1) > 0).all() and list(got[0][8]) == list(range(8))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    if renormalise:
        np.testing.assert_allclose(got[1].sum(axis=1), 1, rtol=1e-6)
    one = logits[:1], np.empty((1, 8), np.int64), np.empty((1, 8), np.float32)
    tracemalloc.start()
    tracemalloc.reset_peak()
    start, _ = tracemalloc.get_traced_memory()
    cpu.route_experts(one[0], renormalise, one[1], one[2])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak - start < 1024, peak - start
