"""What a new user meets first: the version, the license, usage errors, and missing optional
extras that say which extra to install. Missing packages are simulated in a fresh interpreter
with ``sys.modules[name] = None`` (imports of it then fail as if it were not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import vmkv
from vmkv import cli

ROOT = Path(__file__).resolve().parent.parent


def python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with this checkout first on the path."""
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{code}"],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def without(*modules: str) -> str:
    """Code that makes ``modules`` unimportable, as if they were not installed."""
    return "".join(f"sys.modules[{name!r}] = None\n" for name in modules)


def test_version_has_one_source(capsys):
    """``vmkv --version`` prints ``vmkv.__version__``, which is where pyproject reads it from."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"vmkv {vmkv.__version__}"
    assert vmkv.__version__.count(".") == 2
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "vmkv.__version__"}


def test_license_file_is_the_apache_2_text_pyproject_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202  # the whole text


@pytest.mark.parametrize("argv, usage", [
    (["bench", "--bogus"], "usage: vmkv bench"),
    (["info", "--bogus"], "usage: vmkv info"),
    (["--bogus", "info"], "usage: vmkv [-h]"),
])
def test_an_unknown_option_shows_the_usage_of_its_command(argv, usage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(usage) and "unrecognized arguments: --bogus" in err


def test_vmkv_hf_without_transformers_names_the_extra():
    result = python(without("transformers") + "import vmkv\n"
                    "try:\n    import vmkv.hf\nexcept ModuleNotFoundError as exc:\n    print(exc.name, '|', exc)\n"
                    "from vmkv.models import default_hf_model\n"
                    "try:\n    default_hf_model()\nexcept ModuleNotFoundError as exc:\n    print(exc.name, '|', exc)\n")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("transformers | vmkv.hf needs transformers: pip install -e '.[hf]' (in a vmkv clone)")
    assert lines[1].startswith("transformers | default_hf_model needs transformers: pip install -e '.[hf]' (in a vmkv clone)")


def test_vmkv_bench_without_the_bench_extra_says_so_and_runs_nothing(tmp_path):
    """One interpreter, three cases: each makes some of the extra's packages unimportable, runs
    ``vmkv bench mapping --smoke`` (status, stderr, whether anything was written), then restores them."""
    code = """
import contextlib, io, json
from vmkv import cli
results = []
for missing in (["matplotlib"], ["tqdm"], ["matplotlib", "tqdm"]):
    saved = {name: sys.modules.pop(name, None) for name in missing}
    sys.modules.update({name: None for name in missing})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(["bench", "mapping", "--smoke", "--out", "out"])
        listed = cli.main(["bench", "--list"])
    results.append([missing, status, listed, err.getvalue()])
    for name, module in saved.items():
        del sys.modules[name]
        if module is not None:
            sys.modules[name] = module
print(json.dumps(results))
"""
    result = python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for missing, status, listed, err in json.loads(result.stdout.splitlines()[-1]):
        assert status == 2 and listed == 0  # the registry needs no extra
        assert err.strip() == ("vmkv bench needs the bench extra: pip install -e '.[bench]' (in a vmkv clone) "
                               f"(missing: {', '.join(missing)})")
    assert not (tmp_path / "out").exists()  # nothing ran


def test_vmkv_serve_without_the_serve_extra_says_so():
    result = python(without("fastapi", "uvicorn") + "from vmkv import cli\nsys.exit(cli.main(['serve']))")
    assert result.returncode == 2
    assert "vmkv serve needs the serve extra: pip install -e '.[serve]' (in a vmkv clone)" in result.stderr
