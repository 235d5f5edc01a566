// flash_fwd_sm90.cu: FlashAttention forward for Hopper (sm_90a): TMA loads into an mbarrier ring,
// warpgroup MMA (wgmma), warp specialisation. float16 and bfloat16, head_dim up to 256 (the only
// tensor-core kernel above 128).
//
// The maths of flash_fwd_tc.cu, for one query block Q_i (BLOCK_M rows) of one (batch, query head):
//     for each key block K_j, V_j (BLOCK_N keys) that some row of Q_i can see:
//         S = Q_i K_jᵀ                  -inf where the query does not see the key (mask.cuh)
//         m_new = max(m, rowmax S · c)  with c = scale · log2(e): m, and the exponents, are in base 2
//         P = 2^(S · c - m_new);  alpha = 2^(m - m_new);  l = alpha l + rowsum P;  O = alpha O + P V_j
//     out_i = O / l,  lse_i = (m + log2 l) · ln 2  (natural log); a row that saw no key: out 0, lse -inf.
// Key blocks that no row of Q_i sees are never loaded (Mask::key_start / key_end), and only the tiles
// that Mask::partial names are masked element by element.
//
// Grid: a tile is a (query block, batch * heads_q) in query_block's order (mask.cuh: the last query
// blocks, which see the most keys when causal, first); `tiles` of them in all. The launcher gives a CTA
// a tile by default; with cupy_backend.SM90_PERSISTENT, min(tiles, SMs) CTAs: CTA b takes tile b first,
// then the first tile no CTA has taken (gridDim.x + an atomicAdd on tile_counter, zero at launch), so that
// a CTA whose tiles were short takes more, as the hardware's dispatch of a CTA a tile balances them.
// The producer then loads the next tile's Q_i and K_j while the consumers finish this one, whose out
// leaves by TMA store under the next tile's GEMMs. (A static round-robin of the tiles, b, b + gridDim.x,
// .., measured no faster on an H200, and 0.72x causal at S = 16k: benchmarks/results/h200_session3/;
// this scheduler: unmeasured.) The producer takes each tile and tells the consumers which through
// tile_slot (below).
// CTA: 1 + CONSUMERS warpgroups of 128 threads, CONSUMERS = BLOCK_M / 64: two (SM90_THREADS), or three
// at head_dim 64 with cupy_backend.SM90_TALL_FORWARD (FA3's 192 query rows there), with different jobs:
//   warpgroup 0, the producer: gives its registers back (setmaxnreg_dec) and one elected thread of its
//     first warp issues every TMA load: per tile Q_i once (once Q_s is free), then K_j and V_j of each
//     key block into a ring of STAGES stages, waiting for a stage's K (or V) to be free before refilling
//     it; the ring runs on across tiles. K_{j+1} goes before V_j, the order the consumers read them in
//     (S of the next block is issued before P V of this one), so that a V_j not yet free does not hold
//     up K_{j+1}. The other producer threads are done.
//   warpgroups 1 .. CONSUMERS: take the registers (setmaxnreg_inc); consumer c owns query rows
//     64 c .. 64 c + 63 of Q_i (one wgmma M of 64; warp w of it rows 16 w .., the lane's two rows
//     as in tc_tile.cuh's C fragments). Per key block, in registers (fp32):
//         S = Q_i K_jᵀ   wgmma_ss m64 n BLOCK_N, both operands from shared memory (K-major)
//         the mask and the online softmax on S in place (tc_tile.cuh's online_softmax): S becomes P
//         O += P V_j     wgmma_rs m64 n HEAD_DIM: P re-packed from S's accumulators as the 16-bit A
//                        fragments (c_to_a: the accumulator layout is the A layout, no shuffle), V_j
//                        from shared memory, MN-major (the B-transpose bit)
//     then out = O / l through shared memory (its own 64 rows of O_s) and a TMA store.
// Shared memory (dynamic, aligned up to 1024 bytes here: the 128B swizzle's repeat). Every tile lies
// as a TMA box with 128B swizzle lands it: atoms of 64 columns (128 bytes a row, rows 128 bytes apart,
// the 16-byte chunk c of row r at chunk c ^ (r % 8)), the HEAD_DIM / 64 atoms of a tile one after
// the other. That is wgmma's K-major 128B layout for Q and K (SBO 1024: 8 rows; k-step s at +32 s
// bytes inside the atom) and its MN-major 128B layout for V (SBO 1024: 8 keys; LBO an atom: the
// next 64 columns of head_dim; k-step t at +2048 t bytes).
//     Q_s   BLOCK_M x HEAD_DIM                      Q_i of the tile
//     K_s   STAGES x BLOCK_N x HEAD_DIM             the ring: stage s holds the CTA's it-th key block
//     V_s   STAGES x BLOCK_N x HEAD_DIM             (it % STAGES == s), counted across its tiles
//     O_s   BLOCK_M x HEAD_DIM                      each consumer's rows of out, for its TMA store
//     total (2 BLOCK_M + 2 STAGES BLOCK_N) HEAD_DIM 2 bytes + 1024 of alignment (launch.py: LAUNCH).
// O_IN_Q: where that is more than a CTA may have (227 KiB: BLOCK_N 176 at HEAD_DIM 128, FA3's key block
// for calls without causal or window; every tile at HEAD_DIM 256, Q_i and the ring alone 225 KiB with 80
// keys), O_s is Q_s: a consumer's rows of O_s are the rows of Q_s that only its own S = Q_i K_jᵀ read,
// all landed before it writes out. The next Q_i then waits for out to have left (q_empty below), so a
// persistent grid's next Q_i no longer loads under this tile's epilogue.
// mbarriers (static shared memory), and why each is waited on:
//     q_full           the producer has written the CTA's next tile into tile_slot, and its Q_i's boxes
//                      have landed (count 1: the producer's arrive.expect_tx, the TMA completing the
//                      bytes; a tile that sees no key, or none left (tile_slot = tiles), a plain arrive).
//                      Consumers wait before they read tile_slot, so before their first S = Q_i K_jᵀ.
//     q_empty          every consumer thread's last S = Q_i K_jᵀ of the tile has landed, or (a tile that
//                      sees no key) every consumer thread has read tile_slot (count: the consumer
//                      threads): the producer waits before writing tile_slot and loading the next Q_i
//                      (parity 1 first). O_IN_Q: every consumer's out has left O_s (its lead's TMA store
//                      has read it, or each thread has copied its part).
//     k_full[s]        K_j of stage s has landed: consumers wait before S = Q_i K_jᵀ.
//     v_full[s]        V_j of stage s has landed: consumers wait before O += P V_j. Apart from K_j's
//                      barrier, so that S and the softmax start before V_j lands.
//     k_empty[s]       every consumer thread's S = Q_i K_jᵀ of stage s has landed (count: the consumer
//                      threads): no wgmma still reads K_j. The producer waits before loading the stage's
//                      next K (parity 1 first: the first STAGES waits pass at once). Apart from V_j's
//                      (FA3's two pipelines): with one barrier for both, the stage of K_{j+2} came free
//                      only when the last consumer's P V_j had landed, at the end of its turn, just when
//                      the first consumer's turn wants K_{j+2}: the load's whole latency on the path of
//                      every other turn. With its own, K_{j+2} is loaded about two turns before its S.
//     v_empty[s]       every consumer thread has passed the wgmma_wait of its P V_j (count: the
//                      consumer threads): no wgmma still reads V_j. The producer waits before loading
//                      the stage's next V (parity 1 first).
// Barriers: one __syncthreads after the mbarrier inits (no thread arrives or waits on a barrier not yet
// initialised); named barrier 1 + c (the consumer's 128 threads) twice a tile: after the consumer's lead
// thread waited for its last TMA store to have read O_c (wait_group.read 0), before anyone writes O_c;
// and between writing O_c (each thread fenced for the async proxy) and the TMA store that reads it.
// ZEROED (VARLEN, every consumer thread): between zeroing V_j's rows past the sequence in the last
// key block (each thread fenced) and the P V_j that reads them.
//
// A packed batch (VARLEN; packed.forward_varlen): a CTA a slot of the grid over cu_seqlens_q (mask.cuh's
// Sequence; a slot past its sequence's blocks exits at once), one tile, never persistent; the tensor maps
// over the (1, total, heads, head_dim) tensors, the boxes at the sequence's rows. A box reaches past the
// sequence into the next one's rows: Q's are computed and never stored, K's are masked by selection, V's
// are zeroed (ZEROED: P = 0 times a NaN there would be NaN), and out leaves row by row from O_c (a TMA
// store box would write the next sequence's rows) through `out`'s pointer, lse row by row as always.
//
// Requirements on the arguments, checked by the launcher (specs.sm90_eligible, flashcupy's
// cupy_backend.forward_path): q, k, v, out contiguous along head_dim, 16-byte aligned, the other
// strides positive multiples of 16 bytes (what a tensor map can describe); head_dim a multiple of 8 up
// to HEAD_DIM: a box reads the columns past head_dim, and the rows past seqlen, as zeros, and the TMA
// store writes neither. v's head_dim_v may differ from q's and k's head_dim (MLA), HEAD_DIM the larger
// rounded up: each map has its own tensor's width, so Q_i and K_j are zero past head_dim and V_j past
// head_dim_v, and out (O's columns up to head_dim_v) is stored up to head_dim_v; the padded columns of
// the smaller cost their wgmma work (192 and 128: a third of P V_j). An atom wholly past its tensor's
// head dim (V_j's third at 192 and 128) is a box with no element inside the tensor, all of it the copy
// engine's zeros, its bytes counted as any box's (as in the backward's kernels but SPLIT_D, which zeroes
// those atoms itself: the GPU session's MLA test, tests/test_cupy_gpu.py, checks the fill on silicon). Modifiers (MODS, specs.sm90_eligible:
// any in one batch but a bias above head_dim 128; in a packed batch the window, softcap and ALiBi): as
// flash_fwd_tc.cu applies them, softcap, ALiBi and the bias make each score of S final (mask.cuh's
// Score, in base 2) before the mask, and the bool mask masks every tile element by element; with a bias
// or mask the key block is 64, and where the
// registers asked for it (specs.sm90_forward_tile). Dropout (MOD_DROPOUT, mask.cuh's Dropout) drops P
// after l took its row sums and before P V_j is packed, as flash_fwd_tc.cu does (tc_dropout: S's
// accumulators are laid out as the mma.sync C fragments, 16 rows a warp), its batch index a packed
// batch's sequence's.
//
// Template parameters: T (__half or __nv_bfloat16), HEAD_DIM (64, 128 or 256: head_dim rounded up to 64),
// BLOCK_M (64 CONSUMERS: 128, or 192 at head_dim 64, specs.sm90_forward_tile), BLOCK_N (a key block: 64,
// 128, the wide 176, 192, or 80 at head_dim 256, where O takes 128 of a consumer's 240 registers),
// MODS (mask.cuh's MOD_* bits).
// `tiles`: the query blocks times batch times heads_q (VARLEN: the grid's CTAs). tile_counter: an int,
// zero at launch, where a grid of fewer CTAs than tiles counts the tiles taken after each CTA's first
// (never read otherwise). VARLEN: a packed batch's kernel.

