"""vmkv's benchmarks and GPU check: small clients of the library (docs/benchmarks.md, docs/gpu.md)."""
