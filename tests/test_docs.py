"""Every ```` ```python ```` block of README.md and docs/*.md runs on this machine as written.

How blocks run:

* Each Markdown file's Python blocks run in order in **one namespace**, so a page can build on its
  earlier blocks, in a **subprocess per file** (``python tests/test_docs.py FILE``) with a timeout:
  a crash, a hang or global state (threads, registered attention functions) cannot reach the
  rest of the suite. The subprocess runs in an empty temporary directory with the repository
  first on ``PYTHONPATH``, so this checkout's ``vmkv`` is the one documented, and reports one
  JSON line per block into a file of its own (what the blocks print cannot garble it).
* Each block is compiled with the Markdown file as its file name and its own line numbers, so a
  traceback points at the line of the page (``docs/api.md", line 42``).
* Markers on a block's first line: ``# requires: cuda`` skips it unless ``torch.cuda.is_available()``,
  ``# requires: vllm`` unless ``vllm`` is importable. A skipped block's names are missing for
  later blocks, so a page keeps its GPU-only blocks self-contained.
* Expected output: a fence ```` ```text output ```` right after a Python block (only blank lines
  between) holds what that block prints. It is compared with the block's real stdout by
  :mod:`doctest`'s checker (``...`` matches anything, whitespace runs are equal), so a number
  shown in the docs is the number the code gives.
* Other fences (``text``, ``bash``, ``json``, diagrams) are not run.

Why a small collector and not an ecosystem runner: pytest-markdown-docs runs each fence as its
own test (it shares a namespace only between fences tagged ``continuation`` one by one),
phmdoctest generates test files to commit, Sybil shares a namespace per document but runs it
inside the pytest process; none runs a page in a subprocess with a timeout or knows the
``# requires:`` markers the other docs already use, and each would be a new test dependency.
What is needed fits in ~120 lines of the standard library (``doctest``'s output checker included).
"""

from __future__ import annotations

import contextlib
import doctest
import importlib.util
import io
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import pytest
from helpers import VLLM_RUN_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 180
"""A page's time limit (a hang fails the test instead of stalling the suite); a page that starts
vLLM gets :data:`helpers.VLLM_RUN_TIMEOUT_S` (see :func:`page_timeout`)."""
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
REQUIRES = re.compile(r"^#\s*requires:\s*(?P<what>[\w.-]+)\s*$")


