"""The GPU check's sections and runner (``python benchmarks/gpu_check.py``).

* :mod:`.registry` -- what a section is, its context, how to add one;
* :mod:`.sections` -- the registry of sections, in run order, with their time estimates;
* :mod:`.runner` -- processes, the time budget, the JSON and the summary;
* :mod:`.workload` -- the decode workload shared by the kernel sections;
* :mod:`.core` -- environment, tests, zero_page, decode, map_unmap;
* :mod:`.kernels` -- paged_vs_vmm: both addressings of every kernel, bandwidth, split counts;
* :mod:`.memory` -- shared_budget (where the device memory goes);
* :mod:`.slots` -- vllm_slots (vLLM contiguous mode's parts without vLLM);
* :mod:`.bench` -- bench (the main job on the GPU);
* :mod:`.vllm_engine` -- vllm and vllm_addressing (need vLLM on the GPU);
* :mod:`.vllm_smoke` -- the vllm section's run: stock vLLM and vLLM + vmkv on the tiny model.
"""
