"""Contiguous mode (``kv_mode="contiguous"``): every request's K/V is one virtually contiguous slot
per layer, read by the stock contiguous kernel; vLLM's block table is the page table.

* :mod:`.pages` -- the page rule: one vLLM block is one page of a slot (no vLLM import but for
  the two functions reading a ``VllmConfig``);
* :mod:`.support` -- what the mode supports and how many slots it has, read from vLLM's config
  at engine start (both sides and vLLM's front end);
* :mod:`.assign` -- scheduler side: which slot each request holds, what each slot maps, and the
  proof that no full block is written (no vLLM import);
* :mod:`.slots` -- worker side: the slot ranges over the KV buffer, blocks mapped into them, and
  each device's slot layout (:data:`~.slots.SLOT_LAYOUTS`; no vLLM import);
* :mod:`.backend` -- vLLM's attention backend over the slots (worker side, and vLLM's front end
  choosing it).

The paged mode's sides (:mod:`vmkv.vllm.scheduler`, :mod:`vmkv.vllm.worker`) carry contiguous
mode's per-step slot changes next to their page changes.
"""
