"""The routed experts' W4A16 MLP on CUDA: the CuTe expert GEMMs (lib/cute/routed_experts_w4a16.py) in sequence
with the Triton grouping and SiTU-GLU (lib/triton/routed_experts_w4a16.py), and the launch configuration.

z[p] = w2[e_p] @ situ_glu(w1[e_p] @ a[p // k], w3[e_p] @ a[p // k]) over MXFP4 tables, or int4 ones with bf16
scales, bf16 activations. Pairwise (up to the grouping's pair count): two CuTe launches whose CTAs stage
their activations (docs/perf/2026-12-05-w4a16-staged-launches.md 0q). Grouped: the Triton grouping with the
word-order copy of a (one launch), the CuTe gate/up, the Triton SiTU-GLU, the CuTe down as its programmatic
dependent (docs/perf/2026-12-06-w4a16-grouped-launches.md 0z).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3fuse.quant import check_layout

from ..cute import routed_experts_w4a16 as cute
from ..triton import routed_experts_w4a16 as tri

#: the ring's depth: STAGES - 1 steps of weights in flight (5 KB of shared memory a stage); 3 was the fastest
#: depth at all but one measured width and token count, and within 4% there (docs/perf/2026-12-04-w4a16-cute-ring.md
#: 0j; deeper rings lost again in docs/perf/2026-12-05-w4a16-h100-ncu.md 0u)
STAGES = 3
TARGET_CTAS = 1056  # ~8 per SM on H200 (132 SMs): each CTA keeps 4 warps' loads in flight
MAX_SPLITS = 8
MAX_N_TILES = 8
#: pairwise MXFP4 launches measured faster without the rule's K split, at K3's shapes (E, I, L, top-k,
#: tokens): 4.7-5.0% at I = 1536 / 1 token, 7.8-11.0% at I = 384 / 2 tokens, one H200
#: (docs/perf/2026-12-05-w4a16-read-ceiling-tuned-table.md 0s, 0t)
UNSPLIT_MXFP4 = frozenset({(896, 1536, 3584, 16, 1), (896, 384, 3584, 16, 2)})


@dataclass(frozen=True, kw_only=True)
class W4A16Launch:
    """The CuTe launches of one call shape (W4A16Launch.for_call): the mode, the gate/up's K split, the
    down's row tiles and the tables' layout. Frozen: a benchmark arm is dataclasses.replace(launch, ...)."""

    format: cute.Format
    I: int  # noqa: E741 (the model's name for the expert intermediate size)
    L: int
    top_k: int
    pairwise: bool  # each pair its own group, in two launches whose CTAs stage their activations; else grouped
    split: int  # the gate/up's K spans, its fp32 partial slots
    n_tiles: int  # the down's row blocks a CTA
    blocked: bool = False  # the tables in quant.block_order's layout (the model's to say)

    def __post_init__(self):
        self.gate_up(), self.down(1.0, 1.0)  # their checks name a split or tile count the widths do not take

    @classmethod
    def for_call(cls, format: cute.Format, T: int, E: int, I: int, L: int, top_k: int,  # noqa: E741
                 layout: str = "rows", *, pairwise: bool | None = None) -> W4A16Launch:
        """The launch for T tokens on E experts of I x L: pairwise up to the grouping's pair count; the
        gate/up's split the smallest divisor of its steps whose grid, at the expected number of groups,
        reaches TARGET_CTAS (or MAX_SPLITS); the down's row tiles the most, in powers of two, that keep
        TARGET_CTAS; `layout` the tables'. `pairwise` imposes a mode (tests of both)."""
        check_layout(layout)
        pairwise = T * top_k <= tri.PAIRWISE_MAX_PAIRS if pairwise is None else pairwise
        groups = tri.expected_groups(T, E, top_k, pairwise)
        steps, blocks = L // cute.STEP, L // cute.BLOCK_ROWS
        ctas = int(groups * 2 * (I // cute.BLOCK_ROWS))  # the gate/up's CTAs a K span
        split = next(s for s in range(1, steps + 1) if steps % s == 0
                     and (ctas * s >= TARGET_CTAS or s >= MAX_SPLITS or s == steps))
        if format == "mxfp4" and pairwise and (E, I, L, top_k, T) in UNSPLIT_MXFP4:
            split = 1
        n_tiles = 1
        while (n_tiles * 2 <= MAX_N_TILES and blocks % (n_tiles * 2) == 0
               and groups * blocks / (n_tiles * 2) >= TARGET_CTAS):
            n_tiles *= 2
        return cls(format=format, I=I, L=L, top_k=top_k, pairwise=pairwise, split=split, n_tiles=n_tiles,
                   blocked=layout == "blocks")

    def gate_up(self) -> cute.GateUp:
        return cute.GateUp(fmt=self.format, I=self.I, L=self.L, top_k=self.top_k, split=self.split,
                           pairwise=self.pairwise, stages=_depth(self.L // self.split), blocked=self.blocked)

    def down(self, beta: float, linear_beta: float) -> cute.Down:
        """The down; pairwise, its CTAs' SiTU-GLU of the gate/up's partials with SiTU's betas."""
        situ = cute.Situ(beta=float(beta), linear_beta=float(linear_beta), splits=self.split) if self.pairwise else None
        return cute.Down(fmt=self.format, I=self.I, L=self.L, n_tiles=self.n_tiles, situ=situ, stages=_depth(self.I),
                         blocked=self.blocked)


def _depth(span: int) -> int:
    """The ring's depth over a K span: STAGES, or fewer where the span has fewer steps (its prologue fills
    stages - 1 steps of one span)."""
    return min(STAGES, span // cute.STEP + 1)


def _rows_for_16_byte_loads(a: torch.Tensor) -> torch.Tensor:
    """a contiguous and 16-byte aligned (a view may be off): the pairwise gate/up reads it with 16-byte loads."""
    a = a.contiguous()
    return a.clone() if a.data_ptr() % 16 else a


def run(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, top_k, situ_beta,
        situ_linear_beta, format, table=None, layout="rows", out: torch.Tensor | None = None,
        launch: W4A16Launch | None = None, **_) -> torch.Tensor:
    """z [T*k, L] (the op's arguments; `table`, MXFP4's E2M1 values, is decoded by the kernel itself).
    `out`: a [T*k, L] buffer to write instead; `launch`: the launch to run (default: W4A16Launch.for_call)."""
    T, L = a.shape
    E, I = w1_packed.shape[0], w1_packed.shape[1]
    top_k = int(top_k)
    P = T * top_k
    launch = launch or W4A16Launch.for_call(format, T, E, I, L, top_k, layout)
    call, made_for = (format, I, L, top_k, layout == "blocks"), (launch.format, launch.I, launch.L, launch.top_k,
                                                                  launch.blocked)
    if made_for != call:
        raise ValueError(f"a launch for (format, I, L, top_k, blocked) {made_for} on a call of {call}")
    z = torch.empty((P, L), dtype=a.dtype, device=a.device) if out is None else out
    if P == 0:
        return z
    gu = torch.empty((launch.split, P, 2 * I), dtype=torch.float32, device=a.device)
    if launch.pairwise:  # the CTAs stage a's rows and h themselves; rows / groups unread (no memset to capture)
        unread = experts.new_empty(4, dtype=torch.int32)
        cute.launch(launch.gate_up(), _rows_for_16_byte_loads(a), w1_packed, w1_scale, w3_packed, w3_scale, gu,
                    experts, unread, unread)
        cute.launch(launch.down(situ_beta, situ_linear_beta), gu, w2_packed, w2_scale, w2_packed, w2_scale, z,
                    experts, unread, unread)
        return z
    rows, groups, x = tri.group_in_word_order(a.contiguous(), experts, E, quads=True)
    cute.launch(launch.gate_up(), x, w1_packed, w1_scale, w3_packed, w3_scale, gu, experts, rows, groups)
    h = tri.act(gu, a.dtype, situ_beta, situ_linear_beta, word_ordered=True, quads=True, launch_dependents=True)
    cute.launch(launch.down(situ_beta, situ_linear_beta), h, w2_packed, w2_scale, w2_packed, w2_scale, z, experts,
                rows, groups)
    return z


__all__ = ["W4A16Launch", "run", "STAGES", "TARGET_CTAS", "UNSPLIT_MXFP4"]
