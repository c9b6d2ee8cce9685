"""The engine's fused, pre-packed linears (vmkv.engine.llama.PackedLinear / LlamaForCausalLM.pack)
give the outputs of the plain ``nn.Linear`` path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vmkv
from vmkv.engine.llama import PackedLinear, linear_backend
from vmkv.engine.runner import cache_config_for, load_model

BACKENDS = ["torch"] + (["onednn"] if linear_backend(torch.device("cpu"), torch.float32)[0] == "onednn" else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_the_layers_it_fuses(backend, dtype):
    if backend == "onednn" and linear_backend(torch.device("cpu"), dtype)[0] != "onednn":
        pytest.skip(f"oneDNN packing is not used for {dtype} on this CPU")
    torch.manual_seed(0)
    layers = [nn.Linear(48, 32, bias=True), nn.Linear(48, 16, bias=False), nn.Linear(48, 8, bias=True)]
    layers = [layer.to(dtype) for layer in layers]
    fused = PackedLinear(layers, backend)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 48).to(dtype)
        parts = fused.split(x)
        assert [p.shape[-1] for p in parts] == [32, 16, 8]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for part, layer in zip(parts, layers):
            torch.testing.assert_close(part, layer(x), atol=tol, rtol=tol)


def _run(model, steps):
    """Logits of a prefill of two sequences then ``steps`` decode steps, on a fresh VMM cache."""
    cache = vmkv.open_cache(cache_config_for(model, max_batch_size=2, max_seq_len=128, memory_budget="8MiB",
                                             page_size="16KiB"))
    try:
        prompts = {"a": list(range(5, 30)), "b": list(range(40, 47))}
        for seq_id in prompts:
            cache.add(seq_id)
        plan = cache.begin_step({s: len(p) for s, p in prompts.items()})
        ids = torch.tensor([t for p in prompts.values() for t in p])
        positions = torch.cat([torch.arange(len(p)) for p in prompts.values()])
        rows = torch.tensor([len(prompts["a"]) - 1, len(ids) - 1])
        logits = [model(cache, plan, ids, positions, rows)]
        lengths = {s: len(p) for s, p in prompts.items()}
        for _ in range(steps):
            nxt = logits[-1].argmax(-1)
            plan = cache.begin_step({"a": 1, "b": 1})
            logits.append(model(cache, plan, nxt, torch.tensor([lengths["a"], lengths["b"]]), torch.arange(2)))
            lengths = {s: n + 1 for s, n in lengths.items()}
        return torch.stack(logits)
    finally:
        cache.close()


def test_the_packed_forward_equals_the_modules_forward():
    model = load_model(None).model
    assert model.linear_backend == linear_backend(torch.device("cpu"), torch.float32)[0]  # packed at load
    model.pack("modules")
    want = _run(model, steps=4)
    for backend in BACKENDS:
        model.pack(backend)
        torch.testing.assert_close(_run(model, steps=4), want, atol=1e-4, rtol=1e-4)


def test_load_weights_repacks():
    model = load_model(None).model
    backend = model.linear_backend
    before = _run(model, steps=1)
    state = {name: tensor * 1.5 for name, tensor in model.state_dict().items()}
    model.load_weights(state)
    assert model.linear_backend == backend
    after = _run(model, steps=1)
    model.pack("modules")
    torch.testing.assert_close(after, _run(model, steps=1), atol=1e-3, rtol=1e-3)  # logits 1.5x larger
    assert not torch.allclose(after, before)


def test_an_unknown_backend_is_refused():
    model = load_model(None).model
    with pytest.raises(vmkv.InvalidConfig, match="linear backend"):
        model.pack("blas")
    assert model.linear_backend in BACKENDS  # unchanged
