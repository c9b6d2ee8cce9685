"""Helpers every benchmark module shares: timing, request traces, cache shapes, tables, JSON, plots.

The module contract (what ``vmkv bench`` calls)::

    NAME: str                      registry name, e.g. "memory"
    DESCRIPTION: str               one line for ``vmkv bench --help``
    add_arguments(parser)          the module's own options
    run(args) -> dict              args has device ("cpu"|"cuda"), smoke, seed, out (Path)
    plot(result, out_dir) -> list[str]   optional: PNG paths written

``run`` returns ``{"name", "schema", "rows", "summary", ...}`` (see :func:`make_result`).
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

import vmkv

# Llama-3-8B KV geometry: 32 layers, 8 KV heads of 128, fp16 -> 2 KiB per token per layer tensor.
LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}

# Mean (input, output) tokens of the two request traces of the vLLM paper (Kwon et al., 2023).
TRACES = {
    "sharegpt": {"input_mean": 161.0, "output_mean": 338.0, "sigma": 0.9},
    "alpaca": {"input_mean": 19.0, "output_mean": 58.0, "sigma": 0.7},
}


@dataclass(frozen=True)
class Request:
    """One request of a trace: prompt and output lengths in tokens, in arrival order."""

    rid: int
    prompt: int
    output: int

    @property
    def total(self) -> int:
        return self.prompt + self.output


def make_trace(kind: str, count: int, seed: int, max_len: int) -> list[Request]:
    """A seeded ShareGPT-like or Alpaca-like trace of ``count`` requests.

    Input and output lengths are lognormal with the trace's means (``mu = ln(mean) - sigma^2/2``),
    at least 1 token, and ``prompt + output <= max_len`` (the output is cut when needed).

    Raises:
        vmkv.InvalidConfig: unknown trace kind.
    """
    if kind not in TRACES:
        raise vmkv.InvalidConfig(f"trace must be one of {sorted(TRACES)}, got {kind!r}")
    spec = TRACES[kind]
    gen = torch.Generator().manual_seed(seed)
    sigma = spec["sigma"]

    def draw(mean: float) -> torch.Tensor:
        mu = math.log(mean) - sigma**2 / 2
        return torch.exp(mu + sigma * torch.randn(count, generator=gen, dtype=torch.float64))

    prompts = draw(spec["input_mean"]).round().clamp(1, max_len // 2).long().tolist()
    outputs = draw(spec["output_mean"]).round().clamp(min=1).long().tolist()
    return [Request(i, p, max(1, min(o, max_len - p))) for i, (p, o) in enumerate(zip(prompts, outputs))]


def trace_stats(trace: Sequence[Request]) -> dict[str, float]:
    """Mean prompt and output lengths of a trace (to check it against the paper's)."""
    return {
        "requests": len(trace),
        "mean_input": statistics.fmean(r.prompt for r in trace),
        "mean_output": statistics.fmean(r.output for r in trace),
    }


def synchronize(device: str) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], device: str, *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_interleaved(fns: dict[str, Callable[[], Any]], device: str, *, repeat: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median wall time of each ``fn()`` in seconds, the candidates taking turns run by run.

    Interleaving spreads drifts of a shared machine (frequency, other processes) over all
    candidates alike, which is what a ratio measured side by side needs.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run the block with ``count`` torch CPU threads (unchanged when ``None``), then restore."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_read_bandwidth(device: str, nbytes: int = 512 * 2**20, repeat: int = 5) -> float:
    """Bytes per second this machine reads from memory: ``torch.sum`` over a large fp32 tensor.

    ``nbytes`` should be well past the last-level cache; the default reads 512 MiB.
    """
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    seconds = time_call(lambda: data.sum(), device, repeat=repeat, warmup=2)
    return data.numel() * 4 / seconds


def cache_config(shape: dict[str, Any], device: str, **fields: Any) -> vmkv.KVCacheConfig:
    """A :class:`vmkv.KVCacheConfig` of model ``shape`` on ``device`` with ``fields`` set."""
    return vmkv.KVCacheConfig(**shape, device=device, **fields)


def paged_available() -> tuple[bool, str]:
    """Whether paged mode can be opened, and if not, why (the package may still be in progress)."""
    try:
        import paged  # noqa: F401

        paged.PagedKVCache  # noqa: B018 - raises AttributeError while the package is a stub
    except (ImportError, AttributeError) as exc:
        return False, f"paged mode unavailable: {exc}"
    return True, ""


def check_device(device: str) -> None:
    """Raise :class:`vmkv.BackendUnavailable` if ``device`` is ``cuda`` and no GPU is usable."""
    if device not in ("cpu", "cuda"):
        raise vmkv.InvalidConfig(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise vmkv.BackendUnavailable("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def make_result(name: str, schema: dict[str, str], rows: list[dict[str, Any]], summary: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The JSON-serialisable result of a benchmark.

    Args:
        name: the benchmark's registry name.
        schema: every row field -> its meaning (with unit).
        rows: the table, one dict per row with exactly the schema's fields.
        summary: headline numbers and which goals were met.
        extra: more top-level entries (e.g. ``series`` for plots, ``config``).
    """
    return {"name": name, "schema": schema, "rows": rows, "summary": summary, "machine": machine(), **extra}


def write_json(result: dict[str, Any], out_dir: Path) -> Path:
    """Write ``result`` to ``out_dir/<name>.json`` and return the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result['name']}.json"
    path.write_text(json.dumps(result, indent=1, default=_jsonable) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None, *, markdown: bool = False) -> str:
    """Rows as an aligned text table (or a Markdown table), floats rounded for reading."""
    rows = list(rows)
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_cell(row.get(col, "")) for col in columns] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(line) + " |" for line in cells]
        return "\n".join(lines)
    widths = [max(len(col), *(len(line[i]) for line in cells)) for i, col in enumerate(columns)]
    lines = ["  ".join(col.ljust(w) for col, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_dir: Path, filename: str) -> str:
    """Save ``fig`` as ``out_dir/filename`` (PNG), close it, return the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return str(path)


def progress(iterable: Iterable[Any], desc: str, total: int | None = None, enabled: bool = True):
    """A tqdm progress bar on stderr (plain iteration when ``enabled`` is False)."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)
