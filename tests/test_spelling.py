"""One source of truth for the K3 decode math: k3fuse.spelling, a leaf module everyone imports.

The model computes with these functions, the rules trace them, the stock sequences run them: the
same function objects, and no other module restates them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import torch

from k3fuse import spelling
from k3fuse.kernels.lib.reference import stock
from k3fuse.model import layers
from k3fuse.model.config import get_config
from k3fuse.patterns import _pattern_tools

ROOT = Path(__file__).resolve().parent.parent
SPELLING = ROOT / "k3fuse" / "spelling.py"
MATH = {"rms_norm", "situ", "situ_glu", "delta_rule", "short_conv"}
#: kernels computing the same function (not torch spellings of it), checked against it in their tests
KERNELS = {"kernels/lib/triton/glu_act.py": {"situ_glu"}}  # the one-launch Triton SiTU-GLU


def test_model_patterns_stock_and_references_share_the_functions():
    assert layers.rms_norm is _pattern_tools.rms_norm is stock.rms_norm is spelling.rms_norm
    assert layers.situ_glu is _pattern_tools.situ_glu is spelling.situ_glu
    assert layers.delta_rule is spelling.delta_rule  # the KDA rule traces layers.delta_rule
    assert layers.short_conv is stock.short_conv is spelling.short_conv  # kda_short_conv traces it
    assert layers.moe_combine is spelling.moe_combine  # the moe_combine rule traces it (with the model's cast)
    assert _pattern_tools.linear is spelling.linear and _pattern_tools.all_reduce_sum is spelling.all_reduce_sum


def test_situ_constants_are_the_configs_defaults():
    assert (spelling.K3_SITU_BETA, spelling.K3_SITU_LINEAR_BETA) == (4.0, 25.0)
    cfg = get_config("k3")
    assert (cfg.situ_beta, cfg.situ_linear_beta) == (spelling.K3_SITU_BETA, spelling.K3_SITU_LINEAR_BETA)


def test_no_other_module_defines_the_math():
    offenders = []
    for folder in ("k3fuse", "patterns", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == SPELLING:
                continue
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in MATH
                        and node.name not in KERNELS.get(rel, ())):
                    offenders.append(f"{rel}:{node.lineno} def {node.name}")
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.startswith("K3_SITU_")
                                                        for t in node.targets):
                    offenders.append(f"{rel}:{node.lineno} K3_SITU_* =")
    assert not offenders, offenders


def test_spelling_is_a_leaf_module():
    """It imports torch and k3fuse.quant (a leaf too) only (and the standard library's typing), so any
    module may import it."""
    imported = set()
    for node in ast.walk(ast.parse(SPELLING.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import in k3fuse/spelling.py: line {node.lineno}"
            imported.add(node.module)
    allowed = {"__future__", "collections.abc", "torch", "torch.nn.functional",
               "torch.distributed._functional_collectives", "k3fuse.quant"}
    assert imported <= allowed, imported - allowed


def test_rms_norm_with_and_without_weight():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    w = torch.rand(16) + 0.5
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(spelling.rms_norm(x, w, 1e-5), (normed * w).to(torch.bfloat16))
    assert torch.equal(spelling.rms_norm(x, None, 1e-5), normed.to(torch.bfloat16))
