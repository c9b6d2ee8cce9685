"""Harness that runs vLLM with and without the vmkv plugin on the same work, for the benchmarks
(``vmkv bench vllm``, the GPU check's vLLM sections) and the end-to-end tests.

* :mod:`.drive` -- start stock and vmkv engines (``vllm.LLM``) or OpenAI servers in the same
  environment but for the plugin's flag, feed them requests, sample their KV memory;
* :mod:`.tiny` -- a tiny Llama checkpoint built offline (random weights, a byte tokenizer).

Not part of the library: :mod:`vmkv.vllm` imports nothing from here.
"""
