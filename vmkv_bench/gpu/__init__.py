"""The GPU check's sections (``python benchmarks/gpu_check.py``; their registry is :mod:`vmkv_bench.registry`)."""
