"""The CuTe W4A16 kernel's copy ring, run on CPU: the kernel's own Python (W4A16RowsDot._ring, _stream,
_step, _issue..., compiled from the module's source without their decorators), with its primitives
replaced by a model of one thread's cp.async groups and shared memory.

Each thread copies its own weight and scale bytes into its own shared-memory slots, `stages - 1` steps
ahead, across span boundaries, and reads back only what it copied (so no barrier): the ring's
correctness is one thread's. The model executes that thread's copies, commits, waits and reads in
program order: a read of bytes that a copy still in flight targets (issued, its group not waited
for) fails, and every read's bytes must be the ones that step needs. Checked at every ring depth,
span length, tile and chunk count the launches use, both formats, and MXFP4's 16-byte scale blocks
(`scale_steps` 4), which no GPU has run yet; and the model is shown to catch a wait one group short.
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
X_BASE, W_BASE, S_BASE, O_BASE = 1 << 40, 2 << 40, 3 << 40, 4 << 40  # tagged global addresses
X_SMEM = 1 << 20  # the staged activation row (x_stage), past any ring


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
        self.events: list[tuple] = []  # ("x",) an activation load; ("flag", groups in flight) the flag wait
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

    def ld_shared_v4_if(self, smem, offset=0, *, pred):
        return self.ld_shared_v4(smem, offset) if pred else (0, 0, 0, 0)

    def ld_shared_u8(self, smem, offset=0):
        return self._read(smem + offset, 1)

    def ld_shared_u16(self, smem, offset=0):
        return self._read(smem + offset, 2)

    def ld_nc_v4(self, addr, offset=0):
        self.events.append(("x",))
        return tuple(addr + offset + 4 * i for i in range(4))

    ld_cg_v4 = ld_nc_v4  # (the one-launch form's activations, written in the launch: through L2)

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


def _thread(params: dict, model: ThreadModel):
    """An object running the kernel's ring methods as plain Python on `model`, with W4A16RowsDot(**params)'s
    attributes; `mmas` and `stores` record what each step read and each span stored."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    real = w4.W4A16RowsDot(**params)
    fake_cutlass = types.SimpleNamespace(range=lambda *a, unroll=None: range(*a), range_constexpr=range,
                                         min=min, max=max, Constexpr=int)

    def wait_flag(flag, tidx):  # the one-launch form's wait: noted with the groups still in flight
        model.events.append(("flag", len(model.groups)))

    def stage_x(x_base, x_smem, pair, P, k_begin, tidx):
        """The staged row (x_stage), as the CTA leaves it: word w of the span (16 bytes) at w, or with x_quads
        at staged_word(w), holds the bf16 at global word-order positions k_begin + 8w .. + 7 of the pair's
        row (their tags)."""
        model.events.append(("stage", len(model.groups)))
        row = pair // real.top_k if real.x_stage == "natural" else pair
        for b in range(2 * real.k_span):
            w = w4.staged_word(b // 16) if real.x_quads else b // 16
            model.smem[x_smem + 16 * w + b % 16] = x_base + (row * real.K + k_begin) * 2 + b

    names = {**w4.__dict__, "compat": model, "cutlass": fake_cutlass, "Int32": int, "Int64": int, "Float32": float,
             "const_expr": lambda v: v, "wait_flag": wait_flag,
             "cute": types.SimpleNamespace(make_rmem_tensor=lambda shape, dtype: [0.0] * shape[0])}

    methods = _undecorated(w4, "W4A16RowsDot", ("_ring", "_stream", "_stream_rounds", "_x_at", "_step", "_consume",
                                                "_fold", "_issue", "_issue_step", "_issue_scales", "_scale_bits",
                                                "_slot", "_scale_block", "smem_bytes", "share",
                                                "_share_ring", "_share_stream", "_share_store", "_block_rows",
                                                "_block_bytes", "_block_scales", "_w_step", "_w_row", "_s_step",
                                                "_s_row"), names)
    sim = type("ThreadRing", (), methods)()
    sim.__dict__.update(real.__dict__)
    sim.mmas, sim.stores, sim.parts = [], [], []
    sim._stage_x = stage_x

    def mmas(acc, wa, wb, sa, sb, xs, one_multiply):
        sim.mmas.append((wa, wb, sa, sb, [x[0] for x in xs]))
        acc[0] += 1  # the steps summed into this part, and (balanced mode) which: bit k of a block's step k
        acc[1] += 1 << ((wa[0] - W_BASE) % (real.K // 2) // 64)

    def store(acc, o_base, split, P, col_off, row, first, m0, size, t, rows):
        sim.stores.append((row, m0))
        sim.parts.append((split, col_off, row, first, int(acc[0]), int(acc[1])))

    sim._mmas, sim._store = mmas, store
    return sim


def _expected(p: dict, tidx: int, e: int, block: int, k_begin: int, first: int, size: int, rows: list[int]):
    """What each step of each span must read: the weights' words of rows a and a + 8, this thread's
    scale of each, its four activation words (tags: global byte addresses)."""
    from k3fuse.kernels.lib.cute.routed_experts_w4a16 import SCALE_BYTES

    K, N, sb = p["K"], p["N"], SCALE_BYTES[p["fmt"]]
    lane, tile_rows = tidx % 32, 16 * p["warps"]
    r, t = lane // 4, lane % 4
    row_a = block * tile_rows + (tidx // 32) * 16 + r
    chunks = -(-size // 8)
    for tile, chunk, s in itertools.product(range(p["n_tiles"]), range(chunks), range(p["k_span"] // 128)):
        row = row_a + tile * tile_rows
        wa = tuple(W_BASE + (e * N + row) * (K // 2) + k_begin // 2 + 64 * s + 16 * t + 4 * i for i in range(4))
        wb = tuple(w + 8 * (K // 2) for w in wa)
        sa = S_BASE + (e * N + row) * (K // 32) * sb + ((k_begin + 128 * s) // 32 + t) * sb
        n = first + min(chunk * 8 + r, size - 1)
        pair = n if p["pairwise"] else rows[n]
        quads = p["x_quads"] and not p["x_stage"]  # (staged, quad order places the words in shared memory)
        x0 = X_BASE + (pair // p["top_k"] * K + k_begin + 128 * s + (8 if quads else 32) * t) * 2
        xs = [x0 + (64 if quads else 16) * q for q in range(4)]
        yield wa, wb, sa, sa + 8 * (K // 32) * sb, [0] * 4 if p["x_stage"] and p["x_quads"] and r else xs


def _run(p: dict, tidx: int, size: int, wait_short: bool = False):
    """One thread's ring over a group of `size` pairs (expert 5, k span 1 of the K split when there is one);
    what it read, what it should have, and the spans it stored."""
    model = ThreadModel(wait_short)
    sim = _thread(p, model)
    e, block, first = 5, 1, 3
    split = 1 if p["K"] // p["k_span"] > 1 else 0
    k_begin = split * p["k_span"]
    rows = list(range(40, 40 + first + size + 8))[::-1]  # grouped: a permutation of pair ids
    sim._ring([0.0] * 4, W_BASE, S_BASE, X_BASE, O_BASE, block, 0, k_begin, e, first, size, split, 64, rows, tidx,
              0, 0, X_SMEM)
    sim.events, sim.written, sim.scale_reads = model.events, model.written, model.scale_reads
    return sim, list(_expected(p, tidx, e, block, k_begin, first, size, rows))


def _params(fmt, K, k_span, stages, scale_steps, n_tiles, pairwise, x_quads, waits=False, x_stage="", pdl="",
            rounds=False, blocked=False):
    return dict(N=1024, K=K, k_span=k_span, top_k=TOP_K, out_fp32=False, out_stride=1024, blocks_a=16, col_b=0,
                pairwise=pairwise, warps=4, n_tiles=n_tiles, stages=stages, rows_first=True, x_quads=x_quads,
                scale_steps=scale_steps, fmt=fmt, waits=waits, x_stage=x_stage, pdl=pdl, rounds=rounds,
                blocked=blocked)


def _cases():
    """(fmt, K, k_span, stages, scale_steps): the spans the launches use (K3's gate/up K = 3584 in 1, 2, 4 or
    7 splits; the downs' I = 3072, 1536, 384; Kimi K2.x's 256) at every ring depth that fits them."""
    from k3fuse.kernels.lib.cute.routed_experts_w4a16 import scale_blocks_fit

    for K, k_span in ((3584, 3584), (3584, 1792), (3584, 896), (3584, 512), (3072, 3072), (1536, 1536),
                      (384, 384), (256, 256)):
        for stages in range(2, min(5, k_span // 128 + 1) + 1):
            yield "int4", K, k_span, stages, 1
            yield "mxfp4", K, k_span, stages, 1
            if scale_blocks_fit(K, k_span):
                yield "mxfp4", K, k_span, stages, 4


@pytest.mark.parametrize("fmt,K,k_span,stages,scale_steps", list(_cases()))
def test_every_step_reads_its_own_landed_bytes(fmt, K, k_span, stages, scale_steps):
    # (row tiles a CTA, the group's pairs, pairwise, quad order, thread, the one-launch form's flag wait,
    # the activations staged: the gate/up's natural row, or (a whole-K span, top-k 1) the down's h)
    launches = [(1, 1, True, False, 0, False, ""), (2, 1, True, True, 77, False, ""),
                (1, 9, False, True, 37, False, ""), (2, 20, False, True, 127, False, ""),
                (8, 3, False, False, 5, False, ""), (1, 1, True, False, 70, True, ""),
                (1, 1, True, False, 45, False, "natural"), (2, 1, True, False, 126, False, "natural"),
                (1, 1, True, True, 66, False, "natural"), (2, 1, True, True, 97, False, "natural"),
                (1, 1, True, True, 45, False, "natural")]
    if k_span == K:  # the down's h, after the gate/up's grid with PDL
        launches += [(2, 1, True, False, 3, False, "situ"), (1, 1, True, False, 99, False, "situ+pdl"),
                     (1, 1, True, True, 50, False, "situ"), (2, 1, True, True, 3, False, "situ+pdl")]
    # rounds (pairwise, one scale copy a step): the same launches, and 4 row tiles, whose spans start the
    # ring at every slot when a span's steps are not a multiple of the depth
    four_tiles = [(4, 1, True, False, 21, False, ""), (4, 1, True, True, 90, False, "natural")]
    rounds = [launch for launch in launches + four_tiles if launch[2] and not launch[5]] if scale_steps == 1 else []
    for (n_tiles, size, pairwise, x_quads, tidx, waits, x_stage), in_rounds in (
            [(launch, False) for launch in launches] + [(launch, True) for launch in rounds]):
        x_stage, _, pdl = x_stage.partition("+")
        p = _params(fmt, K, k_span, stages, scale_steps, n_tiles, pairwise, x_quads, waits, x_stage,
                    "wait" if pdl else "", in_rounds)
        if x_stage == "situ":
            p["top_k"] = 1
        sim, want = _run(p, tidx, size)
        where = (n_tiles, size, pairwise, tidx, waits, x_stage, in_rounds)
        assert len(sim.mmas) == len(want), (where, len(sim.mmas), len(want))
        for step, (got, expect) in enumerate(zip(sim.mmas, want)):
            assert got == expect, (where, step, got, expect)
        rows = [s[0] for s in sim.stores]
        assert len(sim.stores) == n_tiles * -(-size // 8) and rows == sorted(rows), (where, sim.stores)
        # the weight-only rule (the one-launch form): the flag is waited for with the first stages' weights
        # and scales in flight, and before any activation is read; a staged row is staged with them in
        # flight, and no activation is read from global memory after it; with PDL, after the grid wait
        first = ("flag", stages - 1) if waits else ("stage", stages - 1) if x_stage else ("x",)
        waited = [("grid", stages - 1)] * bool(p["pdl"])
        assert sim.events[0] == (waited + [first])[0], (where, sim.events[:2])
        assert not x_stage or sim.events == waited + [first], (where, sim.events[:3])


@pytest.mark.parametrize("fmt,scale_steps", [("mxfp4", 1), ("mxfp4", 4), ("int4", 1)])
def test_the_threads_slots_are_disjoint_and_inside_the_ring(fmt, scale_steps):
    """No barrier orders one thread's copies against another's reads, so each thread's shared bytes must
    be its own: the 128 threads' copy targets do not overlap, and together they are smem_bytes() exactly."""
    p = _params(fmt, 1536, 1536, 3, scale_steps, 2, False, True)
    seen: set[int] = set()
    for tidx in range(32 * p["warps"]):
        sim, _ = _run(p, tidx, 9)
        assert not seen & sim.written, tidx
        seen |= sim.written
    assert seen == set(range(sim.smem_bytes())), (min(seen), max(seen), len(seen), sim.smem_bytes())


def test_the_model_catches_a_wait_one_group_short():
    """The control: with each wait leaving one more group in flight, the first step reads bytes whose
    copy has not landed."""
    p = _params("mxfp4", 1536, 1536, 3, 4, 1, True, False)
    _run(p, 0, 1)  # as the kernel waits: clean
    with pytest.raises(RaceError):
        _run(p, 0, 1, wait_short=True)


def _share_params(fmt: str, I: int, stages: int, shares: int) -> dict:
    """A balanced gate/up launch's parameters (K3's latent K = 3584, 28 steps a block)."""
    from k3fuse.kernels.lib.cute.routed_experts_w4a16 import share_slots

    return dict(N=I, K=3584, k_span=3584, top_k=TOP_K, out_fp32=True, out_stride=2 * I, blocks_a=I // 64, col_b=I,
                pairwise=True, warps=4, n_tiles=1, stages=stages, rows_first=True, x_quads=False, scale_steps=1,
                fmt=fmt, x_stage="natural", shares=shares, slots=share_slots(I // 64, 28, shares))


def _run_share(p: dict, c: int, tidx: int, table: int = 1):
    """One thread of share c of a table (0: w1's, 1: w3's, its outputs I columns on) of pair 9, expert 5."""
    model = ThreadModel()
    sim = _thread(p, model)
    w_base, s_base = W_BASE + table * (1 << 36), S_BASE + table * (1 << 36)
    sim._share_ring([0.0] * 4, 5, c, 9, 64, tidx, 0, X_BASE, w_base, s_base, table * p["col_b"], O_BASE, [], X_SMEM)
    sim.events, sim.sources = model.events, model.sources
    return sim, w_base, s_base


# (format, I, ring stages, shares a table): the rule's 33 at 1 token (K3's I = 3072, 1536, 384 at TP 1, 2, 8:
# blocks split in 2, 3 and 6 parts) and 16 at 2 tokens, a share shorter than a block, a prime count, and
# shares of exactly the ring's prologue
SHARE_CASES = [("mxfp4", 3072, 3, 33), ("mxfp4", 1536, 3, 33), ("mxfp4", 384, 3, 33), ("int4", 1536, 3, 16),
               ("mxfp4", 3072, 3, 16), ("mxfp4", 384, 2, 7), ("int4", 384, 4, 56), ("mxfp4", 384, 3, 84)]


@pytest.mark.parametrize("fmt,I,stages,shares", SHARE_CASES)
def test_balanced_shares_read_their_own_steps_and_fill_every_slot_once(fmt, I, stages, shares):
    """Balanced mode, every share of a table run by the kernel's own code (_share_ring, _share_stream,
    _share_store) for three threads: each step reads its own landed bytes (the share's steps, block by
    block, across block ends), the row staged first with the prologue in flight; and over the shares,
    every (slot, block row) of the partials is stored exactly once, the parts of a block covering each
    of its steps once and the slots no part takes zero."""
    from k3fuse.kernels.lib.cute.routed_experts_w4a16 import SCALE_BYTES, share_start

    p = _share_params(fmt, I, stages, shares)
    K, B, sb = p["K"], p["K"] // 128, SCALE_BYTES[fmt]
    steps = p["blocks_a"] * B
    for tidx in (0, 37, 126):
        lane = tidx % 32
        r, t = lane // 4, lane % 4
        written: dict[tuple, tuple] = {}
        for c in range(shares):
            sim, w_base, s_base = _run_share(p, c, tidx)
            want = []
            for g in range(share_start(c, steps, shares), share_start(c + 1, steps, shares)):
                row = g // B * 64 + tidx // 32 * 16 + r
                k = g % B
                wa = tuple(w_base + (5 * I + row) * (K // 2) + 64 * k + 16 * t + 4 * i for i in range(4))
                sa = s_base + (5 * I + row) * (K // 32) * sb + (4 * k + t) * sb
                x0 = X_BASE + (9 // TOP_K * K + 128 * k + 32 * t) * 2
                want.append((wa, tuple(w + 8 * (K // 2) for w in wa), sa, sa + 8 * (K // 32) * sb,
                             [x0 + 16 * q for q in range(4)]))
            where = (fmt, I, stages, shares, tidx, c)
            assert sim.mmas == want, (where, len(sim.mmas), len(want))
            # nothing issued past the share (the last share's next bytes lie past the table's end)
            weights = [(w[0], 16) for step in want for w in (step[0], step[1])]
            assert [src for src in sim.sources if src[1] == 16] == weights, where
            assert len(sim.sources) == 2 * len(weights), where  # and each row's scales of each step
            assert sim.events == [("stage", stages - 1)], (where, sim.events)
            for slot, col_off, row, pair, count, mask in sim.parts:
                assert (slot, row) not in written, (where, slot, row, written[slot, row])
                assert col_off == I and pair == 9 and 0 <= slot < p["slots"], (where, slot, col_off, pair)
                written[slot, row] = (count, mask)
        rows = [b * 64 + tidx // 32 * 16 + r for b in range(p["blocks_a"])]
        assert set(written) == {(slot, row) for slot in range(p["slots"]) for row in rows}, (fmt, I, shares, tidx)
        for row in rows:
            parts = [written[slot, row] for slot in range(p["slots"])]
            masks = [m for _, m in parts]
            assert sum(masks) == (1 << B) - 1 and sum(n for n, _ in parts) == B, (fmt, I, shares, tidx, row, parts)
            assert all(bin(m).count("1") == n for n, m in parts), (fmt, I, shares, row, parts)  # disjoint parts


def test_balanced_slot_count_is_the_most_parts_a_block_takes():
    """share_slots against a direct count of the shares each block's steps fall in."""
    from k3fuse.kernels.lib.cute.routed_experts_w4a16 import first_share, share_slots, share_start

    for blocks, B, shares in ((48, 28, 33), (24, 28, 33), (6, 28, 33), (6, 28, 84), (48, 28, 16), (5, 3, 7)):
        steps = blocks * B
        owner = [c for c in range(shares)
                 for _ in range(share_start(c, steps, shares), share_start(c + 1, steps, shares))]
        assert len(owner) == steps and owner == sorted(owner)
        assert all(first_share(g, steps, shares) == owner[g] for g in range(steps))
        sizes = {share_start(c + 1, steps, shares) - share_start(c, steps, shares) for c in range(shares)}
        assert max(sizes) - min(sizes) <= 1, sizes  # balanced: shares differ by a step at most
        assert share_slots(blocks, B, shares) == max(len(set(owner[b * B:(b + 1) * B])) for b in range(blocks))



class _Experts(list):
    """A launch's expert ids as the kernel reads them: indexable, with a shape."""

    @property
    def shape(self):
        return (len(self),)


def test_balanced_ctas_take_w1_then_w3_and_leave_out_ids_outside_the_table():
    """share(): a pair's first `shares` CTAs stream w1's blocks into its gate columns, the next `shares`
    w3's into its up columns (I on), each as share c - shares of its table; an expert id outside [0, E)
    reads and stores nothing."""
    p = _share_params("mxfp4", 1536, 3, 33)
    E, N = 896, 1536
    w1, s1, w3, s3 = (types.SimpleNamespace(iterator=base, shape=(E * N,))
                      for base in (W_BASE, S_BASE, W_BASE + (1 << 36), S_BASE + (1 << 36)))

    def cta(c: int, expert: int):
        sim = _thread(p, ThreadModel())
        sim.share(c, 9, 0, 0, types.SimpleNamespace(iterator=X_BASE), w1, s1, w3, s3,
                  types.SimpleNamespace(iterator=O_BASE), _Experts([0] * 9 + [expert] + [0] * 6), [], X_SMEM)
        return sim

    for c in (0, 17, 32, 33, 50, 65):
        sim = cta(c, 5)
        up = c >= 33
        alone, _, _ = _run_share(p, c % 33, 0, table=int(up))
        assert sim.mmas and sim.mmas == alone.mmas, c  # its table's share c % 33, at that table's base
        assert {part[1] for part in sim.parts} == {N if up else 0}, c
    for outside in (-1, E, 10**6):
        sim = cta(40, outside)
        assert not sim.mmas and not sim.parts, outside


def test_the_staged_row_is_each_steps_words_in_quad_order():
    """staged_word (x_stage with x_quads) permutes each step's 16 words among themselves, and puts word i
    of quad lanes t = 0..3 (their step's words 4t + i) side by side: the quad's 16-byte reads are 64
    contiguous bytes, whose 16-byte pieces fall in distinct banks (one wavefront, where the word order's
    64-byte stride took two)."""
    from k3fuse.kernels.lib.cute.routed_experts_w4a16 import staged_word

    for step in range(3):
        words = range(16 * step, 16 * step + 16)
        assert sorted(staged_word(w) for w in words) == list(words)
        for i in range(4):
            at = [staged_word(16 * step + 4 * t + i) for t in range(4)]
            assert at == [16 * step + 4 * i + t for t in range(4)], (step, i, at)
            assert len({16 * a // 4 % 32 for a in at}) == 4  # the first bank of each 16-byte piece


def _scale_words(p: dict, tidx: int) -> list[int]:
    """The row-major byte offsets (from S_BASE) of the scale words the one-multiply check of `_run`'s launch
    reads: lane t's words t, t + 4, ... (a step each) of rows a and a + 8, each row tile (expert 5, block 1)."""
    K, k_span, N = p["K"], p["k_span"], p["N"]
    t, row_a = tidx % 32 % 4, 64 + (tidx // 32) * 16 + tidx % 32 // 4
    k_begin = (1 if K // k_span > 1 else 0) * k_span
    return [(5 * N + row_a + 64 * tile + 8 * b) * (K // 32) + k_begin // 32 + 4 * word
            for tile in range(p["n_tiles"]) for word in range(t, k_span // 128, 4) for b in (0, 1)]


@pytest.mark.parametrize("K,k_span,n_tiles,rounds", [(3584, 1792, 1, False), (1536, 1536, 2, True),
                                                     (384, 384, 4, False)])
def test_the_one_multiply_check_reads_this_lanes_scale_words(K, k_span, n_tiles, rounds):
    """Row-major tables: the scale words the one-multiply check ORs are this lane's of its rows a and a + 8
    over the span, every row tile, exactly (their addresses, in order)."""
    for tidx in (0, 45, 127):
        p = _params("mxfp4", K, k_span, 3, 1, n_tiles, True, False, rounds=rounds)
        sim, _ = _run(p, tidx, 1)
        assert [a - S_BASE for a in sim.scale_reads] == _scale_words(p, tidx), (tidx, sim.scale_reads[:4])


@pytest.mark.parametrize("fmt,K,k_span,stages", [("mxfp4", 3584, 3584, 3), ("mxfp4", 3584, 1792, 4),
                                                 ("mxfp4", 1536, 1536, 3), ("int4", 3584, 1792, 3),
                                                 ("int4", 384, 384, 2), ("mxfp4", 384, 384, 4)])
def test_blocked_tables_give_each_step_the_bytes_of_the_row_major_ones(fmt, K, k_span, stages):
    """`blocked` launches over block_order's tables: every step reads (through the repack) the same weight
    and scale bytes the row-major launch's step reads from the checkpoint's tables, from its own landed
    copies, in the loop and in rounds, one or more row tiles, gate/up and down; the one-multiply check reads
    this lane's scale words of its rows over the span. The bytes are random, so a wrong address shows."""
    import torch

    from k3fuse import quant
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    E, N, sb = 6, 1024, w4.SCALE_BYTES[fmt]
    gen = torch.Generator().manual_seed(K + k_span + stages)
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (E, N, K // 32 * sb), dtype=torch.uint8, generator=gen)
    wb, sbk = quant.block_order(w, s)
    w, s, wb, sbk = (t.reshape(-1) for t in (w, s, wb, sbk))

    def same(blocked_table, table, got, want, n):
        return blocked_table[got:got + n].tolist() == table[want:want + n].tolist()

    # (row tiles, the group's pairs, pairwise, quad order, thread, staged row, rounds)
    launches = [(1, 1, True, False, 0, "", False), (2, 1, True, False, 77, "natural", False),
                (1, 9, False, True, 37, "", False), (2, 1, True, True, 126, "natural", True),
                (4, 1, True, False, 21, "", True)]
    if k_span == K:
        launches += [(2, 1, True, False, 3, "situ", False), (1, 1, True, False, 99, "situ", True)]
    for n_tiles, size, pairwise, x_quads, tidx, x_stage, rounds in launches:
        p = _params(fmt, K, k_span, stages, 1, n_tiles, pairwise, x_quads, x_stage=x_stage, rounds=rounds,
                    blocked=True)
        if x_stage == "situ":
            p["top_k"] = 1
        sim, want = _run(p, tidx, size)
        where = (n_tiles, size, pairwise, tidx, x_stage, rounds)
        assert len(sim.mmas) == len(want), (where, len(sim.mmas), len(want))
        for step, ((gwa, gwb, gsa, gsb, gx), (ewa, ewb, esa, esb, ex)) in enumerate(zip(sim.mmas, want)):
            assert gx == ex, (where, step)
            for g, e in zip(gwa + gwb, ewa + ewb):
                assert same(wb, w, g - W_BASE, e - W_BASE, 4), (where, step, g, e)
            for g, e in ((gsa, esa), (gsb, esb)):
                assert same(sbk, s, g - S_BASE, e - S_BASE, sb), (where, step, g, e)
        if fmt == "mxfp4":
            expect = _scale_words(p, tidx)
            assert len(sim.scale_reads) == len(expect), (where, len(sim.scale_reads), len(expect))
            for g, e in zip(sim.scale_reads, expect):
                assert same(sbk, s, g - S_BASE, e, 4), (where, g, e)
    # the control: a row-major launch over the repacked tables reads other bytes from its second step on
    sim, want = _run(_params(fmt, K, k_span, stages, 1, 1, True, False), 5, 1)
    assert not all(same(wb, w, g - W_BASE, e - W_BASE, 4) for got, expect in zip(sim.mmas[1:], want[1:])
                   for g, e in zip(got[0], expect[0]))
