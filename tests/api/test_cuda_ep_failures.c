/* Expert parallelism with R virtual ranks (the fixture of test_cuda_ep.c, in
 * cuda_ep.{h,c}): how a failure of one rank reaches the others.
 *
 *   - timeout: rank 3 of 4 never calls; moefuse_layer_check of the others reports
 *     MOEFUSE_ERR_TIMEOUT naming the rank, within a host bound, and y is untouched;
 *     layers made again on the same comm, then on a new comm, give the R = 1 bits;
 *   - the backward's failures after a good forward: one rank's saved buffer rejected
 *     (the others fail at once, naming it), one rank that never calls its backward
 *     (the others time out); no dx written; new layers give the R = 1 bits;
 *   - the same timeouts with FP8 layers;
 *   - the comm's refusals: a call before every rank's layer exists, a call on a layer
 *     larger than the other ranks' layers so far, a layer of another num_experts,
 *     a rank, moefuse_comm_destroy with live layers; the comm works afterwards.
 *
 * Every EP run is waited for with a host bound, and every case runs under a watchdog:
 * a hang ends the process with a FAIL line.
 *
 * test_cuda_ep_failures [case-substring]. With no sm_90 device every case prints SKIP. */
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


/* Rank 3 of 4 never calls: the other ranks' waits run out after kTimeoutMs, their
 * calls write nothing and moefuse_layer_check reports MOEFUSE_ERR_TIMEOUT naming the
 * rank. Then layers made again on the same comm, and a new comm, match R = 1. */
/* Elements of a device bf16 buffer that no longer hold the poison (0xffff), through the
 * host buffer `host` of `bytes`; -1 when the copy fails (recorded). */
static int64_t unpoisoned(const uint16_t *dev, uint16_t *host, size_t bytes) {
    const cudaError_t e = cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost);
    CHECK(e == cudaSuccess, "cudaMemcpy: %s", cudaGetErrorString(e));
    if (e != cudaSuccess) return -1;
    int64_t n = 0;
    for (size_t i = 0; i < bytes / 2; i++) n += host[i] != 0xffff;
    return n;
}

/* The failure cases' start: R = 4 ranks of 256 tokens, the comm's bound kTimeoutMs (set
 * before the layers: right whether they read it when made or at each call), buffers
 * sized, outputs poisoned, inputs uploaded. 0 on failure (recorded). */
static int failure_case_open(batch *b, ep *s, moefuse_precision precision) {
    const int T[4] = {256, 256, 256, 256};
    memset(s, 0, sizeof *s);
    if (!batch_make(b, 4, T, ROUTE_RANDOM, -1) ||
        !ep_open(s, 4, kMaxTokens, MOEFUSE_SAVE_ACTIVATIONS))
        return 0;
    s->precision = precision;
    MF_OK(moefuse_comm_set_timeout_ms(s->comm, kTimeoutMs));
    if (!ep_layers_create(s)) return 0;
    for (int r = 0; r < s->R; r++)
        if (!ep_prepare(s, b, r)) return 0;
    return ep_poison(s) && ep_upload(s, b, 0);
done:
    return 0;
}

static void forward_timeout(moefuse_precision precision) {
    if (!ready()) return;
    const int R = 4;
    batch b;
    ep s;
    uint16_t *y = NULL;
    if (!failure_case_open(&b, &s, precision)) goto done;
    for (int r = 0; r < R - 1; r++) {
        const moefuse_fwd_args a = ep_fwd_args(&s, &b, r);
        if (!rank_ok(moefuse_forward(s.rk[r].layer, &a, s.rk[r].stream), r, "moefuse_forward"))
            goto done;
    }
    const double t0 = now_s();
    if (!ep_wait(&s, R - 1, kTimeoutBoundSeconds)) goto done;
    printf("    ranks 0..%d finished %.0f ms after their launch (comm timeout %d ms)\n", R - 2,
           1e3 * (now_s() - t0), kTimeoutMs);
    const size_t yb = (size_t)(kMaxTokens * kH) * 2;
    y = malloc(yb);
    for (int r = 0; r < R - 1; r++) {
        const moefuse_status st = moefuse_layer_check(s.rk[r].layer, s.rk[r].stream);
        const char *msg = moefuse_last_error();
        CHECK(st == MOEFUSE_ERR_TIMEOUT, "rank %d: moefuse_layer_check: %s (%s), expected "
              "MOEFUSE_ERR_TIMEOUT", r, moefuse_status_string(st), msg);
        CHECK(strstr(msg, "rank") && (strcasestr(msg, "timeout") || strcasestr(msg, "timed out")),
              "rank %d: the message should name the rank and the timeout: \"%s\"", r, msg);
        printf("    rank %d: %s: %s\n", r, moefuse_status_string(st), msg);
        const int64_t touched = unpoisoned(s.rk[r].y, y, yb);
        CHECK(touched == 0, "rank %d: the timed-out forward wrote %lld elements of y", r,
              (long long)touched);
    }
    const moefuse_status st3 = moefuse_layer_check(s.rk[R - 1].layer, s.rk[R - 1].stream);
    printf("    rank %d (never called): moefuse_layer_check: %s %s\n", R - 1,
           moefuse_status_string(st3), moefuse_last_error());

    /* "layers created again on the comm start from clean flags"; the default bound */
    ep_layers_destroy(&s);
    MF_OK(moefuse_comm_set_timeout_ms(s.comm, 30000));
    if (!ep_layers_create(&s)) goto done;
    printf("    layers made again on the same comm:\n");
    check_equal(&s, &b);

    ep_close(&s);
    if (!ep_open(&s, R, kMaxTokens, MOEFUSE_SAVE_ACTIVATIONS)) goto done;
    s.precision = precision;
    if (!ep_layers_create(&s)) goto done;
    printf("    a new comm and layers:\n");
    check_equal(&s, &b);
done:
    free(y);
    ep_close(&s);
    batch_free(&b);
}

