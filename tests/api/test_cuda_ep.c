/* Expert parallelism with R virtual ranks in this process on one GPU
 * (moefuse_comm_create_virtual), forward + backward, against ONE layer with R = 1 run
 * on the concatenated batch (rank 0's tokens first, then rank 1's, ...), bit for bit.
 *
 * Rank r holds experts r*E/R .. (r+1)*E/R - 1: its w13 / w2 / dw13 / dw2 are those
 * experts' rows of the global tensors. A rank receives the rows of each of its experts
 * in the concatenated order (source rank, then token), so the EP run is expected to
 * have the bits of the R = 1 run: y, dx and dweights of each rank's tokens, dW13, dW2
 * and expert_counts of each rank's experts. Any difference fails, reported with the
 * first differing element and the largest |difference|.
 *
 *   - R in {2, 4, 8} with T = 512 on every rank; T different on every rank with a T = 0
 *     rank (its token tensors NULL in one case, as the API allows); dropped slots;
 *   - skew: every slot of every rank on the experts of one rank (R = 4 and 8, up to
 *     R * max_tokens * K received rows), also onto the rank with T = 0;
 *   - MOEFUSE_RECOMPUTE (every other case saves activations);
 *   - MOEFUSE_PIPELINE_FUSED on the ranks (forward: gemm1 and gemm2 in one kernel beside
 *     the push; backward: dW2, dgrad1 into the source ranks' combine rows and dW13 in one
 *     kernel) against the staged R = 1 run: R = 4 with uneven T and a T = 0 rank, R = 8
 *     skew.
 *     The R = 1 reference runs staged, so the first fused case also launches the fused
 *     kernel for the first time inside an EP call: before the backend loaded every kernel
 *     at create, CUDA's lazy loading hung it there (docs/decisions/0015-ep-transport).
 *   - MOEFUSE_PRECISION_FP8_BLOCK on the ranks and in the R = 1 reference (each rank's
 *     experts quantized by moefuse_quantize_weights on its layer): the received rows are
 *     the rows one rank gathers, so their codes, and every output, have the R = 1 bits;
 *     R = 2, 4 (uneven, a T = 0 rank; recompute; dropped slots) and 8 (skew). And two
 *     steps on one set of layers with different batches, the last rank launched 50 ms
 *     late (the received rows must all be in before they are quantized).
 *   - W13 and dW13 in two halves (moefuse.h, "W13 in two halves": w13_up, dw13_up,
 *     dw13_up_bf16), as the PyTorch EP path passes TorchTitan's w1 and w3: the same batch
 *     on R ranks with W13 packed, then on new layers with the gate and up halves in arrays
 *     of their own (FP8: quantized from them by moefuse_quantize_weights_halves, and no
 *     bf16 weights passed, as the binding does), bit for bit: y, dx, dweights, dW2,
 *     expert_counts, and each local expert's dW13 gate half = the packed dW13's rows
 *     [0, I), its up half = rows [I, 2I). R = 2 and 4 (uneven, a T = 0 rank, dropped
 *     slots), BF16 (staged, recompute, fused) and FP8, fp32 dW and bf16 dW (dw13_bf16 /
 *     dw13_up_bf16, as for bf16 parameters). The packed run must write every output.
 *
 * The failure cases (timeouts, a rejected saved buffer, the comm's refusals) are in
 * test_cuda_ep_failures.c, the 1000 iterations in test_cuda_ep_iterations.c; the
 * fixture all three share in cuda_ep.{h,c}, cuda_ep_ranks.c.
 *
 * The R = 1 CUDA layer is checked against the fp64 reference by test_cuda_forward and
 * test_cuda_backward; this file checks that expert parallelism changes no bit. All
 * outputs of both runs are poisoned first (0xff bytes, NaN), the R = 1 run must write
 * every one of them (no NaN left), and rows past a rank's T must keep the poison.
 *
 * Every EP run is waited for with a host bound (kWaitSeconds), and every case runs
 * under a watchdog (kCaseSeconds): a hang ends the process with a FAIL line instead of
 * hanging a GPU CI job (kernels that spin cannot be stopped from the host).
 *
 * test_cuda_ep [case-substring]. With no sm_90 device every case prints SKIP. */
