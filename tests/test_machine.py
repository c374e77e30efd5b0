"""Process set-up that run, bench and profile share (nerva_cli/hardware/machine.py)."""

from __future__ import annotations

import subprocess
import sys

# A fresh interpreter does what a prefill chunk does to the allocator, three times: six 3 MiB
# temporaries alive at once (18 MiB: SmolLM2's peak at 1800 positions), then freed, and prints
# the page faults of each round. Pages that glibc gave back are faulted in again the next time.
PROBE = r"""
import resource, sys
if sys.argv[1] == "set-up":
    from nerva_cli.hardware.machine import configure_threads
    configure_threads(1)
import numpy as np
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    live = [np.ones(3 << 20, np.uint8) for _ in range(6)]
    del live
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""
PAGES = (18 << 20) // 4096


def _faults_per_round(arm: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", PROBE, arm], capture_output=True, text=True, check=True)
    return [int(n) for n in out.stdout.split()]


def test_prefill_temporaries_are_not_faulted_in_again_once_the_process_is_set_up():
    """Measured on glibc 2.36: 4615, 4596, 4576 faults by default; 4596, 0, 0 set up. Where the
    default no longer gives the pages back, the test says so rather than pass on nothing."""
    default = _faults_per_round("none")
    assert min(default[1:]) > PAGES // 2, f"the default allocator kept the pages: {default}"
    first, *later = _faults_per_round("set-up")
    assert first > PAGES // 2 and max(later) < PAGES // 20, (first, later)