/* The backward's failures, R = 4 after a good forward on every rank:
 *   rejected  rank 2's saved header is overwritten: rank 2 reports MOEFUSE_ERR_SAVED_STATE
 *             and the others MOEFUSE_ERR_TIMEOUT naming rank 2, at once (rank 2 raises
 *             its READY flag as failed, so nobody waits out the bound or pushes rows);
 *   missing   rank 3 never calls its backward: ranks 0..2 report MOEFUSE_ERR_TIMEOUT
 *             naming rank 3 within the host bound.
 * Neither writes any dx or d p; layers made again on the comm then give the R = 1 bits. */
static void backward_failure(int rejected, moefuse_precision precision) {
    if (!ready()) return;
    const int R = 4, odd = rejected ? 2 : 3;
    batch b;
    ep s;
    uint16_t *dx = NULL;
    if (!failure_case_open(&b, &s, precision)) goto done;
    for (int r = 0; r < R; r++) {
        const moefuse_fwd_args a = ep_fwd_args(&s, &b, r);
        if (!rank_ok(moefuse_forward(s.rk[r].layer, &a, s.rk[r].stream), r, "moefuse_forward"))
            goto done;
    }
    if (!ep_wait(&s, R, kWaitSeconds) || !ep_check(&s)) goto done;
    if (rejected) CUDA_OK(cudaMemset(s.rk[odd].saved, 0x5a, 64));
    const double t0 = now_s();
    for (int r = 0; r < R; r++) {
        if (!rejected && r == odd) continue;
        const moefuse_bwd_args g = ep_bwd_args(&s, &b, r);
        if (!rank_ok(moefuse_backward(s.rk[r].layer, &g, s.rk[r].stream), r, "moefuse_backward"))
            goto done;
    }
    if (!ep_wait(&s, R, kTimeoutBoundSeconds)) goto done;
    printf("    the backwards finished %.0f ms after their launch (comm timeout %d ms)\n",
           1e3 * (now_s() - t0), kTimeoutMs);
    const size_t dxb = (size_t)(kMaxTokens * kH) * 2;
    dx = malloc(dxb);
    for (int r = 0; r < R; r++) {
        if (!rejected && r == odd) continue;
        const moefuse_status st = moefuse_layer_check(s.rk[r].layer, s.rk[r].stream);
        const char *msg = moefuse_last_error();
        char peer[32];
        snprintf(peer, sizeof peer, "rank %d", odd);
        if (r == odd)
            CHECK(st == MOEFUSE_ERR_SAVED_STATE, "rank %d: moefuse_layer_check: %s (%s), expected "
                  "MOEFUSE_ERR_SAVED_STATE", r, moefuse_status_string(st), msg);
        else
            CHECK(st == MOEFUSE_ERR_TIMEOUT && strstr(msg, peer),
                  "rank %d: moefuse_layer_check: %s (%s), expected MOEFUSE_ERR_TIMEOUT naming %s",
                  r, moefuse_status_string(st), msg, peer);
        printf("    rank %d: %s: %s\n", r, moefuse_status_string(st), msg);
        const int64_t touched = unpoisoned(s.rk[r].dx, dx, dxb);
        CHECK(touched == 0, "rank %d: the failed backward wrote %lld elements of dx", r,
              (long long)touched);
    }
    if (rejected)
        CHECK(now_s() - t0 < 0.5 * kTimeoutMs / 1e3, "the rejected saved buffer should fail the "
              "other ranks at once, not after the %d ms bound", kTimeoutMs);

    ep_layers_destroy(&s);
    MF_OK(moefuse_comm_set_timeout_ms(s.comm, 30000));
    if (!ep_layers_create(&s)) goto done;
    printf("    layers made again on the same comm:\n");
    check_equal(&s, &b);
done:
    free(dx);
    ep_close(&s);
    batch_free(&b);
}

static const moefuse_precision BF16 = MOEFUSE_PRECISION_BF16, FP8 = MOEFUSE_PRECISION_FP8_BLOCK;
static void case_timeout(void) { forward_timeout(BF16); }
static void case_bwd_rejected_saved(void) { backward_failure(1, BF16); }
static void case_bwd_missing_rank(void) { backward_failure(0, BF16); }
/* FP8 with a comm: the same failures through its paths (x's codes pushed, the
 * backward's wait for every received row before its quantizers) */
