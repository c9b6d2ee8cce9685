"""vLLM with and without the vmkv plugin on the same work (:mod:`.drive`), on a tiny model built offline
(:mod:`.tiny`): for the benchmarks and the end-to-end tests."""
