// flash_bwd_tc.cu: FlashAttention backward on tensor cores (mma.sync m16n8k16), float16 and bfloat16 (float16
// alone on Turing, sm_75, through tensor_core.cuh's stand-ins).
//
// The same maths as flash_bwd.cu, with P recomputed from the forward's lse (natural log), in base 2:
//     P = 2^(S c - lse log2 e),  c = scale log2 e;   dP = dO Vᵀ;   dS = P ∘ (dP - D),  D = rowsum(dO ∘ O)
//     dV = Pᵀ dO;   dK = scale dSᵀ Q;   dQ = scale dS K
// A row with lse = -inf saw no key: its P is 0, so are its dS and its dQ. Blocks that no pair of rows
// can see are never loaded, and only the tiles that Mask::partial names (mask.cuh) are masked
// element by element. Three kernels, launched in this order:
//
// 1. flash_bwd_preprocess (flash_bwd_common.cuh, the SIMT one): D into a float workspace.
//
// 2. flash_bwd_dkdv_tc: one CTA per (key block j, batch * heads_kv), flattened on x (key_block in
//    mask.cuh). K_j, V_j (BLOCK_N = 64 keys) stay in shared memory while the query blocks Q_i
//    (BLOCK_M rows) of every query head of the GQA group that can see key block j stream past,
//    double-buffered by cp.async (a "pass" is one (query head, query block)):
//        Sᵀ = K_j Q_iᵀ;  dPᵀ = V_j dO_iᵀ;  Pᵀ = 2^(Sᵀ c - lse_i log2 e);  dSᵀ = Pᵀ ∘ (dPᵀ - D_i)
//        dV_j += Pᵀ dO_i;  dK_j += dSᵀ Q_i                    (dK_j times scale once, at the end)
//    Sᵀ, not S, is computed, so that each warp owns keys: warp w holds keys 16 w .. 16 w + 15, the
//    rows of Sᵀ, dPᵀ and of its dK_j, dV_j accumulators (no reduction between warps). Per pass and
//    warp, in registers (C fragments as in tc_tile.cuh):
//        Sᵀ, dPᵀ  BLOCK_M / 8 C fragments each (fp32): 16 keys x BLOCK_M queries; then Pᵀ, dSᵀ in place
//        dK, dV   COLS / 8 C fragments each (fp32), kept across passes (COLS: HEAD_DIM, or half, below)
//    The operands, each one ldmatrix from a swizzled tile:
//        Sᵀ = K_j Q_iᵀ     A: K_j rows (ldmatrix_x4)              B = Q_iᵀ: Q_i rows (ldmatrix_x4)
//        dPᵀ = V_j dO_iᵀ   A: V_j rows (ldmatrix_x4)              B = dO_iᵀ: dO_i rows (ldmatrix_x4)
//        dV += Pᵀ dO_i     A: Pᵀ from the Sᵀ C fragments (c_to_a) B = dO_i: dO_i rows (ldmatrix_x4_trans)
//        dK += dSᵀ Q_i     A: dSᵀ from the dPᵀ C fragments        B = Q_i: Q_i rows (ldmatrix_x4_trans)
//    lse_i and D_i are per query, so per column of Sᵀ: they come from shared memory, lse_i already
//    times log2 e and +inf where P must be 0 (rows that saw no key, rows past seqlen_q).
//    With DQ_ATOMIC (the default backward, not deterministic), a fifth GEMM per pass:
//        dQ_i += dS K_j            A: dS from dS_s (ldmatrix_x4)         B = K_j: K_j rows (ldmatrix_x4_trans)
//    each warp stores its dSᵀ C fragments transposed into dS_s (BLOCK_M x BLOCK_N, T, swizzled), a
//    barrier, then the warps share dQ_i's 16 x 16 output tiles (atomic_dq) and add them into an fp32
//    workspace with atomics, a warp's tile at a time through a 16 x 16 float staging tile so that each
//    atomic instruction covers whole 32-byte sectors. The dQ kernel below is then not launched:
//    flash_bwd_dq_convert scales and rounds the workspace into dq. Five GEMMs a (query block, key
//    block) pair instead of seven; the price: the atomics' order varies, so dq's rounding does.
//
// 3. flash_bwd_dq_tc (deterministic=True): one CTA per (query block i, batch * heads_q), flattened on x (query_block in
//    mask.cuh). Q_i, dO_i (BLOCK_M = 64 rows) stay in shared memory while the key blocks K_j, V_j
//    (BLOCK_N keys) that Q_i can see stream past, double-buffered by cp.async:
//        S = Q_i K_jᵀ;  dP = dO_i V_jᵀ;  P = 2^(S c - lse_i log2 e);  dS = P ∘ (dP - D_i);  dQ_i += dS K_j
//    Warp w owns query rows 16 w .. 16 w + 15, their lse_i, D_i (registers) and dQ_i (HEAD_DIM / 8
//    C fragments, fp32; times scale at the end). S, dP: BLOCK_N / 8 C fragments each.
//        S = Q_i K_jᵀ      A: Q_i rows (ldmatrix_x4)              B = K_jᵀ: K_j rows (ldmatrix_x4)
//        dP = dO_i V_jᵀ    A: dO_i rows (ldmatrix_x4)             B = V_jᵀ: V_j rows (ldmatrix_x4)
//        dQ += dS K_j      A: dS from the dP C fragments (c_to_a) B = K_j: K_j rows (ldmatrix_x4_trans)
//    dQ gets its own kernel, like flash_bwd_dq: every output element is written by one thread, no
//    atomics, bitwise reproducible; the price is computing S and dP a second time.
//
// Above head_dim 128 (TC_COLUMN_PARTS, tc_tile.cuh) two CTAs share each block, blockIdx.y the part: each
// computes Sᵀ and dPᵀ (S and dP) over all HEAD_DIM columns and then only its COLS = HEAD_DIM / 2 columns
// of dK, dV (dQ), columns c0 = COLS blockIdx.y on, of the shared tiles it reads the B operand from
// (mma_ab's chunk0) and of the outputs it writes. A warp's dK and dV of 256 columns would take 256
// registers a thread; halves take what head_dim 128 takes. The price: S and dP computed twice, seven
// GEMMs a (query block, key block) pair where five were (eleven where seven were, deterministic), and
// the operands of S and dP read by both CTAs.
//
// The A operands of the first two products (K_j, V_j in dK/dV; Q_i, dO_i in dQ) are read from
// shared memory at every k-step rather than kept in registers as flash_fwd_tc keeps Q_i (two_mma_abt
// in tc_tile.cuh): the registers go to the fp32 accumulators, HEAD_DIM / 2 a thread for each of dK
// and dV.
//
// Shared memory (dynamic), T (2 bytes) tiles of HEAD_DIM elements a row, swizzled (tc_tile.cuh):
//     dK/dV:  K_s, V_s        BLOCK_N x HEAD_DIM each       K_j, V_j; loaded once
//             Q_s, dO_s       2 x BLOCK_M x HEAD_DIM each   Q_i, dO_i of this pass and the next
//             stats_s         2 x 2 x BLOCK_M floats        lse_i log2 e and D_i, per stage
//             total (2 BLOCK_N + 4 BLOCK_M) HEAD_DIM 2 + 16 BLOCK_M bytes, and with DQ_ATOMIC
//             dS_s            BLOCK_M x BLOCK_N             this pass's dS, swizzled rows of BLOCK_N
//             dQ_stage        NUM_WARPS x 16 x 16 floats    a warp's dQ tile on its way to the atomics
//     dQ:     Q_s, dO_s       BLOCK_M x HEAD_DIM each       Q_i, dO_i; loaded once
//             K_s, V_s        2 x BLOCK_N x HEAD_DIM each   K_j, V_j of this pass and the next
//             total (2 BLOCK_M + 4 BLOCK_N) HEAD_DIM 2 bytes
//     Above 48 KiB the launcher raises max_dynamic_shared_size_bytes (sm_70+). The tiles per head
//     dim are TC_TILES' dkdv and dq rows in specs.py; `python -m flashcupy kernels` prints each
//     specialization's shared memory, registers, spills and HMMA count.
//
// Barriers, the same two per pass in both kernels, as in flash_fwd_tc.cu: after the cp.async wait
// (the other threads' copies of this pass's stage, and in dK/dV the lse_i, D_i they stored, have
// landed), and at the end of the pass (no warp still reads the stage that the next pass's prefetch,
// or its lse_i, D_i, overwrites, nor, with DQ_ATOMIC, the dS_s the next pass stores). DQ_ATOMIC adds a
// third, between storing dS and the dQ GEMM that reads every warp's part of it.
// tests/test_cupy_backend.py removes each in turn under the emulator.
//
// Registers: every loop over a tile is unrolled and ptxas hoists the ldmatrix of whole k-loops ahead
// of their mmas, so it takes what __launch_bounds__ allows (MIN_CTAS, chosen by launch.py's Bounds,
// which says why). With any modifier the S and dP products also run their k-steps as a loop
// (two_mma_abt's ROLLED, tc_tile.cuh), which frees the registers the modifiers' work takes, and so do
// the kernels of two column parts, whose plain dK/dV and dQ at 256 took the report's last registers
// unrolled (benchmarks/results/tile_choices.md); the plain kernels up to 128 keep the unrolled loop.
//
// Requirements on the arguments, checked by the launcher (as for flash_fwd_tc): head_dim (q's and k's)
// and, in a kernel specialised for it (MOD_HEAD_DIM_V, V_HEAD_DIM below), head_dim_v (v's, dout's)
// multiples of 8 and at most HEAD_DIM, the larger rounded up: each tile is zero-filled past its own
// tensor's head dim, so the padding adds nothing to S, dP, dV, dK or dQ, and each output is written up
// to its own (a column part past it writes nothing); q, k, v, dout and the outputs
// contiguous in head_dim, every row 16-byte aligned (pointers and the other strides multiples of 8
// elements). lse may have any strides. Rows past seqlen are zero-filled and never written.
//
// Score modifiers (mask.cuh, the MODS template parameter): as in flash_fwd_tc.cu, Score gives the
// final score in base 2 (in place of S c) before P is recomputed, and dS is multiplied by the
// softcap's derivative 1 - tanh^2 (Score::grad); the caller's bool mask hides pairs of any tile;
// with a window the Mask is the band, so the passes and KVStream take only its blocks. dbias is
// computed after these kernels, by flash_pairs.cu's SIMT kernel.
//
// Template parameters: T (__half or __nv_bfloat16), HEAD_DIM (the larger head dim rounded up to 16, at most
// 256; above 128 to 32, so that each part is whole k-steps: specs.tc_head_dim),
// BLOCK_M, BLOCK_N: dK/dV BLOCK_N = 16 NUM_WARPS = 64 and BLOCK_M a multiple of 16 (at most 64);
// dQ BLOCK_M = 64 and BLOCK_N a multiple of 16; MODS the score modifiers (0: none), dropout and
// MOD_HEAD_DIM_V (any bit rolls the k-steps of S and dP).

