// flash_bwd_sm90.cu: FlashAttention backward for Hopper (sm_90a): TMA loads into an mbarrier ring,
// warpgroup MMA (wgmma), warp specialisation. float16 and bfloat16, head_dim up to 256, every score
// modifier (mask.cuh; a packed batch: the window, softcap and ALiBi).
//
// The maths of flash_bwd_tc.cu, with P recomputed from the forward's lse (natural log), in base 2:
//     P = 2^(S c - lse log2 e),  c = scale log2 e;   dP = dO Vᵀ;   dS = P ∘ (dP - D),  D = rowsum(dO ∘ O)
//     dV = Pᵀ dO;   dK = scale dSᵀ Q;   dQ = scale dS K
// Three kernels, launched in this order: flash_bwd_preprocess (D, flash_bwd_common.cuh), then
// flash_bwd_dkdv_sm90 below, which adds dQ into an fp32 workspace by bulk reduce-adds, then
// flash_bwd_dq_convert_sm90 below, which scales and rounds it into dq.
//
// deterministic=True (DETERMINISTIC, FA3's scheme): the key blocks add into a dQ tile in one order, so
// that dq is the same bits on every run. dq_turns holds an int per tile (zeros): how many key blocks
// have added into it. Before its reduce-add a CTA's lead waits until the tile's count is its turn (the
// key blocks before it in the order the hardware dispatches CTAs, so that it only waits for CTAs that
// are resident or done: key_block's order, ascending key blocks; a packed batch's slots, descending),
// then adds; at its next add (or its end) it waits for that add's completion and raises the count. A
// wait for the turn stalls the owner's warpgroup: the price of the order.
//
// The dQ workspace: zeros, a tile of BLOCK_M rows x DQ_ROW (HEAD_DIM + 8) floats per (batch, query head,
// query block of BLOCK_M), tiles in that order; columns from head_dim on and rows past seqlen_q receive
// zeros. The dK/dV kernel stages dQ in the same layout, so that one bulk reduce-add moves a whole tile;
// the 8 floats of padding a row make a half-warp's 8-byte fragment stores hit 32 distinct banks, at
// offsets the compiler writes as immediates (an XOR swizzle would hold them in registers).
//
// A packed batch (VARLEN; packed.backward_varlen): sequence s is rows cu_seqlens_q[s] .. of q, dout (and
// lse, D) and cu_seqlens_k[s] .. of k, v, dk, dv, read by the kernels (mask.cuh's Sequence, clamped into
// the arrays); the dQ workspace holds a tile per (query head, slot), varlen_slots(total_q) slots a head,
// sequence s's query blocks from slot first_slot(s) on, and flash_bwd_dq_convert_sm90_varlen (below)
// writes them into dq.
//
// flash_bwd_dkdv_sm90: one CTA per (key block j, batch * heads_kv), flattened on x (key_block in
// mask.cuh; VARLEN: per (slot of cu_seqlens_k, heads_kv), a slot past its sequence's blocks exiting at
// once), key-block stationary as FA3's: K_j, V_j (BLOCK_N keys) stay in shared memory while the
// query blocks Q_i (BLOCK_M rows) of every query head of the GQA group that can see key block j
// stream past (a "pass" is one (query head, query block); the band's Mask::query_start / query_end
// skip the rest). CTA: 1 + CONSUMERS warpgroups (sm90_tile.cuh):
//   warpgroup 0, the producer (setmaxnreg_dec): one elected thread of warp 0 issues the TMA loads, of
//     K_j and V_j once and of Q_i and dO_i of each pass into a ring of STAGES stages; the 32 lanes of
//     warp 1 store each pass's lse_i log2 e (+inf where P must be 0: lse_for_p) and D_i into its stage
//     and arrive on the stage's full barrier with the TMA's transaction. A row of the pass that sees no
//     key (lse -inf: causal or a window with seqlen_q > seqlen_k, the bool mask) gets D_i 0 and marks
//     the stage (dead_rows), and the consumers zero its row of dO_i before any wgmma reads it: P = 0
//     times a NaN in its dout would be NaN (README: fully masked rows; the passes start at a multiple
//     of BLOCK_M, before the first row that sees the key block, unlike flash_bwd_tc.cu's).
//   warpgroups 1 .. CONSUMERS (setmaxnreg_inc): consumer c owns keys 64 c .. 64 c + 63 of K_j (one
//     wgmma M; warp w of it keys 16 w .., the lane's two as in tc_tile.cuh's C fragments). Per pass,
//     Sᵀ and dPᵀ (not S, dP) are computed, so that Pᵀ and dSᵀ are already A fragments in registers:
//         Sᵀ = K_c Q_iᵀ      wgmma_ss m64 n BLOCK_M, both K-major from shared memory
//         dPᵀ = V_c dO_iᵀ    wgmma_ss, the same
//         Pᵀ = 2^(Sᵀ c - lse_i log2 e), dSᵀ = Pᵀ ∘ (dPᵀ - D_i) in place (lse_i, D_i per column: the stage);
//                            at head_dim 64 (P_UNDER_DP) Pᵀ while dPᵀ's wgmma runs, as FA3 does
//         dV_c += Pᵀ dO_i    wgmma_rs m64 n HEAD_DIM: A = Pᵀ re-packed (c_to_a), B = dO_i MN-major
//         dK_c += dSᵀ Q_i    wgmma_rs, the same with Q_i
//         dQ_i = dS K_j      by one consumer, the pass's owner (pass p: consumer p % CONSUMERS), over all
//                            BLOCK_N keys: wgmma_ss, a wgmma M for each 64 rows of the pass (M_CHUNKS),
//                            A = dS from every consumer's dSᵀ in dS_s (MN-major A, the A-transpose bit),
//                            B = K_j MN-major. The owner stages dQ_i in dQ_s (the workspace tile's layout)
//                            and its first thread adds it into the workspace with one bulk reduce-add: a
//                            CTA adds each dQ element once a pass (per-element atomics of each consumer's
//                            64-key partial asked the L2 twice as often, an atomic each), in whole lines.
//                            At head_dim 64 with 64 rows a pass (DQ_UNDER_DK) the owner issues it under its
//                            dV and dK wgmma, as FA3 issues dQ's under dK's; at head_dim 128 its
//                            accumulators do not fit beside theirs (C7512), and it follows them. With two
//                            wgmma Ms (the tall pass), the first M's rows are stored while the second's run.
//     dK_c (times scale) and dV_c are stored once, from the accumulators, at the end.
// The pass: 64 query rows (FA3's 64 x 128 at head_dim 128); with cupy_backend.SM90_TALL_BACKWARD, 128 at
// head_dim 64 without the window (FA3's 128 x 128 there: Sᵀ, dPᵀ of twice the columns for the same K_c,
// V_c operand reads, half the barriers a FLOP; specs.sm90_backward_tile).
// SPLIT_D, head_dim 136..256 (HEAD_DIM 256; at 136..192 the TMA loads three atoms of head_dim, and the
// consumers zero the fourth of K_s, V_s and the stage once, before any wgmma: specs.sm90_backward_bucket):
// a consumer's dK_c and dV_c of 64 keys x 256 columns would take 256 registers a thread, so the consumers
// split the columns instead of the keys (FA3's hdim-256 backward takes P and dS through shared
// memory too). The CTA's key block is 64 keys, the pass 64 rows, one stage (the ring's second would not fit:
// 245 KiB; FA3's takes one stage of Q_i and of dO_i at 256 too, with 80 keys a CTA: its launch template).
// Per pass, consumer c:
//         Sᵀ_c = K_j Q_cᵀ, dPᵀ_c = V_j dO_cᵀ   wgmma_ss m64 n32: all 64 keys x its 32 queries (32 c ..)
//         Pᵀ, dSᵀ as above, rounded to T, into its query columns of P_s and dS_s (keys x queries)
//         DS_READY: both consumers' columns are there (each thread fenced for the async proxy)
//         dV_c += Pᵀ dO_i[:, 128 c ..]       wgmma_ss m64 n128, A = Pᵀ K-major from P_s, B MN-major
//         dK_c += dSᵀ Q_i[:, 128 c ..]       the same from dS_s
//         dQ_i[:, 128 c ..] = dS K_j[:, 128 c ..]   wgmma_ss, A = dS MN-major from dS_s (a group of its own)
//         its columns of dQ_i into dQ_s; DQ_STAGED: both consumers' are; consumer 0's lead adds the tile.
// dV_c, dK_c, dQ_i's columns: 64 accumulators a thread each. The stage is released once dV's and dK's wgmma
// have landed, so the next pass's Q_i, dO_i load under dQ's wgmma and the add. The pass's P_s and dS_s are
// written again only after DQ_STAGED, which each consumer reaches after its own wgmma of the pass have
// landed; dQ_s after DS_READY, which consumer 0's lead reaches after its last add has read dQ_s.
// Shared memory (dynamic, aligned up to 1024 bytes), tiles as sm90_tile.cuh lays them:
//     K_s, V_s      BLOCK_N x HEAD_DIM each            K_j, V_j; loaded once
//     Q_s, dO_s     STAGES x BLOCK_M x HEAD_DIM each   the ring: stage s holds pass p (p % STAGES == s)
//     dS_s          2 x CONSUMERS x 64 x BLOCK_M       each consumer's dSᵀ of pass p in buffer p % 2 (keys
//                                                      x queries, the queries in atoms of 64): together
//                                                      dSᵀ of the key block, the owner's A (two buffers,
//                                                      FA3's: see DS_READY)
//     dQ_s          BLOCK_M x DQ_ROW floats            the owner's dQ_i, the workspace tile's layout
//     stats_s       STAGES x 2 x BLOCK_M floats        lse_i log2 e, then D_i, per stage
//     total (2 BLOCK_N + 4 BLOCK_M) HEAD_DIM 2 + 512 BLOCK_M + 4 BLOCK_M DQ_ROW + 16 BLOCK_M bytes
//     + 1024 (launch.py: _sm90_backward_smem). SPLIT_D: one stage (STAGES), and in dS_s's place dSᵀ, then
//     Pᵀ (P_s), 64 keys x BLOCK_M each: 216,576 bytes at 64 x 64.
// mbarriers (static shared memory), and why each is waited on:
//     kv_full       K_j and V_j have landed (the producer's arrive.expect_tx): before the first pass.
//     full[s]       Q_i, dO_i of stage s have landed, and warp 1's 32 lanes have stored lse_i, D_i
//                   (count 33: the elected thread's arrive.expect_tx, each lane's arrive after its
//                   stores): before the pass's first wgmma and its reads of the statistics.
//     empty[s]      every consumer thread's dV and dK wgmma of its pass on stage s, the last that read Q_i
//                   and dO_i, have landed (count: the consumer threads): no wgmma still reads them, nobody
//                   the statistics. The producer (warp 0's elected thread and warp 1) waits before
//                   refilling (parity 1 first). The owner's dQ_i = dS K_j reads dS_s and K_s, not the
//                   stage: it arrives before that wgmma lands, not after (FA3 releases Q and dO there too),
//                   so that the stage is refilled a dQ wgmma and a DS_READY wait sooner; DQ_UNDER_DK,
//                   with the wait that covers dV, dK and dQ's wgmma together (an arrive before dV and dK
//                   land is a race: test_a_stage_released_before_its_wgmma_lands_is_caught).
// Barriers: one __syncthreads after the mbarrier inits, then named barriers among the consumers (the two
// alternate as owners: pass p's owner is the other's of pass p - 1):
//     DS_READY   pass p's owner syncs (before its dV, dK wait where DQ_UNDER_DK, after it otherwise), the
//                other arrives after storing its dSᵀ rows (each thread fenced for the async proxy): the
//                owner's dQ wgmma reads every consumer's. Before arriving or
//                syncing there each consumer's first thread waits for its last bulk reduce-add to have
//                read dQ_s (wait_group.read 0), so the owner's stores into dQ_s follow it. It also
//                orders the reuse of dS_s's buffers: a consumer's dSᵀ rows of pass p overwrite its rows
//                of pass p - 2, which that pass's owner, pass p's too, read by its dQ wgmma. The owner
//                waited for that wgmma itself; the other consumer, pass p - 1's owner, synced here in
//                pass p - 1 after the owner's arrival, which followed the wait. (With one buffer, pass
//                p's owner had to wait before its stores for pass p - 1's dQ wgmma, run by the other.)
//     1 + c      the owner's 128 threads, between their stores into dQ_s (fenced) and the bulk
//                reduce-add that reads them.
//     (SPLIT_D: DS_READY and DQ_STAGED, number 1, synced by both consumers' 256 threads in every pass: above.)
//     ZEROED     the consumers' 256 threads, between zeroing rows of a box (each thread fenced) and the
//                first wgmma that reads it: dO_i's rows that see no key (dead_rows), and VARLEN, the rows
//                of a box past its sequence: K_j, V_j's once, Q_i, dO_i's in each pass whose block ends
//                past seqlen_q. Those rows are the next sequence's (a box past the tensor's end lands
//                zeros): P = 0 times a NaN there would be NaN. SPLIT_D at head_dim 136..192, and a
//                head_dim_v of its own: once, the atoms the TMA leaves out.
// A consumer runs at most a pass ahead of the other: each owner's DS_READY sync waits for the other's
// arrival of the same pass, so that the barrier never holds two passes' arrivals.
//
// Requirements on the arguments, checked by the launcher (cupy_backend.backward_path): q, k, v, dout
// as for flash_fwd_sm90.cu (strides a tensor map describes); lse any strides; dk, dv contiguous along
// head_dim; the dQ workspace contiguous, q's shape. v's (and dout's, dv's) head_dim_v may differ from q's
// and k's head_dim (MLA), HEAD_DIM the larger's bucket: each map has its own tensor's width, so a tile is
// zero past its tensor's head dim (SPLIT_D: the atoms wholly past it not loaded but zeroed once, ZEROED),
// and dV is stored up to head_dim_v; the padded columns cost their wgmma work (192 and 128: those of
// dPᵀ = V_j dOᵀ and dV, as the mma.sync backward's).
//
// Template parameters: T (__half or __nv_bfloat16), HEAD_DIM (64, 128 or 256: head_dim rounded up to 64),
// BLOCK_M (query rows a pass: 64 or 128, specs.sm90_backward_tile), BLOCK_N (64 CONSUMERS keys; SPLIT_D: 64),
// MODS (the score modifiers, mask.cuh: Score makes each score of Sᵀ final, the bool mask masks every tile, and dS
// takes the softcap's derivative, as in flash_bwd_tc.cu; a packed batch takes no bias or mask; dropout
// (MOD_DROPOUT) drops Pᵀ before dV and dPᵀ before dSᵀ, through TC_P_DS as there), VARLEN (a
// packed batch: the tensor maps over its (1, total, heads, head_dim) tensors, dk, dv, lse with batch
// strides 0), DETERMINISTIC (the dQ tiles' adds in key-block order through dq_turns; otherwise dq_turns
// is not read).

