"""One install line: the README's install and test commands are what CI runs (issue 11)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_install_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Install\n```bash\n(.*?)```", text, re.S)
    assert block, "README has no ## Install bash block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.split("#", 1)[0].strip()]


def test_ci_runs_exactly_the_readme_lines():
    readme = readme_install_commands()
    assert readme[0] == "pip install torch==2.13.0"  # pinned first: an unpinned torch pulls a CUDA build
    assert readme[-1] == 'python -m pytest -m "not gpu"'  # the engine tests too (scripts/install_engines.sh)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci == readme


def test_test_extra_brings_what_the_kernel_compile_tests_need():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~ ]", req)[0] for req in extras["test"]}
    assert {"pytest", "pytest-timeout", "nvidia-cutlass-dsl", "apache-tvm-ffi", "triton"} <= names