#include <cuda_runtime.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_ep.h"
#include "fixture_cuda.h"
#include "harness.h"
#include "moefuse.h"
#ifdef MOEFUSE_HAVE_NCCL
#include <nccl.h>
#endif

/* ---- cases ------------------------------------------------------------------------------ */

typedef struct ep_case {
    int R;
    int T[kMaxRanks];           /* tokens of each rank */
    routing route;
    int skew, skew_rank;        /* skew: every slot on skew_rank's experts */
    moefuse_saved_mode mode;
    int null_if_empty;          /* ranks with T = 0 pass NULL token tensors */
    moefuse_pipeline pipeline;
    moefuse_precision precision;
} ep_case;

static void equality_case(const ep_case *c) {
    if (!ready()) return;
    batch b;
    ep s;
    memset(&s, 0, sizeof s);
    if (batch_make(&b, c->R, c->T, c->route, c->skew ? c->skew_rank : -1) &&
        ep_open(&s, c->R, kMaxTokens, c->mode)) {
        s.null_if_empty = c->null_if_empty;
        s.pipeline = c->pipeline;
        s.precision = c->precision;
        if (ep_layers_create(&s)) check_equal(&s, &b);
    }
    ep_close(&s);
    batch_free(&b);
}

#define M kMaxTokens
static void case_r1(void) { equality_case(&(ep_case){.R = 1, .T = {M}}); }
static void case_r2(void) { equality_case(&(ep_case){.R = 2, .T = {M, M}}); }

/* One rank over a real NCCL communicator: its windows registered with NCCL, the peer
 * table from ncclGetPeerPointer; and moefuse_comm_create_nccl refusing NVLS. (More
 * ranks need more GPUs.) */
static void case_nccl_r1(void) {
#ifdef MOEFUSE_HAVE_NCCL
    if (!ready()) return;
    ncclUniqueId id;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r == ncclSuccess) r = ncclCommInitRank(&comm, 1, id, 0);
    CHECK(r == ncclSuccess, "one-rank NCCL communicator: %s", ncclGetErrorString(r));
    if (r != ncclSuccess) return;
    unsetenv("NCCL_NVLS_ENABLE");
    moefuse_comm *mc = (moefuse_comm *)0x1;
    const moefuse_status st = moefuse_comm_create_nccl(comm, &mc);
    CHECK(st == MOEFUSE_ERR_UNSUPPORTED && strstr(moefuse_last_error(), "NCCL_NVLS_ENABLE"),
          "without NCCL_NVLS_ENABLE=0: %s: %s", moefuse_status_string(st), moefuse_last_error());
    CHECK(mc == NULL, "no comm on failure");
    printf("    refused: %s\n", moefuse_last_error());
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    ncclCommDestroy(comm);
    G.use_nccl = 1;
    equality_case(&(ep_case){.R = 1, .T = {M}});
    G.use_nccl = 0;
#else
    th_skip("built without NCCL (no nccl_device.h and libnccl.so.2 under NCCL_HOME)");
#endif
}
static void case_r4(void) { equality_case(&(ep_case){.R = 4, .T = {M, M, M, M}}); }
static void case_r8(void) { equality_case(&(ep_case){.R = 8, .T = {M, M, M, M, M, M, M, M}}); }
static void case_r2_uneven(void) { equality_case(&(ep_case){.R = 2, .T = {1, 333}}); }
static void case_r4_uneven(void) { equality_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}}); }
static void case_r8_uneven_null(void) {
    equality_case(&(ep_case){.R = 8, .T = {5, M, 0, 128, 1, 77, 256, 400}, .null_if_empty = 1});
}
static void case_r4_dropped(void) {
    equality_case(&(ep_case){.R = 4, .T = {300, M, 64, 0}, .route = ROUTE_DROPPED});
}
static void case_skew_r4(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, M, M, M}, .skew = 1, .skew_rank = 3});
}
static void case_skew_r4_onto_empty(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, 0, 100, M}, .skew = 1, .skew_rank = 1});
}
static void case_skew_r8(void) {
    equality_case(&(ep_case){.R = 8, .T = {M, M, M, M, M, M, M, M}, .skew = 1, .skew_rank = 0});
}
static void case_fused_r4(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}, .pipeline = MOEFUSE_PIPELINE_FUSED});
}
static void case_fused_skew_r8(void) {
    equality_case(&(ep_case){.R = 8, .T = {M, M, M, M, M, M, M, M}, .skew = 1, .skew_rank = 0,
                             .pipeline = MOEFUSE_PIPELINE_FUSED});
}
static void case_recompute_r4(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}, .mode = MOEFUSE_RECOMPUTE});
}

