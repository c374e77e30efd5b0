"""The CPU backend: ref's kernel contract compiled with numba and threaded (ARCHITECTURE section 7).

Kernels compile on first use and are cached on disk (`cache=True`). They release the GIL
(`nogil`), so the pager's reader thread issues its disk reads while they compute. Decode kernels allocate
nothing; the tiny ones (a few hundred elements, ~300 calls a token) run on one thread because a
parallel region costs more than their work (CPU-NOTES); the matvecs and decode attention run in
parallel. Threads: `set_threads`.

This package is the contract (what get_backend("cpu") returns); the kernels live in its modules:
  numba_setup        numba's cache directory and start-up patches, the cache stamp, fast-math
                     flags, set_threads (imported first, before numba is)
  target             the compile target's features, which pick the lowerings
  ir_helpers         LLVM IR helpers and small intrinsics
  norms              rmsnorm, add_rmsnorm, add_rows, rope
  integer_dots       the integer dots and row walk of W4A8, W8A8 and W8A16
  q4_float           W4A16 in float lanes (AVX-512F's table lowering), Q4 dequantisation
  q4_bf16            W4A16 in bf16 dot products (AVX512-BF16)
  q4_w4a8            W4A8 rows, short prompts' batches and the rows-in-lanes prompt GEMM; W4A16 on
                     Q16 codes (no AVX-512F)
  q4                 the Q4 matvecs, matmuls, a mixture's experts' matvecs, dequantisation and token
                     lookup of the contract
  quantize_act       activation quantisation (Q8, Q16, prefill's fake-quantised rows)
  q8                 Q8_0 matvecs and their batch forms, dequantisation and token lookup
  exact              f16 / bf16 matrices as stored
  gemm               prefill's GEMMs, short_prefill_rows and batch_matches_matvec
  glu                SiLU and GeLU gates and their exp
  routing            a mixture of experts' router (top-k and weights)
  decode_attention   decode attention
  prefill_attention  prefill attention
  layer              a resident layer's decode step in a few calls (decode_layer_halves)
  disk_cache         warm_marker, compiled_before, counting_compiles
  sampling           host sampling (penalise, sample_logits)

numba's disk cache keys each function on its own file's source, so a kernel that inlines IR or
calls a kernel from another file would keep stale machine code when only that file changed
(numba issue 1833): numba_setup stamps every function cached from this folder with the whole
folder's sources instead, so an edit to any of these modules has numba compile them all again.

Fast-math: `_FAST` allows reassociation (so reductions vectorise) and FMA contraction, but not
the no-NaN/no-inf assumptions, so inf and NaN still propagate as IEEE says.
"""

from __future__ import annotations

# first: the cache directory is set before numba's import, and the cache stamp before any kernel
from nerva_cli.planes.cpu.kernels.numba_setup import set_threads

from nerva_cli.planes.cpu.compile_aside import compile_aside, compile_only  # Engine.warm_up's
from nerva_cli.planes.cpu.kernels.decode_attention import (
    attention_decode, attention_decode_rows, attention_geometry, attention_kernel, decode_splits, pack_sizes)
from nerva_cli.planes.cpu.kernels.disk_cache import compiled_before, counting_compiles, warm_marker
from nerva_cli.planes.cpu.kernels.exact import embed_exact, matmul_exact, matvec_exact, widen_exact
from nerva_cli.planes.cpu.kernels.gemm import (
    GEMM_MIN_ROWS, GEMM_SLICE_BYTES, batch_matches_matvec, gemm_exact, gemm_q4, gemm_q8, short_prefill_rows)
from nerva_cli.planes.cpu.kernels.glu import gelu_mul, silu_mul
from nerva_cli.planes.cpu.kernels.layer import decode_layer_halves
from nerva_cli.planes.cpu.kernels.norms import add_rmsnorm, add_rows, rmsnorm, rope
from nerva_cli.planes.cpu.kernels.prefill_attention import attention_prefill
from nerva_cli.planes.cpu.kernels.q4 import (
    dequantize_q4, embed_q4, matmul_q4_w4a8, matmul_q4_w4a16, matvec_q4_experts_w4a8, matvec_q4_experts_w4a16,
    matvec_q4_w4a8, matvec_q4_w4a16)
from nerva_cli.planes.cpu.kernels.q8 import (
    dequantize_q8, embed_q8, matmul_q8_w8a8, matmul_q8_w8a16, matvec_q8_w8a8, matvec_q8_w8a16)
from nerva_cli.planes.cpu.kernels.quantize_act import fake_quantize_q8, quantize_act_q8, quantize_act_q16
from nerva_cli.planes.cpu.kernels.routing import route_experts
from nerva_cli.planes.cpu.kernels.sampling import penalise, sample_logits

__all__ = [
    "set_threads", "compile_aside", "compile_only", "compiled_before", "counting_compiles", "warm_marker",
    "rmsnorm", "add_rmsnorm", "add_rows", "rope", "silu_mul", "gelu_mul",
    "quantize_act_q8", "quantize_act_q16", "fake_quantize_q8",
    "matvec_q4_w4a16", "matmul_q4_w4a16", "matvec_q4_w4a8", "matmul_q4_w4a8", "dequantize_q4", "embed_q4",
    "matvec_q4_experts_w4a8", "matvec_q4_experts_w4a16", "route_experts",
    "matvec_q8_w8a16", "matvec_q8_w8a8", "matmul_q8_w8a16", "matmul_q8_w8a8", "dequantize_q8", "embed_q8",
    "matvec_exact", "matmul_exact", "widen_exact", "embed_exact",
    "short_prefill_rows", "batch_matches_matvec", "GEMM_SLICE_BYTES", "GEMM_MIN_ROWS", "gemm_q4", "gemm_q8", "gemm_exact",
    "attention_decode", "attention_decode_rows", "attention_geometry", "attention_kernel", "decode_splits", "pack_sizes", "attention_prefill",
    "decode_layer_halves", "penalise", "sample_logits",
]