// Floats a row of a dQ workspace tile (and of dQ_s): launch.py's LAUNCH and the launcher's workspace say
// the same (specs.SM90_DQ_ROW_PAD)
template <int HEAD_DIM>
constexpr int DQ_ROW = HEAD_DIM + 8;

#include "flash_bwd_common.cuh"
#include "mask.cuh"
#include "sm90_tile.cuh"

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MODS = 0, bool VARLEN = false,
          bool DETERMINISTIC = false>
__global__ void __launch_bounds__(SM90_THREADS, 1) flash_bwd_dkdv_sm90(
    const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
    const __grid_constant__ TensorMap map_v, const __grid_constant__ TensorMap map_dout,
    LSE_PARAMS(const float, lse), const float* __restrict__ Dvec, TENSOR_PARAMS(T, dk), TENSOR_PARAMS(T, dv),
    PROBLEM_PARAMS(float), float* __restrict__ dqa, int* __restrict__ dq_turns, VARLEN_PARAMS) {
    // SPLIT_D (head_dim 256): the consumers split the head_dim columns of dK, dV and dQ_i, and Sᵀ's queries
    // (below); otherwise the keys
    constexpr bool SPLIT_D = HEAD_DIM > 128;
    static_assert(SPLIT_D || BLOCK_N == 64 * SM90_CONSUMERS, "a consumer warpgroup owns 64 keys");
    static_assert(!SPLIT_D || (BLOCK_N == 64 && BLOCK_M == 64), "SPLIT_D: one wgmma M of keys, of queries");
    static_assert(SM90_CONSUMERS == 2, "the owners of dQ alternate, or split it in halves: the barriers count on it");
    static_assert(BLOCK_M == 64 || BLOCK_M == 128, "a pass: one or two atoms of a dS row, wgmma Ms of dQ");
    static_assert(HEAD_DIM % ATOM == 0 && (HEAD_DIM <= 128 || HEAD_DIM == 256),
                  "head_dim in whole atoms; wgmma N of 64 or 128 (a consumer's half of 256)");
    static_assert(!VARLEN || (MODS & MOD_PAIRS) == 0, "a packed batch takes no bias or mask (attention_varlen)");
    // SPLIT_D: one stage, Q_i, dO_i, the dQ_s of 64 x 256 floats and K_j, V_j take 213 KiB
    constexpr int STAGES = SPLIT_D ? 1 : SM90_STAGES;
    constexpr int COLS = HEAD_DIM / (SPLIT_D ? SM90_CONSUMERS : 1);     // columns of dK, dV, dQ_i a consumer owns
    constexpr int S_COLS = BLOCK_M / (SPLIT_D ? SM90_CONSUMERS : 1);    // queries of Sᵀ, dPᵀ a consumer computes
    constexpr int M_TILES = S_COLS / 8;      // 8-query column tiles of Sᵀ
    constexpr int D_TILES = COLS / 8;        // 8-column tiles of dK, dV, dQ
    constexpr int QK_STEPS = HEAD_DIM / 16;  // k-steps of Sᵀ, dPᵀ
    constexpr int Q_STEPS = BLOCK_M / 16;    // k-steps of dV, dK (over the queries)
    constexpr int K_STEPS = BLOCK_N / 16;    // k-steps of dQ (over the block's keys)
    constexpr int M_CHUNKS = BLOCK_M / 64;   // wgmma Ms of dQ (64 queries each)
    // DQ_UNDER_DK: the owner issues dQ's wgmma under dV's and dK's, where its accumulators fit beside theirs,
    // Pa's and dSa's (64 queries x head_dim 64: 32 a thread; below)
    constexpr bool DQ_UNDER_DK = M_CHUNKS == 1 && HEAD_DIM == 64;
    // P_UNDER_DP: Pᵀ is computed while dPᵀ's wgmma runs where ptxas keeps the pipeline: head_dim 64 and 64
    // rows a pass, no window. The tall pass's kernels spilled 140-530 bytes, head_dim 128's too, and the
    // window's had the wgmma serialised (C7514)
    constexpr bool P_UNDER_DP = HEAD_DIM == 64 && M_CHUNKS == 1 && MODS == 0;
    // PAIRED_STATS: a thread's lse_i and D_i read from the stage two columns at a time (for_each_element_cols),
    // not an element at a time: some 550-750 fewer instructions in the kernel's SASS. The window's kernels at
    // head_dim 128 then spilled 4-8 bytes
    constexpr bool PAIRED_STATS = !(MODS && HEAD_DIM == 128);
    constexpr int COPIES = DQ_UNDER_DK ? 2 : 1;
    constexpr int KV_BYTES = BLOCK_N * HEAD_DIM * 2, QO_BYTES = BLOCK_M * HEAD_DIM * 2;
    constexpr int DS_BYTES = 64 * BLOCK_M * 2;
    constexpr int DQ_BYTES = BLOCK_M * DQ_ROW<HEAD_DIM> * 4;
    // named barriers (1 + c: the owner's staging of dQ_i; SPLIT_D: DQ_STAGED, both consumers')
    constexpr int DS_READY = 3, ZEROED = 5, DQ_STAGED = 1;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* K_s = aligned_smem(smem_raw);
    unsigned char* V_s = K_s + KV_BYTES;
    unsigned char* Q_s = V_s + KV_BYTES;
    unsigned char* dO_s = Q_s + STAGES * QO_BYTES;
    unsigned char* dS_s = dO_s + STAGES * QO_BYTES;
    // dS_s: two buffers of each consumer's dSᵀ rows; SPLIT_D: dSᵀ, then Pᵀ (P_s), each consumer's queries
    unsigned char* P_s = dS_s + DS_BYTES;
    float* dQ_s = reinterpret_cast<float*>(dS_s + (SPLIT_D ? 2 : 2 * SM90_CONSUMERS) * DS_BYTES);
    float* stats_s = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(dQ_s) + DQ_BYTES);
    __shared__ __align__(8) unsigned long long kv_full, full[STAGES], empty[STAGES];
    __shared__ int dead_rows[STAGES];  // whether stage s's pass has a row that sees no key (warp 1's)
    __shared__ int dq_tile[SM90_CONSUMERS];  // each consumer's lead thread's own (no other thread's)
    __shared__ int dq_added[SM90_CONSUMERS];  // DETERMINISTIC: the tile of the lead's last add, its turn not
                                              // yet passed on (-1: none); the lead's own too

    // The key block; for VARLEN its sequence's (a tile of the grid over cu_seqlens_k, mask.cuh's Sequence),
    // the problem that sequence's, and the TMA's rows and the dQ workspace's tiles counted from its first
    const int total_q = seqlen_q;  // the launch's: a packed batch's total
    DRows<const float, VARLEN> D{Dvec, heads_q, seqlen_q};
    int q_row0 = 0, k_row0 = 0, dq_slot0 = 0, seq_index = 0;  // seq_index: the sequence's, for ALiBi's slopes
    KeyBlock kb;
    if constexpr (VARLEN) {
        const Sequence seq = sequence_of<BLOCK_N, true>(VARLEN_ARGS, seqlen_q, seqlen_k, group);
        if (seq.start < 0) return;  // the whole CTA, before any barrier
        SEQUENCE_LENGTHS(seq);
        AT_SEQUENCE_Q(seq, lse), AT_SEQUENCE_K(seq, dk), AT_SEQUENCE_K(seq, dv);
        D.at_row(seq.q_start);
        q_row0 = seq.q_start, k_row0 = seq.k_start, seq_index = seq.index;
        dq_slot0 = first_slot<BLOCK_M>(cu_seqlens_q, seq.index, total_q);
        kb = {seq.start, 0, seq.kv_head};  // batch 0: the packed tensors' (their batch strides are 0)
    } else {
        kb = key_block<BLOCK_N>(seqlen_k, heads_q / group);
    }
    const auto mask = MAKE_MASK(MODS);
    // the passes: the query blocks that see key block j, in every query head of the group, from a
    // multiple of BLOCK_M (a dQ workspace tile; the rows before query_start see none of the block's keys)
    struct Plan {
        KeyBlock blk;
        int i_start, q_blocks, passes;
    };
    const int i_start0 = mask.query_start(kb.j0) / BLOCK_M * BLOCK_M;
    const int q_blocks0 = num_blocks(mask.query_end(kb.j0) - i_start0, BLOCK_M);
    const Plan own{kb, i_start0, q_blocks0, group * q_blocks0};
    // PLAN_SHARED: the key block and the passes are read where used from thread 0's copy in shared memory
    // (after the __syncthreads below), not kept in registers across the pass. ptxas (NVRTC 12.9 and 13.5)
    // spilled them from registers in the 128-row pass of one batch; a packed batch's kernels and the
    // window's at head_dim 128 spilled the other way (each kernel compiles without spills as chosen here:
    // test_hopper_nvrtc.py)
    constexpr bool PLAN_SHARED = !VARLEN && !(MODS && HEAD_DIM == 128);
    __shared__ Plan shared_plan;
    if (PLAN_SHARED && threadIdx.x == 0) shared_plan = own;
    const Plan& plan = PLAN_SHARED ? shared_plan : own;
    const KeyBlock& blk = plan.blk;
    const int &i_start = plan.i_start, &q_blocks = plan.q_blocks, &passes = plan.passes;
    const auto head_of = [&](int p) { return blk.kv_head * group + p / q_blocks; };
    const auto row_of = [&](int p) { return i_start + p % q_blocks * BLOCK_M; };
    // dQ_i's workspace tile: (batch, query head, query block), or for VARLEN (query head, the sequence's
    // first slot + query block): varlen_slots a head, a sequence's blocks from first_slot (mask.cuh)
    const auto dq_tile_of = [&](int h, int i0) {
        return VARLEN ? h * varlen_slots(total_q, num_seqs, BLOCK_M) + dq_slot0 + i0 / BLOCK_M
                      : (blk.b * heads_q + h) * num_blocks(seqlen_q, BLOCK_M) + i0 / BLOCK_M;
    };
    // VARLEN: whether the keys of the block, the rows of pass p, reach past the sequence
    const bool k_tail = VARLEN && kb.j0 + BLOCK_N > seqlen_k;
    const auto q_tail = [&](int p) { return VARLEN && row_of(p) + BLOCK_M > seqlen_q; };
    const int warpgroup = threadIdx.x / 128, warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;

    if (threadIdx.x == 0) {
        mbarrier_init(&kv_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&full[s], 1 + WARP_SIZE);
            mbarrier_init(&empty[s], 128 * SM90_CONSUMERS);
        }
        mbarrier_init_fence();
    }
    __syncthreads();  // the barriers are initialised, and plan written, before any thread uses them

    // the atoms of each tile the TMA loads. SPLIT_D: those that hold some of its tensor's head dim (Q_i,
    // K_j: head_dim; V_j, dO_i: head_dim_v, which may differ), leaving out the fourth at head_dim 136..192
    // and those wholly past a head dim of v's own (MLA's 192 and 128), which the consumers zero once
    // (below), so that no box there relies on the copy engine's fill of a box with no element inside the
    // tensor. Otherwise every atom, as the forward loads them: where q's and v's head dims differ
    // (64 and 128), a box wholly past one lands as the copy engine's zeros (zeroing them here too pushed
    // the default kernel with softcap, ALiBi and dropout at 128 to a 16-byte spill under NVRTC 12.9)
    const int atoms_qk = SPLIT_D ? min(HEAD_DIM / ATOM, num_blocks(head_dim, ATOM)) : HEAD_DIM / ATOM;
    const int atoms_v = SPLIT_D ? min(HEAD_DIM / ATOM, num_blocks(head_dim_v, ATOM)) : HEAD_DIM / ATOM;

    if (warpgroup == 0) {  // the producer
        setmaxnreg_dec<PRODUCER_REGISTERS<SM90_CONSUMERS>>();
        if (warp == 0 && elect_one_sync() && passes > 0) {
            mbarrier_arrive_expect_tx(&kv_full, (atoms_qk + atoms_v) * ATOM_BYTES<BLOCK_N>);
            load_box<BLOCK_N, HEAD_DIM>(K_s, map_k, blk.kv_head, k_row0 + blk.j0, blk.b, &kv_full, atoms_qk);
            load_box<BLOCK_N, HEAD_DIM>(V_s, map_v, blk.kv_head, k_row0 + blk.j0, blk.b, &kv_full, atoms_v);
            for (int p = 0; p < passes; ++p) {
                const int s = p % STAGES;
                // the consumers are done with the pass this stage held (the first round passes at once)
                mbarrier_wait_parity(&empty[s], (p / STAGES + 1) & 1);
                mbarrier_arrive_expect_tx(&full[s], (atoms_qk + atoms_v) * ATOM_BYTES<BLOCK_M>);
                load_box<BLOCK_M, HEAD_DIM>(Q_s + s * QO_BYTES, map_q, head_of(p), q_row0 + row_of(p), blk.b, &full[s],
                                            atoms_qk);
                load_box<BLOCK_M, HEAD_DIM>(dO_s + s * QO_BYTES, map_dout, head_of(p), q_row0 + row_of(p), blk.b,
                                            &full[s], atoms_v);
            }
        } else if (warp == 1) {
            for (int p = 0; p < passes; ++p) {
                const int s = p % STAGES;
                mbarrier_wait_parity(&empty[s], (p / STAGES + 1) & 1);  // as warp 0's
                const int h = head_of(p), i0 = row_of(p);
                float* stats = stats_s + s * 2 * BLOCK_M;
                if (lane == 0) dead_rows[s] = 0;
                __syncwarp();  // lane 0's reset, before any lane's mark
                bool dead_any = false;
#pragma unroll(PLAN_SHARED ? 1 : 4)  // in the producer's 24 registers: ptxas spilled the other way
                for (int r = lane; r < BLOCK_M; r += WARP_SIZE) {
                    const int i = i0 + r;
                    const float lse_p = lse_for_p(LSE_ROW(lse, blk.b, h), i, seqlen_q);
                    // a row of the sequence that sees no key (lse -inf): D 0, and its dO zeroed (dead_rows)
                    const bool dead = i < seqlen_q && lse_p == INFINITY;
                    stats[r] = lse_p * LOG2E;
                    stats[BLOCK_M + r] = i < seqlen_q && !dead ? D.template row<true>(blk.b, h)[i] : 0.0f;
                    dead_any |= dead;
                }
                if (dead_any) dead_rows[s] = 1;
                mbarrier_arrive(&full[s]);  // this lane's statistics (and mark) are stored
            }
        }
        return;
    }

    // a consumer: keys key_c .. key_c + 63 of the block, the warp's 16 from key_w
    setmaxnreg_inc<CONSUMER_REGISTERS<SM90_CONSUMERS>>();
    const int c = warpgroup - 1;
    const int key_c = blk.j0 + (SPLIT_D ? 0 : 64 * c), key_w = key_c + 16 * (warp % 4);
    const unsigned char* K_c = K_s + (key_c - blk.j0) * 128;  // the consumer's rows of K_s, V_s, in their first atoms
    const unsigned char* V_c = V_s + (key_c - blk.j0) * 128;
    const bool lead = threadIdx.x % 128 == 0;  // the consumer's thread that issues its bulk reduce-adds
    const float scale_log2 = scale * LOG2E;
    // DETERMINISTIC: the lead passes the turn at the tile of its last add on to the next key block, once
    // that add has completed. It does so at its next add (or at the end), not at once: by then the add has
    // long completed, where waiting for it at once stalled the warpgroup; the next key block, which runs
    // behind this one anyway, waits a pass longer.
    const auto pass_turn_on = [&] {
        if (dq_added[c] < 0) return;
        tma_store_wait_group<0>();                        // [deterministic] the add has completed
        fence_proxy_async_global();                       // [deterministic] its writes, before the release
        flag_release_add(dq_turns + dq_added[c], 1);      // [deterministic] the next key block's turn
        dq_added[c] = -1;
    };
    if (DETERMINISTIC && lead) dq_added[c] = -1;

    // VARLEN: a box reaches past its sequence into the next one's rows (a box past the tensor's end lands
    // zeros, one inside it the rows there): the consumers' 256 threads zero those rows of the stage before
    // any wgmma reads it, so that the kernel runs as on the sequence alone (tail rows of K_j, V_j once,
    // of Q_i, dO_i in the passes whose block ends past seqlen_q)
    const int zeroer = threadIdx.x - 128;
    float dK[D_TILES][4], dV[D_TILES][4];
    zero(dK);
    zero(dV);
    if (SPLIT_D && min(atoms_qk, atoms_v) < HEAD_DIM / ATOM) {  // the atoms the TMA leaves out: zeros
        zero_atoms<BLOCK_N, HEAD_DIM>(K_s, atoms_qk, zeroer, 128 * SM90_CONSUMERS);
        zero_atoms<BLOCK_N, HEAD_DIM>(V_s, atoms_v, zeroer, 128 * SM90_CONSUMERS);
        for (int s = 0; s < STAGES; ++s) {
            zero_atoms<BLOCK_M, HEAD_DIM>(Q_s + s * QO_BYTES, atoms_qk, zeroer, 128 * SM90_CONSUMERS);
            zero_atoms<BLOCK_M, HEAD_DIM>(dO_s + s * QO_BYTES, atoms_v, zeroer, 128 * SM90_CONSUMERS);
        }
        fence_proxy_async();                                  // this thread's zeros, before any wgmma reads them
        named_barrier_sync(ZEROED, 128 * SM90_CONSUMERS);     // every consumer thread's
    }
    if (passes > 0) mbarrier_wait_parity(&kv_full, 0);
    if (k_tail && passes > 0) {
        zero_rows<BLOCK_N, HEAD_DIM>(K_s, seqlen_k - blk.j0, zeroer, 128 * SM90_CONSUMERS);
        zero_rows<BLOCK_N, HEAD_DIM>(V_s, seqlen_k - blk.j0, zeroer, 128 * SM90_CONSUMERS);
        fence_proxy_async();                                  // this thread's zeros, before any wgmma reads them
        named_barrier_sync(ZEROED, 128 * SM90_CONSUMERS);     // every consumer thread's
    }
    // Waits until pass p's stage s has landed, then zeros its rows that must be zeros
    const auto stage_landed = [&](int p, int s, int i0, const float* lse_i) {
        mbarrier_wait_parity(&full[s], (p / STAGES) & 1);
        if (q_tail(p) || dead_rows[s]) {
            if (q_tail(p))
                zero_rows<BLOCK_M, HEAD_DIM>(Q_s + s * QO_BYTES, seqlen_q - i0, zeroer, 128 * SM90_CONSUMERS);
            // dO_i's rows past seqlen_q and those of rows that see no key: lse_i marks both +inf
            zero_rows_if<BLOCK_M, HEAD_DIM>(dO_s + s * QO_BYTES, [&](int r) { return lse_i[r] == INFINITY; },
                                            zeroer, 128 * SM90_CONSUMERS);
            fence_proxy_async();                               // this thread's zeros, before any wgmma reads them
            named_barrier_sync(ZEROED, 128 * SM90_CONSUMERS);  // every consumer thread's
        }
    };
    // Consumer c's lead: dQ_s (staged, fenced and synced) into its workspace tile dq_tile[c], query block i0
    const auto add_dq = [&](int i0) {
        float* tile = dqa + static_cast<size_t>(dq_tile[c]) * (BLOCK_M * DQ_ROW<HEAD_DIM>);
        if constexpr (DETERMINISTIC) {
            pass_turn_on();
            // this key block's turn at the tile: the key blocks that add into it before this one have
            // (the first in the order the hardware dispatches CTAs: key_block's ascending j; a packed
            // batch's slots, last first, descending j), and their adds are complete
            const int j = blk.j0 / BLOCK_N;
            const int turn = VARLEN ? num_blocks(mask.key_end(i0), BLOCK_N) - 1 - j
                                    : j - mask.key_start(i0) / BLOCK_N;
            flag_wait_at_least(dq_turns + dq_tile[c], turn);  // [deterministic]
            fence_proxy_async_global();                        // [deterministic] the acquire, before the add
        }
        bulk_reduce_add_f32(tile, dQ_s, DQ_BYTES);
        tma_store_commit_group();
        if constexpr (DETERMINISTIC) dq_added[c] = dq_tile[c];
    };

    // A consumer's dQ_i accumulators (64 rows from row0, COLS columns from col0; landed) into dQ_s, the workspace
    // tile's layout
    const auto store_dq = [&](float (&acc)[D_TILES][4], int row0, int col0) {
        wgmma_fence_operand<COLS / 2>(&acc[0][0]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + 16 * (warp % 4) + c_row(2 * r);
#pragma unroll
            for (int nt = 0; nt < D_TILES; ++nt)
                *reinterpret_cast<float2*>(dQ_s + row * DQ_ROW<HEAD_DIM> + col0 + 8 * nt + c_col(0)) =
                    make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
        }
    };

    // SPLIT_D (head_dim 256): a pass's work split by columns. Consumer c computes Sᵀ and dPᵀ of the block's
    // 64 keys and its S_COLS queries of the pass (S_COLS c ..), stores Pᵀ and dSᵀ of them into P_s and dS_s
    // (keys x queries: with the other's, the whole pass's), then, once both have (DS_READY), its COLS columns
    // (COLS c ..) of dV += Pᵀ dO_i, dK += dSᵀ Q_i and dQ_i = dS K_j, all wgmma_ss from shared memory: each of
    // the three accumulators takes 64 registers a thread, where the other split's dK and dV of 64 keys x 256
    // columns would take 256. Both stage their halves of dQ_i into dQ_s; consumer 0's lead adds the tile.
    if constexpr (SPLIT_D)
        for (int p = 0; p < passes; ++p) {
            const int s = p % STAGES, h = head_of(p), i0 = row_of(p);
            if (lead) dq_tile[c] = dq_tile_of(h, i0);
            const unsigned char* Q_i = Q_s + s * QO_BYTES;
            const unsigned char* dO_i = dO_s + s * QO_BYTES;
            const float* lse_i = stats_s + s * 2 * BLOCK_M;
            const float* D_i = lse_i + BLOCK_M;
            stage_landed(p, s, i0, lse_i);

            // Sᵀ = K_j Q_cᵀ and dPᵀ = V_j dO_cᵀ (K_c, V_c: all of K_j, V_j here); Q_c, dO_c: the consumer's
            // rows of Q_i, dO_i (within each atom)
            const int q_c = S_COLS * c;
            float S[M_TILES][4], dP[M_TILES][4];
            wgmma_fence();  // dK, dV and the last pass's fragments were written by ordinary instructions
#pragma unroll
            for (int ks = 0; ks < QK_STEPS; ++ks)
                wgmma_ss<T, S_COLS>(&S[0][0], k_major<BLOCK_N>(K_c, ks), k_major<BLOCK_M>(Q_i + q_c * 128, ks), ks > 0);
#pragma unroll
            for (int ks = 0; ks < QK_STEPS; ++ks)
                wgmma_ss<T, S_COLS>(&dP[0][0], k_major<BLOCK_N>(V_c, ks), k_major<BLOCK_M>(dO_i + q_c * 128, ks),
                                    ks > 0);
            wgmma_commit_group();
            wgmma_wait_group<0>();
            wgmma_fence_operand<S_COLS / 2>(&S[0][0]);
            wgmma_fence_operand<S_COLS / 2>(&dP[0][0]);
            {
                const bool partial = TILE_MASKED(MODS, i0, blk.j0);
                const auto score = MAKE_SCORE(T, float, MODS, VARLEN ? seq_index : blk.b, h, scale_log2, LOG2E);
                const auto drop = MAKE_DROPOUT(float, MODS, true, VARLEN ? seq_index : blk.b, h);  // read by TC_P_DS
                for_each_element_cols<PAIRED_STATS>([&](int r, int col, float lse, float D, float& x, float& dp) {
                    TC_P_DS(TC_PAIR_HIDDEN(partial, i0 + q_c + col, key_w + r), false, i0 + q_c + col, key_w + r, x,
                            dp, lse, D, scale_log2);
                }, lse_i + q_c, D_i + q_c, S, dP);
            }
            // Pᵀ and dSᵀ, rounded to T, into the consumer's query columns of P_s and dS_s: the wgmma of the
            // pass before, of both consumers, have read them (both waited for theirs before DQ_STAGED)
#pragma unroll
            for (int kt = 0; kt < S_COLS / 16; ++kt) {
                unsigned pa[4], dsa[4];
                c_to_a<T>(pa, S[2 * kt], S[2 * kt + 1]);
                c_to_a<T>(dsa, dP[2 * kt], dP[2 * kt + 1]);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = 16 * (warp % 4) + c_row(2 * (i & 1));
                    const int query = q_c + 16 * kt + 8 * (i >> 1) + c_col(0);
                    *reinterpret_cast<unsigned*>(P_s + swizzled_byte<64>(key, query)) = pa[i];
                    *reinterpret_cast<unsigned*>(dS_s + swizzled_byte<64>(key, query)) = dsa[i];
                }
            }
            fence_proxy_async();  // this thread's Pᵀ, dSᵀ stores, before both consumers' wgmma read them
            if (lead) tma_store_wait_group_read<0>();  // the last reduce-add has read dQ_s
            named_barrier_sync(DS_READY, 128 * SM90_CONSUMERS);  // both consumers' Pᵀ and dSᵀ, fenced

            // the consumer's columns: dV += Pᵀ dO_i, dK += dSᵀ Q_i (a group), dQ_i = dS K_j (the next)
            const int atom_c = COLS / ATOM * c;
            wgmma_fence();  // the first wgmma since ordinary instructions used registers