@dataclass
class Block:
    """One fenced code block: where it starts (1-based line of its first code line), its info
    string's words, its dedented source and, for a Python block, its expected output if any."""

    path: Path
    line: int
    info: list[str]
    source: str
    expected: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"

    @property
    def requires(self) -> str | None:
        first = self.source.lstrip("\n").split("\n", 1)[0]
        match = REQUIRES.match(first.strip())
        return match["what"] if match else None


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order (CommonMark fences, also inside lists)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        body_start = i + 1
        j = body_start
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[body_start:j]]
        blocks.append(Block(path, body_start + 1, match["info"].split(), textwrap.dedent("\n".join(body))))
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    """The Python blocks of a page, each with the ```` ```text output ```` block that follows it."""
    blocks = fenced_blocks(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    found = []
    for index, block in enumerate(blocks):
        if block.info[:1] != ["python"]:
            continue
        after = blocks[index + 1] if index + 1 < len(blocks) else None
        if after is not None and after.info == ["text", "output"]:
            end = block.line + block.source.count("\n") + 1  # the closing fence of this block
            between = lines[end : after.line - 2]
            if all(not line.strip() for line in between):
                block.expected = after.source
        found.append(block)
    return found


def missing_requirement(what: str) -> str | None:
    """Why a block marked ``# requires: what`` cannot run here, or None if it can."""
    if what == "cuda":
        import torch

        return None if torch.cuda.is_available() else "no CUDA device"
    if what == "vllm":
        return None if importlib.util.find_spec("vllm") is not None else "vllm is not installed"
    return f"unknown requirement {what!r} (known: cuda, vllm)"


def run_page(path: Path, report: TextIO) -> int:
    """Run a page's Python blocks in one namespace; write one JSON line per block to ``report``
    (a file of its own: output of the blocks, or of processes they start, cannot garble it).

    Returns:
        0 if every block ran (or was skipped) and printed what the docs show, else 1.
    """
    namespace: dict = {"__name__": "__main__"}

    def result(block: Block, status: str, detail: str = "") -> None:
        report.write(json.dumps({"where": block.where, "status": status, "detail": detail}) + "\n")
        report.flush()

    for block in python_blocks(path):
        why = missing_requirement(block.requires) if block.requires else None
        if why is not None:
            result(block, "skipped", why)
            continue
        stdout = io.StringIO()
        try:
            code = compile("\n" * (block.line - 1) + block.source, str(block.path), "exec")
            with contextlib.redirect_stdout(stdout):
                exec(code, namespace)  # noqa: S102 - running the documentation is the point
        except BaseException as exc:  # noqa: BLE001 - any failure of a doc block is reported with its line
            frames = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # drop this frame
            result(block, "failed", stdout.getvalue() + "".join(traceback.format_exception(type(exc), exc, frames)))
            return 1
        got = stdout.getvalue()
        checker = doctest.OutputChecker()
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        if block.expected is not None and not checker.check_output(block.expected, got, flags):
            result(block, "failed", "printed output differs from the docs' ```text output block:\n"
                   + checker.output_difference(doctest.Example("", block.expected), got, flags))
            return 1
        result(block, "ok")
    return 0


def page_timeout(path: Path) -> float:
    """The time limit for running ``path``: :data:`VLLM_RUN_TIMEOUT_S` when one of its blocks
    starts vLLM here (engine start-up takes minutes on a busy machine), else :data:`TIMEOUT_S`."""
    runs_vllm = any(b.requires == "vllm" and missing_requirement("vllm") is None for b in python_blocks(path))
    return VLLM_RUN_TIMEOUT_S if runs_vllm else TIMEOUT_S


def run_page_subprocess(path: Path, cwd: Path, timeout: float | None = None) -> tuple[list[dict], str]:
    """Run :func:`run_page` for ``path`` in a fresh interpreter; ``(results, its output)``.

    ``timeout`` defaults to :func:`page_timeout`; a page that runs past it is a failure of the
    block that was running (the blocks before it reported already)."""
    timeout = page_timeout(path) if timeout is None else timeout
    env = {"OMP_NUM_THREADS": "1",  # as the suite's one-thread fixture: small ops on a shared CPU
           **os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    report = cwd / f"{path.name}.results.jsonl"
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(path), str(report)], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=timeout)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = None
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                         for part in (exc.stdout, exc.stderr))
    results = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    if returncode is None:
        blocks = python_blocks(path)
        running = blocks[len(results)].where if len(results) < len(blocks) else str(path)
        results.append({"where": running, "status": "failed", "detail": f"timed out after {timeout:.0f} s\n{output[-3000:]}"})
    elif returncode != 0 and not any(r["status"] == "failed" for r in results):
        results.append({"where": str(path), "status": "failed", "detail": f"exit status {returncode}\n{output[-3000:]}"})
    return results, output


# ---- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_page_runs(path: Path, tmp_path: Path) -> None:
    """Every Python block of the page runs and prints what the page shows."""
    results, output = run_page_subprocess(path, tmp_path)
    failed = [r for r in results if r["status"] == "failed"]
    assert not failed, "\n".join(f"{r['where']}: block failed\n{r['detail']}" for r in failed)
    assert len(results) == len(python_blocks(path)), f"not every block reported:\n{output[-3000:]}"
    if all(r["status"] == "skipped" for r in results):
        pytest.skip("; ".join(f"{r['where']}: {r['detail']}" for r in results))


def test_every_python_fence_is_collected() -> None:
    """No Python code hides under another info string (```py, ```python3, ```pycon) where the
    runner would not see it, and every page in the docs is one the runner reads."""
    for path in PAGES:
        for block in fenced_blocks(path):
            assert block.info[:1] not in (["py"], ["python3"], ["pycon"], ["Python"]), f"{block.where}: use ```python"
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= {p.name for p in PAGES}


