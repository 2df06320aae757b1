"""The read ceiling of a routed-experts step: the bytes the op reads, read and nothing else.

Two launches, as the CuTe op's: the gate/up phase reads each distinct expert's w1 and w3 (packed
words and scales), then the down phase its w2. Each program xor-reduces a span of one expert's words
and stores one word, so the time is the reads' and the launches' alone. Set beside the op's time at
the same tokens (bench/w4a16_table.py's "read" arm), it says what a kernel that dequantizes and
multiplies nothing could reach on those bytes: how much of a miss against the 256 MiB copy is the
size and scatter of a few-token step rather than the op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