static void case_fp8_timeout(void) { forward_timeout(FP8); }
static void case_fp8_bwd_missing_rank(void) { backward_failure(0, FP8); }
/* What the comm refuses: a call before every rank's layer exists, a call on rank 0's
 * second, larger layer before rank 1 has one as large (its windows are too small), a
 * layer with another num_experts (the layers share the flags' window), destroying the
 * comm with live layers. None of it breaks the comm. */
static void case_refusals(void) {
    if (!ready()) return;
    const int R = 2, T[2] = {64, 64};
    batch b;
    ep s;
    memset(&s, 0, sizeof s);
    moefuse_layer *second = NULL;
    if (!batch_make(&b, R, T, ROUTE_RANDOM, -1) || !ep_open(&s, R, 64, MOEFUSE_SAVE_ACTIVATIONS))
        goto done;
    MF_OK(ep_layer_create(&s, 0));
    if (!ep_prepare(&s, &b, 0) || !ep_upload(&s, &b, 0)) goto done;

    const moefuse_fwd_args a = ep_fwd_args(&s, &b, 0);
    moefuse_status st = moefuse_forward(s.rk[0].layer, &a, s.rk[0].stream);
    CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && strstr(moefuse_last_error(), "rank 1"),
          "forward before rank 1's layer exists: %s (%s), expected MOEFUSE_ERR_INVALID_CONFIG "
          "naming rank 1", moefuse_status_string(st), moefuse_last_error());
    printf("    forward before rank 1's layer: %s: %s\n", moefuse_status_string(st),
           moefuse_last_error());
    const moefuse_bwd_args g = ep_bwd_args(&s, &b, 0);
    st = moefuse_backward(s.rk[0].layer, &g, s.rk[0].stream);
    CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && strstr(moefuse_last_error(), "rank 1"),
          "backward before rank 1's layer exists: %s (%s), expected MOEFUSE_ERR_INVALID_CONFIG "
          "naming rank 1", moefuse_status_string(st), moefuse_last_error());

    MF_OK(ep_layer_create(&s, 1));
    moefuse_config big = ep_config(&s, 0);
    big.max_tokens = 2 * s.max_tokens;  // grows rank 0's pool, not rank 1's
    MF_OK(moefuse_layer_create(&big, s.comm, &second));
    st = moefuse_forward(second, &a, s.rk[0].stream);
    CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && strstr(moefuse_last_error(), "rank 1"),
          "forward on rank 0's larger layer before rank 1 has one: %s (%s), expected "
          "MOEFUSE_ERR_INVALID_CONFIG naming rank 1", moefuse_status_string(st),
          moefuse_last_error());
    printf("    forward on a larger layer of rank 0 alone: %s: %s\n", moefuse_status_string(st),
           moefuse_last_error());
    MF_OK(moefuse_layer_destroy(second));
    second = NULL;
    moefuse_config other = ep_config(&s, 1);
    other.num_experts = kE / 2;
    st = moefuse_layer_create(&other, s.comm, &second);
    CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && second == NULL &&
              strstr(moefuse_last_error(), "num_experts"),
          "a layer of another num_experts: %s (%s), expected MOEFUSE_ERR_INVALID_CONFIG naming "
          "num_experts and no layer", moefuse_status_string(st), moefuse_last_error());
    printf("    a layer of another num_experts: %s: %s\n", moefuse_status_string(st),
           moefuse_last_error());

    st = moefuse_comm_destroy(s.comm);
    CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && strstr(moefuse_last_error(), "rank"),
          "moefuse_comm_destroy with live layers: %s (%s), expected MOEFUSE_ERR_INVALID_CONFIG "
          "naming a rank", moefuse_status_string(st), moefuse_last_error());
    printf("    moefuse_comm_destroy with live layers: %s: %s\n", moefuse_status_string(st),
           moefuse_last_error());
    if (st == MOEFUSE_OK) { /* freed under the layers: leak them rather than touch it */
        s.comm = NULL;
        for (int r = 0; r < R; r++) s.rk[r].layer = NULL;
        goto done;
    }
    printf("    after the refusals:\n");
    check_equal(&s, &b);
done:
    if (second) moefuse_layer_destroy(second);
    ep_close(&s);
    batch_free(&b);
}
/* test_cuda_ep_failures [case-substring] */
int main(int argc, char **argv) {
    static const named_case cases[] = {
        {case_timeout, "timeout: rank 3 of 4 never calls"},
        {case_bwd_rejected_saved, "backward: rank 2 of 4 passes a rejected saved buffer"},
        {case_bwd_missing_rank, "backward timeout: rank 3 of 4 never calls its backward"},
        {case_fp8_timeout, "fp8 timeout: rank 3 of 4 never calls"},
        {case_fp8_bwd_missing_rank, "fp8 backward timeout: rank 3 of 4 never calls its backward"},
        {case_refusals, "refusals: call before every layer, a larger layer alone, another E, "
                        "comm destroy"},
    };
    return ep_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]));
}
