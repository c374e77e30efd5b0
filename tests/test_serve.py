"""`nerva serve` as its users meet it: the real server in a subprocess on a loopback port, driven
by the `openai` and `ollama` client packages and by raw HTTP (framing, headers, errors).

Two servers, each started once for the module: A holds SmolLM2 q4_1 from its start with a key,
two engines and a queue of one; B starts empty, with one engine and a queue of one, for loading,
unloading and overload. Every wait has a timeout; the servers are killed in the finalisers."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import TOOL_TEMPLATE
from nerva_cli.store.pull import pull

httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

REPO = Path(__file__).resolve().parent.parent
KEY = "test-key-5f2c"
MODEL = "smollm2-135m:q4_1"  # the variant whose MCAP profile ships (no profiling at start)
OTHER = "smollm2-135m:f16"
TWINS = ("twin:q4_1", "triplet:q4_1")
TOOLBOX = "toolbox:f16"
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"city": "string"}}}  # a tiny
# vocabulary writes a schema in some 100 tokens: a short one, for server B's context of 512
COUNTING = "1, 2, 3, 4, 5,"  # SmolLM2 counts on from here, for hundreds of tokens with LONG's options
LONG = {"temperature": 0, "repeat_penalty": 1.0}  # (ollama's default penalty, 1.1, ends it in some 50)
# a first start on a machine compiles the CPU kernels (a minute or more on 2 busy cores); later
# starts take seconds
START_TIMEOUT_S = 300
WAIT_S = 20  # any other wait


class Server:
    def __init__(self, home: Path, log: Path, *args: str):
        env = {k: v for k, v in os.environ.items() if k not in ("NERVA_HOST", "NERVA_API_KEY")}
        env.update(NERVA_HOME=str(home), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
                   NUMBA_CACHE_DIR=numba_cache())
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "nerva_cli", "serve", "--port", "0", "--threads", "1",
                                          *args], env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self.url = self._wait_for(r"listening on (http://127\.0\.0\.1:\d+)", START_TIMEOUT_S)
            deadline = time.monotonic() + START_TIMEOUT_S
            while httpx.get(f"{self.url}/health", timeout=5).status_code != 200:
                assert self.proc.poll() is None, self.text()
                assert time.monotonic() < deadline, "the server did not become ready:\n" + self.text()
                time.sleep(0.2)
        except BaseException:  # no finaliser is registered yet: the server must not outlive the test
            self.proc.kill()
            self.proc.wait(5)
            raise

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def _wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (m := re.search(pattern, self.text())) is None:
            assert self.proc.poll() is None, "the server exited:\n" + self.text()
            assert time.monotonic() < deadline, f"no {pattern!r} in the server's output:\n" + self.text()
            time.sleep(0.1)
        return m.group(1)

    def stop(self) -> int | None:
        """SIGTERM, as a service manager stops it; -> its exit code, None if it had to be killed."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return None


def numba_cache() -> str:
    """The compiled kernels this process's runs use (kernels.py's rule), so that a server in a
    fresh NERVA_HOME does not compile them all again (a minute on 2 cores)."""
    return os.environ.get("NUMBA_CACHE_DIR") or \
        str(Path(os.environ.get("NERVA_HOME") or "~/.nerva").expanduser() / "numba-cache")