static const moefuse_precision FP8 = MOEFUSE_PRECISION_FP8_BLOCK;
static void case_fp8_r2(void) { equality_case(&(ep_case){.R = 2, .T = {M, M}, .precision = FP8}); }
static void case_fp8_r4_uneven(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}, .precision = FP8});
}
static void case_fp8_recompute_r4(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}, .mode = MOEFUSE_RECOMPUTE,
                             .precision = FP8});
}
static void case_fp8_r4_dropped(void) {
    equality_case(&(ep_case){.R = 4, .T = {300, M, 64, 0}, .route = ROUTE_DROPPED,
                             .precision = FP8});
}
/* Two steps on the same layers, different batches (the windows hold the first batch's
 * rows when the second arrives), the last rank launched 50 ms after the others: a
 * quantizer that read received rows before they were all in would read stale or
 * missing ones. */
static void case_fp8_two_steps_late_rank(void) {
    if (!ready()) return;
    static const int T1[kMaxRanks] = {M, 0, 37, 300}, T2[kMaxRanks] = {200, M, M, 5};
    batch b1, b2;
    ep s;
    memset(&s, 0, sizeof s);
    memset(&b2, 0, sizeof b2);
    if (batch_make(&b1, 4, T1, ROUTE_RANDOM, -1) && batch_make(&b2, 4, T2, ROUTE_DROPPED, -1) &&
        ep_open(&s, 4, M, MOEFUSE_SAVE_ACTIVATIONS)) {
        s.precision = FP8;
        s.delay_last_ms = 50;
        if (ep_layers_create(&s)) {
            check_equal(&s, &b1);
            check_equal(&s, &b2);
        }
    }
    ep_close(&s);
    batch_free(&b1);
    batch_free(&b2);
}
static void case_fp8_skew_r8(void) {
    equality_case(&(ep_case){.R = 8, .T = {M, M, M, M, M, M, M, M}, .skew = 1, .skew_rank = 0,
                             .precision = FP8});
}

/* The batch of c on R ranks twice, each time on a comm and layers of its own: W13 packed
 * (into G.ref; it must write every output), then W13 and dW13 in two halves (into G.got,
 * the halves packed back by ep_gather), with the weight gradients in bf16 when dw_bf16.
 * The packed run (fp32 dW) at these configurations is checked against R = 1 by the cases
 * above. */
static void halves_case(const ep_case *c, int dw_bf16) {
    if (!ready()) return;
    batch b;
    ep s;
    memset(&s, 0, sizeof s);
    int ok = batch_make(&b, c->R, c->T, c->route, -1);
    for (int halves = 0; halves < 2 && ok; halves++) {
        ok = ep_open(&s, c->R, kMaxTokens, c->mode);
        s.pipeline = c->pipeline;
        s.precision = c->precision;
        s.w13_halves = halves;
        s.dw_bf16 = dw_bf16;
        ok = ok && ep_layers_create(&s) && ep_step(&s, &b, halves ? &G.got : &G.ref);
        ep_close(&s);
    }
    if (ok) {
        check_reference(&b, &G.ref, "the packed run");
        const int bad = compare_results(&b, &G.ref, "W13 packed", &G.got);
        char ts[96];
        printf("    R=%d T=%s, %s%s%s, %s dW: %s\n", c->R, fmt_ints(ts, sizeof ts, b.T, c->R),
               c->mode == MOEFUSE_RECOMPUTE ? "recompute" : "saved activations",
               c->pipeline == MOEFUSE_PIPELINE_FUSED ? ", fused" : "",
               c->precision == FP8 ? ", fp8" : "", dw_bf16 ? "bf16" : "fp32",
               bad ? "W13 in halves DIFFERS from packed"
                   : "W13 in halves: every output bitwise equal to packed");
    }
    batch_free(&b);
}

