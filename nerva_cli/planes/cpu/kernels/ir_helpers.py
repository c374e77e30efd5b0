"""LLVM IR helpers the intrinsics build their loops from (vectors, loads, reductions, prefetches,
the operands of numba arrays), and small intrinsics of plain IR."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()


def _vec(elt, n):
    return ir.VectorType(elt, n)


def _splat(elt, n, value):
    return ir.Constant(_vec(elt, n), [ir.Constant(elt, value)] * n)


def _lanes(indices):
    return ir.Constant(_vec(_I32, len(indices)), [ir.Constant(_I32, i) for i in indices])


def _load(builder, base, offset, ty):
    """A ty at byte offset of base (i8*), no alignment assumed."""
    return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=1)


def _broadcast(builder, scalar, n=8):
    v = builder.insert_element(ir.Constant(_vec(scalar.type, n), ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, _lanes([0] * n))


def _maxnum(builder, a, b):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 2),
                                        f"llvm.maxnum.v{a.type.count}f32")
    return builder.call(fn, [a, b])


def _fmuladd(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3),
                                        f"llvm.fmuladd.v{a.type.count}f32")
    return builder.call(fn, [a, b, c])


def _hsum(builder, v):
    """The lanes' sum in a fixed order (halves, then quarters, and so on)."""
    while v.type.count > 1:
        half = v.type.count // 2
        v = builder.fadd(builder.shuffle_vector(v, v, _lanes(range(half))),
                         builder.shuffle_vector(v, v, _lanes(range(half, 2 * half))))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _half_at(builder, row, b):
    return builder.fpext(_load(builder, row, builder.mul(b, ir.Constant(_I64, 2)), ir.HalfType()), _F32)


def _f32_at(builder, base, b, lanes=1, first=0):
    ty = _F32 if lanes == 1 else _vec(_F32, lanes)
    index = builder.add(b, ir.Constant(_I64, first))
    return _load(builder, base, builder.mul(index, ir.Constant(_I64, 4)), ty)


def _c_arrays(*arrays):
    return all(isinstance(a, types.NoneType) or (isinstance(a, types.Array) and a.layout == "C")
               for a in arrays)


def _planes_at(builder, base, b, n, elt, size):
    """n consecutive elements of a scale plane from block b, as a vector (floats widened from f16)."""
    v = _load(builder, base, builder.mul(b, ir.Constant(_I64, size)), _vec(elt, n))
    return builder.fpext(v, _vec(_F32, n)) if isinstance(elt, ir.HalfType) else v


def _intp(context, builder, sig, args, i):
    return context.cast(builder, args[i], sig.args[i], types.intp)


class _Operands:
    """Pointers into the numba arrays an intrinsic received (rows of a 2-D array by its row stride;
    the kernels' typing admits C-contiguous arrays only, so a row's elements are adjacent). The
    arguments that are not arrays (None, scalars) are None here."""

    def __init__(self, context, builder, types_, values):
        self.builder = builder
        self.arrays = [context.make_array(t)(context, builder, v) if isinstance(t, types.Array) else None
                       for t, v in zip(types_, values)]

    def data(self, i):
        return self.builder.bitcast(self.arrays[i].data, _I8.as_pointer())

    def row(self, i, r):
        stride = self.builder.extract_value(self.arrays[i].strides, 0)
        return self.builder.gep(self.data(i), [self.builder.mul(r, stride)])

    def cols(self, i):
        return self.builder.extract_value(self.arrays[i].shape, 1)


def _prefetch(builder, base, offset, locality=3):
    """A read prefetch of data; locality 3 (prefetcht0) keeps it in every cache level, 1
    (prefetcht2) from L2 outward. Past the matrix's end it asks for nothing harmful: a prefetch
    never faults."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
    builder.call(fn, [builder.gep(base, [offset]), ir.Constant(_I32, 0), ir.Constant(_I32, locality),
                      ir.Constant(_I32, 1)])


# How far ahead the matvecs ask the cache for codes. The hardware prefetcher does not ramp up over
# the short streams a thread walks (rows of a few hundred bytes, SmolLM2's 288 and 768; the float
# kernels take four at a time).
#
# The integer kernels (a row at a time) prefetch PREFETCH_BYTES ahead in the row's codes, which
# runs on into the thread's next rows. 8192 bytes were about the fastest distance tried;
# prefetching the scale planes as well was slower (docs/perf/code_figures.md).
PREFETCH_BYTES = 8192


@intrinsic
def _half_to_f32(typingctx, bits):
    """IEEE half bits (uint16) -> float32 by LLVM's fpext: one vcvtph2ps with F16C, exact for
    every input (subnormals, inf, NaN). Measured 25% faster on the Q4 matvecs than decoding the
    bits in numba code, whose branches sit in the per-block path; tests check all 65536 inputs."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _stack_f32(typingctx, n):
    """A float32[n] on the calling function's stack (n a literal), for numba.carray: scratch that
    is not a heap allocation, so decode stays allocation-free."""
    if not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, _F32, size=n.literal_value)
        ptr.align = 64  # a cache line: vector loads and stores never straddle two
        return ptr
    return types.CPointer(types.float32)(n), codegen


@intrinsic
def _stack_u16(typingctx, n):
    """A uint16[n] on the calling function's stack (n a literal), as _stack_f32."""
    if not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, _I16, size=n.literal_value)
        ptr.align = 64
        return ptr
    return types.CPointer(types.uint16)(n), codegen
