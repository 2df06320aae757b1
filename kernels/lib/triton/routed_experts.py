"""Triton routed experts for decode: each selected expert's weights are read once, in 2 or 3 launches.

Why: the model's CUDA spelling (k3fuse/spelling.py `routed_experts_grouped`) sorts the T*k
(token, slot) pairs, runs three `torch._grouped_mm` (CUTLASS grouped GEMMs with a preparation
kernel each) and scatters the result back: about a dozen kernels, and the grouped GEMMs' 128-row
tiles are mostly padding when an expert has one or two tokens. On H200 (K3, moe_inter 128, TP 1)
they took 75 µs at 1 token for 44 MB of expert weights (an 11 µs read) and 650 µs at 64 tokens.

Two or three kernels:
1. `_group_kernel` (one program, grouped mode only): sorts the keys expert * BLOCK_P + pair
   (tl.sort), which lays the pairs out grouped by expert, and lists the groups where the expert
   changes: expert, first row, size. No host sync, no atomics; deterministic.
2. `_gate_up_kernel`, one program per (group, block of BLOCK_N columns of g or of u): the group's
   token rows of `a` against w1[e] or w3[e] (tl.dot, fp32 accumulation), rounded to the trunk
   dtype as the grouped GEMMs' outputs are, into gu [T*k, 2I] in pair order. g and u in separate
   programs: at one token, 16 groups need that many programs to cover the SMs.
3. `_down_kernel`, one program per (group, N_TILES blocks of BLOCK_N latent columns): SiTU-GLU in
   fp32 on the group's g and u rows (as `situ_glu`), rounded to the trunk dtype, against w2[e],
   rounded and written to z [T*k, L] in pair order (no scatter pass). N_TILES grows with the
   tokens, so that many small groups do not each pay the program's prologue per column block.
Programs whose group index is past the number of groups return at once. An expert's weight tile is
read by one program, whatever the number of tokens that picked it; groups larger than BLOCK_M rows
loop over row blocks (their weight re-reads hit L2).

Pairwise mode (PAIRWISE, up to PAIRWISE_MAX_PAIRS pairs: 1-2 tokens at top-16): no `_group_kernel`;
every pair is its own group of one row (its expert read from `experts`, rows the identity), since a
token's top-k experts are distinct and two tokens rarely share one: the grouping would save no weight
read and costs a launch and a sort. Still tl.dot on a 16-row tile with one live row (the masked rows
read no memory) rather than a multiply-and-sum GEMV: Triton 3.6 software-pipelines the loads that feed
a dot (cp.async, num_stages deep, in the sm_90 PTX), not the GEMV's, and a decode's one or two
programs per SM need those loads in flight. Same rounding points as grouped.

Numerics: the model's rounding points (g, u and act and z in the trunk dtype); the dot products'
summation order is tl.dot's, so results match the stock grouped GEMMs to bf16 rounding, not bit for
bit. Expert ids must lie in [0, E) (torch.topk's output does); a pair whose id does not is left out
of every group (pairwise: its group is empty) and its row of z is unspecified, as in the stock
grouped GEMMs (rows past the last group's end).

a [T, L], experts int64 [T*k], w1/w3 [E, I, L], w2 [E, L, I], all contiguous, a 16-bit dtype
-> z [T*k, L] new, contiguous.
"""
from __future__ import annotations

import functools
import os

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