static void case_halves_r2(void) { halves_case(&(ep_case){.R = 2, .T = {M, M}}, 0); }
static void case_halves_r4_bf16_dw(void) {
    halves_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}}, 1);
}
static void case_halves_recompute_r4(void) {
    halves_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}, .mode = MOEFUSE_RECOMPUTE}, 1);
}
static void case_halves_fused_r4(void) {
    halves_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}, .pipeline = MOEFUSE_PIPELINE_FUSED}, 1);
}
static void case_halves_fp8_r2(void) {
    halves_case(&(ep_case){.R = 2, .T = {M, M}, .precision = FP8}, 0);
}
static void case_halves_fp8_r4_dropped_bf16_dw(void) {
    halves_case(&(ep_case){.R = 4, .T = {300, M, 64, 0}, .route = ROUTE_DROPPED,
                           .precision = FP8}, 1);
}
static void case_halves_fp8_recompute_r4(void) {
    halves_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}, .mode = MOEFUSE_RECOMPUTE,
                           .precision = FP8}, 1);
}
#undef M
/* test_cuda_ep [case-substring] */
int main(int argc, char **argv) {
    static const named_case cases[] = {
        {case_r1, "R=1 comm: the expert-parallel kernels with one rank"},
        {case_nccl_r1, "R=1 NCCL comm: windows registered with a one-rank communicator"},
        {case_r2, "R=2 T=512 each"},
        {case_r4, "R=4 T=512 each"},
        {case_r8, "R=8 T=512 each"},
        {case_r2_uneven, "R=2 T={1,333}"},
        {case_r4_uneven, "R=4 T={512,0,37,300}"},
        {case_r8_uneven_null, "R=8 T={5,512,0,128,1,77,256,400}, NULL tensors at T=0"},
        {case_r4_dropped, "R=4 T={300,512,64,0} dropped slots and tokens"},
        {case_skew_r4, "R=4 skew: every slot on rank 3's experts"},
        {case_skew_r4_onto_empty, "R=4 skew: T={512,0,100,512}, every slot on rank 1 (T=0)"},
        {case_skew_r8, "R=8 skew: every slot on rank 0's experts"},
        {case_recompute_r4, "R=4 T={512,0,37,300} recompute"},
        {case_fused_r4, "R=4 T={512,0,37,300} fused forward and backward"},
        {case_fused_skew_r8, "R=8 skew onto rank 0, fused forward and backward"},
        {case_fp8_r2, "fp8 R=2 T=512 each"},
        {case_fp8_r4_uneven, "fp8 R=4 T={512,0,37,300}"},
        {case_fp8_recompute_r4, "fp8 R=4 T={512,0,37,300} recompute"},
        {case_fp8_r4_dropped, "fp8 R=4 T={300,512,64,0} dropped slots and tokens"},
        {case_fp8_skew_r8, "fp8 R=8 skew: every slot on rank 0's experts"},
        {case_fp8_two_steps_late_rank, "fp8 R=4 two steps, two batches, the last rank 50 ms late"},
        {case_halves_r2, "W13 halves = packed: R=2 T=512 each, fp32 dW"},
        {case_halves_r4_bf16_dw, "W13 halves = packed: R=4 T={512,0,37,300}, bf16 dW"},
        {case_halves_recompute_r4, "W13 halves = packed: R=4 T={512,0,37,300} recompute, bf16 dW"},
        {case_halves_fused_r4, "W13 halves = packed: R=4 T={512,0,37,300} fused, bf16 dW"},
        {case_halves_fp8_r2, "W13 halves = packed: fp8 R=2 T=512 each, fp32 dW"},
        {case_halves_fp8_r4_dropped_bf16_dw,
         "W13 halves = packed: fp8 R=4 T={300,512,64,0} dropped slots, bf16 dW"},
        {case_halves_fp8_recompute_r4,
         "W13 halves = packed: fp8 R=4 T={512,0,37,300} recompute, bf16 dW"},
    };
    return ep_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]));
}
