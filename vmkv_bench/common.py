"""What every benchmark shares: interleaved timing, request traces, cache configurations, spreads and
verdicts, tables, JSON and plots (the module contract and the verdict's rules: docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import sys
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

import vmkv
from vmkv.sizes import format_size

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
    """A seeded ShareGPT-like or Alpaca-like trace of ``count`` requests."""
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


TRIM_FROM = 5
"""From this many samples on, a spread's range leaves out the lowest and highest (an interrupted round)."""


@dataclass(frozen=True)
class Spread:
    """A measured value with its spread over repeats: the median and a min-max range."""

    value: float
    low: float
    high: float
    runs: int
    deterministic: bool = False
    kept: int | None = None
    samples: tuple[float, ...] = ()  # the repeats themselves (``of``), in the order measured: a sign test reads them

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Spread":
        """Median of ``samples`` and their min-max (of the middle ``n - 2`` from :data:`TRIM_FROM` on)."""
        if not samples:
            raise vmkv.InvalidInput("a spread needs at least one sample")
        ordered = sorted(samples)
        inner = ordered[1:-1] if len(ordered) >= TRIM_FROM else ordered
        return cls(statistics.median(ordered), inner[0], inner[-1], len(ordered), kept=len(inner), samples=tuple(samples))

    @classmethod
    def exact(cls, value: float) -> "Spread":
        """A deterministic value (a seeded replay): no spread."""
        return cls(value, value, value, 1, deterministic=True)

    @property
    def crosses_one(self) -> bool:
        """Whether the range has rounds on both sides of 1.0 (reaching 1.0 is not crossing it)."""
        return self.low < 1.0 < self.high

    def scaled(self, factor: float) -> "Spread":
        """The same spread multiplied by ``factor`` (> 0)."""
        return Spread(self.value * factor, self.low * factor, self.high * factor, self.runs, self.deterministic, self.kept,
                      tuple(x * factor for x in self.samples))

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high, "runs": self.runs, "kept": self.kept or self.runs}


@dataclass
class Timings:
    """Seconds per call of each candidate, one sample per round (rounds interleave candidates)."""

    samples: dict[str, list[float]]

    def median(self, name: str) -> float:
        """Median seconds per call of ``name``."""
        return statistics.median(self.samples[name])

    def spread(self, name: str) -> Spread:
        """Median and min-max seconds per call of ``name``."""
        return Spread.of(self.samples[name])

    def ratio(self, numerator: str, denominator: str) -> Spread:
        """``numerator / denominator`` time round by round (paired): the median of the ratios and their range."""
        pairs = zip(self.samples[numerator], self.samples[denominator])
        return Spread.of([a / b for a, b in pairs])


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
"""``wall``: elapsed time; ``cpu``: the calling thread's CPU time, which other processes cannot inflate."""


def pick_clock(requested: str, device: str, threads: int | None) -> str:
    """``requested``, or for ``auto`` ``cpu`` when the work runs on one CPU thread of this process, else ``wall``."""
    one_thread = device == "cpu" and (threads or torch.get_num_threads()) == 1
    if requested == "auto":
        return "cpu" if one_thread else "wall"
    if requested == "cpu" and not one_thread:
        raise vmkv.InvalidConfig("--clock cpu measures the calling thread only: use it on --device cpu with --threads 1")
    if requested not in CLOCKS:
        raise vmkv.InvalidConfig(f"clock must be auto, {' or '.join(CLOCKS)}; got {requested!r}")
    return requested


def time_interleaved(
    fns: dict[str, Callable[[], Any]], device: str, *, repeat: int = 5, warmup: int = 1, min_sample_s: float = 0.0,
    clock: str = "wall",
) -> Timings:
    """Time every ``fn()`` in rounds: each round runs every candidate once, in a fresh (seeded) random order."""
    now = CLOCKS[clock]

    def per_call(fn: Callable[[], Any], count: int) -> float:
        start = now()
        for _ in range(count):
            fn()
        synchronize(device)
        return (now() - start) / count

    warm = {name: per_call(fn, max(1, warmup)) for name, fn in fns.items()}  # seconds per call, warming up
    numbers = {name: max(1, math.ceil(min_sample_s / once)) if once > 0 and min_sample_s else 1 for name, once in warm.items()}
    order = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name in order.sample(list(fns), len(fns)):
            times[name].append(per_call(fns[name], numbers[name]))
    return Timings(times)


