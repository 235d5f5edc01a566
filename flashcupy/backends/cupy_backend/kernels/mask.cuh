// mask.cuh: which keys each query sees, what the score modifiers do to a score, and which block of
// which head a CTA works on. Every kernel, SIMT and tensor-core alike, asks these questions here
// instead of spelling the rule itself.
//
// Query i sees key j iff j < seqlen_k and, when causal, j <= i + diagonal. The interface computes
// diagonal once (Problem.diagonal in flashcupy/_api.py: seqlen_k - seqlen_q, the causal mask aligned
// bottom-right) and every kernel takes it as an argument; a kernel over a packed batch (VARLEN) makes
// its lengths and diagonal those of its CTA's sequence first (Sequence, TAKE_SEQUENCE below), so the
// same Mask holds per sequence. The kernels' loops run over key_start ..
// key_end (query_start .. query_end) and mask element by element only the tiles that partial()
// names, so a sliding window changes the answers here, not the loops.
//
// A window (Problem.band: left, right, causal being right = 0) is a template flag of the kernels
// (MOD_WINDOW in MODS): with it, query i sees key j iff j < seqlen_k and
// i + diagonal - left <= j <= i + diagonal + right, and the causal flag is not read (the launcher
// passes right = 0 for it). An unbounded side arrives clamped to a value that hides nothing
// (_window_args in cupy_backend/__init__.py), so no bound overflows. Without the flag the Mask is
// exactly the causal rule above, and compiles to the same instructions as before windows existed.
//
// Rows past seqlen_q, the padding of the last query block, are no part of the rule: no kernel stores
// them, and the backward gives them P = 0 through their lse (lse_for_p in flash_bwd_common.cuh).
// Checking them here too took the tensor-core dK/dV kernel past the register limit that
// tests/test_nvrtc.py sets.

#pragma once

#include "flash_common.cuh"

// The score modifiers a kernel is specialised for: its MODS template parameter, a sum of these
// (specs.py names them). A kernel with MODS = 0 is the plain (or causal) kernel.
constexpr int MOD_WINDOW = 1;   // a band: Mask<.., true>
constexpr int MOD_SOFTCAP = 2;  // s -> c tanh(s / c), on the scaled score
constexpr int MOD_ALIBI = 4;    // s -> s - slope |i + diagonal - j|, a slope per (batch, query head)
constexpr int MOD_BIAS = 8;     // s -> s + bias[b, h, i, j]
constexpr int MOD_MASK = 16;    // the pair is hidden where mask[b, h, i, j] is false (the caller's bool mask)
constexpr int MOD_SCORE = MOD_SOFTCAP | MOD_ALIBI | MOD_BIAS;  // the modifiers that change a score's value
constexpr int MOD_PAIRS = MOD_BIAS | MOD_MASK;  // they read a rank-4 array per (query, key) pair
constexpr int MOD_DROPOUT = 32;  // no score modifier: P is dropped (Dropout below) before P V, dP before dS
constexpr int MOD_HEAD_DIM_V = 64;  // no score modifier: v and dout have a head dim of their own (flash_bwd_tc.cu)

template <int BLOCK_M, int BLOCK_N, bool WINDOW = false>  // query rows and keys of the kernel's tile
struct Mask {
    int seqlen_q, seqlen_k;
    int diagonal;
    bool causal;
    int left = 0, right = 0;  // the band's sides (WINDOW only): never unbounded, see the header

    __device__ __forceinline__ bool visible(int i, int j) const {
        if constexpr (WINDOW) return j < seqlen_k && j >= i + diagonal - left && j <= i + diagonal + right;
        return j < seqlen_k && (!causal || j <= i + diagonal);
    }

    // The keys that some row of the query block at i0 sees lie in key_start(i0) .. key_end(i0) - 1;
    // key_end <= key_start when the block sees none (causal, its last row before the diagonal starts).
    // key_start is 0 while no window hides the earliest keys.
    __device__ __forceinline__ int key_start(int i0) const {
        if constexpr (WINDOW) return max(0, i0 + diagonal - left);
        return 0;
    }
    __device__ __forceinline__ int key_end(int i0) const {
        const int last_row = min(i0 + BLOCK_M, seqlen_q) - 1;
        if constexpr (WINDOW) return max(0, min(seqlen_k, last_row + diagonal + right + 1));
        if (!causal) return seqlen_k;
        return max(0, min(seqlen_k, last_row + 1 + diagonal));
    }

