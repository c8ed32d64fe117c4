/* The sync window of a rank (MF_WIN_SYNC): 32-bit words, written by this rank and by
 * its peers. Zeroed when the comm's set of layers is complete (peers.cu).
 *
 *   word 0                  epoch: calls so far on this layer (this rank only)
 *   word 1                  blocks of mf_ep_push_rows done (this rank only)
 *   word 2                  comm_failed: this call failed a wait (this rank only)
 *   flags [4][R]            flag f from rank q at 16 + f * R + q: (epoch << 1) | failed
 *   counts [2][R][E]        int32, the counts of rank q for epoch parity b at
 *                           counts_at(b, q): written by rank q
 *   arrivals [blocks]       rows written into each 128-row receive block, by every rank
 *                           (every push, forward and backward), never reset: they only grow
 *   targets [blocks]        this rank's running sum of 128 per block of every push
 *                           (forward and backward): block b of a push is complete when arrivals[b] reaches
 *                           targets[b] (written by this rank only)
 *
 * Epochs: each forward and each backward adds one on every rank (all ranks make the
 * same calls), so epoch n on one rank meets epoch n on the others; flags are never
 * reset, a wait is for (flag >> 1) >= epoch. The counts are double-buffered by the
 * epoch's parity: a rank writes parity n & 1 only after it finished epoch n - 1,
 * whose waits needed every peer in epoch n - 1, past its reads of parity n - 2 & 1. */
#ifndef MOEFUSE_EP_SYNC_H
#define MOEFUSE_EP_SYNC_H

#include <stddef.h>
#include <stdint.h>

enum {
    MF_EP_SYNC_EPOCH = 0,
    MF_EP_SYNC_PUSH_DONE = 1,
    MF_EP_SYNC_COMM_FAILED = 2,
    MF_EP_SYNC_FLAGS = 16,
};

enum {
    MF_EP_FLAG_COUNTS = 0,   /* forward: counts landed */
    MF_EP_FLAG_ROWS = 1,     /* rows landed (forward and backward) */
    MF_EP_FLAG_DONE = 2,     /* combine slot rows (and d p) landed */
    MF_EP_FLAG_READY = 3,    /* backward: the sender started the call */
    MF_EP_NUM_FLAGS = 4,
};

#ifdef __cplusplus
#define MF_HD __host__ __device__ inline
#else
#define MF_HD static inline
#endif

MF_HD size_t mf_ep_flag_word(int flag, int from_rank, int num_ranks) {
    return MF_EP_SYNC_FLAGS + (size_t)flag * num_ranks + from_rank;
}

MF_HD size_t mf_ep_counts_word(int parity, int from_rank, int num_ranks, int num_experts) {
    const size_t base = MF_EP_SYNC_FLAGS + (size_t)MF_EP_NUM_FLAGS * num_ranks;
    return base + ((size_t)parity * num_ranks + from_rank) * num_experts;
}

MF_HD size_t mf_ep_arrivals_word(int num_ranks, int num_experts) {
    return mf_ep_counts_word(2, 0, num_ranks, num_experts);
}

MF_HD size_t mf_ep_targets_word(int num_ranks, int num_experts, int blocks) {
    return mf_ep_arrivals_word(num_ranks, num_experts) + (size_t)blocks;
}

/* blocks: receive capacity / 128 */
MF_HD size_t mf_ep_sync_bytes(int num_ranks, int num_experts, int blocks) {
    return mf_ep_targets_word(num_ranks, num_experts, blocks) * sizeof(uint32_t) +
           (size_t)blocks * sizeof(uint32_t);
}

#undef MF_HD
#endif /* MOEFUSE_EP_SYNC_H */