def test_shell_commands_in_the_docs_name_real_extras_and_subcommands() -> None:
    """The README quick start (and every ```bash block) installs extras pyproject defines and runs
    `vmkv` subcommands and benchmarks that exist; CI runs the README's test command as written."""
    import tomllib

    from vmkv.cli import build_parser
    from vmkv_bench.registry import BENCHMARKS

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    subcommands = {"--version", "--help", *build_parser()._subparsers._group_actions[0].choices}  # noqa: SLF001
    commands = [line for path in PAGES for block in fenced_blocks(path) if block.info[:1] == ["bash"]
                for line in block.source.splitlines()]
    readme = [b.source for b in fenced_blocks(ROOT / "README.md") if b.info[:1] == ["bash"]]
    assert 'pip install torch==2.13.0 && pip install -e ".[bench]" && vmkv bench' in readme
    test_command = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q'
    assert test_command in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci and "python3 -m venv" in ci  # as a newcomer runs it: in a fresh environment
    for line in commands:
        for extra in re.findall(r"-e \S*\.\[([\w,]+)\]|vmkv\[([\w,]+)\]", line):
            for name in ",".join(extra).strip(",").split(","):
                assert name in extras, f"{line!r}: no extra {name!r} in pyproject.toml"
        for words in re.findall(r"(?:^|&&|\|)\s*vmkv ([\w-]+)(?: ([\w-]+))?", line):
            assert words[0] in subcommands, f"{line!r}: vmkv has no subcommand {words[0]!r}"
            if words[0] == "bench" and words[1] and not words[1].startswith("-"):
                assert words[1] in BENCHMARKS, f"{line!r}: no benchmark {words[1]!r}"


def test_hf_generate_benchmark_section_names_the_real_options() -> None:
    """docs/hf.md's Benchmark section lists every option of ``vmkv_bench/generate.py`` and its
    ``vmkv bench generate ...`` command lines parse with them (lists are space-separated)."""
    import argparse
    import shlex

    from vmkv_bench import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    section = (ROOT / "docs" / "hf.md").read_text().split("## Benchmark", 1)[1].split("\n## ", 1)[0]
    options = {o for action in parser._actions for o in action.option_strings if o.startswith("--")}  # noqa: SLF001
    options.discard("--help")
    assert {o for o in options if f"`{o}`" not in section} == set(), "options of generate.py missing from docs/hf.md"
    assert set(re.findall(r"`(--[\w-]+)`", section)) <= options | {"--device", "--smoke", "--seed", "--out", "--no-plots",
                                                                    "--progress", "--no-progress"}
    commands = re.findall(r"`vmkv bench generate([^`]*)`", section)
    assert commands
    for command in commands:
        parser.parse_args(shlex.split(command))  # exits on an unknown option or a wrong value


PAGE = """\
# A page

Text.

```python
x = 6
print(x * 7)
```

```text output
42
```

```bash
exit 1
```

```python
# requires: cuda
import torch
assert torch.cuda.is_available()
```

```python
# requires: vllm
import importlib.util
assert importlib.util.find_spec("vllm") is not None
```

* a list item

  ```python
  print(x + 1)
  ```
  ```text output
  7
  ```
"""


def test_the_readme_quotes_the_saved_memory_run() -> None:
    """The README's KV-utilization figures are those of the last saved ``vmkv bench memory`` run
    (docs/img/memory.json, ShareGPT-like trace): one source (it once said 32-token default pages
    where the run's VMM default had 16)."""
    rows = {r["allocator"]: r for r in json.loads((ROOT / "docs" / "img" / "memory.json").read_text())["rows"]
            if r["trace"] == "sharegpt"}
    readme = (ROOT / "README.md").read_text()
    default, static, paged = rows["vmm-default"], rows["static-max"], rows["paged-b16"]
    pct = lambda row: f"{100 * row['steady_util']:.0f} %"  # noqa: E731
    assert f"({pct(default)} with its default {default['tokens_per_page']}-token pages)" in readme
    assert f"keeps {pct(static)} of its KV memory busy, vmkv {pct(default)}" in readme
    assert f"paged mode is this design: {pct(paged)} KV utilization on a ShareGPT-like trace" in readme


