"""The W4A16 expert MLP of a pairwise (1-2 token) decode step in one launch: CTAs take tiles by ticket.

The two-launch form (lib/cute/routed_experts_w4a16.py with the Triton word-order copy and SiTU-GLU
between) runs, at 1-2 tokens, four launches of about one wave each; the ramp-up and tail of each GEMM,
the two small launches and the gaps between them are where 1 token loses to the copy bandwidth
(docs/perf.md 0k, 0n). Here one launch does it all, and a CTA takes the next tile by a ticket (an atomic
counter), so the down's tiles start while the last gate/up tiles finish, group by group, and no SM
idles at a launch boundary.

Tiles, in ticket order:
- 0: the activations a [T, L] put in word order (word_order; quad order with `x_quads`) into x;
- 1 .. P x GU: the gate/up, W4A16RowsDot's tiles (GU a group: its row blocks and K splits together),
  fp32 partials into gu [split, P, 2I]. The group's last tile to finish (a counter a group) computes its
  SiTU-GLU into h [P, I], in the down's order, and raises the group's flag;
- then the down's tiles, group by group, into z [P, L].
A gate/up or down tile issues its first weight stages and reads its scales, then waits for its input's
flag (x's, or its group's): the weight-only rule, static weights cross the synchronization point and
activations never. No deadlock: a tile waits only for tiles of smaller tickets, all taken by CTAs
already running, and those never wait for a larger ticket.

The state, int32 [STATE_HEAD + 2 * P]: the ticket, the exits, x's flag, then each group's gate/up count,
then each group's flag. It is zero before a launch and the launch's last CTA to exit zeroes it, so one
state serves launches in stream order; launches that could overlap need their own (`state`: one per
device and stream).
"""
from __future__ import annotations

import threading

import torch

from .compat import SELF as compat
from .routed_experts_w4a16 import WARPS, down_params, gate_up_params, table_fakes, table_views

THREADS = 32 * WARPS  # the row kernels' CTA
STATE_HEAD = 3  # ticket, exits, x's flag

