"""Shared fixtures: a private NERVA_HOME per test, tiny random HF models made with transformers,
and the bundled SmolLM2 converted once per session."""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
from pathlib import Path

import pytest

TEXT_PATH = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture
def rng():
    """A fresh generator per test; its seed is printed, so pytest shows it when the test fails."""
    import numpy as np

    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def nerva_home(tmp_path, monkeypatch):
    home = tmp_path / "nerva-home"
    monkeypatch.setenv("NERVA_HOME", str(home))
    return home


def load_script(name: str):
    """scripts/<name>.py as a fresh module (the scripts are not a package; tests may change a
    module's globals, so none is shared)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cli(capsys):
    """Runs `nerva ARGS` in-process, its stdin a pipe that holds `stdin` (empty: as from a script
    or CI); returns (exit code, stdout, stderr)."""
    import io

    from nerva_cli.cli.app import main

    def run(*args: str, stdin: str = ""):
        capsys.readouterr()  # drop what fixtures printed before the command
        old, old_stdin = sys.argv, sys.stdin
        sys.argv, sys.stdin = ["nerva", *map(str, args)], io.StringIO(stdin)
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv, sys.stdin = old, old_stdin
            gc.unfreeze()  # main froze what its process would keep until exit; this one goes on
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def train_tokenizer(out_dir: Path, vocab_size: int = 384, also: str = "") -> None:
    """A small byte-level BPE trained on a license text (and `also`), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = TEXT_PATH.read_text() if TEXT_PATH.exists() else "the quick brown fox " * 500
    tok.train_from_iterator([text, also], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant:{% endif %}"}))


# A chat template that takes tools and has its model write calls in Hermes' <tool_call> blocks, as
# Qwen2.5's and Qwen3's do (written for these tests: the shape, not any model's own text).
TOOL_TEMPLATE = (
    "{% if tools %}<s>tools:{% for t in tools %} {{ t | tojson }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<s>tool: {{ m.content }}</s>"
    "{% elif m.tool_calls %}<s>assistant:{% for c in m.tool_calls %}<tool_call>"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}</s>{% else %}<s>{{ m.role }}: {{ m.content }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}")

FAMILIES = {
    # name: (transformers config class, extra config; its "layers" the layer count where not 3)
    "llama": ("LlamaConfig", {}),
    "llama-untied": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama3-scaled": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    # YaRN as Qwen's model cards add it (factor 4 over a 128-token original context)
    # matrices whose rows are not whole Q4_0 blocks (32 weights), which the Q4 variants keep in
    # f16 (convert._kept_exact): three 48-wide heads make o's rows 144 wide; a hidden size of 80
    # makes q, k, v, gate, up and the token table's rows 80 wide (o's 192 and down's 160 stay Q4)
    "qwen3-hd48": ("Qwen3Config", {"head_dim": 48, "heads": 3, "kv_heads": 1}),
    "qwen3-h80": ("Qwen3Config", {"head_dim": 48, "hidden": 80}),
    "qwen3-yarn": ("Qwen3Config", {"head_dim": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 128}}),
    # fused q/k/v and gate/up; the second rotates half of each 16-wide head with LongRoPE's
    # short factors (the context, 256 at most in the tests, within its original 256) and its
    # attention factor (max 512 / original 256: sqrt(1 + ln 2 / ln 256) = 1.061)
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "phi3-longrope": ("Phi3Config", {"pad_token_id": 0, "partial_rotary_factor": 0.5,
                                     "original_max_position_embeddings": 256,
                                     "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.7],
                                                      "long_factor": [1.5, 2.9, 5.3, 9.1]}}),
    # no RoPE in every fourth layer (the fourth of four), as SmolLM3's config and llama.cpp have it
    "smollm3": ("SmolLM3Config", {"layers": 4, "pad_token_id": 0}),
    # Granite's multipliers, powers of two (folded into the weights exactly; 16-wide heads, so
    # attention 1/8 is half of Llama's 1/4)
    "granite": ("GraniteConfig", {"embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.125, "logits_scaling": 2.0}),
    # Gemma 1: GeGLU, norms stored as 1 + w, the embedding times sqrt(hidden) = 8, in Llama's layer
    # (GemmaConfig's head_dim is 256 unless named)
    "gemma": ("GemmaConfig", {"head_dim": 16, "pad_token_id": 0}),
    # Gemma 3: GeGLU, norms after attention and the MLP, q/k norms, the embedding times
    # sqrt(hidden) = 8; an 8-position window (a 10-token prompt and its answer reach past it) in
    # all layers but every sixth (transformers' and llama.cpp's pattern), whose RoPE turns at
    # 10000, the full layer's at 1e6 scaled linearly by 8, as the 4B's
    "gemma3": ("Gemma3TextConfig", {
        "layers": 6, "head_dim": 16, "pad_token_id": 0, "sliding_window": 8, "query_pre_attn_scalar": 16,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # the 27B's kind of query_pre_attn_scalar: attention 1/sqrt(64) where head_dim 16 gives 1/4 (a
    # factor of 2 folded into the q norm, exactly); its layers named by layer_types
    "gemma3-qpas": ("Gemma3TextConfig", {
        "head_dim": 16, "pad_token_id": 0, "sliding_window": 8, "query_pre_attn_scalar": 64,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # Gemma 2: Gemma 3's layer without q/k norms, an 8-position window in every other layer (the
    # first of each pair, as transformers and llama.cpp have it), one RoPE base, and its logit caps,
    # small enough to bite here (the scores' std is about 8, the logits' 0.5: without the attention
    # cap the logits move by their own size)
    "gemma2": ("Gemma2Config", {
        "layers": 4, "head_dim": 16, "pad_token_id": 0, "sliding_window": 8, "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 10.0, "final_logit_softcapping": 1.5}),
    # the 27B's kind of query_pre_attn_scalar: attention 1/8 where head_dim 16 gives 1/4, a factor
    # of 1/2 folded into q (no q norm), exactly
    "gemma2-qpas": ("Gemma2Config", {
        "head_dim": 16, "pad_token_id": 0, "sliding_window": 8, "query_pre_attn_scalar": 64,
        "attn_logit_softcapping": 10.0, "final_logit_softcapping": 1.5}),
    # Mixtures of experts, 8 experts a layer and 2 a token: OLMoE's softmax without renormalising
    # and q/k norms over the whole projection; Qwen3-MoE's renormalised, with its second layer
    # dense (mlp_only_layers) and experts narrower than that layer's MLP; Mixtral's (w1/w2/w3
    # names); Qwen2-MoE's shared expert and its sigmoid gate, with q/k/v biases. Their weights are
    # whole f16 values (f16_exact), so the router, which the store keeps f32, is what
    # hf_model's f16-rounded transformers model routes by.
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate": 64, "f16_exact": True,
                              "tie_word_embeddings": False}),
    "qwen3moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "intermediate": 96, "norm_topk_prob": True, "head_dim": 32, "mlp_only_layers": [1],
                                    "f16_exact": True, "tie_word_embeddings": False}),
    # as many kv heads as heads, as OLMoE has them and llama.cpp's olmoe expects (its k norm is
    # hidden wide)
    "olmoe-mha": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate": 64, "kv_heads": 4,
                                  "f16_exact": True, "tie_word_embeddings": False}),
    # every layer a mixture, as llama.cpp's qwen3moe expects
    "qwen3moe-sparse": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                           "norm_topk_prob": True, "head_dim": 32, "f16_exact": True,
                                           "tie_word_embeddings": False}),
    # OLMoE with experts whose every plane is whole 4 KB pages (128 x 512: Q4 codes 32 KB, scales
    # 4 KB), which O_DIRECT may read straight into an expert cache's slots
    "olmoe-pages": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate": 128, "hidden": 512,
                                    "layers": 2, "f16_exact": True, "tie_word_embeddings": False}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate": 64,
                                  "f16_exact": True, "tie_word_embeddings": False}),
    "qwen2moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "shared_expert_intermediate_size": 64, "intermediate": 96, "f16_exact": True,
                                    "tie_word_embeddings": False}),
}


