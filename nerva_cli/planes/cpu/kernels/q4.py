"""The Q4_0 / Q4_1 kernels of the contract: W4A16 and W4A8 matvecs and short prompts' batch
kernels, each picking its lowering for the target, and the dequantisation and token lookup."""

from __future__ import annotations

import numpy as np
from numba import njit

from nerva_cli.planes.cpu.kernels.numba_setup import _threads
from nerva_cli.planes.cpu.kernels.q4_bf16 import _BF16_WORDS_A_PAIR, _w4a16_bf16, _w4a16_bf16_batch
from nerva_cli.planes.cpu.kernels.q4_float import _dequantize_q4, _w4a16_batch, _w4a16_by_row
from nerva_cli.planes.cpu.kernels.q4_w4a8 import (
    _LANES_FROM, _lane_rows, _w4a16_q16, _w4a16_q16_batch, _w4a16_q16_experts, _w4a8, _w4a8_batch, _w4a8_experts,
    _w4a8_lanes)
from nerva_cli.planes.cpu.kernels.target import _AVX512BF16, _AVX512F


# -- Q4_0 / Q4_1 matvecs --------------------------------------------------------------------
#
# The inner loops are LLVM vector IR (numba intrinsics): numba types integer arithmetic as int64
# and keeps no SIMD register across loop iterations. W4A16 takes four rows a call through every
# block and keeps a <16 x float> accumulator per row, its lanes summed once, at the end, or with
# AVX-512F a row a call that looks its weights up (_w4a16_row), or with AVX512-BF16 a row a call
# in bf16 dot products (_w4a16_bf16_row); W4A8 takes a row a call (see integer_dots.py). Against
# the numba kernels before them (the first IR kernels, four rows a call), about twice as fast
# (docs/perf/code_figures.md).
#
# m is None for Q4_0 (w = d (q - 8)) and the Q4_1 offsets (w = d q + m) otherwise; the IR is
# built for one case or the other, so Q4_0 pays nothing for Q4_1.
#
# GB/s figures of the kernels as they stand: scripts/cpu_matvec_bench.py (--dram for a matrix
# read from DRAM, --lowering avx2 for the kernels a host without AVX-512 runs); the figures of
# kernels since replaced were taken with their commits.


def _bits(a):
    """An f16 plane as the uint16 view the kernels decode (numba has no float16); None stays."""
    return None if a is None else a.view(np.uint16)


@njit(cache=True, nogil=True)
def _w4a16_float(qs, d, m, x, xq16, xd, xs, quantize, out):
    # AVX-512F's W4A16 kernels take x as it is: _w4a16_kernel's signature, the Q16 scratch unread
    _w4a16_float_kernel(qs, d, m, x, out)


# Globals, so compiled callers type the one this host runs, through one signature (qs, d, m, x,
# xq16, xd, xs, quantize, out): bf16 dot products (AVX512-BF16), row tables (AVX-512F), else
# the integer kernel on Q16 codes (q4_w4a8._w4a16_q16), whose scratch the others leave alone
_w4a16_float_kernel = _w4a16_bf16 if _AVX512BF16 else _w4a16_by_row
_w4a16_kernel = _w4a16_float if _AVX512F else _w4a16_q16
_q16_buffers = [np.empty(0, np.int16), np.empty(0, np.float32), np.empty(0, np.int32)]