    // The rows that see some key of the key block at j0 lie in query_start(j0) .. query_end(j0) - 1
    // (none when query_start >= query_end). query_end is seqlen_q while no window hides the latest
    // rows.
    __device__ __forceinline__ int query_start(int j0) const {
        if constexpr (WINDOW) return max(0, j0 - diagonal - right);
        return causal ? max(0, j0 - diagonal) : 0;
    }
    __device__ __forceinline__ int query_end(int j0) const {
        if constexpr (WINDOW) return min(seqlen_q, min(j0 + BLOCK_N, seqlen_k) - diagonal + left);
        return seqlen_q;
    }

    // Whether visible() is false anywhere in the tile of the query block at i0 and the key block at
    // j0 (rows past seqlen_q aside); the other tiles skip the element-wise mask.
    __device__ __forceinline__ bool partial(int i0, int j0) const {
        if constexpr (WINDOW)
            return j0 + BLOCK_N > seqlen_k || j0 + BLOCK_N - 1 > i0 + diagonal + right ||
                   j0 < i0 + BLOCK_M - 1 + diagonal - left;
        return j0 + BLOCK_N > seqlen_k || (causal && j0 + BLOCK_N - 1 > i0 + diagonal);
    }
};

// The Mask of a kernel specialised for MODS, made of the kernel's PROBLEM_PARAMS (flash_common.cuh).
template <int BLOCK_M, int BLOCK_N, int MODS>
using MaskFor = Mask<BLOCK_M, BLOCK_N, (MODS & MOD_WINDOW) != 0>;
#define MAKE_MASK(MODS) \
    MaskFor<BLOCK_M, BLOCK_N, MODS> { seqlen_q, seqlen_k, diagonal, causal != 0, window_left, window_right }

// One (batch, query head) slice of a rank-4 array broadcastable to (batch, heads_q, seqlen_q, seqlen_k):
// the bias or the bool mask, addressed in bytes (strides s_q, s_k; 0 along a broadcast dimension), so
// that one pointer serves whichever dtype the array holds (a float32 bias with 16-bit inputs). at()
// clamps i and j into the problem: a tile carries rows past seqlen_q and keys past seqlen_k (hidden,
// or never stored), and they must read an element that exists.
struct PairSlice {
    const char* base;  // element (b, h, 0, 0)
    index_t s_q, s_k;
    int last_q, last_k;

    template <typename X>
    __device__ __forceinline__ X at(int i, int j) const {
        return *reinterpret_cast<const X*>(base + min(i, last_q) * s_q + min(j, last_k) * s_k);
    }
};

// The slice of (batch b, query head h) of x (element strides sb, sh, sq, sk; size bytes an element), or
// an empty one when the kernel is not specialised for it.
template <bool ON>
__device__ __forceinline__ PairSlice pair_slice(const void* x, int size, index_t sb, index_t sh, index_t sq, index_t sk,
                                                int b, int h, int seqlen_q, int seqlen_k) {
    if constexpr (ON) return {static_cast<const char*>(x) + (b * sb + h * sh) * size, sq * size, sk * size,
                              seqlen_q - 1, seqlen_k - 1};
    return {nullptr, 0, 0, 0, 0};
}

// The score modifiers of MODS & MOD_SCORE, and the bool mask, for one (batch, query head), in the
// units of the kernel that applies them. A score s becomes
//     softcap:  cap_out tanh(s cap_in)       (without softcap: s times mul)
//     alibi:    then minus slope |i + diagonal - j|
//     bias:     then plus unit bias[b, h, i, j]
// The SIMT kernels score in natural units (s is already times scale): cap_in = 1 / c, cap_out = c,
// mul = 1, unit = 1. The tensor-core kernels hold s = q.k and exponentiate in base 2: cap_in =
// scale / c, cap_out = c log2 e, mul = scale log2 e, unit = log2 e (the slope is times unit too); the
// result is then the final score in base 2. cap_in and cap_out are kernel arguments, per kernel path
// (_modifier_args in cupy_backend/__init__.py). t (softcap only) is tanh(s cap_in), for the
// backward's dS (1 - t^2). keeps(i, j) is the bool mask (true without MOD_MASK); a pair is seen iff
// Mask::visible and keeps both say so.
template <typename T, typename Acc, int MODS>
struct Score {
    Acc cap_in, cap_out, mul, slope, unit;
    int diagonal;
    PairSlice bias;  // of T, or of float where bias_f32 (a float32 bias with 16- or 64-bit inputs)
    bool bias_f32;
    PairSlice keep;  // of bool

