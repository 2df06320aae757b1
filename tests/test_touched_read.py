"""bench/touched_read.py, the routed-experts read ceiling, through Triton's interpreter on CPU: each
phase reads every word of the step's distinct experts' tables once (its xors equal the words' own), a
repeated id reads nothing more, and no other expert is read."""
import importlib.util
import os
import textwrap

import pytest

from triton_interpreter import run_in_interpreter

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")

SCRIPT = textwrap.dedent(f"""
    import json, sys
    import torch
    sys.path.insert(0, {BENCH!r})
    import touched_read as tr
    from k3fuse import quant

    def xor_of(t):  # the xor of an int32 tensor's words
        v = 0
        for w in t.reshape(-1).tolist():
            v ^= w
        return v

    torch.manual_seed(0)
    out = []
    for fmt, E, I, L in (("mxfp4", 7, 96, 160), ("int4", 5, 64, 256)):
        packed = []
        for rows, cols in ((I, L), (I, L), (L, I)):
            shape, sshape = (E, *quant.packed_shape(fmt, rows, cols)), (E, *quant.scale_shape(fmt, rows, cols))
            if fmt == "mxfp4":  # uint8 codes and E8M0 scales
                packed += [torch.randint(0, 256, shape, dtype=torch.uint8),
                           torch.randint(0, 256, sshape, dtype=torch.uint8)]
            else:  # int32 words of nibbles and bf16 group scales
                packed += [torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32),
                           torch.randn(sshape, dtype=torch.bfloat16)]
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
            out.append({{"fmt": fmt, "step": step, "ids": ids.tolist(), "got": got, "want": want,
                        "per_slot": [xor_of(torch.tensor(r)) for r in per_slot],
                        "per_slot_want": [0 if e < 0 else xor_of(torch.cat([tr.words(t)[e] for t in packed[:4]]))
                                          for e in ids.tolist()],
                        "items": read.gate_up.work.shape[0]}})
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

    spec = importlib.util.spec_from_file_location("touched_read", os.path.join(BENCH, "touched_read.py"))
    tr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tr)
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