#pragma unroll
            for (int kt = 0; kt < Q_STEPS; ++kt)
                wgmma_ss<T, COLS, false, true>(&dV[0][0], k_major<64>(P_s, kt),
                                               mn_major<BLOCK_M>(dO_i + atom_c * ATOM_BYTES<BLOCK_M>, kt), true);
#pragma unroll
            for (int kt = 0; kt < Q_STEPS; ++kt)
                wgmma_ss<T, COLS, false, true>(&dK[0][0], k_major<64>(dS_s, kt),
                                               mn_major<BLOCK_M>(Q_i + atom_c * ATOM_BYTES<BLOCK_M>, kt), true);
            wgmma_commit_group();
            float dQ[D_TILES][4];
#pragma unroll
            for (int kt = 0; kt < K_STEPS; ++kt)
                wgmma_ss<T, COLS, true, true>(&dQ[0][0], mn_major<64>(dS_s, kt),
                                              mn_major<BLOCK_N>(K_s + atom_c * ATOM_BYTES<BLOCK_N>, kt), kt > 0);
            wgmma_commit_group();
            wgmma_wait_group<1>();  // dV and dK have landed
            wgmma_fence_operand<COLS / 2>(&dK[0][0]);
            wgmma_fence_operand<COLS / 2>(&dV[0][0]);
            mbarrier_arrive(&empty[s]);  // dV's and dK's wgmma, the last to read the stage, have landed
            wgmma_wait_group<0>();       // dQ_i's columns have landed
            store_dq(dQ, 0, COLS * c);
            fence_proxy_async();                                // this thread's dQ_s stores, before the add
            named_barrier_sync(DQ_STAGED, 128 * SM90_CONSUMERS);  // both consumers' halves
            if (lead && c == 0) add_dq(i0);
        }

    if constexpr (!SPLIT_D)
    for (int p = 0; p < passes; ++p)
