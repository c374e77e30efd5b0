#!/usr/bin/env python3
"""The machine-code instruction mix of a kernel's loops, without a GPU: NVRTC compiles the source
(as the runtime does), nvdisasm (pip install nvidia-cuda-nvdisasm) disassembles it, and each loop
(a backward branch) prints its instruction count by opcode, with how many are integer or
conversion ops. The integer pipe issues at half the FP32 rate on sm_80..sm_90, so a decode kernel
whose loop is mostly such work cannot stream weights at HBM speed, however many bytes it keeps
in flight.

    python3 scripts/sass_mix.py kernels/matvec.cu matvec_q4_w4a16 [--arch sm_90] [-D MV_ROWS=4]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Integer and conversion opcodes (which pipe runs IMAD and IDP varies by architecture)
INTEGER = {"LOP3", "SHF", "IADD3", "VIADD", "LEA", "IMAD", "I2FP", "I2F", "F2I", "ISETP", "SEL", "PRMT", "IDP",
           "IABS", "IMNMX", "VIMNMX", "MOV", "POPC", "FLO", "BFE", "BFI", "SGXT"}


def nvdisasm() -> str:
    found = shutil.which("nvdisasm") or next(
        (p for d in sys.path for p in glob.glob(os.path.join(d, "nvidia", "*", "bin", "nvdisasm"))), None)
    if not found:
        sys.exit("sass_mix.py: nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    return found


def loops(sass: str, kernel: str) -> list[collections.Counter]:
    """Opcode counts of each loop of `kernel` (instructions from a label to a branch back to it)."""
    section = sass.split(f".text.{kernel}:", 1)
    if len(section) < 2:
        sys.exit(f"sass_mix.py: no kernel {kernel!r} in the disassembly")
    body = section[1].split("//----", 1)[0]
    ops, labels, found = [], {}, []
    for line in body.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ops)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;", line):
            ops.append(m.group(1))
            target = re.search(r"`\((\.L_x_\d+)\)", line) if m.group(1) == "BRA" else None
            # a branch back to a label is a loop; the branch-to-self after EXIT is not
            if target and len(ops) - labels.get(target.group(1), len(ops)) > 1:
                found.append(collections.Counter(ops[labels[target.group(1)]:]))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("kernel")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro for NVRTC, e.g. MV_ROWS=4")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from nerva_cli.planes.cuda.nvrtc import compile_cubin, resources

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compile_cubin(args.source, args.arch, defines=tuple(args.defines)))
        f.flush()
        sass = subprocess.run([nvdisasm(), f.name], check=True, capture_output=True, text=True).stdout
    r = resources(args.source, args.arch, tuple(args.defines)).get(args.kernel)
    if r:
        print(f"{args.kernel} ({args.arch}): {r['registers']} registers, {r['stack']} bytes stack frame, "
              f"{r['spill_stores']} bytes spill stores, {r['spill_loads']} bytes spill loads (a loop's LDL and STL "
              "below are its spill traffic)")
    for i, ops in enumerate(loops(sass, args.kernel)):
        total, integer = sum(ops.values()), sum(n for op, n in ops.items() if op in INTEGER)
        mix = ", ".join(f"{op} {n}" for op, n in ops.most_common())
        print(f"{args.kernel} ({args.arch}) loop {i}: {total} instructions, {integer} integer: {mix}")


if __name__ == "__main__":
    main()
