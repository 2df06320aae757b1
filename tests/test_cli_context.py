"""DecodeContext refuses wrong types instead of doing the wrong thing with them; dtype is guarded
(issue 11)."""
from __future__ import annotations

import pytest
import torch

import k3fuse
from k3fuse.context import ContextError, DecodeContext
from k3fuse.usage_error import UsageError


@pytest.mark.parametrize("kwargs,fragment", [
    ({"enabled_rules": "decode_gemm"}, "is a string, not a collection of rule names"),
    ({"disabled_rules": "decode_gemm"}, "is a string"),
    ({"enabled_rules": [1]}, "non-string rule names"),
    ({"device_capability": "sm90"}, "device_capability must be (major, minor)"),
    ({"device_capability": (9,)}, "device_capability must be (major, minor)"),
    ({"tokens": (1.9, 8.7)}, "tokens must be an int or (min, max) ints"),
    ({"tokens": "1-8"}, "tokens must be"),
    ({"tp_size": True}, "tp_size must be a positive int"),
    ({"tp_size": 2.0}, "tp_size must be a positive int"),
    ({"rank": 1}, "rank 1 is outside tp_size 1"),
    ({"rank": False}, "outside tp_size"),
    ({"strict": "no"}, "strict must be True or False"),
    ({"dtype": "bf16"}, "dtype must be a floating torch.dtype"),
    ({"dtype": torch.int32}, "dtype must be a floating torch.dtype"),
    ({"group_name": 0}, "group_name must be the c10d group name"),
    ({"agreed_settings": "yes"}, "agreed_settings must be (name, value) pairs"),
])
def test_wrong_types_are_clear_errors(kwargs, fragment):
    with pytest.raises(ContextError) as exc:
        DecodeContext(**kwargs)
    assert fragment in str(exc.value)
    assert isinstance(exc.value, UsageError) and isinstance(exc.value, ValueError)


def test_good_values_still_accepted():
    ctx = DecodeContext(enabled_rules=["decode_gemm"], device_capability=[9, 0], tokens=8, dtype=torch.bfloat16)
    assert ctx.enabled_rules == frozenset({"decode_gemm"}) and ctx.device_capability == (9, 0)
    assert ctx.tokens == (8, 8)


def test_dtype_takes_part_in_the_site_guard():
    """A context fixing the trunk dtype rejects sites of another dtype, logging what it saw."""
    from k3fuse.model import K3DecodeStack, get_config

    model = K3DecodeStack(get_config("tiny", n_layers=1), seed=0).eval()
    x = torch.randn(2, model.config.hidden, dtype=model.config.torch_dtype)
    ep = torch.export.export(model, (x, model.init_state(2)))
    trunk = model.config.torch_dtype
    other = torch.bfloat16 if trunk == torch.float32 else torch.float32
    _, same = k3fuse.apply(ep, DecodeContext(dtype=trunk))
    _, wrong = k3fuse.apply(ep, DecodeContext(dtype=other))
    assert same.applied("decode_gemm") > 0
    assert wrong.applied("decode_gemm") == 0
    rej = wrong.rejected("decode_gemm")
    assert rej and all(e.guard == "dtype" for e in rej)
    assert rej[0].values == {"x": str(trunk), "expected": str(other)}


@pytest.mark.parametrize("argv0", ["serve.py", "/usr/local/bin/k3fuse", "-c"])
def test_import_k3fuse_is_the_same_however_the_process_was_launched(argv0):
    """Issue 49.7: `import k3fuse` reads no sys.argv and never imports torch or the reference model;
    `k3fuse.load()` (every entry point's first step, and `import k3fuse` itself once torch is
    imported) registers the ops, still without the model."""
    import subprocess
    import sys

    heavy = "('torch', 'k3fuse.model', 'k3fuse.model.stack', 'k3fuse.kernels')"
    light = ("import sys\nsys.argv[0] = " + repr(argv0) + "\nimport k3fuse\n"
             f"print(sorted(m for m in {heavy} if m in sys.modules))\n"
             "k3fuse.load()\nimport torch\n"
             "print(hasattr(torch.ops.k3fuse, 'decode_gemm'), 'k3fuse.model' in sys.modules)\n")
    after_torch = ("import sys\nsys.argv[0] = " + repr(argv0) + "\nimport torch\nimport k3fuse\n"
                   "print(hasattr(torch.ops.k3fuse, 'decode_gemm'), 'k3fuse.model' in sys.modules)\n")
    outputs = []
    for code in (light, after_torch):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        outputs.append(res.stdout.split("\n")[:-1])
    assert outputs == [["[]", "True False"], ["True False"]], outputs