#pragma unroll
    for (int copy = 0; copy < COPIES; ++copy) {
        // whether this consumer computes the pass's dQ_i. DQ_UNDER_DK: the pass in two copies, the other's
        // and the owner's, `owner` a constant in each, one of them skipped: a wgmma issued in a branch on a
        // value ptxas cannot prove uniform over the warpgroup, with others in flight, was serialised (C7518,
        // C7520). (A lambda for the pass instead spilled the tall pass's kernels.)
        const bool owner = COPIES == 1 ? p % SM90_CONSUMERS == c : copy == 1;
        if (COPIES == 2 && owner != (p % SM90_CONSUMERS == c)) continue;
        const int s = p % STAGES, h = head_of(p), i0 = row_of(p);
        // dQ_i's workspace tile, for the lead's reduce-add at the end: kept in a register across the pass
        // (or made again there), it spilled the window kernel at head_dim 128 under NVRTC 12.9
        if (lead) dq_tile[c] = dq_tile_of(h, i0);
        const unsigned char* Q_i = Q_s + s * QO_BYTES;
        const unsigned char* dO_i = dO_s + s * QO_BYTES;
        const float* lse_i = stats_s + s * 2 * BLOCK_M;
        const float* D_i = lse_i + BLOCK_M;
        stage_landed(p, s, i0, lse_i);

        // Sᵀ = K_c Q_iᵀ and dPᵀ = V_c dO_iᵀ: the consumer's 64 keys x BLOCK_M queries. P_UNDER_DP: each a group
        // of its own, so that Pᵀ's exponentials run while dPᵀ's wgmma does (FA3's order)
        float S[M_TILES][4], dP[M_TILES][4];
        wgmma_fence();  // dK, dV and the last pass's fragments were written by ordinary instructions
#pragma unroll
        for (int ks = 0; ks < QK_STEPS; ++ks)
            wgmma_ss<T, BLOCK_M>(&S[0][0], k_major<BLOCK_N>(K_c, ks), k_major<BLOCK_M>(Q_i, ks), ks > 0);
        if constexpr (P_UNDER_DP) wgmma_commit_group();
#pragma unroll
        for (int ks = 0; ks < QK_STEPS; ++ks)
            wgmma_ss<T, BLOCK_M>(&dP[0][0], k_major<BLOCK_N>(V_c, ks), k_major<BLOCK_M>(dO_i, ks), ks > 0);
        wgmma_commit_group();

        // Sᵀ becomes Pᵀ, dPᵀ becomes dSᵀ: row r of the warp's tile is key key_w + r, column col query i0 + col
        // (the mask's and score's values made after the wait: between the commit and the wait ptxas
        // serialised the window kernel's wgmma, C7514)
        if constexpr (P_UNDER_DP) {
            wgmma_wait_group<1>();  // Sᵀ has landed
            wgmma_fence_operand<BLOCK_M / 2>(&S[0][0]);
            const bool partial = TILE_MASKED(MODS, i0, blk.j0);
            const auto score = MAKE_SCORE(T, float, MODS, VARLEN ? seq_index : blk.b, h, scale_log2, LOG2E);
            for_each_element_cols<PAIRED_STATS>([&](int r, int col, float lse, float, float& x) {
                TC_P(TC_PAIR_HIDDEN(partial, i0 + col, key_w + r), i0 + col, key_w + r, x, lse, scale_log2);
            }, lse_i, D_i, S);
            wgmma_wait_group<0>();  // dPᵀ has landed
            wgmma_fence_operand<BLOCK_M / 2>(&dP[0][0]);
            for_each_element_cols<PAIRED_STATS>([&](int, int, float, float D, float& x, float& dp) { TC_DS(x, dp, D); },
                                  lse_i, D_i, S, dP);
        } else {
            wgmma_wait_group<0>();
            wgmma_fence_operand<BLOCK_M / 2>(&S[0][0]);
            wgmma_fence_operand<BLOCK_M / 2>(&dP[0][0]);
            const bool partial = TILE_MASKED(MODS, i0, blk.j0);
            const auto score = MAKE_SCORE(T, float, MODS, VARLEN ? seq_index : blk.b, h, scale_log2, LOG2E);
            const auto drop = MAKE_DROPOUT(float, MODS, true, VARLEN ? seq_index : blk.b, h);  // read by TC_P_DS
            for_each_element_cols<PAIRED_STATS>([&](int r, int col, float lse, float D, float& x, float& dp) {
                TC_P_DS(TC_PAIR_HIDDEN(partial, i0 + col, key_w + r), false, i0 + col, key_w + r, x, dp, lse, D,
                        scale_log2);
            }, lse_i, D_i, S, dP);
        }
        unsigned Pa[Q_STEPS][4], dSa[Q_STEPS][4];
#pragma unroll
        for (int kt = 0; kt < Q_STEPS; ++kt) {
            c_to_a<T>(Pa[kt], S[2 * kt], S[2 * kt + 1]);
            c_to_a<T>(dSa[kt], dP[2 * kt], dP[2 * kt + 1]);
        }
        // dSᵀ into the consumer's rows of pass p's buffer of dS_s, p % 2 (keys x queries): the owner's A operand
        // of dQ_i = dS K_j; pass p - 2's dQ wgmma has read them (DS_READY, above). Pass p's owner is consumer
        // p % 2: its buffer is c, the other's 1 - c (numbered so, p stays out of the addresses: with it the
        // window's kernel at head_dim 128 spilled under NVRTC 12.9)
        unsigned char* dS_c = dS_s + (owner ? c : 1 - c) * SM90_CONSUMERS * DS_BYTES + c * DS_BYTES;
#pragma unroll
        for (int kt = 0; kt < Q_STEPS; ++kt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = 16 * (warp % 4) + c_row(2 * (i & 1)), query = 16 * kt + 8 * (i >> 1) + c_col(0);
                *reinterpret_cast<unsigned*>(dS_c + swizzled_byte<64>(key, query)) = dSa[kt][i];
            }
        fence_proxy_async();  // this thread's dSᵀ stores, before the owner's dQ wgmma reads them
        if (lead) tma_store_wait_group_read<0>();  // this consumer's last reduce-add has read dQ_s
        if (!owner) named_barrier_arrive(DS_READY, 128 * SM90_CONSUMERS);

        // dV_c += Pᵀ dO_i and dK_c += dSᵀ Q_i
        wgmma_fence();  // Pa, dSa were written by ordinary instructions
#pragma unroll
        for (int kt = 0; kt < Q_STEPS; ++kt)
            wgmma_rs<T, HEAD_DIM, true>(&dV[0][0], Pa[kt], mn_major<BLOCK_M>(dO_i, kt), true);
#pragma unroll
        for (int kt = 0; kt < Q_STEPS; ++kt)
            wgmma_rs<T, HEAD_DIM, true>(&dK[0][0], dSa[kt], mn_major<BLOCK_M>(Q_i, kt), true);
        wgmma_commit_group();  // [registers]

        // the owner: dQ_i = dS K_j over the block's BLOCK_N keys, a wgmma M (a group) for each 64 rows of the
        // pass, M_CHUNKS: with two, chunk 0 is stored into dQ_s while chunk 1's wgmma runs. DQ_UNDER_DK: chunk
        // 0 is issued under dV's and dK's wgmma, as FA3 issues dQ's under dK's. At head_dim 128 dQ_i's 64
        // accumulators beside dK's, dV's, Pa and dSa ran out of registers and ptxas serialised the wgmma
        // (C7512): there dV and dK land first; split into two wgmma Ns of 64 the operand dS was read twice
        float dQ[M_CHUNKS][D_TILES][4];
        const unsigned char* dS_own = dS_s + c * SM90_CONSUMERS * DS_BYTES;  // the buffer of the owner's passes
        const auto issue_chunk = [&](auto chunk) {
            constexpr int m = decltype(chunk)::value;
            // k-step kt (16 keys) of A is in consumer kt / 4's rows of dS_s, its atom m (queries 64 m ..)
#pragma unroll
            for (int kt = 0; kt < K_STEPS; ++kt)
                wgmma_ss<T, HEAD_DIM, true, true>(&dQ[m][0][0],
                                                  mn_major<64>(dS_own + kt / 4 * DS_BYTES + m * ATOM_BYTES<64>, kt % 4),
                                                  mn_major<BLOCK_N>(K_s, kt), kt > 0);
            wgmma_commit_group();
        };
        if (DQ_UNDER_DK && owner) {
            named_barrier_sync(DS_READY, 128 * SM90_CONSUMERS);  // every consumer's dSᵀ rows, fenced
            issue_chunk(Static<0>{});
        }
        wgmma_wait_group<0>();  // [registers] dV and dK have landed (DQ_UNDER_DK: the owner's chunk 0 too)
        wgmma_fence_operand<HEAD_DIM / 2>(&dK[0][0]);
        wgmma_fence_operand<HEAD_DIM / 2>(&dV[0][0]);
        mbarrier_arrive(&empty[s]);  // this thread's wgmma no longer read the stage, nor it the statistics
        if (!owner) continue;

        if constexpr (DQ_UNDER_DK) {
            store_dq(dQ[0], 0, 0);
        } else {
            named_barrier_sync(DS_READY, 128 * SM90_CONSUMERS);  // every consumer's dSᵀ rows, fenced
            wgmma_fence();  // the first wgmma since ordinary instructions used registers (else ptxas adds one)
            issue_chunk(Static<0>{});
            if constexpr (M_CHUNKS == 2) {
                issue_chunk(Static<1>{});
                wgmma_wait_group<1>();  // chunk 0 has landed
                store_dq(dQ[0], 0, 0);
                wgmma_wait_group<0>();  // chunk 1 has landed
                store_dq(dQ[1], 64, 0);
            } else {
                wgmma_wait_group<0>();
                store_dq(dQ[0], 0, 0);
            }
        }
        fence_proxy_async();             // this thread's dQ_s stores, before the bulk reduce-add reads them
        named_barrier_sync(1 + c, 128);  // every owner thread's
        if (lead) add_dq(i0);
    }
    if (lead) {
        if constexpr (DETERMINISTIC) pass_turn_on();
        tma_store_wait_group_read<0>();  // the last reduce-add has read dQ_s before the CTA ends
    }

    const int key_g = key_w + lane / 4;  // this lane's keys: key_g, key_g + 8
    const int col_c = SPLIT_D ? COLS * c : 0;  // and its first column
    store_fragments<COLS>(HEAD_ROWS(dk, blk.b, blk.kv_head).from_column(col_c), dK, {scale, scale}, key_g, seqlen_k,
                          head_dim - col_c);
    store_fragments<COLS>(HEAD_ROWS(dv, blk.b, blk.kv_head).from_column(col_c), dV, {1.0f, 1.0f}, key_g, seqlen_k,
                          head_dim_v - col_c);
}

