"""vmkv's serving engine against vLLM's CPU build: output tokens/s on the same model, work and threads.

Run: ``python -m vmkv_bench.engine_vs_vllm [--threads 2] [--requests 64] [--prompt-len 128]
[--max-tokens 128] [--batched-tokens 2048] [--rounds 3] [--model-dir DIR] [--kv-mode vmm]
[--memory-budget SIZE] [--no-vllm]``

The model is a random-weight Llama (12 layers, hidden 768, 12 query / 4 KV heads of 64,
intermediate 2048, vocabulary 8192) saved with a word-level tokenizer to ``--model-dir`` (a temp
dir by default), built offline: nothing is downloaded (``HF_HUB_OFFLINE=1``). Both engines get
the same requests (random prompt token ids, greedy, ``ignore_eos``, every request in flight at
once), float32, the same number of threads (vLLM: ``VLLM_CPU_OMP_THREADS_BIND`` on the first
``--threads`` cores; vmkv: ``torch.set_num_threads``). Rounds alternate the two engines; the
table shows each round, the median ratio and its spread, and how many requests produced the
same greedy tokens in both (float32 on both sides: near-ties may still differ in a few).

The vmkv engine's KV budget (``--memory-budget``) is, unless given, sized to the work: every
request whole at once (``--requests`` x (``--prompt-len`` + ``--max-tokens``) tokens, each
request rounded up to whole pages, x the model's KV bytes per token; :func:`kv_budget`), so it
never preempts (vLLM gets ``VLLM_CPU_KVCACHE_SPACE``, 2 GiB by default, far more than the work
needs). Both engines' preemptions are counted per round (vmkv: its engine stats; vLLM: its
``vllm:num_preemptions`` metric); a run in which either preempted says so in its verdict: a
preempted request is computed again, so the two engines did not do the same work.

vLLM is optional: without it the script says so and only times vmkv.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=4096)


def token_kv_bytes(element_size: int = 4) -> int:
    """KV bytes one token takes in the model (K and V of every layer; float32 by default)."""
    return 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * element_size


def kv_budget(requests: int, prompt_len: int, max_tokens: int, kv_mode: str = "vmm", block_size: int = 16) -> int:
    """Bytes of KV the vmkv engine needs to hold every request whole at once (so it never preempts).

    ``requests`` x (``prompt_len`` + ``max_tokens``) tokens x :func:`token_kv_bytes`, each request
    rounded up to whole pool pages (the cache's default VMM page for this model and budget, or
    ``block_size`` tokens in paged mode), the total rounded up to a MiB.
    """
    from vmkv.config import KVCacheConfig
    from vmkv.sizing import resolve

    tokens = prompt_len + max_tokens
    mib = 1 << 20

    def round_up(n: int, step: int) -> int:
        return -(-n // step) * step

    budget = round_up(requests * tokens * token_kv_bytes(), mib)
    for _ in range(8):  # the default page size may depend on the budget: repeat until it holds
        config = resolve(KVCacheConfig(num_layers=SHAPE["num_hidden_layers"], num_kv_heads=SHAPE["num_key_value_heads"],
                                       head_dim=SHAPE["head_dim"], dtype="float32", device="cpu", max_batch_size=requests,
                                       max_seq_len=tokens + 16, memory_budget=budget, block_size=block_size))
        per_page = block_size if kv_mode == "paged" else config.page_size // config.tensor_token_bytes()
        need = round_up(requests * round_up(tokens, per_page) * config.bytes_per_token, mib)
        if need <= budget:
            return budget
        budget = need
    return budget


def build_model_dir(root: Path, seed: int = 0) -> Path:
    """A random-weight Llama and a word-level tokenizer saved to ``root`` (idempotent)."""
    if (root / "config.json").is_file() and (root / "tokenizer.json").is_file():
        return root
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**SHAPE, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(root, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, SHAPE["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(root)
    return root


def cpu_seconds() -> float:
    """CPU time used so far by this process and every live child (vLLM's engine-core and worker
    processes), user + system."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def make_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(4, SHAPE["vocab_size"]) for _ in range(length)] for _ in range(count)]


class VmkvRunner:
    """vmkv's engine over the model directory, every request queued at once, stepped to the end."""

    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        from vmkv.engine import Engine, EngineConfig

        self.engine = Engine.from_config(EngineConfig(
            model=str(model_dir), kv_mode=args.kv_mode, memory_budget=args.memory_budget, max_num_seqs=args.requests,
            max_seq_len=args.prompt_len + args.max_tokens + 16, max_num_batched_tokens=args.batched_tokens,
            max_prefill_chunk=args.batched_tokens, prefix_caching=False, dtype="float32",
        ))
        self.max_tokens = args.max_tokens

    def preemptions(self) -> int:
        """Preemptions since the engine started."""
        return int(self.engine.stats()["engine"]["preemptions"])

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        from vmkv.engine import SamplingParams

        params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        ids = [self.engine.add_request(list(p), params) for p in prompts]
        done: dict[str, list[int]] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return [done[i] for i in ids]


