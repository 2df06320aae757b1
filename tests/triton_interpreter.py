"""Running a kernel test script through Triton's interpreter on CPU: in a subprocess, because
TRITON_INTERPRET must be set before triton is imported and must not leak into the other tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: the checkout's root: a script imports `bench.<module>` from it, as the test process does (pytest's pythonpath)
ROOT = str(Path(__file__).resolve().parents[1])


def run_in_interpreter(script: str, timeout: int = 900) -> Any:
    """Run `script` with TRITON_INTERPRET=1; it prints one line `RESULT <json>`, which is returned."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])