MAX_TOKENS = 64
MAX_EXPERTS = 4096  # expert * BLOCK_P + pair must fit an int32 sort key
MAX_PAIRS = 2048  # one block of pairs in the grouping program (K3: 64 tokens x 16 = 1024)
BLOCK_M = 16  # rows of a group per tl.dot (tl.dot's minimum; decode groups are small)
DTYPES = (torch.bfloat16, torch.float16)
#: Triton's CPU interpreter (TRITON_INTERPRET=1) has no libdevice (its functions return None there):
#: under it tanh is spelled with tl.exp; compiled for a GPU it is libdevice's tanh, as Inductor's is
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if HAVE_TRITON:

    if INTERPRET:
        @triton.jit
        def _tanh(x):
            return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0
    else:
        @triton.jit
        def _tanh(x):
            return libdevice.tanh(x)

    @triton.jit
    def _group_kernel(experts_ptr, rows_ptr, groups_ptr, scratch_ptr, P, E, BLOCK_P: tl.constexpr):
        """One program: `_group_pairs_into`."""
        _group_pairs_into(experts_ptr, rows_ptr, groups_ptr, scratch_ptr, P, E, BLOCK_P)

    @triton.jit
    def _group_pairs_into(experts_ptr, rows_ptr, groups_ptr, scratch_ptr, P, E, BLOCK_P: tl.constexpr):
        """rows [P]: pair ids grouped by expert (experts ascending, pairs ascending within a group);
        groups [1 + 3 * P]: the number of groups, then (expert, first row, size) per group, each a
        column of P entries. One sort of the keys expert * BLOCK_P + pair does the grouping. The
        calling program's work alone (other launches share it)."""
        p = tl.arange(0, BLOCK_P)
        in_p = p < P
        e = tl.load(experts_ptr + p, mask=in_p, other=-1)
        ok = in_p & (e >= 0) & (e < E)
        key = tl.where(ok, e.to(tl.int32) * BLOCK_P + p, 2147483647)  # out-of-range ids sort last, unused
        key = tl.sort(key)
        s_ok = key != 2147483647
        s_e = key // BLOCK_P
        tl.store(rows_ptr + p, key % BLOCK_P, mask=s_ok)
        # a group starts where the expert differs from the previous row's
        tl.store(scratch_ptr + p, tl.where(s_ok, s_e, -1))
        tl.debug_barrier()
        prev = tl.load(scratch_ptr + p - 1, mask=p > 0, other=-1)
        starts = s_ok & (s_e != prev)
        slot = tl.cumsum(starts.to(tl.int32), axis=0) - 1
        n_groups = tl.sum(starts.to(tl.int32), axis=0)
        n_rows = tl.sum(s_ok.to(tl.int32), axis=0)
        tl.store(groups_ptr + 1 + slot, s_e, mask=starts)
        tl.store(groups_ptr + 1 + P + slot, p, mask=starts)
        tl.debug_barrier()
        following = tl.load(groups_ptr + 1 + P + slot + 1, mask=starts & (slot + 1 < n_groups), other=n_rows)
        tl.store(groups_ptr + 1 + 2 * P + slot, following - p, mask=starts)
        tl.store(groups_ptr, n_groups)

    @triton.jit
    def _group(gid, experts_ptr, groups_ptr, P, E, PAIRWISE: tl.constexpr):
        """(expert int64, first row, size) of group gid < the number of groups. Pairwise, group gid is
        pair gid alone, empty when its expert id is outside [0, E) (left out, as the grouping leaves it)."""
        if PAIRWISE:
            e = tl.load(experts_ptr + gid)
            first = gid
            size = ((e >= 0) & (e < E)).to(tl.int32)
        else:
            e = tl.load(groups_ptr + 1 + gid).to(tl.int64)
            first = tl.load(groups_ptr + 1 + P + gid)
            size = tl.load(groups_ptr + 1 + 2 * P + gid)
        return e, first, size

    @triton.jit
    def _group_pairs(rows_ptr, first, m0, m, m_ok, PAIRWISE: tl.constexpr):
        """The pair ids of rows m0 + m of a group: `rows` from the grouping, or (pairwise) the pair itself."""
        if PAIRWISE:
            pair = first + m0 + m
        else:
            pair = tl.load(rows_ptr + first + m0 + m, mask=m_ok, other=0)
        return pair

    @triton.jit
    def _group_rows_dot(x_ptr, w_ptr, out_ptr, rows_ptr, first, size, e, n, n_ok,
                        N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        OUT_STRIDE: tl.constexpr, PAIRWISE: tl.constexpr):
        """out[pair, n] = x[pair // TOP_K] . w[e, n] over K, for the group's pairs, rounded to out's dtype."""
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        w_rows = e * N * K + n[:, None].to(tl.int64) * K
        for mb in range(0, ROW_BLOCKS):  # constexpr trip count; blocks past the group skip
            m0 = mb * BLOCK_M
            if m0 < size:
                m_ok = m0 + m < size
                pair = _group_pairs(rows_ptr, first, m0, m, m_ok, PAIRWISE)
                x_rows = (pair // TOP_K).to(tl.int64)[:, None] * K
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k_ok = k0 + kk < K
                    x = tl.load(x_ptr + x_rows + k0 + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    w = tl.load(w_ptr + w_rows + k0 + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    acc = tl.dot(x, tl.trans(w), acc)
                out = out_ptr + pair.to(tl.int64)[:, None] * OUT_STRIDE + n[None, :]
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gate_up_kernel(a_ptr, w1_ptr, w3_ptr, gu_ptr, experts_ptr, rows_ptr, groups_ptr, P, E,
                        I: tl.constexpr, L: tl.constexpr, TOP_K: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PAIRWISE: tl.constexpr):
        """gu [P, 2I]: g = a . w1[e] in columns [0, I), u = a . w3[e] in [I, 2I), in the trunk dtype
        (the grouped GEMMs' outputs). Programs (group, column block of g or of u): twice the programs
        of a fused gate/up, which a one-token decode needs to cover the SMs."""
        gid = tl.program_id(0)
        if PAIRWISE or gid < tl.load(groups_ptr):  # pairwise: the grid is one program per pair
            e, first, size = _group(gid, experts_ptr, groups_ptr, P, E, PAIRWISE)
            blocks: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
            col = tl.program_id(1)
            n = (col % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < I
            if col < blocks:
                _group_rows_dot(a_ptr, w1_ptr, gu_ptr, rows_ptr, first, size, e, n, n_ok, I, L, TOP_K, ROW_BLOCKS,
                                BLOCK_M, BLOCK_N, BLOCK_K, 2 * I, PAIRWISE)
            else:
                _group_rows_dot(a_ptr, w3_ptr, gu_ptr + I, rows_ptr, first, size, e, n, n_ok, I, L, TOP_K,
                                ROW_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_K, 2 * I, PAIRWISE)

    @triton.jit
    def _down_kernel(gu_ptr, w2_ptr, z_ptr, experts_ptr, rows_ptr, groups_ptr, P, E, beta, linear_beta,
                     I: tl.constexpr, L: tl.constexpr, ROW_BLOCKS: tl.constexpr, N_TILES: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRWISE: tl.constexpr):
        """z[pair, block] = situ_glu(g, u)[pair] . w2[e, block]: SiTU-GLU in fp32 on the rounded g and
        u, rounded to the trunk dtype (the model's `situ_glu`), then the down projection. A program
        does N_TILES column blocks, so that many tokens' groups do not each pay the prologue per block."""
        gid = tl.program_id(0)
        if PAIRWISE or gid < tl.load(groups_ptr):  # pairwise: the grid is one program per pair
            e, first, size = _group(gid, experts_ptr, groups_ptr, P, E, PAIRWISE)
            m = tl.arange(0, BLOCK_M)
            kk = tl.arange(0, BLOCK_K)
            for mb in range(0, ROW_BLOCKS):
                m0 = mb * BLOCK_M
                if m0 < size:
                    m_ok = m0 + m < size
                    pair = _group_pairs(rows_ptr, first, m0, m, m_ok, PAIRWISE).to(tl.int64)
                    for tile in range(0, N_TILES):
                        n = (tl.program_id(1) * N_TILES + tile) * BLOCK_N + tl.arange(0, BLOCK_N)
                        n_ok = n < L
                        w_rows = e * L * I + n[:, None].to(tl.int64) * I
                        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                        for k0 in range(0, I, BLOCK_K):
                            k_ok = k0 + kk < I
                            hm = m_ok[:, None] & k_ok[None, :]
                            g = tl.load(gu_ptr + pair[:, None] * (2 * I) + k0 + kk[None, :], mask=hm, other=0.0)
                            u = tl.load(gu_ptr + pair[:, None] * (2 * I) + I + k0 + kk[None, :], mask=hm, other=0.0)
                            g = g.to(tl.float32)
                            u = u.to(tl.float32)
                            act = beta * _tanh(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
                            w2 = tl.load(w2_ptr + w_rows + k0 + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                         other=0.0)
                            acc = tl.dot(act.to(w2.dtype), tl.trans(w2), acc)
                        out = z_ptr + pair[:, None] * L + n[None, :]
                        tl.store(out, acc.to(z_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


TARGET_PROGRAMS = 528  # ~4 per SM on H200 (132 SMs)
MAX_N_TILES = 8
#: pairwise (no grouping launch) up to this many pairs: 2 tokens at top-16, where the pairs almost never
#: share an expert. Measured on H200 (bench/bench_routed_experts.py, both modes forced; K3 E 896,
#: L 3584): 1 token 15.8 vs 18.5 µs grouped at I = 64 (TP 2 width), 22.6 vs 24.4 at I = 128; 2 tokens
#: 21.2 vs 25.8 at I = 64, 42.6 vs 40.8 at I = 128; from 4 tokens on the two are within ~5% either
#: way, and at 64 tokens grouped wins by 1.4-1.5x (bench/results/h200_routed_experts_pairwise.json)
PAIRWISE_MAX_PAIRS = 32
#: launch configurations; bench/bench_routed_experts.py --sweep on H200 found alternatives at most 12%
#: faster (down BLOCK_N 256 at 8 tokens, I = 64), most under 10%; that sweep predates the sort-based
#: grouping and N_TILES and has not been repeated
GATE_UP = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
DOWN = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def expected_groups(T: int, E: int, top_k: int, pairwise: bool) -> float:
    """The launch's expected group count: every pair pairwise, else the distinct experts T tokens'
    top_k of E touch under uniform routing (what grid sizes aim at)."""
    return T * top_k if pairwise else E * (1.0 - (1.0 - min(top_k, E) / E) ** T)


def pick_config(T: int, E: int, I: int, L: int, top_k: int, overrides: dict | None = None) -> dict:
    """Block sizes. Gate/up: BLOCK_N columns of g or of u per program, BLOCK_K of L per step. Down:
    BLOCK_N latent columns, BLOCK_K over I. Grids: (groups, column blocks), groups <= min(E, T*k), or
    T*k when pairwise (T*k <= PAIRWISE_MAX_PAIRS: every pair its own group, no grouping launch).
    row_blocks: the row-block loop's trip count, enough 16-row blocks for the largest possible group
    (T*k rows, or 1 pairwise; blocks past a group's size are skipped), a power of two so that few
    variants compile. N_TILES (down): column blocks per program, so that the expected number of groups
    gives about TARGET_PROGRAMS programs. `overrides`: {"pairwise": bool, "gate_up": {...},
    "down": {...}} (the benchmark's arms and sweep)."""
    P = T * top_k
    overrides = overrides or {}
    pairwise = bool(overrides.get("pairwise", P <= PAIRWISE_MAX_PAIRS))
    gate_up, down = dict(GATE_UP), dict(DOWN)
    down["BLOCK_K"] = min(down["BLOCK_K"], _pow2(I))
    gate_up.update(overrides.get("gate_up", {}))
    down.update(overrides.get("down", {}))
    blocks = -(-L // down["BLOCK_N"])
    per_program = max(1.0, expected_groups(T, E, top_k, pairwise) * blocks / TARGET_PROGRAMS)
    down.setdefault("N_TILES", min(MAX_N_TILES, 1 << (int(per_program).bit_length() - 1)))
    return {"pairwise": pairwise, "BLOCK_P": _pow2(P), "gate_up": gate_up, "down": down,
            "groups": P if pairwise else min(E, P),
            "row_blocks": 1 if pairwise else _pow2(-(-min(P, MAX_PAIRS) // BLOCK_M), floor=1)}


@functools.lru_cache(maxsize=None)
def _cached_config(T: int, E: int, I: int, L: int, top_k: int) -> dict:
    """pick_config for eager calls (a decode step launches this op once per layer): computed once per shape."""
    return pick_config(T, E, I, L, top_k)


def missing_features() -> str | None:
    """What this triton lacks for the kernels (tl.sort, tl.cumsum), or None."""
    missing = [name for name in ("sort", "cumsum") if not hasattr(tl, name)]
    if missing:
        return f"triton {triton.__version__} lacks tl.{', tl.'.join(missing)}"
    return None


def run(a, experts, w1, w3, w2, top_k, situ_beta, situ_linear_beta, out: torch.Tensor | None = None,
        config: dict | None = None) -> torch.Tensor:
    """z [T*k, L]; `out`: a contiguous [T*k, L] buffer of a's dtype to write instead (tests poison it);
    `config`: pick_config overrides (the benchmark's arms and sweep)."""
    T, L = a.shape
    E, I, _ = w1.shape
    P = T * top_k
    cfg = pick_config(T, E, I, L, top_k, config) if config else _cached_config(T, E, I, L, int(top_k))
    gu = torch.empty((P, 2 * I), dtype=a.dtype, device=a.device)
    z = torch.empty((P, L), dtype=a.dtype, device=a.device) if out is None else out
    assert z.is_contiguous() and tuple(z.shape) == (P, L) and z.dtype == a.dtype
    if P == 0:
        return z
    rows = groups = None  # pairwise: the kernels read the experts directly
    if not cfg["pairwise"]:
        work = torch.empty(P + 1 + 3 * P + cfg["BLOCK_P"], dtype=torch.int32, device=a.device)
        rows, groups, scratch = work[:P], work[P:4 * P + 1], work[4 * P + 1:]
        _group_kernel[(1,)](experts, rows, groups, scratch, P, E, BLOCK_P=cfg["BLOCK_P"], num_warps=4)
    gu_cfg, dn = cfg["gate_up"], cfg["down"]
    _gate_up_kernel[(cfg["groups"], 2 * triton.cdiv(I, gu_cfg["BLOCK_N"]))](
        a, w1, w3, gu, experts, rows, groups, P, E, I=I, L=L, TOP_K=int(top_k), ROW_BLOCKS=cfg["row_blocks"],
        BLOCK_M=BLOCK_M, BLOCK_N=gu_cfg["BLOCK_N"], BLOCK_K=gu_cfg["BLOCK_K"], PAIRWISE=cfg["pairwise"],
        num_warps=gu_cfg["num_warps"], num_stages=gu_cfg["num_stages"])
    _down_kernel[(cfg["groups"], triton.cdiv(triton.cdiv(L, dn["BLOCK_N"]), dn["N_TILES"]))](
        gu, w2, z, experts, rows, groups, P, E, float(situ_beta), float(situ_linear_beta), I=I, L=L,
        ROW_BLOCKS=cfg["row_blocks"], N_TILES=dn["N_TILES"], BLOCK_M=BLOCK_M, BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"],
        PAIRWISE=cfg["pairwise"], num_warps=dn["num_warps"], num_stages=dn["num_stages"])
    return z