#include "mask.cuh"
#include "sm90_tile.cuh"

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int MODS = 0, bool VARLEN = false>
__global__ void __launch_bounds__(128 * (1 + BLOCK_M / 64), 1) flash_fwd_sm90(
    const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
    const __grid_constant__ TensorMap map_v, const __grid_constant__ TensorMap map_out,
    LSE_PARAMS(float, lse), PROBLEM_PARAMS(float), int tiles, int* tile_counter, TENSOR_PARAMS(T, out),
    VARLEN_PARAMS) {
    constexpr int CONSUMERS = BLOCK_M / 64;  // a consumer warpgroup owns 64 query rows
    static_assert(BLOCK_M % 64 == 0 && (CONSUMERS == 2 || CONSUMERS == 3), "two or three consumer warpgroups");
    static_assert(HEAD_DIM % ATOM == 0 && HEAD_DIM <= 256, "head_dim in whole atoms; wgmma N of 64, 128, 192 or 256");
    static_assert(BLOCK_N == 64 || BLOCK_N == 80 || BLOCK_N == 128 || BLOCK_N == 176 || BLOCK_N == 192,
                  "wgmma N of 64, 80, 128, 176 or 192 (hopper.cuh's Wgmma)");
    constexpr int N_TILES = BLOCK_N / 8;     // 8-key column tiles of S (C fragments)
    constexpr int D_TILES = HEAD_DIM / 8;    // 8-column tiles of O
    constexpr int QK_STEPS = HEAD_DIM / 16;  // k-steps of Q_i K_jᵀ
    constexpr int PV_STEPS = BLOCK_N / 16;   // k-steps of P V_j
    constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2, KV_BYTES = BLOCK_N * HEAD_DIM * 2;
    // named barriers: 1 + c, consumer c's O_s; PINGPONG + c, consumer c's turn; ZEROED (VARLEN), the consumers'
    constexpr int PINGPONG = 1 + CONSUMERS, ZEROED = 1 + 2 * CONSUMERS;
    // O_s in Q_s where Q_i, the ring and O_s would not fit (the wide key block, 176 at head_dim 128; 256):
    // launch.py's _sm90_forward_smem says the same
    constexpr bool O_IN_Q = (2 * BLOCK_M + 2 * SM90_STAGES * BLOCK_N) * HEAD_DIM * 2 + 1024 > SM90_SMEM_OPTIN;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* Q_s = aligned_smem(smem_raw);
    unsigned char* K_s = Q_s + Q_BYTES;
    unsigned char* V_s = K_s + SM90_STAGES * KV_BYTES;
    unsigned char* O_s = O_IN_Q ? Q_s : V_s + SM90_STAGES * KV_BYTES;
    __shared__ __align__(8) unsigned long long q_full, q_empty, k_full[SM90_STAGES], v_full[SM90_STAGES],
        k_empty[SM90_STAGES], v_empty[SM90_STAGES];
    __shared__ int tile_slot;  // the tile the producer took next (tiles: none left), for the consumers

    // VARLEN: the CTA's one tile is a query block of a sequence (a slot of the grid over cu_seqlens_q,
    // mask.cuh's Sequence), the problem that sequence's, the TMA's rows counted from its first ones
    int q_row0 = 0, k_row0 = 0, seq_index = 0;  // seq_index: the sequence's, for ALiBi's slopes per sequence
    QueryBlock packed_blk{};
    if constexpr (VARLEN) {
        const Sequence seq = sequence_of<BLOCK_M>(VARLEN_ARGS, seqlen_q, seqlen_k, group);
        if (seq.start < 0) return;  // the whole CTA, before any barrier
        SEQUENCE_LENGTHS(seq);
        AT_SEQUENCE_Q(seq, lse), AT_SEQUENCE_Q(seq, out);
        q_row0 = seq.q_start, k_row0 = seq.k_start, seq_index = seq.index;
        packed_blk = {seq.start, 0, seq.h, seq.kv_head};  // batch 0: the packed tensors' (batch strides 0)
    }
    const auto mask = MAKE_MASK(MODS);
    // A tile: its query block, and the key blocks its rows see (none: no load, out 0 and lse -inf)
    struct Tile {
        QueryBlock blk;
        int j_start, blocks;
    };
    const auto tile_at = [&](int t) {
        const QueryBlock blk = VARLEN ? packed_blk : query_block<BLOCK_M>(seqlen_q, heads_q, group, t);
        const int j_start = mask.key_start(blk.i0);
        return Tile{blk, j_start, num_blocks(mask.key_end(blk.i0) - j_start, BLOCK_N)};
    };
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbarrier_init(&q_full, 1);
        mbarrier_init(&q_empty, 128 * CONSUMERS);
        for (int s = 0; s < SM90_STAGES; ++s) {
            mbarrier_init(&k_full[s], 1);
            mbarrier_init(&v_full[s], 1);
            mbarrier_init(&k_empty[s], 128 * CONSUMERS);
            mbarrier_init(&v_empty[s], 128 * CONSUMERS);
        }
        mbarrier_init_fence();
    }
    __syncthreads();  // the barriers are initialised before any thread arrives on or waits for them

    if (warpgroup == 0) {  // the producer
        setmaxnreg_dec<PRODUCER_REGISTERS<CONSUMERS>>();
        if (threadIdx.x / WARP_SIZE == 0 && elect_one_sync()) {
            int it = 0, n = 0;  // key blocks loaded and tiles taken so far: the rings' places
            // K (or V: the ring, its barriers and map) of the key block at j0 of `tile` into the ring's place
            // `at`, once the consumers are done with what that stage held (the first round passes at once)
            using Barriers = unsigned long long[SM90_STAGES];
            const auto load = [&](unsigned char* ring, Barriers& empty, Barriers& full, const TensorMap& map,
                                  const Tile& tile, int at, int j0) {
                const int s = at % SM90_STAGES;
                mbarrier_wait_parity(&empty[s], (at / SM90_STAGES + 1) & 1);
                mbarrier_arrive_expect_tx(&full[s], KV_BYTES);
                load_box<BLOCK_N, HEAD_DIM>(ring + s * KV_BYTES, map, tile.blk.kv_head, k_row0 + j0, tile.blk.b,
                                            &full[s]);
            };
            for (int t = blockIdx.x;; ++n) {
                // the consumers' last S of the tile before is done reading Q_s, and they have read tile_slot
                // (the first passes at once)
                mbarrier_wait_parity(&q_empty, (n + 1) & 1);
                tile_slot = min(t, tiles);
                if (t >= tiles) {
                    mbarrier_arrive(&q_full);  // none left: the consumers stop
                    break;
                }
                const Tile tile = tile_at(t);
                // the next tile: the first free one of the grid's (a CTA a tile: none)
                t = gridDim.x < tiles ? gridDim.x + atomicAdd(tile_counter, 1) : tiles;
                if (tile.blocks == 0) {
                    mbarrier_arrive(&q_full);  // a tile that sees no key: no load, the consumers write out 0
                    continue;
                }
                mbarrier_arrive_expect_tx(&q_full, Q_BYTES);
                load_box<BLOCK_M, HEAD_DIM>(Q_s, map_q, tile.blk.h, q_row0 + tile.blk.i0, tile.blk.b, &q_full);
                // K_j, then V_{j-1}: each in the order the consumers read them
                for (int jb = 0; jb < tile.blocks; ++jb, ++it) {
                    load(K_s, k_empty, k_full, map_k, tile, it, tile.j_start + jb * BLOCK_N);
                    if (jb > 0) load(V_s, v_empty, v_full, map_v, tile, it - 1, tile.j_start + (jb - 1) * BLOCK_N);
                }
                load(V_s, v_empty, v_full, map_v, tile, it - 1, tile.j_start + (tile.blocks - 1) * BLOCK_N);
            }
        }
        return;
    }

    // a consumer: query rows row_c .. row_c + 63 of each tile, the warp's 16 from row_w
    setmaxnreg_inc<CONSUMER_REGISTERS<CONSUMERS>>();
    const int c = warpgroup - 1;
    const int lane = threadIdx.x % WARP_SIZE;
    const bool lead = threadIdx.x % 128 == 0;  // the consumer's thread that issues its TMA stores
    const unsigned char* Q_c = Q_s + 64 * c * 128;  // the consumer's rows of Q_s, in the first atom
    unsigned char* O_c = O_s + 64 * c * 128;        // and of O_s
    const float scale_log2 = scale * LOG2E;
    int it = 0, n = 0;  // key blocks consumed and tiles taken so far: the rings' places

    for (;; ++n) {
        // the producer's next tile (tile_slot written before its arrival): Q_i landed, or none to load
        mbarrier_wait_parity(&q_full, n & 1);
        const int t = tile_slot;
        if (t >= tiles) break;
        const Tile tile = tile_at(t);
        const QueryBlock& blk = tile.blk;
        const int j_start = tile.j_start, blocks = tile.blocks;
        const int row_c = blk.i0 + 64 * c, row_w = row_c + 16 * (threadIdx.x / WARP_SIZE % 4);
        // a packed batch's blk.b is 0 (the tensor maps' batch); its slopes are the sequence's
        const auto score = MAKE_SCORE(T, float, MODS, VARLEN ? seq_index : blk.b, blk.h, scale_log2, LOG2E);
        const auto drop = MAKE_DROPOUT(float, MODS, true, VARLEN ? seq_index : blk.b, blk.h);

        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        float O[D_TILES][4];
        zero(O);
        float S[N_TILES][4];       // the scores of the newest key block, then its P in fp32
        unsigned P[PV_STEPS][4];   // the P of the key block whose P V_j is in flight, as A fragments
        // key block jb of this tile: its stage of the ring, and the parity of that stage's phase
        const auto stage = [&](int jb) { return (it + jb) % SM90_STAGES; };
        const auto parity = [&](int jb) { return unsigned((it + jb) / SM90_STAGES) & 1; };
        // Waits outside the stretches that issue wgmma: a wait is a loop, and a branch between
        // wgmma_fence and the wgmma it orders made ptxas serialise the wgmma pipeline (C7520)
        const auto wait_k = [&](int jb) { mbarrier_wait_parity(&k_full[stage(jb)], parity(jb)); };
        // S = Q_i K_jᵀ of key block jb into S, issued (not waited for)
        const auto issue_s = [&](int jb) {
#pragma unroll
            for (int ks = 0; ks < QK_STEPS; ++ks)
                wgmma_ss<T, BLOCK_N>(&S[0][0], k_major<BLOCK_M>(Q_c, ks), k_major<BLOCK_N>(K_s + stage(jb) * KV_BYTES, ks),
                                     ks > 0);
            wgmma_commit_group();
        };
        // The mask and the softmax of key block jb's S, once it has landed: S becomes P, m and l move on;
        // alpha: the factor of O's rows, applied once no wgmma adds into O. K_j is read no more: the
        // producer may refill its stage. After the tile's last S, Q_s is read no more either: the producer
        // may load the next tile's Q_i
        float alpha[2];
        const auto softmax = [&](int jb) {
            wgmma_fence_operand<BLOCK_N / 2>(&S[0][0]);
            mbarrier_arrive(&k_empty[stage(jb)]);  // this thread's S no longer reads K_j
            if (!O_IN_Q && jb == blocks - 1) mbarrier_arrive(&q_empty);
            const int j0 = j_start + jb * BLOCK_N;
            tc_final_scores<MODS>(S, mask, score, blk.i0, row_w, j0, scale_log2);
#pragma unroll
            for (int r = 0; r < 2; ++r) alpha[r] = online_softmax_row(S, m, l, r, tc_softmax_scale(score, scale_log2));
            tc_dropout<MODS>(S, drop, row_w, j0);  // after l took the row sums
        };
        // O rescaled, key block jb's P packed as A fragments, its V_j landed: O += P V_j can be issued
        const auto ready_pv = [&](int jb) {
#pragma unroll
            for (int r = 0; r < 2; ++r) rescale_row(O, r, alpha[r]);
#pragma unroll
            for (int kt = 0; kt < PV_STEPS; ++kt) c_to_a<T>(P[kt], S[2 * kt], S[2 * kt + 1]);
            mbarrier_wait_parity(&v_full[stage(jb)], parity(jb));
        };
        const auto issue_pv = [&](int jb) {
#pragma unroll
            for (int kt = 0; kt < PV_STEPS; ++kt)
                wgmma_rs<T, HEAD_DIM, true>(&O[0][0], P[kt], mn_major<BLOCK_N>(V_s + stage(jb) * KV_BYTES, kt), true);
            wgmma_commit_group();
        };
        // P V_j has landed: O may be read and written again, and V_j's stage refilled
        const auto release = [&](int jb) {
            wgmma_wait_group<0>();
            wgmma_fence_operand<HEAD_DIM / 2>(&O[0][0]);
            mbarrier_arrive(&v_empty[stage(jb)]);  // this thread's P V_j no longer reads V_j
        };
        // Pingpong: the consumers take turns to issue their GEMMs, round robin (named barrier PINGPONG + c,
        // 256 threads: consumer c waits there, the one before it arrives), so that one's softmax runs while
        // the others' wgmma keep the tensor cores busy; with three, each softmax has two others' GEMMs to
        // run under (FA3's three warpgroups at head_dim 64, where a softmax takes about as long as the
        // GEMMs of its block). Consumer 0 goes first; each of the blocks + 1 turns of a tile ends by letting
        // the next go, except the last consumer's last (nobody waits for it): every tile's turns balance,
        // so the next tile's start the same way. A barrier never holds two arrivals: consumer c - 1's turn
        // t + 1 follows the whole round of turn t, c's included.
        // [pingpong] scheduling, not ordering: no result depends on it (tests/test_hopper_kernels.py says so)
        const auto my_turn = [&] { named_barrier_sync(PINGPONG + c, 256); };
        const auto your_turn = [&](int turn) {
            if (c < CONSUMERS - 1 || turn < blocks) named_barrier_arrive(PINGPONG + (c + 1) % CONSUMERS, 256);
        };

        if (!O_IN_Q && blocks == 0) mbarrier_arrive(&q_empty);  // tile_slot read; no Q_i to read
        if (blocks > 0) {
            if (c == CONSUMERS - 1) named_barrier_arrive(PINGPONG, 256);  // consumer 0's first turn
            wait_k(0);
            // turn 0: S of key block 0
            my_turn();
            wgmma_fence();
            issue_s(0);
            your_turn(0);
            wgmma_wait_group<0>();
            softmax(0);
            // turn jb + 1: S of key block jb + 1, then O += P V_j of block jb; the softmax of jb + 1 runs
            // while P V_j is in flight (O and P are not touched until it lands)
            for (int jb = 0; jb + 1 < blocks; ++jb) {
                ready_pv(jb);
                wait_k(jb + 1);
                my_turn();
                wgmma_fence();  // O (rescaled) and P were written by ordinary instructions, S read
                issue_s(jb + 1);
                issue_pv(jb);
                your_turn(jb + 1);
                wgmma_wait_group<1>();  // S of block jb + 1 has landed; P V_j may still run
                softmax(jb + 1);
                release(jb);
            }
            // the last turn: P V_j of the last block alone
            ready_pv(blocks - 1);
            // VARLEN: V_j's rows past the sequence's keys are the next sequence's (a box past the tensor's
            // end lands zeros): P = 0 times a NaN there would be NaN. Every consumer's threads zero them
            // before any issues P V_j. Only the last key block reaches past (key_end <= seqlen_k), so
            // the loop above is the non-packed kernel's (registers: the window's spilled at head_dim 128)
            const int j_last = j_start + (blocks - 1) * BLOCK_N;
            if (VARLEN && j_last + BLOCK_N > seqlen_k) {
                zero_rows<BLOCK_N, HEAD_DIM>(V_s + stage(blocks - 1) * KV_BYTES, seqlen_k - j_last, threadIdx.x - 128,
                                             128 * CONSUMERS);
                fence_proxy_async();                           // this thread's zeros, before the wgmma reads them
                named_barrier_sync(ZEROED, 128 * CONSUMERS);  // every consumer thread's
            }
            my_turn();
            wgmma_fence();
            issue_pv(blocks - 1);
            your_turn(blocks);
            release(blocks - 1);
            it += blocks;
        }

        // out = O / l and lse = (m + log2 l) ln 2; a row that saw no key (l == 0) gets out 0, lse -inf
        float inv_l[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[r] = group_sum<4>(l[r]);
            inv_l[r] = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
            const int row = row_w + lane / 4 + 8 * r;
            if (lane % 4 == 0 && row < seqlen_q)
                LSE_ROW(lse, blk.b, blk.h)[row] = l[r] == 0.0f ? -INFINITY : m[r] * LN2 + logf(l[r]);
        }
        // O, rounded to T, into the consumer's own rows of O_s as the TMA store reads a box (the 128B
        // swizzle), once the consumer's last TMA store has read them
        if (lead) tma_store_wait_group_read<0>();
        named_barrier_sync(1 + c, 128);  // the lead's wait: O_c is free
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row_w - row_c + lane / 4 + 8 * r, col = 8 * dt + c_col(0);
                *reinterpret_cast<unsigned*>(O_c + swizzled_byte<BLOCK_M>(row, col)) =
                    pack2<T>(O[dt][2 * r] * inv_l[r], O[dt][2 * r + 1] * inv_l[r]);
            }
        fence_proxy_async();             // this thread's stores, before the TMA store reads them
        named_barrier_sync(1 + c, 128);  // every thread of the consumer has stored and fenced its part
        if constexpr (VARLEN) {
            // a box would reach into the next sequence's rows: the consumer's threads copy its rows of O_c
            // within the sequence, 16 bytes each, a copy at a time (fragment by fragment from the registers,
            // or unrolled, the window's epilogue spilled at head_dim 128 under NVRTC 12.9)
            const Rows<T> out_h = HEAD_ROWS(out, blk.b, blk.h);
            const int rows = min(64, seqlen_q - row_c);
#pragma unroll 1
            for (int e = threadIdx.x % 128; e < rows * (HEAD_DIM / 8); e += 128) {
                const int row = e / (HEAD_DIM / 8), col = 8 * (e % (HEAD_DIM / 8));
                if (col < head_dim_v)
                    *reinterpret_cast<int4*>(&out_h.at(row_c + row, col)) =
                        *reinterpret_cast<const int4*>(O_c + swizzled_byte<BLOCK_M>(row, col));
            }
        } else if (lead) {
#pragma unroll
            for (int a = 0; a < HEAD_DIM / ATOM; ++a)
                if (a * ATOM < head_dim_v)  // an atom wholly past out's head_dim_v: nothing to store
                    tma_store_4d(map_out, a * ATOM, blk.h, row_c, blk.b, O_c + a * ATOM_BYTES<BLOCK_M>);
            tma_store_commit_group();
        }
        if constexpr (O_IN_Q) {
            // Q_c is free for the next Q_i once out has left O_c, which lies in it: the lead's TMA store has
            // read it (q_empty counts the lead's arrival too), or (VARLEN) each thread has copied its part
            if (lead) tma_store_wait_group_read<0>();
            mbarrier_arrive(&q_empty);
        }
    }
    if (lead) tma_store_wait_group_read<0>();  // the CTA's shared memory is read before it exits
}
