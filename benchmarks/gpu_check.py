#!/usr/bin/env python
"""One command that checks and measures everything CUDA in vmkv, in at most 8 minutes on an H200.

    python benchmarks/gpu_check.py                        # on an NVIDIA GPU: every section
    python benchmarks/gpu_check.py --list                 # the sections and their estimates
    python benchmarks/gpu_check.py --device cpu --smoke   # dry run of the same code on the CPU

Exit status: 0 passed (or skipped, with the reason), 1 a section failed, 2 bad arguments, 3 no
CUDA GPU. The sections are in ``vmkv_bench/registry.py``; docs/gpu.md says what each checks.
"""

import sys
import time
from pathlib import Path

STARTED = time.monotonic()  # the budget counts from here, torch's import included
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from vmkv_bench.runner import check_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(check_main(started=STARTED))