def rotated(names: Sequence[str], round_: int) -> list[str]:
    """``names`` starting ``round_`` places further along: rounds that take turns share the machine's drift."""
    names = list(names)
    shift = round_ % len(names) if names else 0
    return names[shift:] + names[:shift]


def generate_rounds(
    names: Sequence[str], repeats: int, device: str, clock: str, run_once: Callable[[str], tuple[Any, Any]],
    failed: dict[str, str], key: Callable[[str], str], tag: str, row: Callable[[str, Any, Spread], dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Time ``run_once(name) -> (cache, output ids)`` of every name in rotating rounds (one that raises goes to
    ``failed[key(name)]``): per name that ran, ``row(name, last cache, seconds)`` plus ``same_tokens_as_dynamic``,
    and its seconds; caches closed."""
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, tuple[Any, Any]] = {}
    for round_ in range(repeats):
        for name in rotated(names, round_):
            if key(name) in failed:
                continue
            synchronize(device)
            start = now()
            try:
                cache, out = run_once(name)
            except Exception as exc:  # noqa: BLE001 - a cache that cannot run is reported, the others go on
                failed[key(name)] = f"{type(exc).__name__}: {exc}"
                print(f"[generate] {tag}{name} left out: {failed[key(name)]}", file=sys.stderr)
                continue
            synchronize(device)
            times[name].append(now() - start)
            if name in last and hasattr(last[name][0], "close"):
                last[name][0].close()
            last[name] = (cache, out)
    reference = last["dynamic"][1] if "dynamic" in last else None
    rows = []
    for name, (cache, out) in last.items():
        same = reference is None or bool(torch.equal(out, reference))
        rows.append({**row(name, cache, Spread.of(times[name])), "same_tokens_as_dynamic": same})
        if hasattr(cache, "close"):
            cache.close()
    return rows, {name: times[name] for name in last}


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


def read_bandwidth_probe(device: str, nbytes: int = 256 * 2**20) -> tuple[Callable[[], Any], int]:
    """A :func:`time_interleaved` candidate reading ``nbytes``, and its bytes: the read bandwidth of the moment."""
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return (lambda: data.sum()), data.numel() * 4


def measure_read_bandwidth(device: str, nbytes: int = 256 * 2**20, repeat: int = 5) -> Spread:
    """Bytes per second this machine reads from memory (``torch.sum`` over fp32): median, min-max."""
    probe, size = read_bandwidth_probe(device, nbytes)
    timings = time_interleaved({"read": probe}, device, repeat=repeat, warmup=2)
    return Spread.of([size / t for t in timings.samples["read"]])


def percentiles_us(values_ns: list[int]) -> dict[str, float]:
    """``median``, ``p90``, ``mean`` and ``max`` of nanosecond samples, in microseconds."""
    ordered = sorted(values_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3  # noqa: E731
    return {"median": pick(0.5), "p90": pick(0.9), "mean": statistics.fmean(ordered) / 1e3, "max": ordered[-1] / 1e3}


def available_memory() -> int | None:
    """Bytes of memory the kernel says are available (``MemAvailable``), ``None`` if unknown."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), None)


def cache_config(shape: dict[str, Any], device: str, **fields: Any) -> vmkv.KVCacheConfig:
    """A config of ``shape`` on ``device``, laid out as a cache would here: a benchmark names what it measures."""
    return vmkv.sizing.resolve(vmkv.KVCacheConfig(**shape, device=device, **fields))


def cache_refusals(planned: Iterable[tuple[str, str, vmkv.KVCacheConfig]], granularity: int) -> dict[str, str]:
    """Why each ``(label, mode, config)`` would not open on pages of ``granularity`` (label -> why, for those only),
    no device used."""
    from vmkv.config import check_mode
    from vmkv.sizing import DeviceFacts, check_page_size, paged_geometry, resolve, vmm_geometry

    refused = {}
    for label, mode, config in planned:
        check_mode(mode)
        config = resolve(config, DeviceFacts(config.device.type, granularity))
        try:
            check_page_size(config, granularity)
            if mode == "vmm":
                vmm_geometry(config, granularity)
            else:
                paged_geometry(config)
        except vmkv.InvalidConfig as exc:
            refused[label] = str(exc)
    return refused


def geometry(cache: vmkv.KVCacheBase) -> str:
    """A cache's pages in words: ``"16-token blocks"`` or ``"per_layer, 64 KiB pages"``."""
    if cache.mode == "paged":
        return f"{cache.tokens_per_page}-token blocks"
    return f"{cache.config.layout}, {format_size(cache.geometry.piece_bytes).replace('.0 ', ' ')} pages"


def check_device(device: str) -> None:
    """Raise :class:`vmkv.BackendUnavailable` if ``device`` is ``cuda`` and no GPU is usable."""
    if device not in ("cpu", "cuda"):
        raise vmkv.InvalidConfig(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise vmkv.BackendUnavailable("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        **({"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}),
    }


def make_result(name: str, schema: dict[str, str], rows: list[dict[str, Any]], summary: dict[str, Any],
                **extra: Any) -> dict[str, Any]:
    """The JSON-serialisable result of a benchmark."""
    return {"name": name, "schema": schema, "rows": rows, "summary": summary, "machine": machine(), **extra}


TIE_MARGIN = 0.05
"""A ratio whose repeats reach into 1.0 +- 5 % is called a tie even when they agree on the side."""


@dataclass(frozen=True)
class Verdict:
    """One answer of a benchmark: a line of the verdict table ``vmkv bench`` ends with."""

    key: str
    question: str
    result: str
    spread: str
    winner: str
    side: str
    reference: str = ""
    agrees: bool | None = None
    value: float | None = None
    low: float | None = None
    high: float | None = None
    reliable: bool = True
    note: str = ""
    better: str = ""
    worse: str = ""
    relation: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def spread_text(spread: Spread, unit: str = "x") -> str:
    """``"1.55-1.70x, 5 runs"``, ``"94-97 %, 3 runs"``, ``"exact (seeded)"`` or ``"1 run: no spread"``."""
    if spread.deterministic:
        return "exact (seeded)"
    if spread.runs == 1:
        return "1 run: no spread"
    runs = f"{spread.runs} runs" if (spread.kept or spread.runs) == spread.runs else f"middle {spread.kept} of {spread.runs} runs"
    return f"{number_text(spread.low, unit, bare=True)}-{number_text(spread.high, unit)}, {runs}"


def number_text(value: float, unit: str = "x", bare: bool = False) -> str:
    """A ratio as ``"1.62x"`` (2 significant decimals), a fraction as ``"97 %"`` / ``"1.3 %"``."""
    if unit == "%":
        pct = 100 * value
        text = f"{pct:.1f}" if abs(pct) < 10 else f"{pct:.0f}"
        return text if bare else f"{text} %"
    text = f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
    return text if bare else f"{text}x"


SIGN_TEST_ALPHA = 0.05
"""A side is named when a one-sided sign test over the paired rounds says so (5 of 5, 7 of 7, 8 of 9)."""


def sign_test(ratios: Sequence[float]) -> tuple[int, int, float]:
    """The sign test of paired per-round ratios against "either side equally likely"."""
    above, below = sum(r > 1.0 for r in ratios), sum(r < 1.0 for r in ratios)
    n, k = above + below, max(above, below)
    p = sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n if n else 1.0
    return above, below, p


def _ratio_side(ratio: Spread, better: str, worse: str, tie_margin: float) -> tuple[str, str]:
    """``(winner text, side)`` of a timed ratio from its paired rounds (see :func:`ratio_verdict`)."""
    band = (1.0 / (1.0 + tie_margin), 1.0 + tie_margin)
    leader, margin = (better, ratio.value) if ratio.value >= 1.0 else (worse, 1.0 / ratio.value)
    if ratio.samples:
        above, below, p = sign_test(ratio.samples)
        rounds = f"{above if leader == better else below} of {len(ratio.samples)} rounds"
    else:  # a spread built without its rounds: its kept range stands for them
        p, rounds = 1.0, f"{ratio.kept or ratio.runs} kept rounds"
    clear = ratio.low > band[1] or ratio.high < band[0]  # every kept round beyond the noise band
    if band[0] < ratio.value < band[1] or not (p < SIGN_TEST_ALPHA or clear):
        if ratio.crosses_one and p >= SIGN_TEST_ALPHA:  # the kept rounds (the spread shown) fall on both sides
            return "tie (spread crosses 1.0)", "tie"
        why = f"by under {100 * tie_margin:.0f} %" if band[0] <= ratio.value <= band[1] else "too few rounds for a sign test"
        return f"tie ({leader} ahead in {rounds}, {why})", "tie"
    return f"{leader}, {number_text(margin)} ({rounds})", leader


def target_status(ratio: Spread, target: float) -> str:
    """"met", "missed" or "not resolved (...)": ``ratio`` (> 1: ours better) against ``>= target`` on the
    evidence a verdict names a side on, drawn at the target instead of 1.0 (docs/benchmarks.md)."""
    if ratio.deterministic:
        return "met" if ratio.value >= target else "missed"
    if ratio.runs < 2:
        return "not judged (1 run)"
    p = sign_test([sample / target for sample in ratio.samples])[2] if ratio.samples else 1.0
    if ratio.value >= target and (ratio.low >= target or p < SIGN_TEST_ALPHA):
        return "met"
    if ratio.value < target and (ratio.high < target or p < SIGN_TEST_ALPHA):
        return "missed"
    return f"not resolved (the median {'meets' if ratio.value >= target else 'misses'} it, the rounds' spread crosses it)"


def ratio_verdict(
    key: str, question: str, ratio: Spread, better: str, worse: str, *,
    reference: str = "", agrees: bool | None = None, note: str = "", tie_margin: float = TIE_MARGIN,
    target: float | None = None,
) -> Verdict:
    """A verdict on ``ratio`` = how many times ``better`` beats ``worse`` (> 1: ``better`` wins)."""
    if ratio.runs < 2 and not ratio.deterministic:
        winner, side = "not judged (1 run)", ""
    elif ratio.deterministic:
        if ratio.value > 1.0 + tie_margin:
            winner, side = f"{better}, {number_text(ratio.value)}", better
        elif ratio.value < 1.0 / (1.0 + tie_margin):
            winner, side = f"{worse}, {number_text(1.0 / ratio.value)}", worse
        else:
            winner, side = f"tie (within {100 * tie_margin:.0f} %)", "tie"
    else:
        winner, side = _ratio_side(ratio, better, worse, tie_margin)
    relation = ""
    if target is not None:
        status = target_status(ratio, target)
        reference = reference or f"target >= {target}x"
        agrees = {"met": True, "missed": False}.get(status)
        relation = "" if agrees is not None else status.split(" (")[0]
    return Verdict(
        key=key, question=question, result=number_text(ratio.value), spread=spread_text(ratio), winner=winner, side=side,
        reference=reference, agrees=agrees, value=ratio.value, low=ratio.low, high=ratio.high, note=note,
        better=better, worse=worse, relation=relation,
    )


def unreliable(key: str, question: str, why: str, value: Spread | None = None, unit: str = "x") -> Verdict:
    """A verdict whose measurement failed its own sanity check: shown, never silently fixed."""
    if value is None:
        return Verdict(key=key, question=question, result="unreliable", spread="", winner="no verdict", side="",
                       reliable=False, note=why)
    return Verdict(key=key, question=question, result=f"{number_text(value.value, unit)} (unreliable)",
                   spread=spread_text(value, unit), winner="no verdict", side="", reliable=False, note=why,
                   value=value.value, low=value.low, high=value.high)


def judged(key: str, question: str, why: str, ratio: Spread | None, better: str, worse: str, **kwargs: Any) -> list[Verdict]:
    """:func:`unreliable` if ``why`` names a compared candidate that failed, else :func:`ratio_verdict` (none without a ratio)."""
    if why:
        return [unreliable(key, question, why)]
    return [] if ratio is None else [ratio_verdict(key, question, ratio, better, worse, **kwargs)]


VERDICT_COLUMNS = ("question", "result", "spread", "winner", "published", "agrees")


def verdict_rows(verdicts: Iterable[dict[str, Any]]) -> list[dict[str, str]]:
    """Verdict dicts as rows of :data:`VERDICT_COLUMNS` (notes go under ``winner``)."""
    rows = []
    for v in verdicts:
        agrees = v.get("relation") or {True: "yes", False: "no", None: ""}[v.get("agrees")]
        winner = v["winner"] + (f" ({v['note']})" if v.get("note") else "")
        rows.append({"question": v["question"], **_directed(v), "winner": winner,
                     "published": v.get("reference", ""), "agrees": agrees})
    return rows


def _directed(v: dict[str, Any]) -> dict[str, str]:
    """A ratio verdict's cells as the side it favours reads them: ``"paged ahead by 1.25x"`` for 0.80x."""
    value, low, high = v.get("value"), v.get("low"), v.get("high")
    cells = {"result": v["result"], "spread": v["spread"]}
    directed = v.get("better") and v.get("worse") and value and low and high and v.get("reliable", True)
    if not directed or number_text(value) == number_text(1.0):  # no side to favour, or it reads as 1.00x
        return cells
    if value > 1.0:
        return {**cells, "result": f"{v['better']} ahead by {number_text(value)}"}
    flipped = cells["spread"]
    if "," in flipped and not v["spread"].startswith("exact"):
        flipped = f"{number_text(1.0 / high, bare=True)}-{number_text(1.0 / low)}" + flipped[flipped.index(","):]
    return {"result": f"{v['worse']} ahead by {number_text(1.0 / value)}", "spread": flipped}


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
        return f"{value:.1f}" if 10 <= abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


def format_table(
    rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None, *, markdown: bool = False,
    wrap: dict[str, int] | None = None,
) -> str:
    """Rows as an aligned text table (or a Markdown table), floats rounded for reading."""
    rows = list(rows)
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_cell(row.get(col, "")) for col in columns] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in cells]
        return "\n".join(lines)
    wrap = wrap or {}
    wrapped = [[textwrap.wrap(c, wrap[col], break_long_words=False) or [""] if col in wrap else [c]
                for c, col in zip(line, columns)] for line in cells]
    widths = [max(len(col), *(len(part) for line in wrapped for part in line[i])) for i, col in enumerate(columns)]
    lines = ["  ".join(col.ljust(w) for col, w in zip(columns, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for line in wrapped:
        for depth in range(max(len(parts) for parts in line)):
            parts = [p[depth] if depth < len(p) else "" for p in line]
            lines.append("  ".join(c.ljust(w) for c, w in zip(parts, widths)).rstrip())
    return "\n".join(lines)


def format_verdicts(verdicts: Iterable[dict[str, Any]], *, markdown: bool = False) -> str:
    """The verdict table: one line per question (long cells wrap on a terminal)."""
    rows, wrap = verdict_rows(verdicts), {"question": 30, "result": 34, "spread": 14, "winner": 30, "published": 28}
    return format_table(rows, VERDICT_COLUMNS, markdown=markdown, wrap=wrap) if rows else "(no verdicts)"


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_dir: Path, filename: str, *, tight: bool = True) -> str:
    """Save ``fig`` as ``out_dir/filename`` (PNG), laid out first unless ``tight`` is False; close it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / filename
    if tight:
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
