"""Split-K configs measured fastest on H200 by bench/sweep_decode_gemm.py (generated).

Key: (N, K, BLOCK_M). Measured 2026-11-30 on H200, torch 2.11.0+cu130, triton 3.6.0, driver 580.159.04;
the sweep in docs/perf/2026-11-30-decode-gemm-fused-ar.md (section 1). SPLIT_K 1 (one 5-stage pipelined
CTA per 64 columns) wins wherever N gives >= 112 column tiles; narrow N (router, W_down) splits K to reach
about 112 CTAs.
"""
TUNED = {
    (896, 7168, 16): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 5},
    (896, 7168, 32): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 5},
    (896, 7168, 64): {'BLOCK_N': 64, 'BLOCK_K': 256, 'SPLIT_K': 7, 'num_warps': 4, 'num_stages': 3},
    (3584, 7168, 16): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 2, 'num_warps': 4, 'num_stages': 5},
    (3584, 7168, 32): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 2, 'num_warps': 4, 'num_stages': 5},
    (3584, 7168, 64): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 2, 'num_warps': 4, 'num_stages': 5},
    (7168, 768, 16): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 768, 32): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 768, 64): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 1536, 16): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 1536, 32): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 1536, 64): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 3584, 16): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 3584, 32): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 3584, 64): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 6144, 16): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 6144, 32): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 6144, 64): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 12288, 16): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 12288, 32): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
    (7168, 12288, 64): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 5},
}
