// flash_fwd_tc.cu: FlashAttention forward on tensor cores (mma.sync m16n8k16), float16 and bfloat16 (float16
// alone on Turing, sm_75, through tensor_core.cuh's stand-ins).
//
// The same maths as flash_fwd.cu, for one query block Q_i (BLOCK_M rows) of one (batch, query head):
//     for each key block K_j, V_j (BLOCK_N keys) that some row of Q_i can see:
//         S = Q_i K_jᵀ                  -inf where the query does not see the key (mask.cuh)
//         m_new = max(m, rowmax S · c)  with c = scale · log2(e): m, and the exponents, are in base 2
//         P = 2^(S · c - m_new);  alpha = 2^(m - m_new);  l = alpha l + rowsum P;  O = alpha O + P V_j
//     out_i = O / l,  lse_i = (m + log2 l) · ln 2  (natural log); a row that saw no key: out 0, lse -inf.
// Key blocks that no row of Q_i can see are never loaded, and only the tiles that Mask::partial
// names are masked element by element.
//
// Grid: one CTA per (query block, batch * heads_q), flattened on x (query_block in mask.cuh); with
// VARLEN, a packed batch, total_q / BLOCK_M + num_seqs CTAs per query head, each finding its sequence
// and query block in the offsets (mask.cuh's Sequence), those past their sequence's blocks exiting
// before any copy.
// CTA: WARPS warps (flash_fwd_tc: NUM_WARPS = 4; flash_fwd_tc_wide: WIDE_WARPS = 8, tc_tile.cuh);
// warp w owns M_TILES 16-row mma tiles, query rows WARP_ROWS w .. WARP_ROWS w + WARP_ROWS - 1 of Q_i
// (WARP_ROWS = 16 M_TILES), so BLOCK_M = 16 M_TILES WARPS. Each K_j or V_j fragment a warp reads from
// shared memory feeds 2 M_TILES mma: two row tiles halve the shared-memory bytes per mma, at the price
// of twice the accumulator registers; twice the warps halve the cp.async bytes per mma. In registers,
// per warp and row tile (C fragments as in tc_tile.cuh):
//     Q_frag  the A fragments of its rows of Q_i for k-steps 0 .. Q_KEPT - 1, loaded once: all
//             HEAD_DIM / 16 with one row tile up to HEAD_DIM 128 (none above: O's 96 or 128 registers a
//             thread at 192 and 256); with two, none or one (the entry points say which),
//             the other k-steps read from Q_s at every pass (the registers go to O and S)
//     S       BLOCK_N / 8 C fragments: S = Q_i K_jᵀ, then P in place (fp32)
//     O       HEAD_DIM / 8 C fragments (fp32); m, l for the lane's two rows (l is the lane's
//             partial row sum, summed over the 4 lanes of a quad once, at the end)
// The operands, each one ldmatrix from a swizzled tile:
//     S = Q_i K_jᵀ      A: Q_frag                                B = K_jᵀ: K_j rows (ldmatrix_x4)
//     O += P V_j        A: P from the S C fragments (c_to_a)     B = V_j: V_j rows (ldmatrix_x4_trans)
// so P never passes through shared memory.
//
// Shared memory (dynamic), T (2 bytes) tiles of HEAD_DIM elements a row, swizzled (tc_tile.cuh):
//     Q_s   BLOCK_M x HEAD_DIM        Q_i; read once into registers, or at every pass (two row tiles;
//                                     the k-steps not kept)
//     K_s   2 x BLOCK_N x HEAD_DIM    K_j, V_j of this pass and the next: cp.async fills one stage
//     V_s   2 x BLOCK_N x HEAD_DIM    while the other is computed on (double buffering)
//     total (BLOCK_M + 4 BLOCK_N) HEAD_DIM 2 bytes; above 48 KiB the launcher raises
//     max_dynamic_shared_size_bytes (sm_70+; 64 KiB at most on Turing). The tiles per head dim are
//     TC_TILES' forward rows (TC_TURING_TILES' on Turing) in flashcupy/backends/cupy_backend/specs.py;
//     `python -m flashcupy kernels` prints each specialization's shared memory, registers, spills and
//     HMMA count.
//
// Barriers, two per pass: after the cp.async wait (the other threads' copies of K_j, V_j, and on the
// first pass Q_i, have landed), and at the end of the pass (no warp still reads the stage that the
// next pass's prefetch overwrites). tests/test_cupy_backend.py removes each in turn and sees the
// emulator give a wrong answer, the second only with warps skewed and cp.async landing at issue.
// Without the wait (cp_async_next_stage, tc_tile.cuh) the copies are never complete, and the
// emulator reports them in flight when the threads exit.
//
// Requirements on the arguments, checked by the launcher: head_dim a multiple of 8 and at most
// HEAD_DIM (columns past head_dim are zero-filled); q, k, v, out contiguous in head_dim (the *_sd
// strides are 1; they are kept so the argument list is flash_fwd's), every row 16-byte aligned
// (pointers and the other strides multiples of 8 elements). Rows past seqlen are zero-filled.
//
// Score modifiers (mask.cuh, the MODS template parameter): with MOD_SOFTCAP, MOD_ALIBI or MOD_BIAS,
// Score turns S = Q_i K_jᵀ into the final score in base 2 (softcap, slope and bias act in natural
// units, Score's constants carry scale and log2 e) before the mask, and the online softmax then takes
// it as it is (multiplier 1); with MOD_MASK every tile is masked element by element (the caller's
// bool mask may hide any pair); with MOD_WINDOW the Mask is the band and KVStream streams only its
// key blocks.
//
// Split-KV (SPLIT): as in flash_fwd.cu, each CTA attends to its split's keys and stores a partial out
// in float, and lse, at its split's offsets. Varlen (VARLEN): as in flash_fwd.cu, each CTA reads the
// offsets, clamped into the arrays, and runs as on its sequence alone (mask.cuh's TAKE_SEQUENCE), its
// keys and values through a KV cache's block table where PAGED_PARAMS give one (CacheRows: a table
// entry read per row copied, each cp.async's source computed from it).
//
// Template parameters: T (__half or __nv_bfloat16), HEAD_DIM (head_dim rounded up to 16, at most 256),
// BLOCK_M (16 M_TILES WARPS, M_TILES 1 or 2), BLOCK_N (a multiple of 16), MIN_CTAS (and in the wide
// kernel MAX_REGISTERS) the occupancy policy (launch.py's Bounds, which says why), MODS the score
// modifiers (0: none), SPLIT split-KV and VARLEN a packed batch (flash_fwd_tc only: a packed batch takes
// its 64-row tile at head_dim 128, specs.tc_tile).

