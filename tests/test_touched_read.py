"""bench/touched_read.py, the routed-experts read ceiling, through Triton's interpreter on CPU: each
phase reads every word of the step's distinct experts' tables once (its xors equal the words' own), a
repeated id reads nothing more, and no other expert is read."""
import re
import textwrap

import pytest

from triton_interpreter import run_in_interpreter

#: what both interpreter scripts start with: the module, an xor of words, random tables in either format
PRELUDE = textwrap.dedent("""
    import json
    import torch
    from bench import touched_read as tr
    from k3fuse import quant

    def xor_of(t):  # the xor of an int32 tensor's words
        v = 0
        for w in t.reshape(-1).tolist():
            v ^= w
        return v

    def random_tables(fmt, E, I, L):  # [w1, its scale, w3, its scale, w2, its scale] of random bytes
        packed = []
        for rows, cols in ((I, L), (I, L), (L, I)):
            shape, sshape = (E, *quant.packed_shape(fmt, rows, cols)), (E, *quant.scale_shape(fmt, rows, cols))
            if fmt == "mxfp4":  # uint8 codes and E8M0 scales
                packed += [torch.randint(0, 256, shape, dtype=torch.uint8),
                           torch.randint(0, 256, sshape, dtype=torch.uint8)]
            else:  # int32 words of nibbles and bf16 group scales
                packed += [torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32),
                           torch.randn(sshape, dtype=torch.bfloat16)]
        return packed
""")

SCRIPT = PRELUDE + textwrap.dedent("""
    torch.manual_seed(0)
    out = []
    for fmt, E, I, L in (("mxfp4", 7, 96, 160), ("int4", 5, 64, 256)):
        packed = random_tables(fmt, E, I, L)
        read = tr.TouchedRead(packed)
        for step in ([3, E - 2, 3, 0], [E - 1] * 4, [2]):
            ids = tr.distinct(torch.tensor(step))
            got = [xor_of(x) for x in read(ids)]
            want = [0, 0]
            for phase, tables in enumerate((packed[:4], packed[4:])):
                for e in set(step):
                    for t in tables:
                        want[phase] ^= xor_of(tr.words(t)[e])
            # each id's words alone, to tell a skipped table from one read twice (a double read cancels)
            per_slot = read.gate_up(ids).tolist()
            out.append({"fmt": fmt, "step": step, "ids": ids.tolist(), "got": got, "want": want,
                        "per_slot": [xor_of(torch.tensor(r)) for r in per_slot],
                        "per_slot_want": [0 if e < 0 else xor_of(torch.cat([tr.words(t)[e] for t in packed[:4]]))
                                          for e in ids.tolist()],
                        "items": read.gate_up.work.shape[0]})
    print("RESULT " + json.dumps(out))
""")


def test_each_phase_reads_the_distinct_experts_words_once():
    results = run_in_interpreter(SCRIPT)
    assert len(results) == 6
    for r in results:
        s = sorted(r["step"])
        assert r["ids"] == [-1 if i and s[i] == s[i - 1] else s[i] for i in range(len(s))], r  # repeats: -1
        assert r["got"] == r["want"], r
        assert r["per_slot"] == r["per_slot_want"], r
        assert r["items"] >= 4  # every table has at least one span in the work list