    static constexpr bool CHANGES = (MODS & MOD_SCORE) != 0;  // whether operator() changes a score's value

    __device__ __forceinline__ Acc operator()(Acc s, int i, int j, Acc& t) const {
        if constexpr ((MODS & MOD_SOFTCAP) != 0) {
            t = acc_tanh(s * cap_in);
            s = cap_out * t;
        } else {
            s *= mul;
        }
        if constexpr ((MODS & MOD_ALIBI) != 0) s -= slope * Acc(abs(i + diagonal - j));
        if constexpr ((MODS & MOD_BIAS) != 0)
            s += unit * (bias_f32 ? Acc(bias.at<float>(i, j)) : Acc(to_acc(bias.at<T>(i, j))));
        return s;
    }

    __device__ __forceinline__ bool keeps(int i, int j) const {
        if constexpr ((MODS & MOD_MASK) != 0) return keep.at<bool>(i, j);
        return true;
    }

    // dS of the scaled score from dS of the modified one: times d(softcap)/ds = 1 - t^2
    __device__ __forceinline__ Acc grad(Acc ds, Acc t) const {
        if constexpr ((MODS & MOD_SOFTCAP) != 0) return ds * (Acc(1) - t * t);
        return ds;
    }
};

// Dropout (MOD_DROPOUT; README, Semantics, "dropout"; flashcupy/_dropout.py is the rule's Python home):
// pair (i, j) of (batch b, query head h) keeps its weight iff word j mod 4 of Philox4x32-10 of the
// counter (j / 4, i, h, b) under the key (seed_lo, seed_hi) is at least threshold = floor(p 2^32), the
// four indices those of the whole call (the launcher's origin added: a chunk's, a view's, a sequence's
// batch). A kept weight is times scale = 1 / (1 - p). The forward drops P after its row sum (l stays
// undropped) and before P V; the backward drops P before dV and dP before dS = P (dP - D).
// One Philox call per pair, or per two adjacent keys (Dropout::pair: the mma.sync and Hopper forwards);
// the four words of a call serve four keys, which no thread holds together (GPU speed unmeasured).
// ROLLED keeps the ten rounds a loop: the SIMT kernels, whose unrolled loops over a thread's pairs
// otherwise interleave several calls and spill under their register cap, and the Hopper kernels, whose
// consumers' accumulators left too few registers (unrolled, 24-156 bytes of spills); unrolled, the
// mma.sync kernels stay below theirs (rolled, the wide forward spilled). The figures:
// benchmarks/results/dropout_registers.md.
template <bool ROLLED>
__device__ __forceinline__ void philox(unsigned& c0, unsigned& c1, unsigned& c2, unsigned& c3, unsigned k0,
                                       unsigned k1) {
#pragma unroll(ROLLED ? 1 : 10)
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {  // the key schedule's Weyl increments
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned hi2 = __umulhi(0xCD9E8D57u, c2), lo2 = 0xCD9E8D57u * c2;
        const unsigned x0 = hi2 ^ c1 ^ k0, x2 = hi0 ^ c3 ^ k1;
        c0 = x0;
        c1 = lo2;
        c2 = x2;
        c3 = lo0;
    }
}

// Word `word` of Philox4x32-10 of the counter (c0, c1, c2, c3) under the key (k0, k1); selected, not
// indexed: an array indexed at run time would live in local memory
template <bool ROLLED>
__device__ __forceinline__ unsigned philox_word(unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0,
                                                unsigned k1, unsigned word) {
    philox<ROLLED>(c0, c1, c2, c3, k0, k1);
    return (word & 2) ? ((word & 1) ? c3 : c2) : ((word & 1) ? c1 : c0);
}

template <typename Acc, bool ON, bool ROLLED = false>
struct Dropout {
    unsigned threshold, seed_lo, seed_hi, b, h, i0, j0;  // b, h with the origin added; i0, j0 the origin's
    Acc scale;