#include "mask.cuh"
#include "tc_tile.cuh"

// The CTA's work, for WARPS warps (the two entry points at the end of the file). Q_KEPT: the k-steps
// of Q_i whose A fragments a warp keeps in registers for the whole loop; the others are read from Q_s
// at every pass.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MODS, bool SPLIT, bool VARLEN, int WARPS, int Q_KEPT>
__device__ __forceinline__ void flash_fwd_tc_cta(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), TENSOR_PARAMS(const T, v),
    SplitOut<SPLIT, T, float>* __restrict__ out, index_t out_sb, index_t out_ss, index_t out_sh, index_t out_sd,
    LSE_PARAMS(float, lse), PROBLEM_PARAMS(float), SPLIT_PARAMS, VARLEN_PARAMS, PAGED_PARAMS) {
    constexpr int THREADS = WARPS * WARP_SIZE;
    constexpr int M_TILES = BLOCK_M / (16 * WARPS);  // 16-row mma tiles a warp owns
    constexpr int WARP_ROWS = 16 * M_TILES;
    static_assert(BLOCK_M == WARP_ROWS * WARPS && (M_TILES == 1 || M_TILES == 2),
                  "each warp owns one or two 16-row mma tiles");
    static_assert(BLOCK_N % 16 == 0, "BLOCK_N is a whole number of P V k-steps");
    static_assert(HEAD_DIM % 16 == 0, "k-steps of 16 columns");
    constexpr int ROW = TILE_ROW<HEAD_DIM>;  // a shared tile row's elements (tc_tile.cuh)
    constexpr int N_TILES = BLOCK_N / 8;     // 8-key column tiles of S
    constexpr int D_TILES = HEAD_DIM / 8;    // 8-column tiles of O
    constexpr int QK_STEPS = HEAD_DIM / 16;  // k-steps of Q_i K_jᵀ
    static_assert(0 <= Q_KEPT && Q_KEPT <= QK_STEPS, "Q_KEPT: k-steps of Q_i");
    // Out is made before the key loop by the plain 4-warp kernel (made after it, it made ptxas spill),
    // after the loop by the others (made before, it took the split kernel to every register and made
    // the 8-warp one spill under its register cap)
    constexpr bool OUT_AFTER_LOOP = SPLIT || WARPS != NUM_WARPS;

    extern __shared__ __align__(16) unsigned char smem[];
    T* Q_s = reinterpret_cast<T*>(smem);
    T* K_s = Q_s + BLOCK_M * ROW;
    T* V_s = K_s + 2 * BLOCK_N * ROW;

    const Split split = split_of_cta<BLOCK_M, SPLIT, VARLEN>(seqlen_q, seqlen_k, key_split, num_seqs, heads_q);
    QueryBlock blk;
    if constexpr (VARLEN) {
        const Sequence seq = sequence_of<BLOCK_M>(VARLEN_ARGS, seqlen_q, seqlen_k, group, split.cta);
        if (seq.start < 0) return;  // past its sequence's query blocks: no work (the whole CTA, before any copy)
        TAKE_SEQUENCE(seq);
        blk = {seq.start, seq.index, seq.h, seq.kv_head};
    } else {
        blk = query_block<BLOCK_M>(seqlen_q, heads_q, group, split.cta);
    }
    const auto mask = MAKE_MASK(MODS);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int row_w = blk.i0 + WARP_ROWS * warp;  // the warp's first row; row tile mt starts at row_w + 16 mt
    T* Q_w = Q_s + WARP_ROWS * warp * ROW;  // the warp's rows of Q_s

    const auto make_out = [&] { return head_rows(out + split.index * out_split, out_sb, out_ss, out_sh, out_sd, blk.b, blk.h); };
    const auto Out = make_out();
    using Stream = KVStream<BLOCK_N, HEAD_DIM, T, THREADS, KeyRows<VARLEN, const T>>;
    const Stream kv = [&] {
        const auto K = KEY_ROWS(VARLEN, k, blk.b, blk.kv_head), V = KEY_ROWS(VARLEN, v, blk.b, blk.kv_head);
        if constexpr (SPLIT) {
            int j_start = mask.key_start(blk.i0), j_end = mask.key_end(blk.i0);
            split_range<BLOCK_N>(j_start, j_end, split.index * key_split, key_split);
            return Stream(K_s, V_s, K, V, j_start, j_end, seqlen_k, head_dim, head_dim_v);
        } else {
            return Stream(K_s, V_s, K, V, mask, blk.i0, head_dim, head_dim_v);
        }
    }();

    // group 0: Q_i and the first key block. A CTA whose rows see no key copies nothing: it never
    // waits, and copies in flight when a CTA exits would land in shared memory that the next CTA on
    // the SM may own.
    if (kv.blocks > 0) {
        load_tile_async<BLOCK_M, HEAD_DIM, THREADS>(Q_s, HEAD_ROWS(q, blk.b, blk.h), blk.i0, seqlen_q, head_dim);
        kv.load(0);
        cp_async_commit();
    }

    const float scale_log2 = scale * LOG2E;
    const auto score = MAKE_SCORE(T, float, MODS, blk.b, blk.h, scale_log2, LOG2E);
    const auto drop = MAKE_DROPOUT(float, MODS, false, blk.b, blk.h);
    float m[M_TILES][2], l[M_TILES][2];
    float O[M_TILES][D_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
    zero(O);
    unsigned Q_frag[M_TILES][Q_KEPT > 0 ? Q_KEPT : 1][4];  // k-steps 0 .. Q_KEPT - 1 of Q_i

    for (int jb = 0; jb < kv.blocks; ++jb) {
        const int j0 = kv.j0(jb);
        kv.next(jb);
        __syncthreads();  // every thread's copies of K_j, V_j (and Q_i) have landed: the stage is whole

        if (Q_KEPT > 0 && jb == 0) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int ks = 0; ks < Q_KEPT; ++ks) load_a<HEAD_DIM>(Q_frag[mt][ks], Q_w + 16 * mt * ROW, ks);
        }

        float S[M_TILES][N_TILES][4];
        zero(S);
#pragma unroll
        for (int ks = 0; ks < Q_KEPT; ++ks) {
            unsigned a[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int i = 0; i < 4; ++i) a[mt][i] = Q_frag[mt][ks][i];
            mma_abt_step<T, HEAD_DIM, BLOCK_N, M_TILES>(S, a, kv.K_j(jb), ks);
        }
        // the rest read from Q_s; not unrolled: ptxas would hoist the fragments of later k-steps, past
        // the registers O and S leave
#pragma unroll 1
        for (int ks = Q_KEPT; ks < QK_STEPS; ++ks) {
            unsigned a[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) load_a<HEAD_DIM>(a[mt], Q_w + 16 * mt * ROW, ks);
            mma_abt_step<T, HEAD_DIM, BLOCK_N, M_TILES>(S, a, kv.K_j(jb), ks);
        }

#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            tc_final_scores<MODS>(S[mt], mask, score, blk.i0, row_w + 16 * mt, j0, scale_log2);
            online_softmax(S[mt], m[mt], l[mt], O[mt], tc_softmax_scale(score, scale_log2));
            tc_dropout<MODS>(S[mt], drop, row_w + 16 * mt, j0);  // after l took the row sums
        }
        mma_ab<T, HEAD_DIM, BLOCK_N, M_TILES>(O, S, kv.V_j(jb));
        __syncthreads();  // every warp is done with this stage before the next pass's prefetch overwrites it
    }

    // out = O / l and lse = (m + log2 l) ln 2; a row that saw no key (l == 0) gets out 0, lse -inf
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        const int row_t = row_w + 16 * mt, row_g = row_t + lane / 4;  // this lane's rows: row_g and row_g + 8
        float inv_l[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[mt][r] = group_sum<4>(l[mt][r]);
            inv_l[r] = l[mt][r] == 0.0f ? 0.0f : 1.0f / l[mt][r];
            const int row = row_g + 8 * r;
            if (lane % 4 == 0 && row < seqlen_q)
                LSE_ROW_AT(lse, split.index * lse_split, blk.b, blk.h)[row] =
                    l[mt][r] == 0.0f ? -INFINITY : m[mt][r] * LN2 + logf(l[mt][r]);
        }
        if constexpr (SPLIT) {
            store_fragments<HEAD_DIM>(make_out(), O[mt], inv_l, row_g, seqlen_q, head_dim_v);  // float: no staging
        } else {
            // staged through the row tile's own rows of Q_s, which only this warp reads (the last time in
            // the last pass)
            store_fragments_staged<HEAD_DIM>(OUT_AFTER_LOOP ? make_out() : Out, O[mt], inv_l, Q_w + 16 * mt * ROW,
                                             row_t, seqlen_q, head_dim_v);
        }
    }
}

