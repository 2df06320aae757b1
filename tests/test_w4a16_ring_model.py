"""The CuTe W4A16 kernel's copy ring, run on CPU: the kernel's own Python (W4A16RowsDot._ring, _stream,
_step, _issue..., compiled from the module's source without their decorators), with its primitives
replaced by a model of one thread's cp.async groups and shared memory.

Each thread copies its own weight and scale bytes into its own shared-memory slots, `stages - 1` steps
ahead, across span boundaries, and reads back only what it copied (so no barrier): the ring's
correctness is one thread's. The model executes that thread's copies, commits, waits and reads in
program order: a read of bytes that a copy still in flight targets (issued, its group not waited
for) fails, and every read's bytes must be the ones that step needs. Checked at every ring depth,
span length, tile and chunk count the launches use, both formats, both modes (pairwise: the staged row;
grouped: global activations, the down after the preceding grid's wait), both table layouts; and the model
is shown to catch a wait one group short.
"""
from __future__ import annotations

import __future__
import ast
import functools
import inspect
import itertools
import types

import pytest

from k3fuse.kernels.lib.cute import compat

pytestmark = pytest.mark.skipif(not compat.HAVE_CUTE, reason=f"nvidia-cutlass-dsl not importable: "
                                                              f"{compat.IMPORT_ERROR}")

TOP_K = 4
N = 1024  # the launches' table rows (the gate/up's I, the down's L): 16 row blocks
X_BASE, W_BASE, S_BASE, O_BASE = 1 << 40, 2 << 40, 3 << 40, 4 << 40  # tagged global addresses
X_SMEM = 1 << 20  # the staged activation row (pairwise), past any ring


class RaceError(AssertionError):
    pass


class ThreadModel:
    """One thread's cp.async groups and shared memory: a copy lands when a wait covers its group; a
    read must not touch bytes an unlanded copy targets. Shared bytes hold the global address they
    were copied from (the tag reads return)."""

    def __init__(self, wait_short: bool = False):
        self.smem: dict[int, int] = {}
        self.groups: list[list[tuple[int, int, int]]] = []
        self.open: list[tuple[int, int, int]] = []
        self.wait_short = wait_short  # the control: each wait leaves one more group in flight
        self.events: list[tuple] = []  # ("x",) a global activation load; ("grid", groups in flight) the grid wait
        self.written: set[int] = set()  # the shared bytes this thread's copies target
        self.sources: list[tuple[int, int]] = []  # every copy's global address and bytes, in issue order
        self.scale_reads: list[int] = []  # the one-multiply choice's scale words (ld_nc_b32), their addresses

    def cp_async(self, smem, addr, nbytes, cache=None, smem_offset=0, offset=0):
        smem, addr = smem + smem_offset, addr + offset
        assert nbytes in (4, 8, 16) and smem % nbytes == 0 and addr % nbytes == 0, (smem, addr, nbytes)
        self.open.append((smem, addr, nbytes))
        self.written.update(range(smem, smem + nbytes))
        self.sources.append((addr, nbytes))

    def cp_async_commit(self):
        self.groups.append(self.open)
        self.open = []

    def cp_async_wait(self, pending):
        pending += self.wait_short
        while len(self.groups) > pending:
            for smem, addr, nbytes in self.groups.pop(0):
                for b in range(nbytes):
                    self.smem[smem + b] = addr + b

    def _read(self, smem, nbytes):
        for group in [*self.groups, self.open]:
            for dst, _, n in group:
                if dst < smem + nbytes and smem < dst + n:
                    raise RaceError(f"read of shared [{smem}, +{nbytes}) while a copy to [{dst}, +{n}) is in flight")
        src = [self.smem.get(smem + b) for b in range(nbytes)]
        assert None not in src and src == list(range(src[0], src[0] + nbytes)), (smem, src)
        return src[0]

    def ld_shared_v4(self, smem, offset=0):
        return tuple(self._read(smem + offset + 4 * i, 4) for i in range(4))

    def ld_shared_u8(self, smem, offset=0):
        return self._read(smem + offset, 1)

    def ld_shared_u16(self, smem, offset=0):
        return self._read(smem + offset, 2)

    def ld_nc_v4(self, addr, offset=0):
        self.events.append(("x",))
        return tuple(addr + offset + 4 * i for i in range(4))

    ld_v4 = ld_nc_v4  # (the grouped down's h, after the grid wait)

    def address(self, iterator):  # (a fake tensor's iterator is its base address)
        return iterator

    def griddep_wait(self):  # PDL: the down waits for the gate/up's grid, its first stages in flight
        self.events.append(("grid", len(self.groups)))

    def ld_nc_b32(self, addr):
        self.scale_reads.append(addr)
        return 0  # the scale bytes' OR: ordinary scales, the one-multiply loop

    def warp_any(self, v):
        return v