    // The factor of pair (i, j) (the kernel's own indices): scale or 0; 1 without MOD_DROPOUT
    __device__ __forceinline__ Acc factor(int i, int j) const {
        if constexpr (ON) {
            const unsigned key = unsigned(j) + j0;
            return philox_word<ROLLED>(key >> 2, unsigned(i) + i0, h, b, seed_lo, seed_hi, key & 3u) >= threshold
                       ? scale
                       : Acc(0);
        }
        return Acc(1);
    }
    // x and y, the weights of pairs (i, j) and (i, j + 1), times their factors: one Philox call where the
    // two keys share one (the key of j even: the mma.sync forward's fragments hold such pairs)
    __device__ __forceinline__ void pair(Acc& x, Acc& y, int i, int j) const {
        if constexpr (ON) {
            const unsigned key = unsigned(j) + j0;
            if ((key & 1u) != 0) {  // an odd origin: the two keys may lie in two calls
                x = (*this)(x, i, j);
                y = (*this)(y, i, j + 1);
                return;
            }
            unsigned c0 = key >> 2, c1 = unsigned(i) + i0, c2 = h, c3 = b;
            philox<ROLLED>(c0, c1, c2, c3, seed_lo, seed_hi);
            const bool high = (key & 2u) != 0;
            x = (high ? c2 : c0) >= threshold ? x * scale : Acc(0);
            y = (high ? c3 : c1) >= threshold ? y * scale : Acc(0);
        }
    }
    // x times a factor; x itself without MOD_DROPOUT (no multiplication by 1 left to the compiler)
    __device__ __forceinline__ Acc times(Acc x, Acc z) const {
        if constexpr (ON) return x * z;
        return x;
    }
    __device__ __forceinline__ Acc operator()(Acc x, int i, int j) const { return times(x, factor(i, j)); }
};

// The Dropout of (batch b, query head h) for a kernel specialised for MODS, of its PROBLEM_PARAMS
// (the seed's words read from device memory where drop_seed_read says so: only in kernels specialised for
// it); ROLLED as philox_word's
#define MAKE_DROPOUT(Acc, MODS, ROLLED, b, h)                                                                    \
    Dropout<Acc, ((MODS) & MOD_DROPOUT) != 0, ROLLED> {                                                           \
        drop_threshold, ((MODS) & MOD_DROPOUT) != 0 && drop_seed_read ? drop_seed[0] : drop_seed_lo,              \
            ((MODS) & MOD_DROPOUT) != 0 && drop_seed_read ? drop_seed[1] : drop_seed_hi, unsigned(b) + drop_b,    \
            unsigned(h) + drop_h, drop_i, drop_j, Acc(drop_scale)                                                 \
    }

// s - lse of a score the backward (or attention_probs) recomputes, clamped to at most 0 as it is by
// definition (P at most 1): where scores are so large that their rounding passes 1 (about 2^22 /
// head_dim in float: a scale of 1e30 with inputs of 0.5), a product rounded otherwise than the
// forward's S can put it far above 0, and P at inf, then NaN gradients. A NaN stays NaN (README,
// Semantics: large scores). In either base.
template <typename Acc>
__device__ __forceinline__ Acc at_most_zero(Acc x) {
    return x > Acc(0) ? Acc(0) : x;
}

// The per-element epilogue of a tile, one set of helpers per kernel family so that every kernel of the
// family spells it alike: the score modifiers on a raw score, whether a pair is seen (the Mask and the
// bool mask), the exponent of a recomputed P and dS. These are the SIMT kernels' (natural units, the
// raw score already times scale, acc_exp); tc_tile.cuh has the tensor-core kernels' (base 2), which
// share ds. Each kernel selects 0 for a hidden pair itself, where its comments say why (a NaN in dO).
// Functions of the kernel's own Mask and Score rather than an object holding them: an object holding
// references, or copies, compiled the kernels to other instructions than the code it replaced
// (benchmarks/sass_counts.py compares); so did seen and hidden as functions, hence macros of the
// kernel's mask and score.

