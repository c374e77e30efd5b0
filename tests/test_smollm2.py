"""The bundled SmolLM2-135M: f16 against transformers loading the same GGUF, and the q4_1 and
q4_0 variants against f16 by perplexity over a real English text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TEXT_PATH, hf_greedy
from nerva_cli.planes.cpu.engine import Engine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhat are three uses of copper?<|im_end|>\n<|im_start|>assistant\n",
]


def test_f16_greedy_equals_transformers_on_bundled_gguf(smollm2_store, hf_smollm2):
    tok, hf = hf_smollm2
    engine = Engine(smollm2_store["f16"], ctx=256, kv_cache="f32")  # what transformers computes
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        want = hf_greedy(hf, ids, 32)[len(ids):]
        engine.reset()
        got = [int(np.argmax(engine.prefill(ids)))]
        while len(got) < 32:
            got.append(int(np.argmax(engine.decode(got[-1]))))
        assert got == want, prompt


def ppl_text(tmp_path, min_tokens=4000):
    """The first ~4,500 tokens of a GPL text (a real English text every Debian machine has)."""
    if not TEXT_PATH.exists():
        pytest.skip(f"{TEXT_PATH} is not on this machine")
    words = TEXT_PATH.read_text().split(" ")
    path = tmp_path / "gpl3.txt"
    path.write_text(" ".join(words[:3800]))
    return path


def test_q4_perplexity_w4a8_within_2_percent_of_w4a16(smollm2_store, tmp_path, cli):
    text = ppl_text(tmp_path)
    results = {}
    for name, model, precision in (("f16", smollm2_store["f16"], None),
                                   ("w4a16", smollm2_store["q4_1"], "w4a16"),
                                   ("w4a8", smollm2_store["q4_1"], "w4a8"),
                                   ("q4_0", smollm2_store["q4_0"], "w4a16")):
        args = ["bench", model.path, "--ppl", text, "--gen-tokens", "4", "--prompt-tokens", "16",
                "--repeat", "1"]
        if precision:
            args += ["--precision", precision]
        code, out, err = cli(*args)
        assert code == 0, err
        lines = out.strip().splitlines()
        assert len(lines) == 1  # exactly one JSON line on stdout
        results[name] = json.loads(lines[0])
    assert results["f16"]["ppl_tokens"] >= 4000
    ppl = {k: v["perplexity"] for k, v in results.items()}
    print("perplexity", ppl)
    assert abs(ppl["w4a8"] / ppl["w4a16"] - 1) < 0.02, ppl
    # q4_1 keeps the file's weights as they are (Q4_1 layers, Q8_0 token table), and f16 holds
    # the same weights rounded to f16, so at W4A16 the two agree to the f32 noise (measured:
    # 24.9677 and 24.9719, 0.02%; before the token table stayed Q8_0, q4_1 was 26.28). Requantising
    # every layer to Q4_0 costs far more (31.27): why `pull` keeps a Q4_1 GGUF's format.
    assert abs(ppl["w4a16"] / ppl["f16"] - 1) < 0.002, ppl
    assert ppl["w4a16"] < 0.9 * ppl["q4_0"] < 1.5 * ppl["f16"], ppl
    assert 1 < ppl["f16"] < 100, ppl


def test_run_prompt_streams_the_greedy_answer(smollm2_store, cli):
    """`run -p` prints exactly the greedy continuation of the chat-templated prompt."""
    from nerva_cli.store.tokenizer import TextTokenizer

    model = smollm2_store["q4_1"]
    code, out, err = cli("run", model.path, "-p", "What is 2+2?", "--temperature", "0", "--max-tokens", "24",
                         "--precision", "w4a16")
    assert code == 0, err
    tok = TextTokenizer(model.path)
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "What is 2+2?"}]), add_special=False)
    engine = Engine(model, ctx=128)
    got = [int(np.argmax(engine.prefill(ids)))]
    while len(got) < 24 and got[-1] not in tok.eos_ids:
        got.append(int(np.argmax(engine.decode(got[-1]))))
    got = [t for t in got if t not in tok.eos_ids]
    assert out == tok.decode(got) + "\n"
    assert out.strip() and "\ufffd" not in out and "<|im_end|>" not in out
