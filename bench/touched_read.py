"""The read ceiling of a routed-experts step: the bytes the op reads, read and nothing else.

Two launches, as the CuTe op's: the gate/up phase reads each distinct expert's w1 and w3 (packed
words and scales), then the down phase its w2. Each program xor-reduces a span of one expert's words
and stores one word, so the time is the reads' and the launches' alone. Set beside the op's time at
the same tokens (bench/w4a16_table.py's "read" arm), it says what a kernel that dequantizes and
multiplies nothing could reach on those bytes: how much of a miss against the 256 MiB copy is the
size and scatter of a few-token step rather than the op.

TiledRead reads the same bytes on the op's own grid (a program a 64-row block, a step of 128 elements at
a time), in the op's order ("read_rows") or each block front to back ("read_block", the order of weights
repacked into steps): between the large spans and the op, what the grid and the access order cost.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3fuse import quant

BLOCK = 1024  # int32 words a load round: 8 a thread at 4 warps, two 16-byte loads
ROUNDS = 4  # load rounds a program: 16 KB of one expert's words


@triton.jit
def _span_xor(base, n, expert, span, BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    """The xor of words [span * BLOCK * ROUNDS, ...) of expert's row of n words at base (0 for expert -1)."""
    row = base + tl.maximum(expert, 0).to(tl.int64) * n
    start = span * BLOCK * ROUNDS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for r in tl.static_range(ROUNDS):
        offs = start + r * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(row + offs, mask=(expert >= 0) & (offs < n), other=0, cache_modifier=".cg")
    return tl.xor_sum(acc, axis=0)


@triton.jit
def _read_words(ids_ptr, work_ptr, out_ptr, t0, t1, t2, t3, n0, n1, n2, n3,
                BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    """Program (slot, item): the xor of one span of expert ids[slot]'s words in one table, the item's
    (work: [items, 2] of table, span); 0 where the id is -1. A load loop a table, so each keeps its
    pointer's alignment (a pointer chosen at run time would not: its loads would go a word at a time)."""
    slot, item = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + slot)
    table = tl.load(work_ptr + 2 * item)
    span = tl.load(work_ptr + 2 * item + 1)
    if table == 0:
        x = _span_xor(t0, n0, expert, span, BLOCK, ROUNDS)
    elif table == 1:
        x = _span_xor(t1, n1, expert, span, BLOCK, ROUNDS)
    elif table == 2:
        x = _span_xor(t2, n2, expert, span, BLOCK, ROUNDS)
    else:
        x = _span_xor(t3, n3, expert, span, BLOCK, ROUNDS)
    tl.store(out_ptr + slot * tl.num_programs(1) + item, x)


def words(t: torch.Tensor) -> torch.Tensor:
    """A per-expert table [E, ...] as [E, words] of int32 (its bytes, as the kernel reads them)."""
    flat = t.reshape(t.shape[0], -1)
    if (flat.shape[1] * flat.element_size()) % 4:
        raise ValueError(f"a table's expert rows must be whole 4-byte words, got {tuple(t.shape)} {t.dtype}")
    return flat.view(torch.int32)


def distinct(experts: torch.Tensor) -> torch.Tensor:
    """The step's expert ids sorted, each repeat replaced by -1 (graph-safe: no host sync)."""
    s = experts.reshape(-1).sort().values
    repeat = torch.zeros_like(s, dtype=torch.bool)
    repeat[1:] = s[1:] == s[:-1]
    return torch.where(repeat, -1, s)


