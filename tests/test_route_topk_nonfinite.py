"""route_topk on non-finite scores (issue 53 item 10): what the fused routing and stock each do, and
that they agree (the decision is in kernels/ops/route_topk.py's docstring).

`validate --skew inf` / `nan` found k3fuse's routing agreeing 0.000 with the float64 copy where stock
agreed 1.000. The cause: an infinite or NaN bias makes hundreds of biased scores exactly equal, and
among equal scores the op takes the lowest index while torch.topk takes an order of its own. Here, on
the inputs `--skew` made and the other non-finite cases:
* the op's reference and stock agree on the ranking (the selected biased scores, NaN as NaN), on the
  experts wherever no tie crosses the k-th place, and on the weights of the experts both chose;
* the Triton kernel (through Triton's interpreter) picks exactly what the reference picks;
* validate's flip analysis counts a flip between equal scores (equal infinities, two NaNs) as a tie;
* `validate --skew nan|inf` is refused before any work.
"""
from __future__ import annotations

import math
import textwrap

import pytest
import torch
from cli_helpers import k3fuse, one_line_error
from triton_interpreter import run_in_interpreter

from k3fuse.kernels.lib.reference import routing, stock

E, K, SCALE = 896, 16, 2.5


def _skewed_bias(skew: float) -> torch.Tensor:
    """The router bias `validate --skew` builds (k3fuse/tools/validate.py)."""
    g = torch.Generator().manual_seed(3)
    b = torch.randn(E, generator=g) * 0.05
    return b + skew * torch.linspace(1.0, -1.0, E)


def _cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, E, generator=g) * 2
    nan_logits = logits.clone()
    nan_logits[1, [5, 600]] = float("nan")
    nan_logits[3, :] = float("nan")
    inf_logits = logits.clone()
    inf_logits[0, :40] = float("inf")  # sigmoid 1.0: forty equal scores
    inf_logits[2, 100:] = float("-inf")
    half = torch.zeros(E)
    half[::2] = float("inf")
    half[1::2] = float("-inf")
    return {"skew_inf": (logits, _skewed_bias(math.inf)), "skew_nan": (logits, _skewed_bias(math.nan)),
            "skew_minus_inf": (logits, _skewed_bias(-math.inf)), "nan_logits": (nan_logits, _skewed_bias(0.0)),
            "inf_logits": (inf_logits, _skewed_bias(0.0)), "alternating_inf_bias": (logits, half),
            "nan_logits_inf_bias": (nan_logits, half)}


def _key(x: float) -> tuple[bool, float]:
    """torch's descending order: NaN above every number, NaNs equal among themselves."""
    return (True, 0.0) if math.isnan(x) else (False, x)


@pytest.mark.parametrize("case", list(_cases()))
def test_reference_and_stock_agree_on_non_finite_scores(case):
    logits, b = _cases()[case]
    w, idx = routing.route_topk(logits, b, K, SCALE)
    w_st, idx_st = stock.route_topk(logits, b, K, SCALE)
    biased = (torch.sigmoid(logits) + b).tolist()
    for t, row in enumerate(biased):
        # the ranking agrees: the same selected scores, NaN counted as NaN
        assert sorted(_key(row[e]) for e in idx[t].tolist()) == sorted(_key(row[e]) for e in idx_st[t].tolist())
        ordered = sorted(map(_key, row), reverse=True)
        if ordered[K - 1] != ordered[K]:  # no tie across the k-th place: the same experts
            assert set(idx[t].tolist()) == set(idx_st[t].tolist()), (case, t)
        # the weights of the experts both chose: equal (NaN where the token's sum is NaN, in both)
        mine = dict(zip(idx[t].tolist(), w[t].tolist()))
        theirs = dict(zip(idx_st[t].tolist(), w_st[t].tolist()))
        if set(mine) == set(theirs):
            for e, a in mine.items():
                assert (math.isnan(a) and math.isnan(theirs[e])) or a == pytest.approx(theirs[e], rel=1e-6, abs=0)
    if case in ("skew_inf", "skew_nan"):  # equal scores: the lowest indices, whatever torch.topk does
        assert idx.tolist() == [list(range(K))] * logits.shape[0]


INTERPRETER = textwrap.dedent("""
    import json, math, sys
    import torch
    sys.path.insert(0, %(tests)r)
    from test_route_topk_nonfinite import _cases, K, SCALE
    from k3fuse.kernels.lib.triton import route_topk as kernel
    from k3fuse.kernels.lib.reference import routing
    out = {}
    for name, (logits, b) in _cases().items():
        w, idx = kernel.run(logits.contiguous(), b.contiguous(), K, SCALE)
        w_ref, idx_ref = routing.route_topk(logits, b, K, SCALE)
        out[name] = {"idx_equal": bool(torch.equal(idx, idx_ref)),
                     "nan_equal": bool(torch.equal(torch.isnan(w), torch.isnan(w_ref))),
                     "w_close": bool(torch.allclose(w.nan_to_num(7.0), w_ref.nan_to_num(7.0), rtol=2e-6, atol=0))}
    print("RESULT " + json.dumps(out))
""")


def test_the_triton_kernel_picks_what_the_reference_picks_on_non_finite_scores():
    import os

    results = run_in_interpreter(INTERPRETER % {"tests": os.path.dirname(__file__)}, timeout=900)
    assert set(results) == set(_cases())
    for name, r in results.items():
        assert r["idx_equal"] and r["nan_equal"] and r["w_close"], (name, r)


def test_validate_counts_a_flip_between_equal_scores_as_a_tie():
    from k3fuse.tools.validate import _flip_analysis

    scores = torch.tensor([[math.inf, math.inf, math.inf, 0.1], [math.nan, math.nan, math.nan, 0.2]])
    ref = [(0, torch.tensor([[0, 1], [0, 1]]), scores)]
    path = [(0, torch.tensor([[1, 2], [1, 2]]))]  # a different expert among equal scores
    agree, flips, near, min_margin, far_steps, _ = _flip_analysis(ref, path, 1, 1, 2, 1e-4)[0]
    assert (flips, near, min_margin, far_steps) == (2, 2, 0.0, set())
    far = [(0, torch.tensor([[0, 3], [0, 3]]))]  # a finite expert where an infinite one belonged: far
    assert _flip_analysis(ref, far, 1, 1, 2, 1e-4)[0][4] == {0}


@pytest.mark.parametrize("skew", ["nan", "inf", "-inf"])
def test_validate_refuses_a_non_finite_skew(skew):
    one_line_error(k3fuse("validate", f"--skew={skew}"), "--skew", "expected a finite number")