@pytest.fixture(scope="module")
def store_home(smollm2_store, tiny_models, tmp_path_factory):
    """A NERVA_HOME whose store holds the session's SmolLM2 conversions, as hard links, under the
    name `pull smollm2-135m` gives (the session's were made in a temporary directory, whose name
    their metadata.json carries)."""
    home = tmp_path_factory.mktemp("serve-home")
    for ref in (MODEL, OTHER):
        name, variant = ref.split(":")
        source, target = smollm2_store[variant].path, home / "models" / name / variant
        shutil.copytree(source, target, copy_function=os.link, ignore=lambda d, names: ["metadata.json"])
        meta = json.loads((source / "metadata.json").read_text())
        (target / "metadata.json").write_text(json.dumps({**meta, "name": name}))
    source = home / "models" / "smollm2-135m" / "q4_1"
    for twin in TWINS:  # the same model under other names: for the RAM budget's test
        target = home / "models" / twin.split(":")[0] / "q4_1"
        shutil.copytree(source, target, copy_function=os.link, ignore=lambda d, names: ["metadata.json"])
        meta = json.loads((source / "metadata.json").read_text())
        (target / "metadata.json").write_text(json.dumps({**meta, "name": twin.split(":")[0]}))
    # a tiny model whose chat template takes tools (conftest's TOOL_TEMPLATE)
    tiny = shutil.copytree(tiny_models("llama"), tmp_path_factory.mktemp("toolbox") / "src")
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    (tiny / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    name, variant = TOOLBOX.split(":")
    pull(str(tiny), variant=variant, name=name, out=home / "models" / name / variant)
    # a copy of q4_1 whose first layer file is cut short: its load fails (written files, not links)
    broken = home / "models" / "broken" / "q4_1"
    shutil.copytree(source, broken, copy_function=os.link, ignore=lambda d, names: ["metadata.json", "layer_000.bin"])
    meta = json.loads((source / "metadata.json").read_text())
    (broken / "metadata.json").write_text(json.dumps({**meta, "name": "broken"}))
    (broken / "layer_000.bin").write_bytes((source / "layer_000.bin").read_bytes()[:4096])
    return home


def _server(request, store_home, tmp_path_factory, name: str, *args: str) -> Server:
    server = Server(store_home, tmp_path_factory.mktemp(name) / "server.log", *args)

    def finish():
        code = server.stop()
        assert code is not None, "the server did not stop within 15 s of SIGTERM:\n" + server.text()

    request.addfinalizer(finish)
    return server


@pytest.fixture(scope="module")
def a(request, store_home, tmp_path_factory):
    return _server(request, store_home, tmp_path_factory, "a", MODEL, "--api-key", KEY, "--parallel", "2",
                   "--max-queue", "1", "--ctx", "512")


@pytest.fixture(scope="module")
def b(request, store_home, tmp_path_factory):
    return _server(request, store_home, tmp_path_factory, "b", "--parallel", "1", "--max-queue", "1", "--ctx", "512")


AUTH = {"Authorization": f"Bearer {KEY}"}


def oa(server: Server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def ol(server: Server):
    return ollama.Client(host=server.url, headers=AUTH, timeout=60)


def metric(server: Server, name: str, headers=AUTH) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=WAIT_S).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def wait_metric(server: Server, name: str, want: float, headers=AUTH, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while (value := metric(server, name, headers)) != want:
        assert time.monotonic() < deadline, f"{name} stayed {value}, not {want}, for {timeout} s"
        time.sleep(0.05)


# -- answers ------------------------------------------------------------------------------------

def test_openai_stream_equals_whole_at_temperature_0(a):
    client = oa(a)
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed and streamed.strip()
    assert whole.choices[0].finish_reason == chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    usage = whole.usage  # (the second's cached_tokens differ: it found the first's prompt in the cache)
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (usage.prompt_tokens, 12)
    assert usage.completion_tokens == 12 and 10 < usage.prompt_tokens < 100
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_ollama_stream_equals_whole_with_timings(a):
    client = ol(a)
    options = {"temperature": 0, "num_predict": 10}
    whole = client.generate(model=MODEL, prompt="Name a colour.", options=options)
    parts = list(client.generate(model=MODEL, prompt="Name a colour.", options=options, stream=True))
    assert whole.response == "".join(p.response for p in parts) and whole.response.strip()
    last = parts[-1]
    assert last.done and not any(p.done for p in parts[:-1])
    for r in (whole, last):
        assert r.eval_count == 10 and r.done_reason == "length" and 5 < r.prompt_eval_count < 100
        assert r.load_duration == 0  # loaded at start
        assert 0 < r.prompt_eval_duration and 0 < r.eval_duration
        assert r.prompt_eval_duration + r.eval_duration <= r.total_duration < 60e9
    chat = client.chat(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], options=options)
    assert chat.message.role == "assistant" and chat.message.content == whole.response  # the same template


def test_a_long_prompt_start_is_reused_and_answers_do_not_change(a):
    """A prompt whose start an engine's cache holds, in whole prefill chunks (256 tokens on the
    cpu plane), is not prefilled again there; the answer is the one a fresh engine gives, the
    same seed sampling the same text (rows are reused only where the same chunk made them)."""
    client = oa(a)
    hits = metric(a, "nerva_prefix_cache_hit_tokens_total")
    story = "The lighthouse keeper climbed the stairs each night and lit the lamp. " * 22  # some 300 tokens
    ask = dict(model=MODEL, max_tokens=8, temperature=1.0, seed=11)
    first, again = (client.completions.create(prompt=story + "One night", **ask) for _ in range(2))
    assert 256 < first.usage.prompt_tokens < 500
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 256
    assert again.choices[0].text == first.choices[0].text
    other = client.completions.create(prompt=story + "By day", **ask)  # the same start, another end
    assert other.usage.prompt_tokens_details.cached_tokens == 256
    short = client.completions.create(prompt="The lighthouse keeper climbed", **ask)
    assert short.usage.prompt_tokens_details.cached_tokens == 0  # no whole chunk: prefilled afresh
    assert metric(a, "nerva_prefix_cache_hit_tokens_total") - hits == 512


def test_a_prompt_start_another_slot_holds_is_copied_not_prefilled(a):
    """With the slot whose cache holds a prompt's start busy, the request runs in the other slot
    and takes those whole chunks from it (copied, not prefilled: cached_tokens), and its answer
    is the one the cold request got."""
    client = oa(a)
    story = "The baker rose before dawn, lit the ovens and shaped the loaves by hand. " * 20  # some 300 tokens
    ask = dict(model=MODEL, max_tokens=8, temperature=1.0, seed=5)
    cold = client.completions.create(prompt=story + "One morning", **ask)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0 and cold.usage.prompt_tokens > 256
    busy = client.completions.create(model=MODEL, prompt=story + "Later", max_tokens=200, temperature=0,
                                     stream=True, extra_body={"repeat_penalty": 1.0})
    try:
        next(iter(busy))  # running, in the slot that holds the story (the one its start picks)
        again = client.completions.create(prompt=story + "One morning", **ask)
    finally:
        busy.close()
    assert again.usage.prompt_tokens_details.cached_tokens == 256
    assert again.choices[0].text == cold.choices[0].text


def test_a_prompt_whose_slot_moved_on_comes_from_the_prompt_cache(b):
    """One slot: a long prompt, another, then the first again. The slot's cache holds the second
    by then, so the first's whole chunk comes back from the prompt cache (cached_tokens, not
    prefilled), and the answer is the cold request's (the rows its own prefill made)."""
    client = oa(b)
    story = "The ferryman rowed the travellers across the wide river at first light. " * 22  # some 300 tokens
    other = "Rain fell on the market square while the stall keepers packed their goods. " * 22
    ask = dict(model=MODEL, max_tokens=8, temperature=1.0, seed=7)
    held = metric(b, "nerva_prompt_cache_bytes", {})
    cold = client.completions.create(prompt=story + "One evening", **ask)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0 and cold.usage.prompt_tokens > 256
    chunk = metric(b, "nerva_prompt_cache_bytes", {}) - held  # its first 256 tokens' K and V, every layer
    assert chunk == 256 * 30 * 2 * 3 * 64 * 2  # SmolLM2: 30 layers, 3 kv heads of 64, f16
    between = client.completions.create(prompt=other + "One evening", **ask)
    assert between.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(prompt=story + "One evening", **ask)
    assert again.usage.prompt_tokens_details.cached_tokens == 256
    assert again.choices[0].text == cold.choices[0].text
    assert metric(b, "nerva_prompt_cache_bytes", {}) == held + 2 * chunk


def test_logprobs_are_the_models_own(a, hf_smollm2):
    """OpenAI's logprobs: the model's log-probabilities (transformers' on the same f16 weights),
    the chosen token's and the likeliest's, in both endpoints' shapes, streamed or not."""
    tok, hf = hf_smollm2
    prompt = "The capital of France is"
    r = oa(a).completions.create(model=OTHER, prompt=prompt, max_tokens=3, temperature=0, logprobs=5)
    got = r.choices[0].logprobs
    with torch.no_grad():
        logits = hf(torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])).logits[0, -1]
    want = torch.log_softmax(logits.double(), -1).topk(5)
    assert list(got.top_logprobs[0]) == [tok.decode([int(i)]) for i in want.indices]
    assert np.allclose(list(got.top_logprobs[0].values()), want.values.numpy(), atol=0.02)
    assert got.token_logprobs[0] == max(got.top_logprobs[0].values())  # greedy: the likeliest
    assert "".join(got.tokens) == r.choices[0].text and got.text_offset[0] == 0
    ol(a).generate(model=OTHER, keep_alive=0)  # A holds MODEL alone again (the tests after count on it)
    deadline = time.monotonic() + WAIT_S
    while OTHER in {m.model for m in ol(a).ps().models}:
        assert time.monotonic() < deadline, "the f16 model did not unload"
        time.sleep(0.1)

    client = oa(a)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, temperature=0,
               logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    for e in content:
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob <= 0
        assert e.top_logprobs[1].logprob <= e.logprob and bytes(e.bytes).decode() == e.token
    streamed = [x for c in client.chat.completions.create(**ask, stream=True) if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert client.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None


def test_same_seed_same_text(a):
    client = oa(a)
    texts = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                                       seed=seed).choices[0].text for seed in (7, 7, 8)]
    assert texts[0] == texts[1]
    options = {"temperature": 1.0, "seed": 3, "num_predict": 8}
    ollama_texts = [ol(a).generate(model=MODEL, prompt="Tell me a story.", options=options).response for _ in range(2)]
    assert ollama_texts[0] == ollama_texts[1]


