"""The CUDA kernel of moe_front_sharded, checked without a GPU (tests/gpu/test_moe_front_gpu.py runs it).

* accept/decline uses only facts every rank shares, and names what it declines on;
* the rule inserts the op on a GPU context only where the kernel covers the site (K3: E 896,
  L 3584 at TP 2), and says why it refuses otherwise;
* the gather kernel and the two-weight push GEMM compile to sm_90 PTX: a bounded spin
  (%globaltimer), volatile polls, no signed remainder, no multicast;
* a timeout in this op is named as this op.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import k3fuse
from k3fuse.model.shapes import gemm_site

triton = pytest.importorskip("triton")

from k3fuse.kernels import collective  # noqa: E402
from k3fuse.kernels.lib.triton import moe_gather as K  # noqa: E402
from k3fuse.kernels.lib.triton import splitk_gemm  # noqa: E402
from k3fuse.kernels.ops import moe_front  # noqa: E402

E, H = gemm_site("router").n, gemm_site("router").k
L = gemm_site("w_down").n
BF16 = torch.bfloat16


def _decide(T=1, h=H, e=E, l_=L, x_dtype=BF16, w_dtype=BF16, world=2, max_tokens=64, protocol="lamport"):
    spec = moe_front.MoEFrontSpec(tokens=T, E=e, L=l_, H=h, dtype=w_dtype, world_size=world, max_tokens=max_tokens,
                                  x_dtype=x_dtype)
    saved = collective.protocol
    collective.protocol = lambda: protocol
    try:
        return moe_front.accepts(spec)
    finally:
        collective.protocol = saved


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("T", [1, 7, 64])
def test_k3_shapes_accepted_at_every_tp(world, T):
    assert _decide(T=T, world=world) is None
    assert _decide(T=T, world=world, l_=0) is None   # router-only form


@pytest.mark.parametrize("kw,needle", [
    (dict(T=65), "tokens 65 outside [1, max_tokens 64]"),
    (dict(T=9, max_tokens=8), "tokens 9 outside [1, max_tokens 8]"),
    (dict(x_dtype=torch.float32, w_dtype=torch.float32), "bf16 or fp16"),
    (dict(w_dtype=torch.float16), "bf16 or fp16, the same"),
    (dict(e=897), "not divisible by world_size 2"),
    (dict(world=16), "world_size 16 outside [1, 8]"),
    (dict(h=7000), "K % 128 == 0"),
    (dict(e=24), "router slice a multiple of 16"),    # 12 router rows per rank: a tile would straddle
    (dict(protocol="flags"), "K3FUSE_AR_PROTOCOL=flags"),
])
def test_declines_name_the_shared_fact(kw, needle):
    why = _decide(**kw)
    assert why is not None and needle in why, why


def test_split_config_keeps_tiles_inside_one_weight():
    for world in (1, 2, 4, 8):
        e1, l1 = E // world, L // world
        for T in (1, 16, 64):
            cfg = splitk_gemm.pick_config(T, e1 + l1, H, rows_first=e1)
            assert cfg is not None and e1 % cfg["BLOCK_N"] == 0 and (e1 + l1) % cfg["BLOCK_N"] == 0, (world, cfg)
    assert splitk_gemm.pick_config(1, 24 + 64, H, rows_first=24) is None


def test_timeout_in_this_op_is_named():
    from k3fuse.kernels.collective import ArWorkspace

    ws = ArWorkspace.__new__(ArWorkspace)
    ws.rank, ws.world, ws.group_name, ws.global_ranks = 0, 2, "tp", [4, 5]
    msg = ws.describe(1, 1, K.ERR_KIND, 3)
    assert msg.startswith("k3fuse.moe_front_sharded: rank 0 (global 4)") and "peer rank 1 (global 5)" in msg


class Front(nn.Module):
    """A K3-like MoE front: fp32 router -> sigmoid top-k, and the latent projection the experts read."""

    def __init__(self, n_experts: int, hidden: int = 256, latent: int = 64, top_k: int = 4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_r = nn.Parameter(torch.randn(n_experts, hidden, generator=g).to(BF16), requires_grad=False)
        self.w_down = nn.Parameter(torch.randn(latent, hidden, generator=g).to(BF16), requires_grad=False)
        self.top_k = top_k

    def forward(self, x):
        logits = nn.functional.linear(x.float(), self.w_r.float())
        w, idx = torch.topk(logits.sigmoid(), self.top_k, dim=-1)
        lat = nn.functional.linear(x, self.w_down)
        return lat * w.sum(-1, keepdim=True).to(lat.dtype), idx


def test_gpu_context_inserts_the_op_only_where_the_kernel_covers():
    ctx = k3fuse.DecodeContext(tp_size=2, group_name="tp", device_capability=(9, 0),
                               enabled_rules={"moe_front_sharded"})
    x = torch.randn(4, 256).to(BF16)
    _, log = k3fuse.apply(torch.export.export(Front(64), (x,)), ctx)
    assert log.applied("moe_front_sharded") == 1, [e.reason for e in log.events]
    _, log = k3fuse.apply(torch.export.export(Front(24), (x,)), ctx)   # 12 router rows per rank
    (e,) = log.rejected("moe_front_sharded")
    assert e.guard == "kernel_shape" and e.values["E"] == 24 and e.values["tokens"] == "4", e.values
    assert any("triton.moe_front_sharded" in lim and "multiple of 16" in lim for lim in e.values["limits"])


def test_gather_kernel_compiles_for_sm90():
    from triton.backends.compiler import GPUTarget

    sig = {"data_ptr": "*i32", "gen_ptr": "*i64", "err_ptr": "*i32", "logits_ptr": "*fp32", "latent_ptr": "*bf16",
           "n_rows": "i32", "timeout_ns": "i64", "WORLD": "constexpr", "MAXT": "constexpr", "NB": "constexpr",
           "E1": "constexpr", "L1": "constexpr", "BLOCK": "constexpr", "KIND": "constexpr"}
    for world, l_ in ((2, L), (8, L), (2, 0)):
        e1, l1 = E // world, l_ // world
        src = triton.compiler.ASTSource(fn=K._gather_kernel, signature=sig, constexprs=dict(
            WORLD=world, MAXT=64, NB=e1 + l1, E1=e1, L1=l1, BLOCK=K._block(e1 + l1), KIND=K.ERR_KIND))
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": K._num_warps(K._block(e1 + l1))}).asm["ptx"]
        assert "%globaltimer" in ptx and "ld.volatile.global" in ptx      # bounded spin, real polls
        assert "atom.global.gpu.acq_rel.add" in ptx                       # the last program rotates
        assert "griddepcontrol.wait" in ptx                                # ... after the whole push GEMM
        assert not re.search(r"\brem\.", ptx) and "multimem" not in ptx   # issue 10; never multicast
