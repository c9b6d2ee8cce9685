"""Run vLLM 0.32's own scheduler-side tests (``tests/v1/core/``) against vmkv's block pool.

vLLM's tests ship in its source distribution, not in its wheels, and are not committed here:
:func:`vllm_tests` fetches them once (``pip download --no-deps --no-binary :all: --no-clean``
unpacks the sdist before building its metadata fails; only ``tests/`` is kept, so the installed
vLLM is what they import) into ``~/.cache/vmkv/`` (``VMKV_CACHE`` overrides). The model ids they
name get offline stand-ins (:func:`write_stand_ins`: each model's ``config.json`` shape and a
byte tokenizer), found through vLLM's own ``VLLM_MODEL_REDIRECT_PATH``.

:func:`run` runs a selection in a subprocess, stock or with the pool swapped in
(``tests/vllm_core_plugin.py``), and returns each test's outcome. ``python tests/vllm_core_suite.py
--record`` runs stock vLLM and writes ``tests/vllm_core_expected.json``, which
``tests/test_vllm_core.py`` compares the plugin's outcomes with.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "vllm_core_expected.json"
VLLM_VERSION = "0.32.0"
# The selection CI runs (the whole of test_scheduler.py and test_kv_cache_utils.py take ~10 more minutes here)
FILES = [
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_scheduler.py",
]

# Each stand-in: the architecture's config as published (the numbers vLLM's config code reads).
STAND_INS = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "num_hidden_layers": 12,
        "num_attention_heads": 12, "ffn_dim": 3072, "max_position_embeddings": 2048, "vocab_size": 50272,
        "word_embed_proj_dim": 768, "do_layer_norm_before": True, "activation_function": "relu",
        "torch_dtype": "float16", "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1},
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "max_window_layers": 28},
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
        "max_position_embeddings": 32768, "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False},
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
        "projector_hidden_act": "gelu", "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "torch_dtype": "float16", "vocab_size": 32064, "pad_token_id": 32001,
        "text_config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 32, "max_position_embeddings": 4096, "vocab_size": 32064,
                        "rms_norm_eps": 1e-5, "torch_dtype": "float16"},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336, "patch_size": 14,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                          "projection_dim": 768}},
}


def cache_dir() -> Path:
    return Path(os.environ.get("VMKV_CACHE", Path.home() / ".cache" / "vmkv")) / f"vllm-{VLLM_VERSION}-tests"


def vllm_tests() -> Path:
    """A directory holding vLLM's ``tests/`` (fetched once, then reused).

    Raises:
        RuntimeError: the source distribution could not be fetched (the pip output's tail says why).
    """
    root = cache_dir()
    if (root / "tests" / "v1" / "core" / "test_prefix_caching.py").exists():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TMPDIR=tmp)
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                   "--no-clean", "--no-build-isolation", f"vllm=={VLLM_VERSION}", "-d", tmp],
                                  capture_output=True, text=True, env=env, timeout=600)
            said = (proc.stdout + proc.stderr)[-600:]
        except subprocess.TimeoutExpired:
            said = "pip download ran past 10 minutes"
        unpacked = glob.glob(os.path.join(tmp, "pip-download-*", "vllm_*", "tests"))
        if not unpacked:
            raise RuntimeError(f"vLLM {VLLM_VERSION}'s source could not be fetched: {said}")
        partial = root.with_name(root.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(unpacked[0], partial / "tests")  # vLLM's own vllm/ stays behind: the installed one is imported
        shutil.rmtree(root, ignore_errors=True)
        partial.rename(root)
    return root


def write_stand_ins(root: Path) -> Path:
    """Offline stand-ins for the model ids the tests name; returns vLLM's redirect file."""
    from vmkv.models import save_byte_tokenizer

    redirect = {}
    for model_id, config in STAND_INS.items():
        path = root / "models" / model_id.replace("/", "--")
        if not (path / "config.json").exists():
            path.mkdir(parents=True, exist_ok=True)
            save_byte_tokenizer(path)
            (path / "config.json").write_text(json.dumps(config, indent=1))
        redirect[model_id] = str(path)
    out = root / "models" / "redirect.json"
    out.write_text(json.dumps(redirect, indent=1))
    return out


def outcomes(junit: Path) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "error" | "skipped"}`` from a JUnit XML report."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        file, _, cls = module.partition("/Test")
        name = f"{file}.py::{'Test' + cls + '::' if cls else ''}{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = "error" if "error" in kinds else "failed" if "failure" in kinds else \
            "skipped" if "skipped" in kinds else "passed"
        if result.get(name) in ("failed", "error") and outcome == "error":
            outcome = result[name] + "+teardown error"  # a call failure and a teardown error
        elif name in result and outcome == "error":
            outcome = "teardown error"
        result[name] = outcome
    return result


def run(files: list[str], plugin: bool, deselect: tuple[str, ...] = (), timeout: int = 1500) -> tuple[dict[str, str], str]:
    """Run ``files`` of vLLM's tests but ``deselect`` (stock, or with vmkv's pool); ``(outcomes, output tail)``."""
    root = vllm_tests()
    redirect = write_stand_ins(root)
    repo = HERE.parent
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), str(HERE)]), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_MODEL_REDIRECT_PATH=str(redirect),
                   VMKV_CORE_POOL="1" if plugin else "0")
        proc = subprocess.run([sys.executable, "-m", "pytest", *files, "-q", "-p", "vllm_core_plugin",
                               "-p", "no:cacheprovider", "--tb=short", "-rfE", f"--junitxml={junit}",
                               *(f"--deselect={test}" for test in deselect)],
                              cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if not junit.exists():
            raise RuntimeError(f"vLLM's tests did not run: {(proc.stdout + proc.stderr)[-2000:]}")
        return outcomes(junit), (proc.stdout + proc.stderr)[-20000:]


def main(argv: list[str]) -> int:
    if argv[1:] != ["--record"]:
        print("usage: python tests/vllm_core_suite.py --record   (runs stock vLLM's core tests, writes "
              f"{EXPECTED.name})")
        return 2
    got, tail = run(FILES, plugin=False)
    EXPECTED.write_text(json.dumps(dict(sorted(got.items())), indent=0) + "\n")
    counts = {k: list(got.values()).count(k) for k in sorted(set(got.values()))}
    print(tail[-1500:])
    print(f"stock vLLM {VLLM_VERSION}: {counts} over {len(got)} tests, written to {EXPECTED}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