// flash_bwd_dq_convert_sm90: dq = scale * the dQ workspace, rounded to T; a thread an element of dq
// (contiguous: batch, seqlen_q, heads_q, head_dim), read from its workspace tile. The
// template's tile is the dK/dV kernel's (BLOCK_N unused: the one name scheme of specs.Kernel).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(NUM_THREADS) flash_bwd_dq_convert_sm90(const float* __restrict__ dqa,
                                                                         T* __restrict__ dq, index_t size, float scale,
                                                                         int seqlen_q, int heads_q, int head_dim) {
    const index_t n = index_t(blockIdx.x) * NUM_THREADS + threadIdx.x;
    if (n >= size) return;
    const int d = static_cast<int>(n % head_dim);
    const index_t row = n / head_dim;  // (b, i, h) flattened
    const int h = static_cast<int>(row % heads_q);
    const int i = static_cast<int>(row / heads_q % seqlen_q);
    const index_t b = row / heads_q / seqlen_q;
    const index_t tile = (b * heads_q + h) * num_blocks(seqlen_q, BLOCK_M) + i / BLOCK_M;
    store(dq + n, scale * dqa[(tile * BLOCK_M + i % BLOCK_M) * DQ_ROW<HEAD_DIM> + d]);
}

// flash_bwd_dq_convert_sm90_varlen: the same for a packed batch (the VARLEN dK/dV kernel's workspace), a
// CTA a workspace tile: tile (query head h, slot) of varlen_slots a head. The CTA finds the sequence and
// query block its slot holds as a VARLEN kernel's CTA does (sequence_of over cu_seqlens_q: a slot no
// block holds exits) and writes that block's rows of dq (total_q, heads_q, head_dim; contiguous) within
// the sequence, clamped as the offsets are: rows of no sequence keep the zeros dq was allocated with.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(NUM_THREADS) flash_bwd_dq_convert_sm90_varlen(
    const float* __restrict__ dqa, T* __restrict__ dq, float scale, int total_q, int heads_q, int head_dim,
    VARLEN_PARAMS) {
    const int slots = varlen_slots(total_q, num_seqs, BLOCK_M);
    const int h = blockIdx.x / slots, slot = blockIdx.x % slots;
    // sequence_of numbers a head's slots last first; the keys' side is not asked (cu_seqlens_q twice)
    const Sequence seq = sequence_of<BLOCK_M>(cu_seqlens_q, cu_seqlens_q, num_seqs, seqused_k, 0, 0, total_q, total_q,
                                              1, h * slots + slots - 1 - slot);
    if (seq.start < 0) return;
    const int rows = min(BLOCK_M, seq.seqlen_q - seq.start);
    const float* tile = dqa + static_cast<size_t>(blockIdx.x) * (BLOCK_M * DQ_ROW<HEAD_DIM>);
    T* dst = dq + (static_cast<index_t>(seq.q_start + seq.start) * heads_q + h) * head_dim;
    for (int e = threadIdx.x; e < rows * head_dim; e += NUM_THREADS) {
        const int r = e / head_dim, d = e % head_dim;
        store(dst + static_cast<index_t>(r) * heads_q * head_dim + d, scale * tile[r * DQ_ROW<HEAD_DIM> + d]);
    }
}