class Phase:
    """One launch's tables (1 to 4, [E, ...] each) and its work list: every span of every table, so no
    program is idle for a short table (the scales)."""

    def __init__(self, tables: list[torch.Tensor]):
        if not 1 <= len(tables) <= 4:
            raise ValueError(f"a phase reads 1 to 4 tables, got {len(tables)}")
        self.tables = [words(t) for t in tables]
        self.sizes = [t.shape[1] for t in self.tables]
        span = BLOCK * ROUNDS
        work = [(i, s) for i, n in enumerate(self.sizes) for s in range(triton.cdiv(n, span))]
        self.work = torch.tensor(work, dtype=torch.int32, device=tables[0].device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The xors [ids, items] of reading every table's rows for each id (-1: none)."""
        grid = (ids.numel(), self.work.shape[0])
        out = torch.empty(grid, device=ids.device, dtype=torch.int32)  # every program stores its word
        pad = 4 - len(self.tables)  # unused slots repeat table 0 (no work item names them)
        _read_words[grid](ids, self.work, out, *self.tables, *[self.tables[0]] * pad, *self.sizes,
                          *[self.sizes[0]] * pad, BLOCK=BLOCK, ROUNDS=ROUNDS)
        return out


class TouchedRead:
    """A step's read over packed = [w1, w1 scale, w3, w3 scale, w2, w2 scale], in the op's two phases
    (gate/up, then down). Build it outside a CUDA graph (the work lists are host-made), and the ids
    (`distinct`) outside the timing: the call is the two read launches alone."""

    def __init__(self, packed: list[torch.Tensor]):
        if len(packed) != 6:
            raise ValueError(f"packed: w1, its scale, w3, its scale, w2, its scale; got {len(packed)} tensors")
        self.gate_up, self.down = Phase(packed[:4]), Phase(packed[4:])

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: the step's distinct experts (`distinct`); the two phases' xors."""
        return self.gate_up(ids), self.down(ids)


TILE_ROWS = quant.BLOCK_ROWS  # rows a program streams: the CuTe op's CTA (4 warps of 16 rows)
STEP_WORDS = quant.BLOCK_STEP // 8  # a row's weight words a step (128 elements): a thread quad's 4 x 16 bytes


@triton.jit
def _tile_xor(w, s, expert, block, rows, row_words, srow_words, STEPS: tl.constexpr, SW: tl.constexpr,
              ROWS: tl.constexpr, STEP_WORDS: tl.constexpr, CONTIGUOUS: tl.constexpr, STAGES: tl.constexpr):
    """The xor of row block `block` of expert's table w ([rows, row_words] words an expert) and its scales s
    ([rows, srow_words]), a step (STEP_WORDS weight words and SW scale words a row; STEPS a row) at a time,
    in the op's order (CONTIGUOUS off: each row's next 64 bytes, rows row_words apart) or the block's own
    (on: the block is one contiguous span, read front to back in pieces of the same size). 0 for expert -1."""
    e = tl.maximum(expert, 0).to(tl.int64)
    w_at = w + (e * rows + block * ROWS) * row_words
    s_at = s + (e * rows + block * ROWS) * srow_words
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, STEP_WORDS)[None, :]
    cs = tl.arange(0, SW)[None, :]
    live = expert >= 0
    acc = tl.zeros([ROWS, STEP_WORDS], dtype=tl.int32)
    s_acc = tl.zeros([ROWS, SW], dtype=tl.int32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        if CONTIGUOUS:
            w_off = step * (ROWS * STEP_WORDS) + r * STEP_WORDS + c
            s_off = step * (ROWS * SW) + r * SW + cs
        else:
            w_off = r * row_words + step * STEP_WORDS + c
            s_off = r * srow_words + step * SW + cs
        acc ^= tl.load(w_at + w_off, mask=live, other=0, cache_modifier=".cg")
        s_acc ^= tl.load(s_at + s_off, mask=live, other=0, cache_modifier=".cg")
    return tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0) ^ tl.xor_sum(tl.xor_sum(s_acc, axis=1), axis=0)


@triton.jit
def _read_tiles(ids_ptr, out_ptr, wa, sa, wb, sb, rows, blocks_a, row_words, srow_words, STEPS: tl.constexpr,
                SW: tl.constexpr, ROWS: tl.constexpr, STEP_WORDS: tl.constexpr, CONTIGUOUS: tl.constexpr,
                STAGES: tl.constexpr):
    """Program (slot, block): the xor of row block `block` of expert ids[slot], in table a for the first
    blocks_a blocks, then in table b (the gate/up's w1 then w3, as the op's grid); 0 where the id is -1."""
    slot, block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + slot)
    if block < blocks_a:
        x = _tile_xor(wa, sa, expert, block, rows, row_words, srow_words, STEPS, SW, ROWS, STEP_WORDS, CONTIGUOUS,
                      STAGES)
    else:
        x = _tile_xor(wb, sb, expert, block - blocks_a, rows, row_words, srow_words, STEPS, SW, ROWS,
                      STEP_WORDS, CONTIGUOUS, STAGES)
    tl.store(out_ptr + slot * tl.num_programs(1) + block, x)


class TilePhase:
    """One launch over one or two tables ([E, rows, ...] weights and scales each) on the op's grid: a
    program a row block of TILE_ROWS rows of one expert, its weights and scales a step at a time."""

    def __init__(self, weights: list[torch.Tensor], scales: list[torch.Tensor], contiguous: bool, stages: int):
        if len(weights) not in (1, 2) or len(scales) != len(weights):
            raise ValueError(f"a tile phase reads one or two tables with their scales, got {len(weights)} "
                             f"weights and {len(scales)} scales")
        self.rows = weights[0].shape[1]
        self.w = [words(t) for t in weights]
        self.s = [words(t) for t in scales]
        self.row_words = self.w[0].shape[1] // self.rows
        self.srow_words = self.s[0].shape[1] // self.rows
        self.steps = steps = self.row_words // STEP_WORDS
        if self.rows % TILE_ROWS or self.row_words % STEP_WORDS or self.srow_words % steps:
            raise ValueError(f"tables of {self.rows} rows of {self.row_words} words ({self.srow_words} scale words) "
                             f"are not whole blocks of {TILE_ROWS} rows by steps of {STEP_WORDS} words")
        self.sw = self.srow_words // steps
        self.blocks_a = self.rows // TILE_ROWS
        self.contiguous, self.stages = contiguous, stages

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The xors [ids, blocks] of reading every row block of every table for each id (-1: none)."""
        grid = (ids.numel(), self.blocks_a * len(self.w))
        out = torch.empty(grid, device=ids.device, dtype=torch.int32)
        wb, sb = self.w[-1], self.s[-1]
        _read_tiles[grid](ids, out, self.w[0], self.s[0], wb, sb, self.rows, self.blocks_a, self.row_words,
                          self.srow_words, STEPS=self.steps, SW=self.sw, ROWS=TILE_ROWS, STEP_WORDS=STEP_WORDS,
                          CONTIGUOUS=self.contiguous, STAGES=self.stages)
        return out


class TiledRead:
    """A step's read over packed = [w1, w1 scale, w3, w3 scale, w2, w2 scale] on the CuTe op's grid (a
    program a 64-row block of one expert's table, a step of 128 elements at a time): `contiguous` off, in
    the op's order (each of a block's rows 64 bytes a step, rows a table row apart), on, each block read
    front to back (what weights repacked into step order would read). Beside TouchedRead's large spans, it
    separates what the op's grid and access order cost from what its arithmetic does."""

    def __init__(self, packed: list[torch.Tensor], contiguous: bool, stages: int = 3):
        if len(packed) != 6:
            raise ValueError(f"packed: w1, its scale, w3, its scale, w2, its scale; got {len(packed)} tensors")
        self.gate_up = TilePhase([packed[0], packed[2]], [packed[1], packed[3]], contiguous, stages)
        self.down = TilePhase([packed[4]], [packed[5]], contiguous, stages)

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: the step's distinct experts (`distinct`); the two phases' xors."""
        return self.gate_up(ids), self.down(ids)
