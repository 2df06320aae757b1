"""route_topk on non-finite scores, on the GPU (the CPU side is tests/test_route_topk_nonfinite.py).

The Triton kernel against the reference on the same device, on the inputs `validate --skew inf|nan`
built and the other non-finite cases: idx and the NaN pattern exactly, weights bit for bit; and the
kernel against stock (torch.topk on CUDA): the same ranking always, the same experts wherever no tie
crosses the k-th place. Whether CUDA's torch.topk also breaks exact ties to the lowest index is
printed (the decision in kernels/ops/route_topk.py does not depend on it).

    python -m pytest -m gpu tests/gpu/test_route_topk_nonfinite_gpu.py -q -s
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI only with -m gpu; skip cleanly there
    pytest.skip("needs CUDA", allow_module_level=True)

import k3fuse.kernels  # noqa: F401,E402  (registers torch.ops.k3fuse.*)
from k3fuse.kernels.lib.reference import routing, stock  # noqa: E402
from k3fuse.kernels.lib.triton import route_topk  # noqa: E402
from test_route_topk_nonfinite import K, SCALE, _cases, _key  # noqa: E402  (tests/, on sys.path via conftest)


@pytest.mark.parametrize("case", list(_cases()))
def test_kernel_matches_the_reference_and_ranks_as_stock(case):
    logits, b = (t.cuda() for t in _cases()[case])
    w, idx = route_topk.run(logits, b, K, SCALE)
    w_ref, idx_ref = routing.route_topk(logits, b, K, SCALE)
    assert torch.equal(idx, idx_ref), case
    assert torch.equal(torch.isnan(w), torch.isnan(w_ref)) and torch.equal(w.nan_to_num(7.0), w_ref.nan_to_num(7.0))
    w_st, idx_st = stock.route_topk(logits, b, K, SCALE)
    biased = (torch.sigmoid(logits) + b).tolist()
    same_experts = True
    for t, row in enumerate(biased):
        assert sorted(_key(row[e]) for e in idx[t].tolist()) == sorted(_key(row[e]) for e in idx_st[t].tolist())
        ordered = sorted(map(_key, row), reverse=True)
        if ordered[K - 1] != ordered[K]:
            assert set(idx[t].tolist()) == set(idx_st[t].tolist()), (case, t)
        same_experts &= set(idx[t].tolist()) == set(idx_st[t].tolist())
    print(f"{case}: CUDA torch.topk picks {'the same' if same_experts else 'other'} experts among exact ties")