// The entry points. flash_fwd_tc: NUM_WARPS warps of one or two row tiles, registers left to ptxas
// (__launch_bounds__ with MIN_CTAS). flash_fwd_tc_wide: WIDE_WARPS warps of two row tiles under a
// register cap (MAX_REGISTERS). specs.py says which head dims and modifiers take which, and the bounds
// of each (Bounds).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MIN_CTAS, int MODS = 0, bool SPLIT = false,
          bool VARLEN = false>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS) flash_fwd_tc(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), TENSOR_PARAMS(const T, v),
    SplitOut<SPLIT, T, float>* __restrict__ out, index_t out_sb, index_t out_ss, index_t out_sh, index_t out_sd,
    LSE_PARAMS(float, lse), PROBLEM_PARAMS(float), SPLIT_PARAMS, VARLEN_PARAMS, PAGED_PARAMS) {
    // Q_i's A fragments stay in registers with one row tile up to head_dim 128; with two, or above 128, O and S
    // take the registers (kept, Q_frag took head_dim 64 to the register limit of tests/test_nvrtc.py:
    // benchmarks/results/tile_choices.md; and 256 past 255 registers)
    constexpr int Q_KEPT = BLOCK_M == 16 * NUM_WARPS && HEAD_DIM <= 128 ? HEAD_DIM / 16 : 0;
    flash_fwd_tc_cta<T, HEAD_DIM, BLOCK_M, BLOCK_N, MODS, SPLIT, VARLEN, NUM_WARPS, Q_KEPT>(
        TENSOR_ARGS(q), TENSOR_ARGS(k), TENSOR_ARGS(v), TENSOR_ARGS(out), LSE_ARGS(lse), PROBLEM_ARGS, SPLIT_ARGS,
        VARLEN_ARGS, PAGED_ARGS);
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MIN_CTAS, int MAX_REGISTERS, int MODS = 0>
__global__ void CAPPED_BOUNDS(WIDE_WARPS * WARP_SIZE, MIN_CTAS, MAX_REGISTERS) flash_fwd_tc_wide(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), TENSOR_PARAMS(const T, v),
    T* __restrict__ out, index_t out_sb, index_t out_ss, index_t out_sh, index_t out_sd,
    LSE_PARAMS(float, lse), PROBLEM_PARAMS(float), SPLIT_PARAMS, VARLEN_PARAMS, PAGED_PARAMS) {
    // k-step 0 of Q_i kept at head_dim 128, where it takes the shared-memory bytes per mma from 208 to
    // 200; below, Q_i is read at every pass (keeping k-step 0 made head_dim 112 spill under its cap)
    constexpr int Q_KEPT = HEAD_DIM == 128 ? 1 : 0;
    flash_fwd_tc_cta<T, HEAD_DIM, BLOCK_M, BLOCK_N, MODS, false, false, WIDE_WARPS, Q_KEPT>(
        TENSOR_ARGS(q), TENSOR_ARGS(k), TENSOR_ARGS(v), TENSOR_ARGS(out), LSE_ARGS(lse), PROBLEM_ARGS, SPLIT_ARGS,
        VARLEN_ARGS, PAGED_ARGS);
}
