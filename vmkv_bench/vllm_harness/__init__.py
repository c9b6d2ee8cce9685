"""vLLM with and without the vmkv plugin on the same work, for the benchmarks and the end-to-end tests
(:mod:`.drive`: engines and servers; :mod:`.tiny`: a tiny model built offline)."""
