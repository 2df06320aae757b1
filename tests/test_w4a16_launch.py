"""The CuTe W4A16 launch the op takes by default (W4A16Launch.for_call) is the one the code before the trim
took (c62ab06's `cute_config(T, E, I, L, top_k, format=..., layout=...)`, the tuned table included), at every
token count 1-64, both formats, both layouts, K3's widths per rank (TP 1, 2, 4, 8) and Kimi K2.x's.

OLD_DEFAULTS was recorded from that code before it changed: per (E, L, top-k, I), runs of token counts (first,
last, pairwise, gate/up split, down row tiles), the same for both formats but at the two points OLD_MXFP4_SPLITS
names. Every other key of those configurations was, at every point, what the kept path fixes: a group's row
blocks side by side, one scale copy a step, no one-launch form,
no balanced gate/up, no PDL between staged launches, no step loop in rounds, staged activations exactly when
pairwise, the grouping and word-order copy in one launch and the down as the SiTU-GLU's dependent exactly when
grouped, the partial slots the split, the rings min(3, steps + 1) deep, `blocked` the layout's. Those fixed
facts are checked on the new launch's kernel types here; its PTX at 72 default launches was compared with
the old code's (identical but for the kernel's mangled name) when the trim was made.
"""
from __future__ import annotations

import pytest

from k3fuse.kernels.lib.composite.routed_experts_w4a16 import W4A16Launch

#: (E, L, top_k, I) -> [(first token count, last, pairwise, split, n_tiles), ...]: both formats' launch
OLD_DEFAULTS = {
    (896, 3584, 16, 3072): [(1, 2, True, 1, 1), (3, 4, False, 1, 2), (5, 10, False, 1, 4), (11, 64, False, 1, 8)],
    (896, 3584, 16, 1536): [(1, 1, True, 2, 1), (2, 2, True, 1, 1), (3, 4, False, 1, 2), (5, 10, False, 1, 4),
        (11, 64, False, 1, 8)],
    (896, 3584, 16, 768): [(1, 1, True, 4, 1), (2, 2, True, 2, 1), (3, 4, False, 1, 2), (5, 10, False, 1, 4),
        (11, 64, False, 1, 8)],
    (896, 3584, 16, 384): [(1, 1, True, 7, 1), (2, 2, True, 4, 1), (3, 4, False, 2, 2), (5, 5, False, 2, 4),
        (6, 10, False, 1, 4), (11, 64, False, 1, 8)],
    (384, 7168, 8, 2048): [(1, 1, True, 4, 1), (2, 2, True, 2, 1), (3, 4, True, 1, 2), (5, 10, False, 1, 4),
        (11, 64, False, 1, 8)],
    (384, 7168, 8, 1024): [(1, 1, True, 7, 1), (2, 2, True, 4, 1), (3, 4, True, 2, 2), (5, 10, False, 1, 4),
        (11, 64, False, 1, 8)],
    (384, 7168, 8, 512): [(1, 1, True, 8, 1), (2, 2, True, 7, 1), (3, 4, True, 4, 2), (5, 8, False, 2, 4),
        (9, 10, False, 1, 4), (11, 64, False, 1, 8)],
    (384, 7168, 8, 256): [(1, 2, True, 8, 1), (3, 4, True, 7, 2), (5, 8, False, 4, 4), (9, 10, False, 2, 4),
        (11, 20, False, 2, 8), (21, 64, False, 1, 8)],
}
#: where MXFP4's launch differed from int4's (the tuned table's two entries): (E, L, top_k, I, tokens) -> split
OLD_MXFP4_SPLITS = {(896, 3584, 16, 1536, 1): 1, (896, 3584, 16, 384, 2): 1}


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
@pytest.mark.parametrize("shape", list(OLD_DEFAULTS), ids=lambda s: "-".join(map(str, s)))
def test_the_default_launch_is_the_old_codes_at_every_token_count(fmt, shape):
    E, L, k, I = shape
    runs = OLD_DEFAULTS[shape]
    assert [r[0] for r in runs] == [1] + [r[1] + 1 for r in runs[:-1]] and runs[-1][1] == 64  # 1-64, no gap
    for first, last, pairwise, split, n_tiles in runs:
        for T in range(first, last + 1):
            want = OLD_MXFP4_SPLITS.get((*shape, T), split) if fmt == "mxfp4" else split
            for layout in ("rows", "blocks"):
                launch = W4A16Launch.for_call(fmt, T, E, I, L, k, layout)
                where = (shape, T, layout, launch)
                assert (launch.pairwise, launch.split, launch.n_tiles) == (pairwise, want, n_tiles), where
                assert (launch.format, launch.I, launch.L, launch.top_k) == (fmt, I, L, k), where
                gate_up, down = launch.gate_up(), launch.down(4.0, 25.0)
                assert gate_up.blocked == down.blocked == (layout == "blocks"), where
                assert gate_up.stages == min(3, L // 128 // want + 1) and down.stages == min(3, I // 128 + 1), where
                assert gate_up.pairwise == pairwise and (down.situ is not None) == pairwise, where
                assert down.situ is None or down.situ.splits == want, where
