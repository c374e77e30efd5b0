"""Random shapes and options through the decode kernels on the CPU emulation, whose memory and race
checks (tests/cuda_emu) are the point: a case fails on an EmuKernelError, or on a result far from
ref. Not collected by pytest (the suite's tests cover chosen shapes); run it after changing a
kernel, for as long as you like. Exits 1 if any case failed.

    python3 tests/fuzz_emulated_kernels.py [--seed N] [--seconds S]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from cuda_emu import EmuKernelError  # noqa: E402
from cuda_emu.device import EmuDevice  # noqa: E402
from nerva_cli.planes import ref  # noqa: E402
from nerva_cli.planes.cuda.launch import Kernels, attention_splits, prefill_partials, unsupported_shapes  # noqa: E402
from nerva_cli.runtime.sampling import SamplingOptions  # noqa: E402
from test_kernels import random_q4, random_q8, randn, rel, rope_tables  # noqa: E402

PRECISIONS = ("w4a16", "w4a8", "f16", "bf16")


class Fuzz:
    def __init__(self, rng: np.random.Generator):
        self.rng, self.dev = rng, EmuDevice()
        self.k = Kernels(self.dev)

    def up(self, a):
        return self.dev.upload(np.ascontiguousarray(a))

    def down(self, a):
        return self.dev.download(a)

    def matrix(self, precision: str, rows: int, cols: int, kind: str = "q4_0") -> dict:
        if precision == "f16":
            return {"w": self.up(randn(self.rng, rows, cols).astype(np.float16))}
        if precision == "bf16":  # the top halves of f32s, as store.py keeps bf16
            return {"w": self.up((randn(self.rng, rows, cols).view(np.uint32) >> 16).astype(np.uint16))}
        if kind == "q8_0":
            q8, d = random_q8(self.rng, rows, cols)
            return {"q8": self.up(q8), "d": self.up(d)}
        qs, d, m = random_q4(self.rng, rows, cols, kind)
        return {"qs": self.up(qs), "d": self.up(d), **({} if m is None else {"m": self.up(m)})}

    def matvecs(self) -> None:
        """One matvec (plain, adding, or adding then normalising), several in a launch, or a GLU;
        quantised weights as Q4_0, Q4_1 or Q8_0 (no GLU: a token table's), one format a launch."""
        rng, k = self.rng, self.k
        stored = rng.choice(PRECISIONS)
        kind = str(rng.choice(["q4_0", "q4_1", "q8_0"]))
        precision = "f16" if stored == "bf16" else stored  # the launch's name for exact weights
        cols = 32 * int(rng.integers(1, 160))

        def matrix(rows: int) -> dict:
            return self.matrix(stored, rows, cols, kind)

        x = self.up(randn(rng, cols))
        shape = rng.choice(["one", "several", "norm"] + ([] if kind == "q8_0" else ["glu"]))
        if shape == "one":
            rows = int(rng.integers(1, 3000))
            k.matvec(matrix(rows), x, self.up(randn(rng, rows)), precision, add=bool(rng.integers(2)))
        elif shape == "several":
            rows = [int(rng.integers(1, 700)) for _ in range(int(rng.integers(1, 4)))]
            k.matvecs([matrix(r) for r in rows], x, [self.up(randn(rng, r)) for r in rows], precision,
                      bool(rng.integers(2)))
        elif shape == "norm":
            rows = 4 * int(rng.integers(1, 1500))
            out, done = self.up(randn(rng, rows)), self.up(np.zeros(1, np.int32))
            for _ in range(2):  # the block count must be back at 0 for the second launch
                k.matvec(matrix(rows), x, out, precision, add=True,
                         norm=(self.up(randn(rng, rows)), self.up(np.zeros(rows, np.float32)), 1e-5, done))
            assert self.down(done)[0] == 0, ("norm count", rows)
        else:
            rows = int(rng.integers(1, 1500))
            k.glu(matrix(rows), matrix(rows), x, self.up(np.zeros(rows, np.float32)), precision)

    def rmsnorm(self) -> None:
        n, rows = 4 * int(self.rng.integers(1, 4096)), int(self.rng.integers(1, 5))
        x, w = randn(self.rng, rows, n), randn(self.rng, n)
        out, want = self.up(np.zeros_like(x)), np.empty_like(x)
        self.k.rmsnorm(self.up(x), self.up(w), 1e-5, out)
        ref.rmsnorm(x, w, 1e-5, want)
        assert rel(self.down(out), want) < 1e-5, ("rmsnorm", rows, n)

    def heads(self) -> tuple[int, int, int]:
        """(heads, kv heads, head dim) of a shape the engine accepts."""
        kvh = int(self.rng.integers(1, 5))
        while True:
            hd = 2 * int(self.rng.integers(1, 129))
            widths = SimpleNamespace(head_dim=hd, hidden_size=64, intermediate_size=64, q_dim=64)
            if not unsupported_shapes(widths):
                return kvh * int(self.rng.integers(1, 5)), kvh, hd

    def attention_decode(self) -> None:
        rng, k = self.rng, self.k
        heads, kvh, hd = self.heads()
        n = int(rng.integers(1, 3000))
        ctx = n + int(rng.integers(1, 600))
        splits = attention_splits(heads, ctx, int(rng.choice([4, 16, 132])))
        kc, vc = (self.up(randn(rng, ctx, kvh, hd).astype(np.float16)) for _ in range(2))
        cos, sin = rope_tables(ctx, hd)
        q, k_new, v_new = randn(rng, heads, hd), randn(rng, kvh, hd), randn(rng, kvh, hd)
        out = self.up(np.zeros((heads, hd), np.float32))
        done = self.up(np.zeros(heads, np.int32))
        k.attention_decode(self.up(q), self.up(k_new), self.up(v_new), self.up(cos), self.up(sin), kc, vc,
                           self.up(np.array([n - 1], np.int32)),
                           self.up(np.zeros(heads * splits[1] * (hd + 2), np.float32)), done, out, heads, splits)
        q_rot = q.copy()
        ref.rope(q_rot, np.array([n - 1]), cos, sin)
        want = np.empty((heads, hd), np.float32)  # over the cache as the kernel left it (its new row)
        ref.attention_decode(q_rot, self.down(kc).astype(np.float32), self.down(vc).astype(np.float32), n, want)
        assert rel(self.down(out), want) < 1e-4, ("attention_decode", heads, kvh, hd, n, splits)
        assert (self.down(done) == 0).all(), ("attention_decode count", heads, splits)

    def attention_prefill(self) -> None:
        rng = self.rng
        heads, kvh, hd = self.heads()
        T, start = int(rng.integers(1, 40)), int(rng.integers(0, 200))
        stride = heads * hd + 2 * kvh * hd
        rows = randn(rng, T, stride)
        kc, vc = (randn(rng, start + T, kvh, hd).astype(np.float16) for _ in range(2))
        out = self.up(np.zeros((T, heads, hd), np.float32))
        splits = int(rng.integers(1, 9))
        part = self.up(np.zeros(prefill_partials(T, heads, kvh, hd, splits), np.float32))
        done = self.up(np.zeros(T * heads, np.int32))
        self.k.attention_prefill(self.up(rows), stride, self.up(kc), self.up(vc),
                                 self.up(np.array([start], np.int32)), out, T, heads, splits, part, done)
        q = rows[:, :heads * hd].reshape(T, heads, hd).copy()
        want = np.empty_like(q)
        ref.attention_prefill(q, kc.astype(np.float32), vc.astype(np.float32), start, want)
        assert rel(self.down(out), want) < 1e-4, ("attention_prefill", heads, kvh, hd, T, start, splits)
        assert (self.down(done) == 0).all(), ("attention_prefill count", heads, kvh, T, splits)

    def sample(self) -> None:
        rng = self.rng
        vocab = int(rng.integers(2, 200000))
        logits = randn(rng, vocab) * float(rng.choice([0.1, 1, 10]))
        if rng.integers(3) == 0:
            logits = np.round(logits)  # many ties: the candidate paths' fallbacks
        opts = SamplingOptions(temperature=float(rng.choice([0, 0.5, 1.0, 1.5])),
                               top_k=int(rng.choice([0, 1, 40, 400, 2000])),
                               top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1])),
                               repeat_penalty=float(rng.choice([1.0, 1.3])), seed=int(rng.integers(1 << 30)))
        state = self.up(np.array((3, 0, 0, 0), np.int32))
        recent = self.up(rng.integers(0, vocab, 64).astype(np.int32))
        self.k.sample(self.up(logits), state, recent, opts, True)
        assert 0 <= self.down(state)[1] < vocab, ("sample", vocab, opts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=120)
    args = ap.parse_args()
    fuzz = Fuzz(np.random.default_rng(args.seed))
    cases = [fuzz.matvecs, fuzz.rmsnorm, fuzz.attention_decode, fuzz.attention_prefill, fuzz.sample]
    start, ran, failed = time.time(), 0, 0
    while time.time() - start < args.seconds:
        case = cases[int(fuzz.rng.integers(len(cases)))]
        try:
            case()
        except (EmuKernelError, AssertionError) as e:
            failed += 1
            print(f"FAIL {case.__name__}: {e}", flush=True)
        ran += 1
    print(f"seed {args.seed}: {ran} cases, {failed} failed, {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