// Whether query i sees key j: the Mask and the bool mask; PAIR_HIDDEN its negation as the SIMT forward
// spells it (the other spelling, too, compiled to other instructions)
#define PAIR_SEEN(i, j) (mask.visible(i, j) && score.keeps(i, j))
#define PAIR_HIDDEN(i, j) (!mask.visible(i, j) || !score.keeps(i, j))
// Whether the tile of the query block at i0 and the key block at j0 is masked element by element: the
// tiles Mask::partial names, and every tile with the bool mask (MOD_MASK), which may hide any pair
#define TILE_MASKED(MODS, i0, j0) (((MODS) & MOD_MASK) != 0 || mask.partial(i0, j0))

// The final score of pair (i, j) from the raw score s; t as Score's (softcap only). s as it is where
// no modifier changes scores.
template <typename ScoreT, typename Acc>
__device__ __forceinline__ Acc final_score(const ScoreT& score, Acc s, int i, int j, Acc& t) {
    if constexpr (ScoreT::CHANGES) return score(s, i, j, t);
    return s;
}

// P = e^x of x = a seen pair's final score - lse
template <typename Acc>
__device__ __forceinline__ Acc prob(Acc x) { return acc_exp(at_most_zero(x)); }

// dS of the final score (what dbias takes), and of the raw one (times the softcap's derivative); both
// families
template <typename Acc>
__device__ __forceinline__ Acc final_ds(Acc P, Acc dp, Acc D) { return P * (dp - D); }
template <typename ScoreT, typename Acc>
__device__ __forceinline__ Acc ds(const ScoreT& score, Acc P, Acc dp, Acc D, Acc t) {
    return score.grad(final_ds(P, dp, D), t);
}

// The slope of (batch b, query head h): alibi holds a (batch, heads_q) array, alibi_sb = 0 for a
// (heads_q,) one; 0 without MOD_ALIBI (the pointer is then never read).
template <int MODS, typename Acc>
__device__ __forceinline__ Acc alibi_slope(const Acc* alibi, index_t alibi_sb, index_t alibi_sh, int b, int h) {
    if constexpr ((MODS & MOD_ALIBI) != 0) return alibi[b * alibi_sb + h * alibi_sh];
    return Acc(0);
}

// The Score of (batch b, query head h) for a kernel specialised for MODS, of storage type T, made of
// the kernel's PROBLEM_PARAMS (flash_common.cuh); mul and unit as above.
#define MAKE_SCORE(T, Acc, MODS, b, h, mul, unit)                                                               \
    Score<T, Acc, MODS> {                                                                                       \
        cap_in, cap_out, mul, alibi_slope<MODS>(alibi, alibi_sb, alibi_sh, b, h) * (unit), unit, diagonal,      \
            pair_slice<(MODS & MOD_BIAS) != 0>(bias, bias_f32 ? 4 : int(sizeof(T)), bias_sb, bias_sh, bias_sq,   \
                                               bias_sk, b, h, seqlen_q, seqlen_k),                              \
            bias_f32 != 0,                                                                                      \
            pair_slice<(MODS & MOD_MASK) != 0>(keep, 1, keep_sb, keep_sh, keep_sq, keep_sk, b, h, seqlen_q, seqlen_k) \
    }

// Grid decode. The grid is flattened on x, which has room for any problem where y and z stop at 65535.

// A kernel with one CTA per (query block, batch * heads_q): the query blocks of one head are adjacent,
// so its K and V stay in L2, and the last query blocks, which see the most keys when causal, go first.
struct QueryBlock {
    int i0;       // its first query row
    int b, h;     // batch, query head
    int kv_head;  // the key/value head that query head h reads (GQA: group query heads share one)
};

template <int BLOCK_M>
__device__ __forceinline__ QueryBlock query_block(int seqlen_q, int heads_q, int group, int cta = blockIdx.x) {
    const int blocks = num_blocks(seqlen_q, BLOCK_M);
    const int bh = cta / blocks, h = bh % heads_q;
    return {int(blocks - 1 - cta % blocks) * BLOCK_M, bh / heads_q, h, h / group};
}

