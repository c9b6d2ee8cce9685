#!/usr/bin/env python
"""One command that checks and measures everything CUDA in vmkv, in at most 8 minutes on an H200.

    python benchmarks/gpu_check.py                        # on an NVIDIA GPU: every section
    python benchmarks/gpu_check.py --list                 # the sections and their estimates
    python benchmarks/gpu_check.py --out DIR --sections zero_page decode --budget-s 120
    python benchmarks/gpu_check.py --device cpu --smoke   # dry run of the same code on the CPU

Every section runs in a process of its own (a CUDA fault loses that section only); one whose
estimate does not fit in what is left of ``--budget-s`` (default 480 s) is skipped with the
reason. The run ends with one screen of summary (each section's verdict and headline number)
and the verdict line; everything is in ``DIR/gpu_check.json`` (default ``gpu-check-out/``),
rewritten after every section. Nothing is installed or downloaded; missing optional packages
(flash-attn, FlashInfer, vLLM, triton) are named.

Exit status: 0 every section passed (or was skipped, with the reason); 1 a section failed;
2 bad arguments; 3 no CUDA GPU here (one line says why; nothing ran).

The sections live in ``vmkv_bench/gpu/`` (the registry: ``vmkv_bench/gpu/sections.py``; how to
add one: ``vmkv_bench/gpu/registry.py``); docs/gpu.md says what each checks and measures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

STARTED = time.monotonic()  # the budget counts from here, torch's import included

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from vmkv_bench.gpu.memory import shared_budget_section  # noqa: E402,F401  (kept importable from here)
from vmkv_bench.gpu.runner import main  # noqa: E402
from vmkv_bench.gpu.workload import SMOKE  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main(started=STARTED))
