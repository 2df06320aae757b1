"""Running the `k3fuse` command in a subprocess, as a user does, and the small programs it reads."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

BIN = Path(sys.executable).parent


def k3fuse(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
           timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """`k3fuse ARGS` through the installed console script (the venv's, next to this python)."""
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    return subprocess.run([str(BIN / "k3fuse"), *args], capture_output=True, text=True, cwd=cwd, env=full_env,
                          timeout=timeout)


def one_line_error(res: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The run exited 2 with exactly one line on stderr containing every fragment; returns it."""
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    assert len(lines) == 1, res.stderr[-3000:]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert "Traceback" not in res.stderr
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class AllReduceStep(nn.Module):
    """h + all_reduce(linear(tanh(h))) over group "0"; with `gather`, an all-gather that records
    the group size (2) instead. Exported without a process group (the ops trace with fake tensors)."""

    def __init__(self, gather: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))
        self.gather = gather

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c10d = torch.ops._c10d_functional
        y = F.linear(torch.tanh(h), self.w)
        if self.gather:
            y = c10d.wait_tensor(c10d.all_gather_into_tensor(y, 2, "0"))[: h.shape[0]]
        else:
            y = c10d.wait_tensor(c10d.all_reduce(y, "sum", "0"))
        return h + y


def save_programs(directory: Path) -> dict[str, Path]:
    """tp1.pt2 (no collectives), allreduce.pt2 (size not recorded), gather2.pt2 (size 2)."""
    from engine_helpers import ResidualStack

    h = torch.randn(4, 16)
    out = {}
    for name, model in (("tp1", ResidualStack(layers=2)), ("allreduce", AllReduceStep()),
                        ("gather2", AllReduceStep(gather=True))):
        out[name] = directory / f"{name}.pt2"
        torch.export.save(torch.export.export(model.eval(), (h,)), out[name])
    return out