// Varlen (the VARLEN flag of the forward, dK/dV and dQ kernels): a packed batch of num_seqs sequences,
// sequence s being rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1 of q (out, lse, dout, dq) and
// cu_seqlens_k[s] .. cu_seqlens_k[s + 1] - 1 of k and v (dk, dv), offsets that the kernel reads from
// device memory itself. Each offset is clamped to [0, total] (the packed length: the kernel's seqlen_q
// or seqlen_k argument) and a sequence's end to at least its start, so that no table, checked on the
// host or not, makes a CTA touch a row outside the arrays: a hostile one gives garbage, in bounds.
//
// A kernel whose CTAs own query blocks (forward, dQ) finds them in cu_seqlens_q; one whose CTAs own key
// blocks (dK/dV, KEYS) in cu_seqlens_k, the same rule on the other side. The grid holds
// varlen_slots(total, num_seqs) = total / BLOCK + num_seqs CTAs per head (a query head; a key/value head
// for KEYS; launch.py's varlen_blocks), the slots of one head adjacent, the last first (as query_block's).
// Sequence s owns slots first_slot(s) = cu[s] / BLOCK + s .. first_slot(s + 1) - 1: its blocks,
// ceil(len / BLOCK) <= cu[s + 1] / BLOCK - cu[s] / BLOCK + 1, and at most one slot more, whose CTA has
// no work and exits (about half a CTA per sequence, whatever the batch). A CTA finds its sequence by
// binary search over first_slot, increasing for valid offsets; over others the search still ends, on
// some sequence in [0, num_seqs). With seqused_k (a KV cache's contiguous rows, has_seqused) sequence
// s's keys are seqused_k[s] + seqused_add rows from cu_seqlens_k[s] on, clamped into the array likewise; the search
// over key blocks (KEYS, the backward's) takes no seqused_k.
struct Sequence {
    int index;             // which sequence (the ALiBi slopes' batch index)
    int q_start, k_start;  // its first rows in q (out, lse, dout, dq) and in k, v (dk, dv)
    int seqlen_q, seqlen_k;
    int start;             // the CTA's block's first row within the sequence: a query row (a key for KEYS);
                           // -1: no work
    int h, kv_head;        // query head (for KEYS the group's first), and the key/value head it reads (GQA)
};

__device__ __forceinline__ int varlen_slots(int total, int num_seqs, int block) { return total / block + num_seqs; }

// cu[s] clamped to [0, total]
__device__ __forceinline__ int clamped_offset(const int* cu, int s, int total) { return min(max(cu[s], 0), total); }

template <int BLOCK>
__device__ __forceinline__ int first_slot(const int* cu, int s, int total) {
    return clamped_offset(cu, s, total) / BLOCK + s;
}

template <int BLOCK, bool KEYS = false>
__device__ __forceinline__ Sequence sequence_of(const int* cu_q, const int* cu_k, int num_seqs, const int* seqused_k,
                                                int has_seqused, int seqused_add, int total_q, int total_k,
                                                int group,
                                                int cta = blockIdx.x) {
    const int* cu = KEYS ? cu_k : cu_q;
    const int total = KEYS ? total_k : total_q;
    const int slots = varlen_slots(total, num_seqs, BLOCK);
    const int head = cta / slots, slot = slots - 1 - cta % slots;
    const int h = KEYS ? head * group : head, kv_head = KEYS ? head : head / group;
    if (num_seqs <= 0) return {0, 0, 0, 0, 0, -1, h, kv_head};  // no offset to read
    int s = 0, last = num_seqs - 1;  // the sequence lies in s .. last
    while (s < last) {
        const int mid = (s + last + 1) / 2;
        if (first_slot<BLOCK>(cu, mid, total) <= slot) s = mid;
        else last = mid - 1;
    }
    const int q_start = clamped_offset(cu_q, s, total_q), k_start = clamped_offset(cu_k, s, total_k);
    const int seqlen_q = max(q_start, clamped_offset(cu_q, s + 1, total_q)) - q_start;
    // the keys from its offset to the next sequence's, or (seqused_k) as many as it uses, into the array
    // (the sum in 64 bits: a hostile length near 2^31 must not wrap into the array's range)
    const int seqlen_k = !KEYS && has_seqused
                             ? int(min(max(index_t(seqused_k[s]) + seqused_add, index_t(0)), index_t(total_k - k_start)))
                                     : max(k_start, clamped_offset(cu_k, s + 1, total_k)) - k_start;
    const int block = slot - ((KEYS ? k_start : q_start) / BLOCK + s);
    const bool works = block >= 0 && block < num_blocks(KEYS ? seqlen_k : seqlen_q, BLOCK);
    return {s, q_start, k_start, seqlen_q, seqlen_k, works ? block * BLOCK : -1, h, kv_head};
}

