"""The gated MLP's activations (SiLU and GeLU times up) and the exp they vectorise with, which
attention's softmax uses too."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from nerva_cli.planes.cpu.kernels.ir_helpers import _F32, _I32
from nerva_cli.planes.cpu.kernels.numba_setup import F32, _FAST


@intrinsic
def _pow2(typingctx, n):
    """2^n for an integral float32 n in -126..127, written straight into the exponent bits (plain
    IR, so a loop around it still vectorises)."""
    def codegen(context, builder, sig, args):
        i = builder.fptosi(args[0], _I32)
        biased = builder.add(i, ir.Constant(_I32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(_I32, 23)), _F32)
    return types.float32(types.float32), codegen


@njit(cache=True, fastmath=_FAST, inline="always")
def _exp_nonpositive(x):
    # exp(x) for x <= 0 (NaN stays NaN): 2^n e^r with r = x - n ln2 in [-ln2/2, ln2/2] and e^r
    # by its Taylor series to r^7, within 1 eps (relative) of float64's exp on [-87, 0] (tested;
    # 0.62 eps at worst, measured). No call to libm, so loops over it vectorise; below -87 it
    # gives exp(-87), 1.6e-38.
    x = x if not x < F32(-87) else F32(-87)
    n = np.floor(x * F32(1.4426950408889634) + F32(0.5))
    r = (x - n * F32(0.693359375)) + n * F32(2.12194440e-4)  # ln2 in two parts: n times the first is exact
    p = ((((((F32(1 / 5040) * r + F32(1 / 720)) * r + F32(1 / 120)) * r + F32(1 / 24)) * r
            + F32(1 / 6)) * r + F32(0.5)) * r + F32(1)) * r + F32(1)
    return p * _pow2(n)


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def silu_mul(gate_up, out):
    # silu(g) = g sigmoid(g), the sigmoid from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0 and
    # e / (1 + e) below, so the one exp takes a non-positive argument and the loop vectorises
    # (_exp_nonpositive; libm's exp kept it scalar, and so did numba's zero-divisor check, which
    # error_model="numpy" drops: 1 + e >= 1), several times faster (docs/perf/code_figures.md).
    # Rows of the fused gate/up output are read in place: prefill copied the halves out first. On
    # one thread in prefill too: a parallel version saved little and cost a first run more
    # compiling.
    _glu(gate_up, out, F32(1), F32(0))


_GELU_C1 = F32(2 * np.sqrt(2 / np.pi))  # 0.5 (1 + tanh(u)) is sigmoid(2u)
_GELU_C3 = F32(2 * np.sqrt(2 / np.pi) * 0.044715)


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def gelu_mul(gate_up, out):
    # GeGLU, GeLU's tanh form as g sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)): silu_mul's
    # vectorising sigmoid on another argument
    _glu(gate_up, out, _GELU_C1, _GELU_C3)


@njit(cache=True, fastmath=_FAST, inline="always", error_model="numpy")
def _glu(gate_up, out, c1, c3):
    # out = g sigmoid(g (c1 + c3 g^2)) up, the sigmoid from e = exp(-|a|) <= 1: 1 / (1 + e) for
    # a >= 0, e / (1 + e) below; inlined where c1 and c3 are constants, which fold (silu: 1, 0)
    f = out.shape[-1]
    gu, o2 = gate_up.reshape(-1, 2 * f), out.reshape(-1, f)
    for t in range(o2.shape[0]):
        for i in range(f):
            g = gu[t, i]
            a = g * (c1 + c3 * g * g)
            e = _exp_nonpositive(-abs(a))
            o2[t, i] = g * ((F32(1) if a >= 0 else e) / (F32(1) + e)) * gu[t, f + i]