class VllmRunner:
    """vLLM's offline ``LLM`` (CPU build) over the same directory."""

    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=str(model_dir), dtype="float32", max_model_len=args.prompt_len + args.max_tokens + 16,
                       max_num_seqs=args.requests, max_num_batched_tokens=max(args.batched_tokens, args.prompt_len + args.max_tokens + 16),
                       enable_prefix_caching=False, seed=0, disable_log_stats=False)  # stats: the preemption counter
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def preemptions(self) -> int | None:
        """Preemptions since the engine started (``vllm:num_preemptions``), ``None`` if vLLM does not report it."""
        try:
            values = [m.value for m in self.llm.get_metrics() if m.name == "vllm:num_preemptions"]
        except Exception:  # noqa: BLE001 -- stats off or another vLLM: say "unknown", not 0
            return None
        return int(sum(values)) if values else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``memory_budget`` is :func:`kv_budget` of the work unless given
    (``budget_sized`` says which)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batched-tokens", type=int, default=2048, help="tokens per step at most (both engines)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-mode", default="vmm", choices=["vmm", "paged"])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--memory-budget", default=None, help="vmkv's KV budget (default: what every request needs "
                        "at once, so it never preempts; vLLM: VLLM_CPU_KVCACHE_SPACE, 2 GiB)")
    parser.add_argument("--no-vllm", action="store_true", help="time vmkv only")
    args = parser.parse_args(argv)
    args.budget_sized = args.memory_budget is None
    if args.budget_sized:
        args.memory_budget = kv_budget(args.requests, args.prompt_len, args.max_tokens, args.kv_mode)
    return args


def main() -> None:
    args = parse_args()
    sized = args.budget_sized

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    import torch

    torch.set_num_threads(args.threads)
    model_dir = build_model_dir(args.model_dir or Path(tempfile.gettempdir()) / "vmkv-bench-llama-12x768")
    prompts = make_prompts(args.requests, args.prompt_len, seed=1)
    work = args.requests * args.max_tokens
    runners = {"vmkv": VmkvRunner(model_dir, args)}
    if not args.no_vllm:
        try:
            runners["vllm"] = VllmRunner(model_dir, args)
        except ImportError as exc:
            if importlib.util.find_spec("vllm") is not None:
                raise  # installed, but an import failed: an error, not a reason to time vmkv alone
            print(f"vLLM is not installed ({exc}); timing vmkv only")
    for runner in runners.values():  # warm-up: first-call allocations, oneDNN kernel creation
        runner.generate(prompts[: min(4, len(prompts))])
    times: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    preempted: dict[str, list[int | None]] = {name: [] for name in runners}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            before = runner.preemptions()
            cpu_start, start = cpu_seconds(), time.perf_counter()
            outputs[name] = runner.generate(prompts)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(cpu_seconds() - cpu_start)
            after = runner.preemptions()
            preempted[name].append(None if before is None or after is None else after - before)
    print(f"model {model_dir} ({SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}), float32, "
          f"threads={args.threads}, {args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} output tokens, "
          f"kv_mode={args.kv_mode}, vmkv KV budget {args.memory_budget if not sized else f'{args.memory_budget / 2**20:.0f} MiB'}"
          f"{' (sized to the work)' if sized else ' (given)'}")
    for name, ts in times.items():
        print(f"  {name:5s} output tokens/s per round: " + ", ".join(f"{work / t:.0f}" for t in ts)
              + f"   median {work / statistics.median(ts):.0f}; CPU-seconds per round (this process and its "
              f"children): median {statistics.median(cpu[name]):.1f} for {statistics.median(ts):.1f} s of wall time; "
              f"preemptions per round: {', '.join('unknown' if n is None else str(n) for n in preempted[name])}")
    preempting = [name for name, counts in preempted.items() if any(counts)]
    unknown = [name for name, counts in preempted.items() if None in counts]
    caveat = ""
    if preempting:
        caveat = (f"; {' and '.join(f'{n} preempted {sum(c or 0 for c in preempted[n])} times' for n in preempting)}: "
                  "preempted requests were computed again"
                  + (", so the two engines did NOT do the same work (not like for like)" if len(runners) > 1 else "")
                  + ("; raise --memory-budget or leave it unset" if "vmkv" in preempting and not sized else ""))
    if unknown:
        caveat += f"; preemptions of {' and '.join(unknown)} unknown"
    if "vllm" in times:
        ratios = sorted(v / m for v, m in zip(times["vllm"], times["vmkv"]))
        same = sum(a == b for a, b in zip(outputs["vmkv"], outputs["vllm"]))
        ratio = statistics.median(ratios)
        print(f"verdict: vmkv engine = {ratio:.2f}x vLLM CPU in output tokens/s (per-round {ratios[0]:.2f}-{ratios[-1]:.2f}; "
              f"target >= 0.9: {'met' if ratio >= 0.9 else 'not met'}); identical greedy outputs {same}/{len(prompts)}"
              f"{caveat}")
    elif caveat:
        print("note: " + caveat.removeprefix("; "))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