def test_the_read_is_16_byte_loads_that_skip_l1():
    """PTX for sm_90: the words load 16 bytes a thread at a time, .cg (through L2 only, as the op's weight
    copies), and nothing spills. (K3's tables are whole 16-word rows an expert at every width.)"""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from bench import touched_read as tr
    names = tr._read_words.arg_names
    constexprs = {"BLOCK": tr.BLOCK, "ROUNDS": tr.ROUNDS}
    sig = {n: "constexpr" if n in constexprs else "i32" if n.startswith("n") else
           "*i64" if n == "ids_ptr" else "*i32" for n in names}
    # what a launch specialises at K3's widths: aligned tables, and words an expert in 16s
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in constexprs}
    src = triton.compiler.ASTSource(fn=tr._read_words, signature=sig, attrs=attrs, constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert ptx.count("ld.global.cg.v4.b32") >= 2 * tr.ROUNDS, ptx[-2000:]
    assert ".local" not in ptx


TILED_SCRIPT = PRELUDE + textwrap.dedent("""
    torch.manual_seed(1)
    out = []
    for fmt, E, I, L in (("mxfp4", 5, 128, 256), ("int4", 4, 128, 384)):
        packed = random_tables(fmt, E, I, L)
        for contiguous in (False, True):
            read = tr.TiledRead(packed, contiguous)
            ids = tr.distinct(torch.tensor([E - 1, 1, 1, 0]))
            gate_up, down = read(ids)
            # per (slot, block): the xor of exactly that row block of that expert, weights and scales
            def block_xor(tables, e, b):
                if e < 0:
                    return 0
                v = 0
                for t in tables:
                    v ^= xor_of(tr.words(t[e:e + 1, b * 64:(b + 1) * 64].contiguous()))
                return v
            nb = I // 64
            want_gu = [[block_xor(packed[0:2] if b < nb else packed[2:4], e, b % nb) for b in range(2 * nb)]
                       for e in ids.tolist()]
            want_down = [[block_xor(packed[4:6], e, b) for b in range(L // 64)] for e in ids.tolist()]
            out.append({"fmt": fmt, "contiguous": contiguous, "sw": read.gate_up.sw, "down_sw": read.down.sw,
                        "got": [gate_up.tolist(), down.tolist()], "want": [want_gu, want_down]})
    try:
        tr.TiledRead([packed[0][:, :32], packed[1][:, :32]] * 3, False)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    print("RESULT " + json.dumps({"runs": out, "refused": refused}))
""")


def test_the_tiled_read_reads_each_row_block_once_in_either_order():
    """TiledRead (the op's grid: a program a 64-row block of one expert): each program's xor is exactly its
    block's weight and scale words, in the op's order and front to back (the same bytes); gate/up blocks
    run over w1 then w3; a repeated id reads nothing; rows that are not whole blocks are refused."""
    results = run_in_interpreter(TILED_SCRIPT)
    assert len(results["runs"]) == 4
    for r in results["runs"]:
        assert r["got"] == r["want"], r
        assert r["sw"] == r["down_sw"] == (1 if r["fmt"] == "mxfp4" else 2), r  # scale words a row and step
        assert any(v for row in r["got"][0] for v in row), r  # not all zeros: the blocks were read
    assert "whole blocks of 64 rows" in results["refused"]


@pytest.mark.parametrize("contiguous", [False, True])
def test_the_tiled_read_copies_as_the_op_does(contiguous):
    """PTX for sm_90 at K3's gate/up step count (I = 1536 per rank's latent 3584: 28 steps): the weights in
    16-byte cp.async.cg copies, the scales in 4-byte ones, a ring of groups (as the op's copies), no spills."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from bench import touched_read as tr
    names = tr._read_tiles.arg_names
    constexprs = {"STEPS": 28, "SW": 1, "ROWS": tr.TILE_ROWS, "STEP_WORDS": tr.STEP_WORDS,
                  "CONTIGUOUS": contiguous, "STAGES": 3}
    sig = {n: "constexpr" if n in constexprs else "*i64" if n == "ids_ptr" else "*i32" if n in (
        "out_ptr", "wa", "sa", "wb", "sb") else "i32" for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in constexprs}
    src = triton.compiler.ASTSource(fn=tr._read_tiles, signature=sig, attrs=attrs, constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)) >= 2, ptx[-2000:]
    assert len(re.findall(r"cp\.async\.ca\.shared\.global \[[^]]*\], \[[^]]*\], 0x4", ptx)) >= 1, ptx[-2000:]
    assert "cp.async.wait_group" in ptx and ".local" not in ptx