def _q16_scratch(n):
    """Buffers for n Q16 codes and their groups' scales and sums, made again only when a wider
    one is needed: a decode step allocates nothing."""
    if _q16_buffers[0].shape[0] < n:
        _q16_buffers[:] = np.empty(n, np.int16), np.empty(n // 32, np.float32), np.empty(n // 32, np.int32)
    return _q16_buffers


def matvec_q4_w4a16(qs, d, m, x, out):
    _w4a16_kernel(qs, d.view(np.uint16), _bits(m), x, *_q16_scratch(x.shape[0]), True, out)


_bf16_scratch = [np.empty(0, np.uint16), np.empty(0, np.float32)]  # the batch's split activations


def matmul_q4_w4a16(qs, d, m, x, out):
    """out[t] = matvec_q4_w4a16 of activation t, the rows of x [T, cols], bit for bit; out [T, rows]
    may be a column slice of a wider array: each row's Q16 codes in the integer batch walk
    without AVX-512F, else _w4a16_row's tables or (AVX512-BF16) its dots, as the matvec picks."""
    if not _AVX512F:
        acts, cols = x.shape
        xq16, xd, xs = _q16_scratch(acts * cols)
        groups = acts * cols // 32
        _w4a16_q16_batch(qs, d.view(np.uint16), _bits(m), np.ascontiguousarray(x),
                         xq16[:acts * cols].reshape(acts, cols), xd[:groups].reshape(acts, -1),
                         xs[:groups].reshape(acts, -1), out)
        return
    if not _AVX512BF16:
        _w4a16_batch(qs, d.view(np.uint16), _bits(m), x, out)
        return
    acts, cols = x.shape
    blocks = cols // 32
    width = (blocks + 1) // 2 * _BF16_WORDS_A_PAIR
    if _bf16_scratch[0].shape[0] < acts * width or _bf16_scratch[1].shape[0] < acts * blocks:
        _bf16_scratch[0] = np.empty(max(acts * width, _bf16_scratch[0].shape[0]), np.uint16)
        _bf16_scratch[1] = np.empty(max(acts * blocks, _bf16_scratch[1].shape[0]), np.float32)
    words = _bf16_scratch[0][:acts * width].reshape(acts, width)
    sums = _bf16_scratch[1][:acts * blocks].reshape(acts, blocks)
    _w4a16_bf16_batch(qs, d.view(np.uint16), _bits(m), x, words, sums, out)


_x_pairs = [np.empty(0, np.int8)]  # the pair-ordered activation of the wrapper's calls


def _pair_scratch(cols):
    """A buffer for cols activation codes in _pair_order, made again only when a wider one is
    needed: a decode step allocates nothing."""
    if _x_pairs[0].shape[0] < cols:
        _x_pairs[0] = np.empty(cols, np.int8)
    return _x_pairs[0]


def matvec_q4_w4a8(qs, d, m, xq, xd, xs, out):
    _w4a8(qs, d.view(np.uint16), _bits(m), xq, _pair_scratch(xq.shape[0]), xd, xs, out)


_lane_buffers = [np.empty(0, np.uint32), np.empty(0, np.uint16)]  # _w4a8_lanes's packed rows, a worker each


def _lane_scratch(workers, blocks, lanes):
    """(codes [workers, blocks, 4, lanes] uint32, scales and offsets [workers, blocks, lanes]
    uint16), over buffers made again only when a wider matrix needs more."""
    words, halves = workers * blocks * 4 * lanes, 2 * workers * blocks * lanes
    if _lane_buffers[0].size < words:
        _lane_buffers[0] = np.empty(words, np.uint32)
    if _lane_buffers[1].size < halves:
        _lane_buffers[1] = np.empty(halves, np.uint16)
    planes = _lane_buffers[1][:halves].reshape(2, workers, blocks, lanes)
    return _lane_buffers[0][:words].reshape(workers, blocks, 4, lanes), planes[0], planes[1]


def matmul_q4_w4a8(qs, d, m, xq, xd, xs, out):
    """out[t] = matvec_q4_w4a8 of activation t, the rows of xq [T, cols] and xd, xs [T, cols / 32],
    bit for bit; out [T, rows] may be a column slice of a wider array. With AVX2 or AVX-512BW
    and at least _LANES_FROM activations, rows in lanes (q4_w4a8._LANE_ACTS); else each row
    against eight activations at a time (and four, and one)."""
    lanes = _lane_rows()
    if lanes and xq.shape[0] >= _LANES_FROM:
        rows, blocks = d.shape
        workers = max(1, min(_threads[0], (rows + lanes - 1) // lanes))
        codes, scales, offsets = _lane_scratch(workers, blocks, lanes)
        _w4a8_lanes(qs.view(np.uint32), d.view(np.uint16), _bits(m), xq, xd, xs, out, codes, scales, offsets)
        return
    acts, cols = xq.shape
    x_pairs = _pair_scratch(acts * cols)[:acts * cols].reshape(acts, cols)
    _w4a8_batch(qs, d.view(np.uint16), _bits(m), xq, x_pairs, xd, xs, out)


_expert_buffers: dict = {}  # code type -> (codes, pair-ordered codes, scales, sums), made again only when wider


def _expert_scratch(acts: int, cols: int, codes: type):
    """[acts, cols] codes of type `codes` (and their pair order), [acts, cols / 32] scales and sums."""
    have = _expert_buffers.get(codes)
    if have is None or have[0].size < acts * cols:
        have = _expert_buffers[codes] = (np.empty(acts * cols, codes), np.empty(acts * cols, codes),
                                         np.empty(acts * cols // 32, np.float32), np.empty(acts * cols // 32, np.int32))
    n, g = acts * cols, acts * cols // 32
    return (have[0][:n].reshape(acts, cols), have[1][:n].reshape(acts, cols), have[2][:g].reshape(acts, -1),
            have[3][:g].reshape(acts, -1))


def matvec_q4_experts_w4a8(qs, d, m, experts, x, out):
    """out[j] = matvec_q4_w4a8 of expert experts[j]'s rows of the stacked matrix and x[j]'s Q8
    codes (x[0]'s where x has one row), bit for bit, in one parallel region (ref's contract)."""
    xq, x_pairs, xd, xs = _expert_scratch(x.shape[0], x.shape[1], np.int8)
    _w4a8_experts(qs, d.view(np.uint16), _bits(m), experts, x, xq, x_pairs, xd, xs, out)


def matvec_q4_experts_w4a16(qs, d, m, experts, x, out):
    """out[j] = matvec_q4_w4a16 of expert experts[j]'s rows and x[j] (x[0] where x has one row),
    bit for bit: on Q16 codes in one parallel region, or with AVX-512F (float activations) a
    matvec an expert."""
    if _AVX512F:
        rows = out.shape[1]
        for j in range(experts.shape[0]):
            lo, hi = experts[j] * rows, (experts[j] + 1) * rows
            matvec_q4_w4a16(qs[lo:hi], d[lo:hi], None if m is None else m[lo:hi], x[0 if x.shape[0] == 1 else j],
                            out[j])
        return
    xq, _, xd, xs = _expert_scratch(x.shape[0], x.shape[1], np.int16)
    _w4a16_q16_experts(qs, d.view(np.uint16), _bits(m), experts, x, xq, xd, xs, out)


def dequantize_q4(qs, d, m, out):
    _dequantize_q4(qs, d.view(np.uint16), _bits(m), out)


@njit(cache=True, nogil=True)
def _embed_q4(qs, d, m, token, out):
    row = out.reshape(1, -1)
    if m is None:
        _dequantize_q4(qs[token:token + 1], d[token:token + 1], None, row)
    else:
        _dequantize_q4(qs[token:token + 1], d[token:token + 1], m[token:token + 1], row)


def embed_q4(qs, d, m, token, out):
    _embed_q4(qs, d.view(np.uint16), _bits(m), token, out)