#include "flash_bwd_common.cuh"
#include "mask.cuh"
#include "tc_tile.cuh"

// v's (and dout's) head dim as a kernel bounds its tiles' columns: head_dim_v in one specialised for a v
// of a head dim of its own (MOD_HEAD_DIM_V: cupy_backend._tc_backward_mods sets it for such calls alone),
// else head_dim, so that the kernels of one head dim keep one column bound for all their tiles: two took
// ptxas up to 4 more registers in the plain dK/dV kernels and spilled dQ's at 256 under NVRTC 12.9
// (benchmarks/results/head_dim_v_registers.md has the figures of the specialised ones)
#define V_HEAD_DIM(MODS) (((MODS) & MOD_HEAD_DIM_V) != 0 ? head_dim_v : head_dim)

// dQ_i += dS K_j for one pass of the dK/dV kernel with DQ_ATOMIC: dS (BLOCK_M queries x BLOCK_N keys,
// T, swizzled rows of BLOCK_N) in dS_s, K_j in K_s. The BLOCK_M / 16 x HEAD_DIM / 16 output tiles of 16
// rows x 16 columns go round the warps; each is BLOCK_N / 16 k-steps of two mmas, then added into
// the fp32 workspace with atomics (rows < seqlen_q, columns < head_dim). The C fragments pass through
// the warp's 16 x 16 floats of stage first, so that the atomics of a warp cover whole 32-byte sectors
// (16 consecutive floats a row) instead of the fragments' 8-byte pieces. Row r of stage holds its 16
// columns XOR-permuted by dq_swizzle(r): straight row-major, the 8 rows one store instruction writes
// (rows g of the lanes, 16 floats apart) fell on 8 of the 32 banks, 4-way conflicts; permuted, the
// stores and the atomics' row-wise reads are conflict-free. Not unrolled over tiles: a tile's
// accumulators (8 floats) are all it adds to the registers the dK, dV accumulators leave.
__device__ __forceinline__ int dq_swizzle(int row) { return (row >> 1 & 1) | (row >> 2 & 1) << 3; }

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int COLS>
__device__ __forceinline__ void atomic_dq(const Rows<float>& dQ, const T* dS_s, const T* K_s, float* stage, int i0,
                                          int seqlen_q, int head_dim, int c0) {
    constexpr int TILES = BLOCK_M / 16 * (COLS / 16);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    stage += warp * 16 * 16;
#pragma unroll 1
    for (int tile = warp; tile < TILES; tile += NUM_WARPS) {
        const int mt = tile / (COLS / 16), dt = c0 / 8 + 2 * (tile % (COLS / 16));  // 16-row tile, 8-column tile
        float acc[2][4] = {};
#pragma unroll 1
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            unsigned a[4], b[4];
            load_a<BLOCK_N>(a, dS_s + 16 * mt * BLOCK_N, kk);
            ldmatrix_x4_trans(b, K_s + swizzled<HEAD_DIM>(16 * kk + lane % 16, dt + lane / 16));
            mma_m16n8k16<T>(acc[0], a, b, acc[0]);
            mma_m16n8k16<T>(acc[1], a, b + 2, acc[1]);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) stage[16 * c_row(i) + ((8 * n + c_col(i)) ^ dq_swizzle(c_row(i)))] = acc[n][i];
        __syncwarp();  // the warp's tile is whole in stage
#pragma unroll
        for (int e = lane; e < 16 * 16; e += WARP_SIZE) {
            const int r = e / 16, row = i0 + 16 * mt + r, col = 8 * dt + e % 16;
            if (row < seqlen_q && col < head_dim) atomicAdd(&dQ.at(row, col), stage[16 * r + (e % 16 ^ dq_swizzle(r))]);
        }
        __syncwarp();  // every lane has read stage before the next tile overwrites it
    }
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MIN_CTAS, int MODS = 0, bool DQ_ATOMIC = false,
          bool VARLEN = false>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS) flash_bwd_dkdv_tc(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), TENSOR_PARAMS(const T, v), TENSOR_PARAMS(const T, dout),
    LSE_PARAMS(const float, lse), const float* __restrict__ Dvec, TENSOR_PARAMS(T, dk), TENSOR_PARAMS(T, dv),
    PROBLEM_PARAMS(float), TENSOR_PARAMS(float, dqa), VARLEN_PARAMS) {
    static_assert(BLOCK_N == 16 * NUM_WARPS, "each warp owns 16 keys: one mma row tile of Sᵀ");
    static_assert(BLOCK_M % 16 == 0 && 2 * BLOCK_M <= NUM_THREADS, "BLOCK_M: whole k-steps, one thread a statistic");
    constexpr int COLS = HEAD_DIM / TC_COLUMN_PARTS<HEAD_DIM>;  // the columns of dK, dV (and dQ) this CTA computes
    static_assert(COLS % 16 == 0, "k-steps of 16 columns, and as many a part");
    constexpr int ROW = TILE_ROW<HEAD_DIM>;  // a shared tile row's elements (tc_tile.cuh)
    constexpr int D_TILES = COLS / 8;
    constexpr int M_TILES = BLOCK_M / 8;  // 8-query column tiles of Sᵀ
    // its first (TC_COLUMN_PARTS: blockIdx.y the part); a constant 0 in the kernels of one part, whose
    // addresses then stay what they were before parts existed
    const int c0 = COLS < HEAD_DIM ? int(blockIdx.y) * COLS : 0;
    const int dim_v = V_HEAD_DIM(MODS);  // v's and dout's head dim

    extern __shared__ __align__(16) unsigned char smem[];
    T* K_s = reinterpret_cast<T*>(smem);
    T* V_s = K_s + BLOCK_N * ROW;
    T* Q_s = V_s + BLOCK_N * ROW;
    T* dO_s = Q_s + 2 * BLOCK_M * ROW;
    float* stats_s = reinterpret_cast<float*>(dO_s + 2 * BLOCK_M * ROW);  // per stage: lse_i log2 e, then D_i
    T* dS_s = reinterpret_cast<T*>(stats_s + 2 * 2 * BLOCK_M);  // DQ_ATOMIC: this pass's dS, BLOCK_M x BLOCK_N
    float* dQ_stage = reinterpret_cast<float*>(dS_s + BLOCK_M * BLOCK_N);  // DQ_ATOMIC: 16 x 16 floats a warp

    DRows<const float, VARLEN> D{Dvec, heads_q, seqlen_q};
    // dqa, with DQ_ATOMIC the dQ workspace (q's rows), else a stand-in of strides 0 that no move changes
    BACKWARD_KEY_BLOCK(blk, D, AT_SEQUENCE_K(seq, dk), AT_SEQUENCE_K(seq, dv), AT_SEQUENCE_Q(seq, dqa));
    const auto mask = MAKE_MASK(MODS);
    const int warp = threadIdx.x / WARP_SIZE;
    const int key_w = blk.j0 + 16 * warp;                   // the warp's first key
    [[maybe_unused]] const int key_g = key_w + threadIdx.x % WARP_SIZE / 4;  // this lane's keys: key_g, key_g + 8

    // the passes: the query blocks that see key block j, in every query head of the group
    const int i_start = mask.query_start(blk.j0);
    const int q_blocks = num_blocks(mask.query_end(blk.j0) - i_start, BLOCK_M);
    const int passes = group * q_blocks;

    // cp.async Q_i, dO_i of pass p into its stage (not committed); thread x < 2 BLOCK_M returns the
    // statistic it stores for that pass: lse log2 e (+inf where P = 0) of row x, or D of row x - BLOCK_M
    // A row the bool mask leaves no key (lse -inf) can lie inside these query blocks (the band starts them at
    // the first row that sees key block j): its dO is zero-filled and its dS selected 0, so that P = 0 times
    // a NaN in its dout reaches neither dV nor dK (nor, with DQ_ATOMIC, dQ)
    auto prefetch = [&](int p) {
        const int h = blk.kv_head * group + p / q_blocks, i0 = i_start + p % q_blocks * BLOCK_M;
        const Stats<const float> lse_h = LSE_ROW(lse, blk.b, h);
        const auto seen_row = [=](int i) { return (MODS & MOD_MASK) == 0 || lse_h[i] != -INFINITY; };
        load_stage_async<BLOCK_M, HEAD_DIM>(Q_s, dO_s, p & 1, HEAD_ROWS(q, blk.b, h), HEAD_ROWS(dout, blk.b, h), i0,
                                            seqlen_q, head_dim, dim_v, seen_row);
        const int i = i0 + threadIdx.x % BLOCK_M;
        if (threadIdx.x < BLOCK_M) return lse_for_p(LSE_ROW(lse, blk.b, h), i, seqlen_q) * LOG2E;
        return i < seqlen_q ? D.template row<true>(blk.b, h)[i] : 0.0f;
    };
    auto store_stat = [&](int p, float stat) {
        if (threadIdx.x < 2 * BLOCK_M) stats_s[(p & 1) * 2 * BLOCK_M + threadIdx.x] = stat;
    };

    // group 0: K_j, V_j and pass 0
    if (passes > 0) {
        load_tile_async<BLOCK_N, HEAD_DIM>(K_s, HEAD_ROWS(k, blk.b, blk.kv_head), blk.j0, seqlen_k, head_dim);
        load_tile_async<BLOCK_N, HEAD_DIM>(V_s, HEAD_ROWS(v, blk.b, blk.kv_head), blk.j0, seqlen_k, dim_v);
        store_stat(0, prefetch(0));
        cp_async_commit();
    }

    const float scale_log2 = scale * LOG2E;
    float dK[D_TILES][4], dV[D_TILES][4];
    zero(dK);
    zero(dV);

    for (int p = 0; p < passes; ++p) {
        const int i0 = i_start + p % q_blocks * BLOCK_M;
        const T* Q_i = Q_s + (p & 1) * BLOCK_M * ROW;
        const T* dO_i = dO_s + (p & 1) * BLOCK_M * ROW;
        const float* lse_i = stats_s + (p & 1) * 2 * BLOCK_M;
        const float* D_i = lse_i + BLOCK_M;
        float next_stat = 0.0f;
        if (p + 1 < passes) next_stat = prefetch(p + 1);
        cp_async_next_stage();
        __syncthreads();  // every thread's copies of this stage, and the lse_i, D_i it stored, have landed

        // Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ: the warp's 16 keys x BLOCK_M queries
        float S[M_TILES][4], dP[M_TILES][4];
        two_mma_abt<T, HEAD_DIM, BLOCK_M, (MODS != 0 || COLS < HEAD_DIM)>(S, dP, K_s + 16 * warp * ROW, Q_i,
                                                                          V_s + 16 * warp * ROW, dO_i);

        // Sᵀ becomes Pᵀ, dPᵀ becomes dSᵀ: row r of the warp's tile is key key_w + r, column c query i0 + c
        const bool partial = TILE_MASKED(MODS, i0, blk.j0);
        const int h = blk.kv_head * group + p / q_blocks;
        const auto score = MAKE_SCORE(T, float, MODS, blk.b, h, scale_log2, LOG2E);
        const auto drop = MAKE_DROPOUT(float, MODS, false, blk.b, h);  // read by TC_P_DS
        for_each_element([&](int r, int c, float& s, float& dp) {  // a hidden row's dS 0 with the bool mask: see seen_row
            TC_P_DS(TC_PAIR_HIDDEN(partial, i0 + c, key_w + r), (MODS & MOD_MASK) != 0, i0 + c, key_w + r, s, dp,
                    lse_i[c], D_i[c], scale_log2);
        }, S, dP);

        if constexpr (DQ_ATOMIC) {  // dS, transposed back, for this pass's dQ_i (the previous pass's readers are done)
            for_each_element([&](int r, int c, float& dp) {
                store(dS_s + swizzled<BLOCK_N>(c, (16 * warp + r) / 8) + r % 8, dp);
            }, dP);
        }
        mma_ab<T, HEAD_DIM, BLOCK_M, COLS>(dV, S, dO_i, c0 / 8);
        mma_ab<T, HEAD_DIM, BLOCK_M, COLS>(dK, dP, Q_i, c0 / 8);
        if constexpr (DQ_ATOMIC) {
            __syncthreads();  // every warp's dS is in dS_s
            const int h = blk.kv_head * group + p / q_blocks;
            if (c0 < head_dim)  // a part past q's head dim (v's is larger) has no dQ to add
                atomic_dq<T, HEAD_DIM, BLOCK_M, BLOCK_N, COLS>(HEAD_ROWS(dqa, blk.b, h), dS_s, K_s, dQ_stage, i0,
                                                               seqlen_q, head_dim, c0);
        }
        if (p + 1 < passes) store_stat(p + 1, next_stat);  // into the stage no warp reads in this pass
        __syncthreads();  // every warp is done with this Q_i, dO_i, lse_i, D_i (and dS): the next pass overwrites them
    }

    // a part whose columns all lie past a tensor's own head dim (the other tensor's is larger: the tiles
    // pad to it) writes none of it, nor forms a pointer past its rows
    if constexpr (DQ_ATOMIC) {
        // staged through the warp's own rows of K_s and V_s: the last pass ended with a barrier, after
        // which no warp reads them (atomic_dq reads all of K_s, but within a pass)
        if (c0 < head_dim)
            store_fragments_staged<COLS>(HEAD_ROWS(dk, blk.b, blk.kv_head).from_column(c0), dK, {scale, scale},
                                         K_s + 16 * warp * ROW, key_w, seqlen_k, head_dim - c0);
        if (c0 < dim_v)
            store_fragments_staged<COLS>(HEAD_ROWS(dv, blk.b, blk.kv_head).from_column(c0), dV, {1.0f, 1.0f},
                                         V_s + 16 * warp * ROW, key_w, seqlen_k, dim_v - c0);
    } else {
        // straight from the fragments: staged, the deterministic kernel with every modifier at head_dim 64
        // spilled (benchmarks/results/tile_choices.md)
        if (c0 < head_dim)
            store_fragments<COLS>(HEAD_ROWS(dk, blk.b, blk.kv_head).from_column(c0), dK, {scale, scale}, key_g,
                                  seqlen_k, head_dim - c0);
        if (c0 < dim_v)
            store_fragments<COLS>(HEAD_ROWS(dv, blk.b, blk.kv_head).from_column(c0), dV, {1.0f, 1.0f}, key_g,
                                  seqlen_k, dim_v - c0);
    }
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MIN_CTAS, int MODS = 0, bool VARLEN = false>
__global__ void __launch_bounds__(NUM_THREADS, MIN_CTAS) flash_bwd_dq_tc(
    TENSOR_PARAMS(const T, q), TENSOR_PARAMS(const T, k), TENSOR_PARAMS(const T, v), TENSOR_PARAMS(const T, dout),
    LSE_PARAMS(const float, lse), const float* __restrict__ Dvec, TENSOR_PARAMS(T, dq), PROBLEM_PARAMS(float),
    VARLEN_PARAMS) {
    static_assert(BLOCK_M == 16 * NUM_WARPS, "each warp owns 16 query rows: one mma row tile");
    static_assert(BLOCK_N % 16 == 0, "BLOCK_N is a whole number of dS K_j k-steps");
    constexpr int COLS = HEAD_DIM / TC_COLUMN_PARTS<HEAD_DIM>;  // the columns of dQ this CTA computes
    static_assert(COLS % 16 == 0, "k-steps of 16 columns, and as many a part");
    constexpr int ROW = TILE_ROW<HEAD_DIM>;  // a shared tile row's elements (tc_tile.cuh)
    constexpr int D_TILES = COLS / 8;
    constexpr int N_TILES = BLOCK_N / 8;  // 8-key column tiles of S
    const int c0 = COLS < HEAD_DIM ? int(blockIdx.y) * COLS : 0;  // its first, as in flash_bwd_dkdv_tc
    const int dim_v = V_HEAD_DIM(MODS);  // v's and dout's head dim

    extern __shared__ __align__(16) unsigned char smem[];
    T* Q_s = reinterpret_cast<T*>(smem);
    T* dO_s = Q_s + BLOCK_M * ROW;
    T* K_s = dO_s + BLOCK_M * ROW;
    T* V_s = K_s + 2 * BLOCK_N * ROW;

    DRows<const float, VARLEN> D{Dvec, heads_q, seqlen_q};
    BACKWARD_QUERY_BLOCK(blk, D, AT_SEQUENCE_Q(seq, dq));
    const auto mask = MAKE_MASK(MODS);
    const int warp = threadIdx.x / WARP_SIZE;
    const int row_w = blk.i0 + 16 * warp;                   // the warp's first row
    const int row_g = row_w + threadIdx.x % WARP_SIZE / 4;  // this lane's rows: row_g and row_g + 8

    const Rows<T> dQ_rows = HEAD_ROWS(dq, blk.b, blk.h);
    const KVStream<BLOCK_N, HEAD_DIM, T> kv(K_s, V_s, HEAD_ROWS(k, blk.b, blk.kv_head),
                                            HEAD_ROWS(v, blk.b, blk.kv_head), mask, blk.i0, head_dim, dim_v);

    // group 0: Q_i, dO_i and the first key block
    if (kv.blocks > 0) {
        load_tile_async<BLOCK_M, HEAD_DIM>(Q_s, HEAD_ROWS(q, blk.b, blk.h), blk.i0, seqlen_q, head_dim);
        load_tile_async<BLOCK_M, HEAD_DIM>(dO_s, HEAD_ROWS(dout, blk.b, blk.h), blk.i0, seqlen_q, dim_v);
        kv.load(0);
        cp_async_commit();
    }

    // lse log2 e (+inf where P = 0) and D of this lane's two rows
    float lse_r[2], D_r[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_g + 8 * r;
        lse_r[r] = lse_for_p(LSE_ROW(lse, blk.b, blk.h), row, seqlen_q) * LOG2E;
        D_r[r] = row < seqlen_q ? D.template row<true>(blk.b, blk.h)[row] : 0.0f;
    }
    const float scale_log2 = scale * LOG2E;
    const auto score = MAKE_SCORE(T, float, MODS, blk.b, blk.h, scale_log2, LOG2E);
    const auto drop = MAKE_DROPOUT(float, MODS, false, blk.b, blk.h);
    float dQ[D_TILES][4];
    zero(dQ);

    for (int jb = 0; jb < kv.blocks; ++jb) {
        const int j0 = kv.j0(jb);
        kv.next(jb);
        __syncthreads();  // every thread's copies of K_j, V_j (and Q_i, dO_i) have landed: the tiles are whole

        // S = Q_i K_jᵀ and dP = dO_i V_jᵀ: the warp's 16 rows x BLOCK_N keys
        float S[N_TILES][4], dP[N_TILES][4];
        two_mma_abt<T, HEAD_DIM, BLOCK_N, (MODS != 0 || COLS < HEAD_DIM)>(S, dP, Q_s + 16 * warp * ROW, kv.K_j(jb),
                                                                          dO_s + 16 * warp * ROW, kv.V_j(jb));

        // dP becomes dS: row r of the warp's tile is query row_w + r (the lane's r / 8), column c key j0 + c
        const bool partial = TILE_MASKED(MODS, blk.i0, j0);
        for_each_element([&](int r, int c, float& s, float& dp) {
            const bool hidden = TC_PAIR_HIDDEN(partial, row_w + r, j0 + c);
            float t = 0.0f;
            const float x = tc_final_score(score, s, row_w + r, j0 + c, t, scale_log2);
            const float P = hidden ? 0.0f : tc_prob(x - lse_r[r / 8]);
            // selected: a NaN in an unseen row's dO stays out of dQ
            dp = hidden ? 0.0f : ds(score, P, drop(dp, row_w + r, j0 + c), D_r[r / 8], t);
        }, S, dP);

        mma_ab<T, HEAD_DIM, BLOCK_N, COLS>(dQ, dP, kv.K_j(jb), c0 / 8);
        __syncthreads();  // every warp is done with K_j, V_j before the next prefetch overwrites them
    }

    // straight from the fragments (twice the sectors of store_fragments_staged, which took this kernel, with
    // every modifier at head_dim 128, past the register limit of tests/test_nvrtc.py)
    if (c0 < head_dim)  // as in flash_bwd_dkdv_tc
        store_fragments<COLS>(dQ_rows.from_column(c0), dQ, {scale, scale}, row_g, seqlen_q, head_dim - c0);
}