// A VARLEN kernel's CTA takes its sequence's problem: its lengths and the causal diagonal bottom-right in
// it (seqlen_k - seqlen_q, SEQUENCE_LENGTHS), and each tensor argument from its sequence's first row
// (AT_SEQUENCE_Q for those with q's rows, AT_SEQUENCE_K for k's), so that the Mask, the Score and the rest
// of the kernel run as on that sequence alone. Made of the kernel's PROBLEM_PARAMS and tensor arguments,
// before MAKE_MASK and MAKE_SCORE; the launcher passes batch strides 0, so that the block's b, the
// sequence, moves nothing but the ALiBi slopes.
#define SEQUENCE_LENGTHS(seq) \
    (seqlen_q = (seq).seqlen_q, seqlen_k = (seq).seqlen_k, diagonal = (seq).seqlen_k - (seq).seqlen_q)
#define AT_SEQUENCE_Q(seq, x) (x += (seq).q_start * x##_ss)
#define AT_SEQUENCE_K(seq, x) (x += (seq).k_start * x##_ss)
// the forward's: q, out, lse and k, v
#define TAKE_SEQUENCE(seq)                                                                    \
    do {                                                                                     \
        SEQUENCE_LENGTHS(seq);                                                               \
        AT_SEQUENCE_Q(seq, q), AT_SEQUENCE_Q(seq, out), AT_SEQUENCE_Q(seq, lse);             \
        AT_SEQUENCE_K(seq, k), AT_SEQUENCE_K(seq, v);                                        \
    } while (0)
// the backward's common arguments: q, dout, lse, k, v, and D (flash_bwd_common.cuh's DRows); each kernel
// moves its outputs itself
#define TAKE_SEQUENCE_BACKWARD(seq, D)                                                        \
    do {                                                                                     \
        SEQUENCE_LENGTHS(seq);                                                               \
        AT_SEQUENCE_Q(seq, q), AT_SEQUENCE_Q(seq, dout), AT_SEQUENCE_Q(seq, lse);            \
        AT_SEQUENCE_K(seq, k), AT_SEQUENCE_K(seq, v);                                        \
        (D).at_row((seq).q_start);                                                           \
    } while (0)

// A backward kernel's block: blk, a QueryBlock (dQ) or a KeyBlock (dK/dV) from the usual grid decode, or
// for VARLEN its sequence's (sequence_of on the side it owns: cu_seqlens_k for dK/dV) with the problem
// and the common arguments moved to that sequence, then the kernel's outputs (the statements in the
// trailing arguments, of `seq`); a CTA past its sequence's blocks returns at once (the whole CTA).
#define BACKWARD_QUERY_BLOCK(blk, D, ...)                                                    \
    QueryBlock blk;                                                                         \
    if constexpr (VARLEN) {                                                                 \
        const Sequence seq = sequence_of<BLOCK_M>(VARLEN_ARGS, seqlen_q, seqlen_k, group);   \
        if (seq.start < 0) return;                                                          \
        TAKE_SEQUENCE_BACKWARD(seq, D);                                                     \
        __VA_ARGS__;                                                                        \
        blk = {seq.start, seq.index, seq.h, seq.kv_head};                                   \
    } else {                                                                                \
        blk = query_block<BLOCK_M>(seqlen_q, heads_q, group);                               \
    }
#define BACKWARD_KEY_BLOCK(blk, D, ...)                                                      \
    KeyBlock blk;                                                                           \
    if constexpr (VARLEN) {                                                                 \
        const Sequence seq = sequence_of<BLOCK_N, true>(VARLEN_ARGS, seqlen_q, seqlen_k, group); \
        if (seq.start < 0) return;                                                          \
        TAKE_SEQUENCE_BACKWARD(seq, D);                                                     \
        __VA_ARGS__;                                                                        \
        blk = {seq.start, seq.index, seq.kv_head};                                          \
    } else {                                                                                \
        blk = key_block<BLOCK_N>(seqlen_k, heads_q / group);                                \
    }