def test_stop_strings_end_the_answer_before_them(a):
    r = oa(a).completions.create(model=MODEL, prompt=COUNTING, max_tokens=40, temperature=0, stop=["9,"])
    assert r.choices[0].text == " 6, 7, 8, " and r.choices[0].finish_reason == "stop"


def test_raw_framing_sse_and_ndjson(a):
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{a.url}/v1/completions", json=body, headers=AUTH, timeout=WAIT_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    objects = [json.loads(e[6:]) for e in events[:-2]]
    assert all(o["object"] == "text_completion" for o in objects) and objects[-1]["choices"][0]["finish_reason"]
    body = {"model": MODEL, "prompt": COUNTING, "raw": True, "options": {"num_predict": 5, "temperature": 0}}
    with httpx.stream("POST", f"{a.url}/api/generate", json=body, headers=AUTH, timeout=WAIT_S) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(x["response"] for x in lines).startswith(" 6, 7")


def test_listing_and_describing(a):
    client = ol(a)
    names = {m.model for m in client.list().models}
    assert {MODEL, OTHER} <= names
    running = client.ps().models
    assert [m.model for m in running] == [MODEL] and running[0].context_length == 512 and running[0].size > 0
    shown = client.show(MODEL)
    assert shown.details.family == "llama" and shown.details.quantization_level == "Q4_1"
    assert shown.modelinfo["llama.block_count"] == 30 and "im_start" in shown.template
    assert {m.id for m in oa(a).models.list()} == names
    assert httpx.get(f"{a.url}/api/version", headers=AUTH, timeout=WAIT_S).json()["version"]


