"""Reference MLA decode over K3's paged latent cache, its plain spelling, and the partials' merge.

For each sequence b and head h, over the entries j < seq_lens[b] of its cache (token j sits in
page block_table[b, j // block_size], row j % block_size; an entry is [c_kv (512) | k_sh (64)]):

    score_j = softmax_scale * (q[b, h] . entry_j)       (entry_j * kv_scale where a scale is given)
    out[b, h] = sum_j softmax(score)_j * c_kv_j          (c_kv_j * kv_scale likewise)

a sequence of length 0 gives zeros; a length past the table's max_blocks * block_size entries attends
over all of them (the plain spelling's mask admits every gathered entry). `mla_decode` is the oracle and the CPU path: one sequence at a
time, its pages gathered, in `compute_dtype` (fp32 by default; float64 for the tests' oracle),
cast to q's dtype (or `out_dtype`). `plain_spelling` is the op's stock sequence, the unfused torch an engine would
run: every sequence's pages gathered to the table's width, fp32 scores, a length mask, softmax,
the weighted sum, cast back. `merge` is the float reference of the split kernel's combine
(kernels/lib/triton/mla_decode.py `combine`).
"""
from __future__ import annotations

import torch

LATENT = 512


def dequantized(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The cache's entries as `dtype` values (fp8: times its fp32 scale)."""
    entries = kv_cache.to(dtype)
    return entries * kv_scale.to(dtype) if kv_scale is not None else entries


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               softmax_scale: float, kv_scale: torch.Tensor | None = None,
               compute_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    B, H, _ = q.shape
    page = kv_cache.shape[1]
    out = torch.zeros((B, H, LATENT), dtype=compute_dtype, device=q.device)
    lengths = seq_lens.tolist()
    for b in range(B):
        n = min(int(lengths[b]), block_table.shape[1] * page)
        if n == 0:
            continue
        tok = torch.arange(n, device=q.device)
        rows = kv_cache.view(torch.uint8)[block_table[b, tok // page].long(), tok % page].view(kv_cache.dtype)
        entries = dequantized(rows, kv_scale, compute_dtype)
        scores = (q[b].to(compute_dtype) @ entries.T) * softmax_scale  # [H, n]
        out[b] = torch.softmax(scores, dim=-1) @ entries[:, :LATENT]
    return out.to(out_dtype or q.dtype)


def plain_spelling(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   softmax_scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The stock sequence: gather pages, fp32 scores, mask, softmax, weighted sum, cast. Table entries
    past a sequence's pages are not followed and entries past its length are zeroed before use:
    neither need hold anything valid (stale fp8 bytes can be NaN)."""
    B, width = block_table.shape
    page = kv_cache.shape[1]
    lengths = seq_lens.long()
    in_use = torch.arange(width, device=q.device)[None, :] * page < lengths[:, None]
    pages = torch.where(in_use, block_table.long(), 0)
    rows = kv_cache.view(torch.uint8)[pages].view(kv_cache.dtype)  # byte gather: fp8 has no CPU index kernel
    entries = rows.reshape(B, width * page, -1).float()  # [B, N, 576]
    if kv_scale is not None:
        entries = entries * kv_scale.float()
    valid = torch.arange(width * page, device=q.device)[None, :] < lengths[:, None]  # [B, N]
    entries = entries.masked_fill(~valid.unsqueeze(-1), 0.0)
    scores = torch.einsum("bhd,bnd->bhn", q.float(), entries) * softmax_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a length-0 row: all -inf -> zeros
    return torch.einsum("bhn,bnd->bhd", probs, entries[..., :LATENT]).to(q.dtype)


def merge(partial_out: torch.Tensor, partial_lse: torch.Tensor, out_dtype: torch.dtype | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, D], lse [B, H]): sum_s exp(lse_s - LSE) * partial_out_s, LSE = logsumexp_s(lse_s),
    in partial_out's precision (then out_dtype); splits with lse -inf are skipped (their partial_out
    is never read, NaN there included); where every split is empty, out is 0 and lse -inf."""
    live = partial_lse > float("-inf")
    lse = torch.logsumexp(partial_lse, dim=-1)  # -inf where no split is live
    weights = torch.where(live, torch.exp(partial_lse - lse.nan_to_num(0.0, neginf=0.0).unsqueeze(-1)), 0.0)
    terms = torch.where(live.unsqueeze(-1), partial_out, 0.0) * weights.unsqueeze(-1).to(partial_out.dtype)
    out = terms.sum(-2)
    return out.to(out_dtype or partial_out.dtype), lse