def test_docs_benchmarks_quotes_the_saved_verdict_table() -> None:
    """docs/benchmarks.md's verdict table is the one docs/img/report.md (the saved run) holds."""

    def verdict_table(text: str, after: str) -> list[str]:
        lines = text[text.index(after):].split("\n")
        start = next(i for i, line in enumerate(lines) if line.startswith("| question | result |"))
        return [line for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start:])]

    saved = verdict_table((ROOT / "docs" / "img" / "report.md").read_text(), "## Verdict")
    assert verdict_table((ROOT / "docs" / "benchmarks.md").read_text(), "The verdict of the quick suite") == saved


def write_page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(textwrap.dedent(text))
    return path


def test_blocks_share_a_namespace_markers_skip_and_output_is_checked(tmp_path: Path) -> None:
    import torch

    path = write_page(tmp_path, PAGE)
    blocks = python_blocks(path)
    assert [b.line for b in blocks] == [6, 19, 25, 33]
    assert [b.requires for b in blocks] == [None, "cuda", "vllm", None]
    assert blocks[0].expected == "42" and blocks[3].expected == "7"
    results, _ = run_page_subprocess(path, tmp_path)
    statuses = [r["status"] for r in results]
    want_cuda = "ok" if torch.cuda.is_available() else "skipped"
    want_vllm = "ok" if importlib.util.find_spec("vllm") is not None else "skipped"
    assert statuses == ["ok", want_cuda, want_vllm, "ok"]


def test_a_failing_block_names_its_file_and_line(tmp_path: Path) -> None:
    path = write_page(tmp_path, "Intro\n\n```python\nx = 1\n\ny = x / 0\n```\n\n```python\nprint('never')\n```\n")
    results, _ = run_page_subprocess(path, tmp_path)
    assert [r["status"] for r in results] == ["failed"]
    assert results[0]["where"].endswith("page.md:4")
    assert f'File "{path}", line 6' in results[0]["detail"] and "ZeroDivisionError" in results[0]["detail"]


def test_output_that_differs_from_the_page_fails(tmp_path: Path) -> None:
    path = write_page(tmp_path, "```python\nprint({'pages': 3, 'util': 0.25})\n```\n"
                                "```text output\n{'pages': 3, 'util': 0.079}\n```\n")
    results, _ = run_page_subprocess(path, tmp_path)
    assert results[0]["status"] == "failed" and "0.079" in results[0]["detail"]
    path = write_page(tmp_path, "```python\nprint({'pages': 3, 'util': 0.25})\n```\n```text output\n{'pages': 3, ...}\n```\n")
    assert run_page_subprocess(path, tmp_path)[0][0]["status"] == "ok"


def test_a_hanging_block_times_out_and_is_named(tmp_path: Path) -> None:
    path = write_page(tmp_path, "```python\nx = 1\n```\n\n```python\nimport time\ntime.sleep(60)\n```\n")
    results, _ = run_page_subprocess(path, tmp_path, timeout=5)
    assert [r["status"] for r in results] == ["ok", "failed"]
    assert results[1]["where"].endswith("page.md:6") and results[1]["detail"].startswith("timed out after 5 s")


def test_a_page_that_starts_vllm_gets_the_engine_s_time_limit(tmp_path: Path) -> None:
    """An engine start-up takes minutes on a busy machine: such a page is not held to TIMEOUT_S."""
    vllm_page = write_page(tmp_path, PAGE)  # its third block requires vllm
    want = VLLM_RUN_TIMEOUT_S if importlib.util.find_spec("vllm") is not None else TIMEOUT_S
    assert page_timeout(vllm_page) == want and page_timeout(ROOT / "docs" / "vllm.md") == want
    assert page_timeout(ROOT / "docs" / "paged.md") == TIMEOUT_S


if __name__ == "__main__":  # python tests/test_docs.py PAGE.md [RESULTS.jsonl] (default: results on stdout)
    sys.path.insert(0, str(ROOT))  # this checkout's vmkv, also when run by hand
    with open(sys.argv[2], "w") if len(sys.argv) > 2 else contextlib.nullcontext(sys.stdout) as out:
        sys.exit(run_page(Path(sys.argv[1]).resolve(), out))