@functools.cache
def _methods_code(module, cls: str, wanted: tuple[str, ...]):
    """The methods `wanted` of class `cls` compiled from the module's source without their decorators
    (the DSL's jit rewrites a function once it has compiled it)."""
    tree = ast.parse(inspect.getsource(module))
    (klass,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    defs = [f for f in klass.body if isinstance(f, ast.FunctionDef) and f.name in wanted]
    for f in defs:
        f.decorator_list = []
    return compile(ast.Module(body=defs, type_ignores=[]), inspect.getsourcefile(module), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)


def _undecorated(module, cls: str, wanted: tuple[str, ...], names: dict) -> dict:
    """_methods_code's functions, their globals `names`."""
    scope = dict(names)
    exec(_methods_code(module, cls, wanted), scope)
    assert set(wanted) <= set(scope), set(wanted) - set(scope)
    return {n: scope[n] for n in wanted}


def _thread(kernel, model: ThreadModel):
    """An object running the kernel's ring methods as plain Python on `model`, with W4A16RowsDot(kernel)'s
    attributes; `mmas` and `stores` record what each step read and each span stored."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    real = w4.W4A16RowsDot(kernel)
    fake_cutlass = types.SimpleNamespace(range=lambda *a, unroll=None: range(*a), range_constexpr=range,
                                         min=min, max=max, Constexpr=int)

    def stage_x(x_base, x_smem, pair, P, k_begin, tidx):
        """The staged row (pairwise), as the CTA leaves it: word w of the span (16 bytes) at w holds the bf16
        at global word-order positions k_begin + 8w .. + 7 of the pair's row (their tags)."""
        model.events.append(("stage", len(model.groups)))
        row = pair // real.top_k
        for b in range(2 * real.k_span):
            model.smem[x_smem + b] = x_base + (row * real.K + k_begin) * 2 + b

    names = {**w4.__dict__, "compat": model, "cutlass": fake_cutlass, "Int32": int, "Int64": int, "Float32": float,
             "const_expr": lambda v: v,
             "cute": types.SimpleNamespace(make_rmem_tensor=lambda shape, dtype: [0.0] * shape[0])}
    methods = _undecorated(w4, "W4A16RowsDot", ("_ring", "_stream", "_x_at", "_step", "_consume", "_issue",
                                                "_issue_step", "_scale_bits", "_slot", "smem_bytes", "_block_bytes",
                                                "_block_scales", "_w_step", "_w_row", "_s_step", "_s_row"), names)
    sim = type("ThreadRing", (), methods)()
    sim.__dict__.update(real.__dict__)
    sim.mmas, sim.stores = [], []
    sim._stage_x = stage_x
    sim._mmas = lambda acc, wa, wb, sa, sb, xs, one_multiply: sim.mmas.append((wa, wb, sa, sb, [x[0] for x in xs]))
    sim._store = lambda acc, o_base, split, P, col_off, row, first, m0, size, t, rows: sim.stores.append((row, m0))
    return sim


def _kernel(fmt: str, K: int, k_span: int, stages: int, *, down: bool = False, pairwise: bool = True,
            n_tiles: int = 1, blocked: bool = False):
    """A launch over a K span: the gate/up (L = K in K / k_span splits, N = I = 1024 rows), or the down (I = K,
    N = L = 1024 rows, n_tiles a CTA; pairwise, its h staged from the partials)."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    if down:
        situ = w4.Situ(beta=4.0, linear_beta=25.0, splits=1) if pairwise else None
        return w4.Down(fmt=fmt, I=K, L=N, n_tiles=n_tiles, situ=situ, stages=stages, blocked=blocked)
    return w4.GateUp(fmt=fmt, I=N, L=K, top_k=TOP_K, split=K // k_span, pairwise=pairwise, stages=stages,
                     blocked=blocked)


def _expected(sim, tidx: int, e: int, block: int, k_begin: int, first: int, size: int, rows: list[int]):
    """What each step of each span must read: the weights' words of rows a and a + 8, this thread's
    scale of each, its four activation words (tags: global byte addresses; grouped, in quad order)."""
    from k3fuse.kernels.lib.cute.routed_experts_w4a16 import SCALE_BYTES

    K, sb = sim.K, SCALE_BYTES[sim.fmt]
    lane = tidx % 32
    r, t = lane // 4, lane % 4
    row_a = block * 64 + (tidx // 32) * 16 + r
    chunks = -(-size // 8)
    quads = not sim.pairwise
    for tile, chunk, s in itertools.product(range(sim.n_tiles), range(chunks), range(sim.k_span // 128)):
        row = row_a + tile * 64
        wa = tuple(W_BASE + (e * N + row) * (K // 2) + k_begin // 2 + 64 * s + 16 * t + 4 * i for i in range(4))
        wb = tuple(w + 8 * (K // 2) for w in wa)
        sa = S_BASE + (e * N + row) * (K // 32) * sb + ((k_begin + 128 * s) // 32 + t) * sb
        n = first + min(chunk * 8 + r, size - 1)
        pair = n if sim.pairwise else rows[n]
        x0 = X_BASE + (pair // sim.top_k * K + k_begin + 128 * s + (8 if quads else 32) * t) * 2
        yield wa, wb, sa, sa + 8 * (K // 32) * sb, [x0 + (64 if quads else 16) * q for q in range(4)]


def _run(kernel, tidx: int, size: int, wait_short: bool = False):
    """One thread's ring over a group of `size` pairs (expert 5, k span 1 of the K split when there is one);
    what it read, what it should have, and the spans it stored."""
    model = ThreadModel(wait_short)
    sim = _thread(kernel, model)
    e, block, first = 5, 1, 3
    split = 1 if sim.K // sim.k_span > 1 else 0
    k_begin = split * sim.k_span
    rows = list(range(40, 40 + first + size + 8))[::-1]  # grouped: a permutation of pair ids
    sim._ring([0.0] * 4, W_BASE, S_BASE, X_BASE, O_BASE, block, 0, k_begin, e, first, size, split, 64, rows, tidx,
              0, X_SMEM)
    sim.events, sim.written, sim.scale_reads = model.events, model.written, model.scale_reads
    return sim, list(_expected(sim, tidx, e, block, k_begin, first, size, rows))


def _cases():
    """(fmt, K, k_span, stages): the spans the launches use (K3's gate/up K = 3584 in 1, 2, 4 or 7 splits; the
    downs' I = 3072, 1536, 384; Kimi K2.x's 256) at every ring depth that fits them."""
    for K, k_span in ((3584, 3584), (3584, 1792), (3584, 896), (3584, 512), (3072, 3072), (1536, 1536),
                      (384, 384), (256, 256)):
        for stages in range(2, min(5, k_span // 128 + 1) + 1):
            for fmt in ("int4", "mxfp4"):
                yield fmt, K, k_span, stages


#: (down, pairwise, row tiles a CTA, the group's pairs, thread): the gate/up and, over a whole-K span, the
#: down; pairwise a CTA's one pair with its row staged, grouped 3-20 pairs (several chunks of 8)
LAUNCHES = [(False, True, 1, 1, 45), (False, True, 1, 1, 126), (False, False, 1, 9, 37), (False, False, 1, 20, 127),
            (True, True, 1, 1, 3), (True, True, 2, 1, 99), (True, False, 1, 9, 37), (True, False, 2, 20, 127),
            (True, False, 8, 3, 5)]


@pytest.mark.parametrize("fmt,K,k_span,stages", list(_cases()))
def test_every_step_reads_its_own_landed_bytes(fmt, K, k_span, stages):
    for down, pairwise, n_tiles, size, tidx in LAUNCHES:
        if down and k_span != K:
            continue
        sim, want = _run(_kernel(fmt, K, k_span, stages, down=down, pairwise=pairwise, n_tiles=n_tiles), tidx, size)
        where = (down, pairwise, n_tiles, size, tidx)
        assert len(sim.mmas) == len(want), (where, len(sim.mmas), len(want))
        for step, (got, expect) in enumerate(zip(sim.mmas, want)):
            assert got == expect, (where, step, got, expect)
        rows = [s[0] for s in sim.stores]
        assert len(sim.stores) == n_tiles * -(-size // 8) and rows == sorted(rows), (where, sim.stores)
        # the weight-only rule: a staged row is staged with the first stages' weights and scales in flight, and
        # no activation is read from global memory after it; the grouped down reads h only after the grid
        # wait, which comes with those stages in flight
        if pairwise:
            assert sim.events == [("stage", stages - 1)], (where, sim.events)
        elif down:
            assert sim.events[:2] == [("grid", stages - 1), ("x",)], (where, sim.events[:3])
        else:
            assert sim.events[0] == ("x",) and ("grid", stages - 1) not in sim.events, (where, sim.events[:3])


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_the_threads_slots_are_disjoint_and_inside_the_ring(fmt):
    """No barrier orders one thread's copies against another's reads, so each thread's shared bytes must
    be its own: the 128 threads' copy targets do not overlap, and together they are smem_bytes() exactly."""
    kernel = _kernel(fmt, 1536, 1536, 3, down=True, pairwise=False, n_tiles=2)
    seen: set[int] = set()
    for tidx in range(128):
        sim, _ = _run(kernel, tidx, 9)
        assert not seen & sim.written, tidx
        seen |= sim.written
    assert seen == set(range(sim.smem_bytes())), (min(seen), max(seen), len(seen), sim.smem_bytes())


def test_the_model_catches_a_wait_one_group_short():
    """The control: with each wait leaving one more group in flight, the first step reads bytes whose
    copy has not landed."""
    kernel = _kernel("mxfp4", 1536, 1536, 3, down=True)
    _run(kernel, 0, 1)  # as the kernel waits: clean
    with pytest.raises(RaceError):
        _run(kernel, 0, 1, wait_short=True)


def _scale_words(sim, tidx: int) -> list[int]:
    """The row-major byte offsets (from S_BASE) of the scale words the one-multiply check of `_run`'s launch
    reads: lane t's words t, t + 4, ... (a step each) of rows a and a + 8, each row tile (expert 5, block 1)."""
    K, k_span = sim.K, sim.k_span
    t, row_a = tidx % 32 % 4, 64 + (tidx // 32) * 16 + tidx % 32 // 4
    k_begin = (1 if K // k_span > 1 else 0) * k_span
    return [(5 * N + row_a + 64 * tile + 8 * b) * (K // 32) + k_begin // 32 + 4 * word
            for tile in range(sim.n_tiles) for word in range(t, k_span // 128, 4) for b in (0, 1)]


@pytest.mark.parametrize("K,k_span,down,n_tiles", [(3584, 1792, False, 1), (1536, 1536, True, 2),
                                                   (384, 384, True, 4)])
def test_the_one_multiply_check_reads_this_lanes_scale_words(K, k_span, down, n_tiles):
    """Row-major tables: the scale words the one-multiply check ORs are this lane's of its rows a and a + 8
    over the span, every row tile, exactly (their addresses, in order)."""
    for tidx in (0, 45, 127):
        sim, _ = _run(_kernel("mxfp4", K, k_span, 3, down=down, pairwise=not down, n_tiles=n_tiles), tidx, 1)
        assert [a - S_BASE for a in sim.scale_reads] == _scale_words(sim, tidx), (tidx, sim.scale_reads[:4])


@pytest.mark.parametrize("fmt,K,k_span,stages", [("mxfp4", 3584, 3584, 3), ("mxfp4", 3584, 1792, 4),
                                                 ("mxfp4", 1536, 1536, 3), ("int4", 3584, 1792, 3),
                                                 ("int4", 384, 384, 2), ("mxfp4", 384, 384, 4)])
def test_blocked_tables_give_each_step_the_bytes_of_the_row_major_ones(fmt, K, k_span, stages):
    """`blocked` launches over block_order's tables: every step reads (through the repack) the same weight
    and scale bytes the row-major launch's step reads from the checkpoint's tables, from its own landed
    copies, one or more row tiles, gate/up and down, both modes; the one-multiply check reads this lane's
    scale words of its rows over the span. The bytes are random, so a wrong address shows."""
    import torch

    from k3fuse import quant
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    E, sb = 6, w4.SCALE_BYTES[fmt]
    gen = torch.Generator().manual_seed(K + k_span + stages)
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (E, N, K // 32 * sb), dtype=torch.uint8, generator=gen)
    wb, sbk = quant.block_order(w, s)
    w, s, wb, sbk = (t.reshape(-1) for t in (w, s, wb, sbk))

    def same(blocked_table, table, got, want, n):
        return blocked_table[got:got + n].tolist() == table[want:want + n].tolist()

    for down, pairwise, n_tiles, size, tidx in LAUNCHES:
        if down and k_span != K:
            continue
        sim, want = _run(_kernel(fmt, K, k_span, stages, down=down, pairwise=pairwise, n_tiles=n_tiles,
                                 blocked=True), tidx, size)
        where = (down, pairwise, n_tiles, size, tidx)
        assert len(sim.mmas) == len(want), (where, len(sim.mmas), len(want))
        for step, ((gwa, gwb, gsa, gsb, gx), (ewa, ewb, esa, esb, ex)) in enumerate(zip(sim.mmas, want)):
            assert gx == ex, (where, step)
            for g, e in zip(gwa + gwb, ewa + ewb):
                assert same(wb, w, g - W_BASE, e - W_BASE, 4), (where, step, g, e)
            for g, e in ((gsa, esa), (gsb, esb)):
                assert same(sbk, s, g - S_BASE, e - S_BASE, sb), (where, step, g, e)
        if fmt == "mxfp4":
            expect = _scale_words(sim, tidx)
            assert len(sim.scale_reads) == len(expect), (where, len(sim.scale_reads), len(expect))
            for g, e in zip(sim.scale_reads, expect):
                assert same(sbk, s, g - S_BASE, e, 4), (where, g, e)
    # the control: a row-major launch over the repacked tables reads other bytes from its second step on
    sim, want = _run(_kernel(fmt, K, k_span, stages), 5, 1)
    assert not all(same(wb, w, g - W_BASE, e - W_BASE, 4) for got, expect in zip(sim.mmas[1:], want[1:])
                   for g, e in zip(got[0], expect[0]))