def make_tiny_model(out_dir: Path, family: str, dtype: str = "float32", layers: int = 3,
                    hidden: int = 64, intermediate: int = 160, vocab: int = 384, seed: int = 0) -> Path:
    """A random-weight HF model of one family, saved as safetensors with a tokenizer."""
    import torch
    import transformers

    cls_name, extra = FAMILIES[family]
    extra = dict(extra)
    tie = extra.pop("tie_word_embeddings", True)
    layers = extra.pop("layers", layers)
    hidden = extra.pop("hidden", hidden)
    intermediate = extra.pop("intermediate", intermediate)
    f16_exact = extra.pop("f16_exact", False)
    cfg = getattr(transformers, cls_name)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=extra.pop("heads", 4), num_key_value_heads=extra.pop("kv_heads", 2),
        max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # default init is tiny: widen it so greedy decoding does not settle
        # on one repeated token (std 0.08 gave 5 distinct tokens in 64, 0.25 gave 53)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.25 if p.ndim > 1 else 0.05)
        if family.startswith("gemma"):  # its embedding is multiplied by sqrt(hidden): std 0.25 after
            # that, or the token's own row outweighs every layer's output and greedy repeats it
            model.get_input_embeddings().weight.div_(hidden ** 0.5)
        if f16_exact:
            for p in model.parameters():
                p.copy_(p.half().float())
    model = model.to(getattr(torch, dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    train_tokenizer(out_dir, vocab)
    return out_dir


def hf_greedy(hf, ids, n):
    """transformers' plain argmax continuation of ids by n tokens (generate() would suppress
    EOS under min_new_tokens, or stop at it)."""
    import torch

    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> directory of a tiny random float32 HF model (made once per session)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tiny-hf")
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = make_tiny_model(root / family, family)
        return cache[family]

    return get


def smollm2_gguf() -> Path:
    from nerva_cli.errors import BadInput
    from nerva_cli.store.sources.resolve import bundled_gguf

    try:
        return bundled_gguf("smollm2-135m")
    except BadInput as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smol_tokenizer(tmp_path_factory):
    """SmolLM2's TextTokenizer, from the bundled GGUF's vocabulary."""
    from nerva_cli.store.gguf_tokenizer import tokenizer_files_from_gguf
    from nerva_cli.store.sources.gguf_header import read_header
    from nerva_cli.store.tokenizer import TextTokenizer

    path = smollm2_gguf()
    out = tmp_path_factory.mktemp("smol-tokenizer")
    for name, text in tokenizer_files_from_gguf(read_header(path).fields, str(path)).items():
        (out / name).write_text(text)
    return TextTokenizer(out)


@pytest.fixture(scope="module")
def hf_smollm2():
    """transformers' SmolLM2 from the bundled GGUF, its matrices rounded to f16 as the f16
    variant stores them: (tokenizer, model)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    gguf = smollm2_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                              dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    return tok, model.eval()


@pytest.fixture(scope="session")
def smollm2_store(tmp_path_factory):
    """NERVA_HOME-independent directory holding SmolLM2 converted to f16, q4_0 and q4_1 (what
    `pull smollm2-135m` makes: its layers are Q4_1), once."""
    from nerva_cli.store.pull import pull

    root = tmp_path_factory.mktemp("smollm2")
    gguf = smollm2_gguf()
    models = {}
    for variant in ("f16", "q4_0", "q4_1"):
        models[variant] = pull(str(gguf), variant=variant, out=root / variant)
    return models


@pytest.fixture(scope="session", params=["emu", pytest.param("gpu", marks=pytest.mark.gpu)])
def cuda_device(request):
    """What the cuda backend runs on: the CPU emulation of kernels/*.cu (always), and a real GPU
    through CuPy (skipped, with the reason, where none answers)."""
    if request.param == "gpu":
        from nerva_cli.planes.cuda import launch as cuda

        if cuda.cupy_or_none() is None:
            pytest.skip(f"GPU test: {cuda.why_no_cuda}")
        return cuda.CupyDevice()
    from cuda_emu.device import EmuDevice

    return EmuDevice()