// Split-KV (the forward kernels' SPLIT flag): the keys are cut into splits of key_split keys (a
// multiple of BLOCK_N; the launcher's split_plan), and the grid holds one copy of the usual grid per
// split, split s being CTAs s P .. s P + P - 1 (P = gridDim.x / splits). Each CTA attends to its
// split's keys only and stores a partial out (in Acc) and lse, merged afterwards by the lse rule
// (flashcupy.merge) in one launch of flash_merge.cu.
struct Split {
    int index;  // which split
    int cta;    // the CTA's place in that split's grid, for query_block
};

__device__ __forceinline__ Split split_of(int seqlen_k, int key_split) {
    const int per_split = gridDim.x / num_blocks(seqlen_k, key_split);
    return {int(blockIdx.x / per_split), int(blockIdx.x % per_split)};
}

// A packed batch's split (SPLIT and VARLEN: a KV cache's sequences): one copy of the packed grid
// (varlen_slots per query head, total_q the launch's seqlen_q) per split, the CTA's place in it for
// sequence_of. A split past a sequence's keys leaves its CTAs no key: they store out 0, lse -inf.
template <int BLOCK_M>
__device__ __forceinline__ Split packed_split_of(int total_q, int num_seqs, int heads_q) {
    const int per_split = varlen_slots(total_q, num_seqs, BLOCK_M) * heads_q;
    return {int(blockIdx.x / per_split), int(blockIdx.x % per_split)};
}

// The split of a forward kernel's CTA: none, a packed batch's, or the usual grid's
template <int BLOCK_M, bool SPLIT, bool VARLEN>
__device__ __forceinline__ Split split_of_cta(int seqlen_q, int seqlen_k, int key_split, int num_seqs, int heads_q) {
    if constexpr (!SPLIT) return Split{0, int(blockIdx.x)};
    if constexpr (VARLEN) return packed_split_of<BLOCK_M>(seqlen_q, num_seqs, heads_q);
    return split_of(seqlen_k, key_split);
}

// The keys [start, end) a CTA's key loop visits: the Mask's range for its query block, within split
// [s0, s0 + len) when split. The start is aligned to BLOCK_N from s0, so that no tile reaches into the
// next split (len is a multiple of BLOCK_N); the keys it adds before the band are hidden by the Mask
// (partial() names that tile).
template <int BLOCK_N>
__device__ __forceinline__ void split_range(int& start, int& end, int s0, int len) {
    start = s0 + max(0, start - s0) / BLOCK_N * BLOCK_N;
    end = min(end, s0 + len);
}

// A kernel with one CTA per (row block, key block, batch * heads) of a pair-shaped output
// (flash_pairs.cu): attention_probs' tiles of P (row blocks of the asked rows, heads_q heads), or
// the bias gradient's tiles of its own shape (row_blocks or key_blocks 1 where it is summed over; the
// bias's batch and heads). The key blocks of one row block are adjacent, then its row blocks.
struct PairTile {
    int r0, j0;  // its first row (of its own rows) and key
    int b, h;    // batch and head (of the output's own shape)
};

template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ PairTile pair_tile(int key_blocks, int row_blocks, int heads) {
    const int j0 = int(blockIdx.x % key_blocks) * BLOCK_N;
    const int r0 = int(blockIdx.x / key_blocks % row_blocks) * BLOCK_M;
    const int bh = blockIdx.x / key_blocks / row_blocks;
    return {r0, j0, bh / heads, bh % heads};
}

// A kernel with one CTA per (key block, batch * heads_kv) (the grid's x is their product): key block j of
// every (batch, kv head) before key block j + 1 of any. Causal, the first key blocks are seen by the
// most queries: the longest CTAs go first over the whole grid, not only within a head, and the last
// wave holds the shortest (head by head, the last heads' long CTAs started late: on an H200 the Hopper
// backward kept its SMs busy 78% of the time at S=4096, causal; benchmarks/results/h200_session3/).
// The CTAs running together still walk the same query blocks in step: the L2 keeps serving them.
struct KeyBlock {
    int j0;  // its first key
    int b, kv_head;
};

template <int BLOCK_N>
__device__ __forceinline__ KeyBlock key_block(int seqlen_k, int heads_kv) {
    const int heads = gridDim.x / num_blocks(seqlen_k, BLOCK_N);  // batch * heads_kv
    const int bk = blockIdx.x % heads;
    return {int(blockIdx.x / heads) * BLOCK_N, bk / heads_kv, bk % heads_kv};
}