if compat.HAVE_CUTE:
    import cutlass
    from cutlass import Int32, Int64, const_expr

    from .routed_experts_w4a16 import W4A16RowsDot, situ_glu_x8, wait_flag, word_order_x8

    cute = compat.cute

    class W4A16OneLaunch:
        """z [P, L] = w2[e_p] @ situ_glu(w1[e_p] @ a[p // top_k], w3[e_p] @ a[p // top_k]), pairwise."""

        def __init__(self, *, gate_up: dict, down: dict, beta: float, linear_beta: float):
            assert gate_up["pairwise"] and down["pairwise"] and gate_up["x_quads"] == down["x_quads"]
            assert gate_up["warps"] == down["warps"] == THREADS // 32
            self.gu = W4A16RowsDot(**gate_up, waits=True)
            self.dn = W4A16RowsDot(**down, waits=True)
            self.I, self.L, self.top_k = gate_up["N"], gate_up["K"], gate_up["top_k"]
            self.splits = gate_up["K"] // gate_up["k_span"]
            self.x_quads = gate_up["x_quads"]
            self.beta, self.linear_beta = beta, linear_beta

        @cute.jit
        def __call__(self, mA: cute.Tensor, mX: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor,
                     mW3: cute.Tensor, mS3: cute.Tensor, mGU: cute.Tensor, mH: cute.Tensor, mW2: cute.Tensor,
                     mS2: cute.Tensor, mZ: cute.Tensor, mExperts: cute.Tensor, mState: cute.Tensor, stream):
            P = mExperts.shape[0]
            tiles = 1 + P * (self.gu.grid_y * self.splits + self.dn.grid_y)
            self.kernel(mA, mX, mW1, mS1, mW3, mS3, mGU, mH, mW2, mS2, mZ, mExperts, mState).launch(
                grid=(tiles, 1, 1), block=(THREADS, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mA: cute.Tensor, mX: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor,
                   mS3: cute.Tensor, mGU: cute.Tensor, mH: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
                   mZ: cute.Tensor, mExperts: cute.Tensor, mState: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            P = mExperts.shape[0]
            GU: cutlass.Constexpr = self.gu.grid_y * self.splits  # gate/up tiles a group
            DN: cutlass.Constexpr = self.dn.grid_y
            tiles = 1 + P * (GU + DN)
            smem = compat.SmemAllocator()
            ring = compat.smem_address(smem.allocate_array(cutlass.Uint8, max(self.gu.smem_bytes(),
                                                                              self.dn.smem_bytes())))
            said = compat.smem_address(smem.allocate_array(Int32, 4))  # thread 0's word to the CTA
            state = compat.address(mState.iterator)
            x_flag = state + 4 * 2
            counts = state + 4 * STATE_HEAD
            flags = counts + 4 * P

            ticket = self._count(said, tidx, state, ordered=False)
            if ticket == 0:
                self._word_order(mA, mX, P // self.top_k, tidx)
                compat.fence_acq_rel_gpu()
                cute.arch.sync_threads()
                if tidx == 0:
                    compat.st_release_gpu_s32(x_flag, 1)
            elif ticket <= P * GU:
                t = ticket - 1
                gid = t // GU
                split = (t % GU) // self.gu.grid_y
                size = self.gu.tile(gid, t % self.gu.grid_y, split, tidx, ring, x_flag, mX, mW1, mS1, mW3, mS3,
                                    mGU, mExperts, mExperts, mExperts, Int32(0))
                if size > 0:  # (an expert id outside [0, E): no tile of its group counts, waits or works)
                    compat.fence_acq_rel_gpu()  # this thread's partials before the count
                    last = self._count(said, tidx, counts + 4 * gid)
                    if last == GU - 1:
                        compat.fence_acq_rel_gpu()
                        self._situ_glu(mGU, mH, gid, P, tidx)
                        compat.fence_acq_rel_gpu()
                        cute.arch.sync_threads()
                        if tidx == 0:
                            compat.st_release_gpu_s32(flags + 4 * gid, 1)
            else:
                t = ticket - 1 - P * GU
                gid = t // DN
                self.dn.tile(gid, t % DN, 0, tidx, ring, flags + 4 * gid, mH, mW2, mS2, mW2, mS2, mZ, mExperts,
                             mExperts, mExperts, Int32(0))

            # the last CTA out zeroes the state for the next launch: every other CTA is past its waits
            exits = self._count(said, tidx, state + 4)
            if exits == tiles - 1:
                for i in cutlass.range(tidx, STATE_HEAD + 2 * P, THREADS, unroll=1):
                    compat.st_relaxed_gpu_s32(state + 4 * i, 0)

        @cute.jit
        def _count(self, said, tidx, counter, ordered: cutlass.Constexpr = True):
            """Thread 0 adds 1 to the int32 at `counter` once the CTA's earlier work is done (a barrier);
            the old value, to every thread. `ordered`: acquire-release (an arrival whose last arriver
            reads the others' work); else relaxed (the ticket, at a CTA's start: the flags order
            the work it hands out, so an acquire there would only add its cost)."""
            cute.arch.sync_threads()
            if tidx == 0:
                if const_expr(ordered):
                    compat.st_shared_b32(said, compat.atom_add_acq_rel_gpu_s32(counter, 1))
                else:
                    compat.st_shared_b32(said, compat.atom_add_relaxed_gpu_s32(counter, 1))
            cute.arch.sync_threads()
            return compat.ld_shared_b32(said)

        @cute.jit
        def _word_at(self, w):
            """Where a row's 16-byte word w goes: itself, or with x_quads, word 4t + i of each 128-element
            step at 4i + t (word_order's quad order, which the row kernels' loads expect)."""
            to = w
            if const_expr(self.x_quads):
                to = w // 16 * 16 + w % 4 * 4 + w % 16 // 4
            return to

        @cute.jit
        def _word_order(self, mA: cute.Tensor, mX: cute.Tensor, T, tidx):
            """x = word_order(a, x_quads): each 16-byte word of 8 elements to 4 registers of (j, j + 4)."""
            WORDS: cutlass.Constexpr = self.L // 8
            a_base = compat.address(mA.iterator)
            x_base = compat.address(mX.iterator)
            for i in cutlass.range(tidx, T * WORDS, THREADS, unroll=1):
                row = i // WORDS
                w = i % WORDS
                words = word_order_x8(compat.ld_nc_v4(a_base + Int64(i) * 16))
                compat.st_v4_b32(x_base + (Int64(row) * WORDS + self._word_at(w)) * 16, *words)

        @cute.jit
        def _situ_glu(self, mGU: cute.Tensor, mH: cute.Tensor, pair, P, tidx):
            """h[pair] = situ_glu(g, u) in the down's word order: the splits' partials summed, g and u
            rounded to bf16, SiTU in fp32 (the Triton SiTU-GLU's numerics), rounded to bf16."""
            gu_base = compat.address(mGU.iterator)
            h_base = compat.address(mH.iterator)
            for w in cutlass.range(tidx, self.I // 8, THREADS, unroll=1):
                words = situ_glu_x8(gu_base, pair, P, w, self.I, self.splits, self.beta, self.linear_beta, True)
                compat.st_v4_b32(h_base + (Int64(pair) * self.I + 8 * self._word_at(w)) * 2, *words)


def builder(*, gate_up: dict, down: dict, beta: float, linear_beta: float):
    """(key, build) for compat.compiled / compat.compile_to_ptx_on_cpu: gate_up_params and down_params
    (pairwise), SiTU's two betas; E and the pair count are dynamic."""
    key = ("w4a16_one_launch", tuple(sorted(gate_up.items())), tuple(sorted(down.items())), float(beta),
           float(linear_beta))

    def build():
        sym = cute.sym_int
        I, L = gate_up["N"], gate_up["K"]
        # a, x, h (16-byte loads and stores), z (2-byte stores: any view of a [P, L] buffer)
        bf16 = [compat.fake_tensor(cutlass.BFloat16, (sym(), n), (n, 1), align=16 if j < 3 else 2)
                for j, n in enumerate((L, L, I, L))]
        (w1, s1), (w3, s3), (w2, s2) = (table_fakes(gate_up["fmt"], k) for k in (L, L, I))
        gu = compat.fake_tensor(cutlass.Float32, (sym(),), (1,), align=16)
        experts = compat.fake_tensor(cutlass.Int64, (sym(),), (1,), align=8)
        state = compat.fake_tensor(cutlass.Int32, (sym(),), (1,), align=4)
        k = W4A16OneLaunch(gate_up=gate_up, down=down, beta=beta, linear_beta=linear_beta)
        return (k, bf16[0], bf16[1], w1, s1, w3, s3, gu, bf16[2], w2, s2, bf16[3], experts, state,
                compat.fake_stream())

    return key, build


def params(I: int, L: int, top_k: int, config: dict, fmt: str) -> dict:
    """builder's launch parameters for cute_config's `config` (pairwise, one_launch) over `fmt` tables."""
    assert config["pairwise"], "one launch runs pairwise mode"
    # the scale blocks' 16-byte copies need 16-byte aligned tables: the op's tensors are only checked
    # for a step's copy, so the one-launch form keeps one scale copy a step
    config = {**config, "scale_steps": 1}
    return {"gate_up": gate_up_params(I, L, top_k, config, fmt), "down": down_params(I, L, config, fmt)}


_states: dict[tuple[int, int], torch.Tensor] = {}
_states_lock = threading.Lock()


def state(device: torch.device, max_pairs: int) -> torch.Tensor:
    """The int32 state for launches on `device`'s current stream, with room for `max_pairs` pairs:
    zeroed once here, and left zeroed by each launch (allocated in a CUDA-graph capture, its zeroing is
    captured too). One size a stream: the op always asks its most pairs, so that a state a graph
    captured is never replaced; asking more than the stream's state holds raises."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    words = STATE_HEAD + 2 * max_pairs
    with _states_lock:
        have = _states.get(key)
        if have is None:
            have = _states[key] = torch.zeros(words, dtype=torch.int32, device=f"cuda:{index}")
        elif have.numel() < words:
            raise ValueError(f"this stream's one-launch state holds {have.numel()} words, not {words}: "
                             f"ask one size (the most pairs) on a stream")
        return have


def launch(a, x, w1, s1, w3, s3, gu, h, w2, s2, z, experts, state_words, *, gate_up: dict, down: dict,
           beta: float, linear_beta: float) -> None:
    """One compiled launch (CUDA tensors, contiguous): a [T, L] bf16 (16-byte aligned) -> z [P, L],
    through the scratch x [T, L], gu [split, P, 2I] fp32 and h [P, I]."""
    if not 0 < experts.shape[0] <= (state_words.numel() - STATE_HEAD) // 2:
        raise ValueError(f"{experts.shape[0]} pairs: one launch takes 1 to its state's room, "
                         f"{(state_words.numel() - STATE_HEAD) // 2} ({STATE_HEAD} + 2 words a pair)")
    key, build = builder(gate_up=gate_up, down=down, beta=beta, linear_beta=linear_beta)
    I, L = gate_up["N"], gate_up["K"]
    compat.compiled(key, build)(a, x, *table_views(w1, s1, L), *table_views(w3, s3, L), gu.view(-1), h,
                                *table_views(w2, s2, I), z, experts, state_words)


__all__ = ["STATE_HEAD", "builder", "params", "state", "launch"]