# -- concurrency --------------------------------------------------------------------------------

def _stream_times(server: Server, prompt: str, n: int, out: list) -> None:
    body = {"model": MODEL, "prompt": prompt, "raw": True, "options": {"num_predict": n, **LONG}}
    with httpx.stream("POST", f"{server.url}/api/generate", json=body, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                out.append(time.monotonic())


def test_parallel_requests_make_progress_together(a):
    """--parallel 2: neither request waits for the other's whole answer."""
    times: list[list[float]] = [[], []]
    threads = [threading.Thread(target=_stream_times, args=(a, p, 32, t)) for p, t in
               zip((COUNTING, "The sky is"), times)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    first, second = times
    assert len(first) > 10 and len(second) > 10
    assert first[0] < second[-1] and second[0] < first[-1]


def test_an_answer_is_the_same_alone_and_batched(a):
    """A's model is one engine of two sequence slots whose decode steps run batched: a greedy
    answer beside another is the one it gives alone, token for token."""
    assert "2 sequence slots on 1 engine" in a.text()
    body = {"model": MODEL, "raw": True, "stream": False, "options": {"num_predict": 24, **LONG}}
    prompts = ("The sky is", "Here is a list of fruits: apple,")
    alone = [httpx.post(f"{a.url}/api/generate", json={**body, "prompt": p}, headers=AUTH, timeout=60).json()["response"]
             for p in prompts]
    together: dict[str, str] = {}

    def ask(p: str) -> None:
        together[p] = httpx.post(f"{a.url}/api/generate", json={**body, "prompt": p}, headers=AUTH,
                                 timeout=60).json()["response"]

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [together[p] for p in prompts] == alone


def test_disconnect_cancels_the_request(a):
    made = metric(a, "nerva_generated_tokens_total")
    body = {"model": MODEL, "prompt": COUNTING, "raw": True, "options": {"num_predict": 400, **LONG}}
    with httpx.stream("POST", f"{a.url}/api/generate", json=body, headers=AUTH, timeout=WAIT_S) as r:
        lines = r.iter_lines()
        next(lines), next(lines)
        assert metric(a, "nerva_requests_running") == 1
    wait_metric(a, "nerva_requests_running", 0, timeout=5)
    assert metric(a, "nerva_generated_tokens_total") - made < 400  # cut short, not run to its end
    assert "cancelled" in a.text()


def test_full_queue_is_refused_at_once_with_retry_after(b):
    """--parallel 1 --max-queue 1: one answer runs, one waits, the next is refused (503 +
    Retry-After) in both APIs' shapes; then the waiting one runs once the first is dropped."""
    assert httpx.post(f"{b.url}/api/generate", json={"model": MODEL}, timeout=START_TIMEOUT_S).status_code == 200
    rejected = metric(b, "nerva_requests_rejected_total", {})
    body = {"model": MODEL, "prompt": COUNTING, "raw": True, "options": {"num_predict": 200, **LONG}}
    with httpx.stream("POST", f"{b.url}/api/generate", json=body, timeout=WAIT_S) as running:
        lines = running.iter_lines()  # kept: a generator dropped here would close the stream
        next(lines)
        waiting = {}
        t = threading.Thread(target=lambda: waiting.update(r=httpx.post(
            f"{b.url}/api/generate", json={**body, "stream": False, "options": {"num_predict": 3}}, timeout=60)))
        t.start()
        wait_metric(b, "nerva_requests_waiting", 1, {})
        started = time.monotonic()
        refused = httpx.post(f"{b.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                             timeout=WAIT_S)
        refused_ollama = httpx.post(f"{b.url}/api/generate", json={**body, "stream": False}, timeout=WAIT_S)
        assert time.monotonic() - started < 2  # at once, not after a wait
        assert metric(b, "nerva_requests_running", {}) == 1
    assert refused.status_code == refused_ollama.status_code == 503
    assert int(refused.headers["retry-after"]) >= 1 and "retry-after" in refused_ollama.headers
    assert refused.json()["error"]["type"] and isinstance(refused_ollama.json()["error"], str)
    assert metric(b, "nerva_requests_rejected_total", {}) == rejected + 2
    t.join(60)
    assert waiting["r"].status_code == 200 and waiting["r"].json()["eval_count"] == 3
    wait_metric(b, "nerva_requests_running", 0, {})


def test_keep_alive_0_unloads_and_load_requests(b):
    client = ollama.Client(host=b.url, timeout=START_TIMEOUT_S)
    r = client.generate(model=OTHER, prompt="Hi", options={"num_predict": 2}, keep_alive=0)
    assert r.eval_count == 2 and r.load_duration > 0  # this request waited for the load
    deadline = time.monotonic() + WAIT_S
    while OTHER in {m.model for m in client.ps().models}:
        assert time.monotonic() < deadline, "keep_alive 0 did not unload the model"
        time.sleep(0.1)
    assert client.generate(model=OTHER, keep_alive="5m").done_reason == "load"
    assert OTHER in {m.model for m in client.ps().models}
    assert client.generate(model=OTHER, keep_alive=0).done_reason == "unload"
    while OTHER in {m.model for m in client.ps().models}:
        assert time.monotonic() < deadline, "an unload request did not unload the model"
        time.sleep(0.1)


def test_the_least_recently_used_model_makes_room(store_home, request, tmp_path_factory):
    """--ram-budget for two models: a third request's model unloads the one used least lately."""
    from nerva_cli.runtime.options import EngineOptions
    from nerva_cli.serve.scheduler import planned_bytes
    from nerva_cli.store.catalog import find_model

    need = planned_bytes(find_model(str(store_home / "models" / "smollm2-135m" / "q4_1")), EngineOptions(ctx=256), 1)
    c = _server(request, store_home, tmp_path_factory, "c", "--ctx", "256", "--ram-budget", str(int(need * 2.5)))
    client = ollama.Client(host=c.url, timeout=START_TIMEOUT_S)

    def ask(model):
        assert client.generate(model=model, prompt="Hi", options={"num_predict": 1}).eval_count == 1

    twin, triplet = TWINS
    for model in (MODEL, twin, MODEL):
        ask(model)
    assert sorted(m.model for m in client.ps().models) == sorted([MODEL, twin])
    ask(triplet)  # does not fit beside both: twin, used least lately, goes
    assert sorted(m.model for m in client.ps().models) == sorted([MODEL, triplet])
    assert f"{twin}: unloaded to make room for {triplet}" in c.text()
    ask(twin)  # and back: now MODEL is the least recently used
    assert sorted(m.model for m in client.ps().models) == sorted([triplet, twin])


def test_tools_reach_a_template_that_takes_them(b):
    """Tools go to a template that takes them (SmolLM2's does not: BAD above), with the earlier
    calls and their results, through both APIs; with tools a stream sends the answer at its end."""
    client = openai.OpenAI(base_url=f"{b.url}/v1", api_key="none", max_retries=0, timeout=START_TIMEOUT_S)
    messages = [{"role": "user", "content": "the quick brown fox"}]
    ask = dict(model=TOOLBOX, messages=messages, max_tokens=3, temperature=0)
    plain = client.chat.completions.create(**ask)
    offered = client.chat.completions.create(**ask, tools=[WEATHER])
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tool's schema went in
    assert client.chat.completions.create(**ask, tools=[WEATHER], tool_choice="none").usage.prompt_tokens == \
        plain.usage.prompt_tokens
    streamed = list(client.chat.completions.create(**ask, tools=[WEATHER], stream=True))
    message = offered.choices[0].message
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (message.content or "")
    assert streamed[-1].choices[0].finish_reason == offered.choices[0].finish_reason
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}]
    after = client.chat.completions.create(**{**ask, "messages": follow}, tools=[WEATHER])
    assert after.usage.prompt_tokens > offered.usage.prompt_tokens
    # a call the answer must be (tool_choice "required" or by name): held to the tool's schema
    pick = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"const": 1}}, "required": ["n"], "additionalProperties": False}}}
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        r = client.chat.completions.create(**{**ask, "max_tokens": None, "temperature": 1.0}, tools=[pick, WEATHER] if choice != "required"
                                           else [pick], tool_choice=choice, seed=1)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["pick"], \
            (r.choices[0].message.content, r.usage.completion_tokens)
        assert json.loads(calls[0].function.arguments) == {"n": 1}
    with pytest.raises(openai.BadRequestError, match="'tool_choice' must name one of the tools given"):
        client.chat.completions.create(**ask, tools=[WEATHER], tool_choice={"type": "function",
                                                                             "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="no 'tools' were given"):
        client.chat.completions.create(**ask, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="leaves no way to call the tools offered"):
        client.chat.completions.create(**ask, tools=[WEATHER], response_format={"type": "json_object"})
    native = ollama.Client(host=b.url, timeout=START_TIMEOUT_S)
    r = native.chat(model=TOOLBOX, messages=messages, tools=[WEATHER], options={"num_predict": 3, "temperature": 0})
    assert r.done and r.prompt_eval_count > plain.usage.prompt_tokens + 20  # (its client reshapes the schema)
    assert "tools" in native.show(TOOLBOX).capabilities and "tools" not in native.show(MODEL).capabilities
    assert native.generate(model=TOOLBOX, keep_alive=0).done_reason == "unload"


# -- structured output --------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def test_answers_held_to_a_schema_validate_through_both_clients(a):
    """ollama's `format` and OpenAI's `response_format`, through their own client packages, at
    several seeds, checked with jsonschema; streamed too; cut by max_tokens is finish_reason length."""
    jsonschema = pytest.importorskip("jsonschema")
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in (1, 2, 3):
        r = ol(a).chat(model=MODEL, messages=ask, format=PERSON, options={"seed": seed})
        assert r.done_reason == "stop"
        jsonschema.validate(json.loads(r.message.content), PERSON)
        r = oa(a).chat.completions.create(model=MODEL, messages=ask, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert isinstance(json.loads(ol(a).generate(model=MODEL, prompt="A cat as JSON", format="json",
                                                options={"seed": 1, "num_predict": 200}).response), dict)
    chunks = oa(a).chat.completions.create(model=MODEL, messages=ask, seed=4, stream=True,
                                           response_format={"type": "json_object"}, max_tokens=200)
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), dict)
    story = {"type": "object", "properties": {"story": {"type": "string", "minLength": 300}}, "required": ["story"]}
    r = oa(a).chat.completions.create(model=MODEL, messages=ask, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "story", "schema": story}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith('{"story": "')


# -- security -----------------------------------------------------------------------------------

def test_api_key_and_origins(a):
    def get(path, **headers):
        return httpx.get(f"{a.url}{path}", headers={k.replace("_", "-"): v for k, v in headers.items()},
                         timeout=WAIT_S)

    assert get("/health").status_code == 200
    for path in ("/api/tags", "/v1/models", "/metrics", "/api/version"):
        assert get(path).status_code == 401, path
    assert isinstance(get("/api/tags").json()["error"], str)
    assert get("/v1/models").json()["error"]["code"] == "invalid_api_key"
    assert get("/v1/models", authorization="Bearer wrong").status_code == 401
    assert get("/api/tags", x_api_key="wrong").status_code == 401
    assert get("/api/tags", x_api_key=KEY).status_code == 200
    assert get("/v1/models", authorization=f"Bearer {KEY}").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{a.url}/v1", api_key="wrong", max_retries=0).models.list()
    foreign = get("/api/tags", origin="https://evil.example", x_api_key=KEY)
    assert foreign.status_code == 403 and "origin" in foreign.json()["error"]
    local = get("/api/tags", origin="http://localhost:3000", x_api_key=KEY)
    assert local.status_code == 200 and local.headers["access-control-allow-origin"] == "http://localhost:3000"


# -- bad input ----------------------------------------------------------------------------------

PAST_CONTEXT = "word " * 700  # some 700 tokens: past A's context of 512
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
GEN = {"model": MODEL, "prompt": "Hi"}
BAD = [
    # (path, body: a dict as JSON or bytes as they are, status, what the error says)
    ("/api/generate", b'{"model": "x", "prompt": ', 400, "not valid JSON"),
    ("/v1/chat/completions", b'{"model": ', 400, "not valid JSON"),
    ("/v1/chat/completions", b'[1, 2]', 400, "JSON object"),
    ("/api/generate", b'{"model": "smollm2-135m:q4_1", "prompt": "caf\xe9"}', 400, "UTF-8"),
    ("/api/generate", {"model": 5, "prompt": "Hi"}, 400, "'model' must be a string"),
    ("/api/generate", {**GEN, "options": {"temperature": "hot"}}, 400, "'options.temperature' must be a number"),
    ("/api/generate", {**GEN, "options": {"temperature": -1}}, 400, "temperature"),
    ("/api/generate", {**GEN, "options": {"num_predict": -5}}, 400, "num_predict"),
    ("/api/generate", {**GEN, "stream": "yes"}, 400, "'stream' must be true or false"),
    ("/api/generate", {**GEN, "keep_alive": "soon"}, 400, "not a duration"),
    ("/api/generate", {**GEN, "options": {"num_ctx": 100000}}, 400, "num_ctx"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400, "'max_tokens' must be an integer >= 1"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**12}, 400, "past the context"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "ten"}, 400, "must be an integer"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "'temperature' must be a number from 0 to 2"),
    ("/v1/chat/completions", b'{"model": "smollm2-135m:q4_1", "messages": [{"role": "user", "content": "Hi"}], '
                             b'"temperature": NaN}', 400, "finite"),
    ("/v1/chat/completions", {**CHAT, "model": "no-such-model"}, 404, "not found"),
    ("/api/chat", {**CHAT, "model": "no-such-model:q4_0"}, 404, "not found"),
    ("/api/generate", {**GEN, "model": "../../etc"}, 404, "not found"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "non-empty array"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("/v1/chat/completions", {**CHAT, "stop": ["x"] * 10000}, 400, "at most 64 stop strings"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "'n'"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, 400, "'top_logprobs' needs 'logprobs'"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "'top_logprobs' must be"),
    ("/v1/completions", {**GEN, "logprobs": 9}, 400, "'logprobs' must be"),
    ("/v1/completions", {"model": MODEL, "prompt": PAST_CONTEXT}, 400, "context holds 512"),
    ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": PAST_CONTEXT}]}, 400, "context holds 512"),
    ("/v1/embeddings", {"model": MODEL, "input": "Hi"}, 404, "no such endpoint"),
    # structured output fails closed: what the grammar engine cannot hold to is a 400, never ignored
    ("/api/chat", {**CHAT, "format": "xml"}, 400, "'format' must be \"json\" or a JSON Schema"),
    ("/api/generate", {**GEN, "format": {"type": "strnig"}}, 400, "'format': the JSON Schema cannot be held to: "
                                                                  "Invalid type: strnig"),
    ("/api/chat", {**CHAT, "format": {"type": "array", "uniqueItems": True}}, 400, "uniqueItems"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(["}}}}, 400, "unclosed character class"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, 400, "'response_format.type' must be"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400,
     "'response_format.json_schema' is required"),
]


def _check_error(r, path: str, status: int, says: str) -> None:
    assert r.status_code == status, (path, r.status_code, r.text)
    error = r.json()["error"]
    message = error["message"] if path.startswith("/v1") else error
    if path.startswith("/v1"):
        assert set(error) >= {"message", "type", "code"}
    assert isinstance(message, str) and says in message, (path, message)
    assert "Traceback" not in r.text


@pytest.mark.parametrize("path, body, status, says", BAD, ids=[f"{p} {s}: {w}" for p, _, s, w in BAD])
def test_bad_input_is_one_error_and_the_server_lives_on(a, path, body, status, says):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{a.url}{path}", content=content, headers={**AUTH, "content-type": "application/json"},
                   timeout=WAIT_S)
    _check_error(r, path, status, says)
    if status == 400 and "context holds" in says:
        count = int(re.search(r"takes (\d+) tokens", r.text).group(1))
        assert count > 512
    ok = httpx.post(f"{a.url}/api/generate", json={**GEN, "stream": False, "options": {"num_predict": 1}},
                    headers=AUTH, timeout=WAIT_S)
    assert ok.status_code == 200 and ok.json()["eval_count"] == 1


def test_ollama_truncate_drops_the_oldest_turns(a):
    """Past the context, a 400 (BAD above) unless ollama's truncate asks: then the oldest turns
    go (the system message stays), or a raw prompt's start."""
    turns = [{"role": "system", "content": "You are terse."}]
    for i in range(12):
        turns += [{"role": "user", "content": f"Question {i}: " + "tell me more " * 20},
                  {"role": "assistant", "content": "More. " * 20}]
    turns.append({"role": "user", "content": "Last question: name a colour."})
    body = {"model": MODEL, "messages": turns, "stream": False, "options": {"num_predict": 3, "temperature": 0}}
    refused = httpx.post(f"{a.url}/api/chat", json=body, headers=AUTH, timeout=WAIT_S)
    assert refused.status_code == 400 and "context holds 512" in refused.json()["error"]
    cut = httpx.post(f"{a.url}/api/chat", json={**body, "truncate": True}, headers=AUTH, timeout=WAIT_S).json()
    # room for num_predict's 3 tokens; a turn here is some 100 tokens, so at most two too many went
    assert 1 <= cut["eval_count"] <= 3 and 512 - 3 - 200 < cut["prompt_eval_count"] <= 512 - 3, cut
    generated = httpx.post(f"{a.url}/api/generate", headers=AUTH, timeout=WAIT_S, json={
        "model": MODEL, "prompt": PAST_CONTEXT, "raw": True, "truncate": True, "stream": False,
        "options": {"num_predict": 3}}).json()
    assert generated["eval_count"] == 3 and generated["prompt_eval_count"] == 512 - 3


def test_bodies_past_the_limit_get_413_before_they_are_read(a):
    host, port = a.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as s:  # says 20 MB, sends 1 KB
        s.sendall(f"POST /api/generate HTTP/1.1\r\nHost: x\r\nX-Api-Key: {KEY}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {20 << 20}\r\n\r\n".encode() + b"{" + b" " * 1024)
        reply = b""
        while b"}" not in reply and (chunk := s.recv(65536)):  # the head, then the JSON body
            reply += chunk
    head, _, body = reply.decode(errors="replace").partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413") and "at most" in json.loads(body)["error"]
    r = httpx.post(f"{a.url}/v1/completions", content=b" " * (5 << 20), headers=AUTH, timeout=WAIT_S)
    _check_error(r, "/v1/completions", 413, "at most")


def test_a_model_that_fails_to_load_is_one_error_and_the_server_lives_on(a):
    r = httpx.post(f"{a.url}/v1/completions", json={"model": "broken:q4_1", "prompt": "Hi", "max_tokens": 2},
                   headers=AUTH, timeout=START_TIMEOUT_S)
    assert r.status_code == 500 and "loading broken:q4_1 failed" in r.json()["error"]["message"]
    assert "layer_000.bin" in r.json()["error"]["message"]
    assert [m.model for m in ol(a).ps().models] == [MODEL]
    assert oa(a).completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_run_ps_and_stop_talk_to_a_running_server(a, store_home, cli, monkeypatch):
    """`nerva run` answers through a running server (its model loaded already) as it does in its
    own process; `nerva ps` lists what the server holds, `nerva stop` unloads one."""
    monkeypatch.setenv("NERVA_HOME", str(store_home))
    monkeypatch.setenv("NERVA_HOST", a.url)
    monkeypatch.setenv("NERVA_API_KEY", KEY)
    ask = ("run", MODEL, "-p", "Name three colours.", "--temperature", "0", "-n", "12")
    made = metric(a, "nerva_generated_tokens_total")
    code, served, err = cli(*ask, "--verbose")
    assert code == 0 and f"answered by the nerva server at {a.url}" in err, err
    assert metric(a, "nerva_generated_tokens_total") - made == 12
    assert re.search(r"answer 12 tok, [\d.]+ tok/s", err)
    code, local, err = cli(*ask, "--no-server", "--threads", "1")
    assert code == 0 and "answered by" not in err
    assert served == local and served.strip()
    held = ("run", MODEL, "-p", "A person as JSON.", "--format", json.dumps(PERSON), "--seed", "2")
    code, served, err = cli(*held, "--verbose")  # the schema goes as ollama's `format`
    assert code == 0 and "answered by the nerva server" in err and json.loads(served).keys() == PERSON["properties"].keys()
    code, cut, err = cli(*held, "-n", "3")
    assert code == 1 and "stopped at --max-tokens (3) before its JSON Schema was complete" in err
    pexpect = pytest.importorskip("pexpect")  # the chat, in a terminal, as a person types it
    chat = pexpect.spawn(sys.executable, ["-m", "nerva_cli", "run", "smollm2-135m", "--temperature", "0", "-n", "4"],
                         env=dict(os.environ, PYTHONPATH=str(REPO)), encoding="utf-8", timeout=60)
    for line, shows in (("Hi", ""), ("/show info", "llama, 30 layers"), ("/set verbose", ""),
                        ("And a colour?", "answer 4 tok")):
        chat.expect(">>> ")
        chat.sendline(line)
        if shows:
            chat.expect(">>> ")
            assert shows in chat.before, chat.before
            chat.sendline("")
    chat.sendline("/bye")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0

    code, out, err = cli("ps")
    assert code == 0 and out.split("\n")[0].split() == ["NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    assert MODEL in out and "512" in out and "100% CPU" in out
    code, out, err = cli("ps", "--json")
    assert code == 0 and [m["name"] for m in json.loads(out)] == [MODEL]
    code, out, err = cli("stop", "no-such-model")
    assert code == 1 and "no-such-model" in err and len(err.strip().splitlines()) == 1
    code, out, err = cli("stop", "smollm2-135m")  # a bare name: the variant `run` would pick
    assert code == 0 and f"{MODEL}: unloaded" in err
    deadline = time.monotonic() + WAIT_S
    while MODEL in {m.model for m in ol(a).ps().models}:
        assert time.monotonic() < deadline, "nerva stop did not unload the model"
        time.sleep(0.1)
    assert oa(a).completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2  # loads again

    monkeypatch.setenv("NERVA_HOST", "127.0.0.1:9")  # nobody listens (discard)
    code, out, err = cli("ps")
    assert code == 1 and "no nerva server answers at http://127.0.0.1:9" in err and len(err.strip().splitlines()) == 1


def test_no_traceback_in_the_log(a):
    """Last in the module's use of A: none of the refusals above put a traceback in its log."""
    assert "Traceback" not in a.text() and "Exception" not in a.text()


# -- the command itself -------------------------------------------------------------------------

def test_serve_refuses_a_taken_port_in_one_line(cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, out, err = cli("serve", "--port", str(taken.getsockname()[1]), "--threads", "1")
    assert code == 1 and "is in use" in err and "Traceback" not in err


def test_host_and_duration_parsing():
    from nerva_cli.errors import BadInput
    from nerva_cli.serve.options import is_loopback, parse_duration, parse_host

    assert parse_host("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_host("http://[::1]:9000/") == ("::1", 9000)
    assert parse_host(":7000") == ("127.0.0.1", 7000) and parse_host("example.com") == ("example.com", None)
    assert parse_duration("5m", "x") == 300 and parse_duration("1h30m", "x") == 5400
    assert parse_duration(0, "x") == 0 and parse_duration("-1", "x") is None and parse_duration(-1, "x") is None
    assert parse_duration("250ms", "x") == 0.25 and parse_duration(30, "x") == 30
    for bad in ("soon", "5 m", "", True):
        with pytest.raises(BadInput):
            parse_duration(bad, "x")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
