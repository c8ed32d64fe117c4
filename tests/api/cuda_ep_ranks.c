/* The R ranks of the expert-parallel tests: a comm, a layer, a stream and buffers per
 * rank; their launch, wait, gather and the check against R = 1 (see cuda_ep.h). */
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
#include "internal.h"
#include "moefuse.h"
#ifdef MOEFUSE_HAVE_NCCL
#include <nccl.h>
#endif

/* A moefuse call of rank r: a failure is recorded with the rank and the message. */
int rank_ok(moefuse_status st, int r, const char *what) {
    CHECK(st == MOEFUSE_OK, "rank %d: %s: %s: %s", r, what, moefuse_status_string(st),
          moefuse_last_error());
    return st == MOEFUSE_OK;
}

/* The comm, streams and buffers; no layers yet. 0 on failure (recorded); ep_close
 * cleans up either way. */
/* A one-rank NCCL communicator (this process, this GPU) and moefuse's comm over it. */
int open_nccl_comm(ep *s) {
#ifdef MOEFUSE_HAVE_NCCL
    ncclUniqueId id;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r == ncclSuccess) r = ncclCommInitRank(&comm, 1, id, 0);
    CHECK(r == ncclSuccess, "one-rank NCCL communicator: %s", ncclGetErrorString(r));
    if (r != ncclSuccess) return 0;
    s->nccl = comm;
    MF_OK(moefuse_comm_create_nccl(comm, &s->comm));
    return 1;
done:
    return 0;
#else
    (void)s;
    return 0;
#endif
}

int ep_open(ep *s, int R, int max_tokens, moefuse_saved_mode mode) {
    memset(s, 0, sizeof *s);
    s->R = R;
    s->max_tokens = max_tokens;
    s->mode = mode;
    s->capacity = R;
    const int64_t Er = kE / R, cap = max_tokens;
    if (R == 1 && G.use_nccl) {
        if (!open_nccl_comm(s)) goto done;
    } else {
        MF_OK(moefuse_comm_create_virtual(R, &s->comm));
    }
    for (int r = 0; r < R; r++) {
        rank_state *k = &s->rk[r];
        CUDA_OK(cudaStreamCreateWithFlags(&k->stream, cudaStreamNonBlocking));
        CUDA_OK(cudaMalloc((void **)&k->x, (size_t)(cap * kH) * 2));
        CUDA_OK(cudaMalloc((void **)&k->dy, (size_t)(cap * kH) * 2));
        CUDA_OK(cudaMalloc((void **)&k->y, (size_t)(cap * kH) * 2));
        CUDA_OK(cudaMalloc((void **)&k->dx, (size_t)(cap * kH) * 2));
        CUDA_OK(cudaMalloc((void **)&k->ids, (size_t)(cap * kK) * 4));
        CUDA_OK(cudaMalloc((void **)&k->p, (size_t)(cap * kK) * 4));
        CUDA_OK(cudaMalloc((void **)&k->dp, (size_t)(cap * kK) * 4));
        CUDA_OK(cudaMalloc((void **)&k->counts, (size_t)Er * 4));
        CUDA_OK(cudaMalloc((void **)&k->dw13, (size_t)(Er * kW13Expert) * 4));
        CUDA_OK(cudaMalloc((void **)&k->dw2, (size_t)(Er * kW2Expert) * 4));
    }
    return 1;
done:
    return 0;
}

moefuse_config ep_config(const ep *s, int r) {
    moefuse_config c;
    moefuse_config_init(&c, kH, kI, kE, kK, s->max_tokens);
    c.num_ranks = s->R;
    c.rank = r;
    c.backend = MOEFUSE_BACKEND_CUDA;
    c.saved_mode = s->mode;
    c.pipeline = s->pipeline;
    c.recv_capacity_factor = s->capacity;
    c.precision = s->precision;
    return c;
}

moefuse_status ep_layer_create(ep *s, int r) {
    const moefuse_config c = ep_config(s, r);
    return moefuse_layer_create(&c, s->comm, &s->rk[r].layer);
}

/* The layers, with FP8 each rank's experts' quantized weights, and with W13 in halves
 * each rank's buffer of dW13's up half. */
int ep_layers_create(ep *s) {
    const int64_t Er = kE / s->R;
    if (s->w13_halves && !fixture_halves()) return 0;
    for (int r = 0; r < s->R; r++) {
        rank_state *k = &s->rk[r];
        if (!rank_ok(ep_layer_create(s, r), r, "moefuse_layer_create")) return 0;
        if (s->w13_halves && !k->dw13_up)
            CUDA_OK(cudaMalloc((void **)&k->dw13_up, (size_t)(Er * kI * kH) * 4));
        if (s->precision == MOEFUSE_PRECISION_FP8_BLOCK && !k->fp8_buf &&
            !fp8_weights_make(k->layer, r * Er, s->w13_halves, k->stream, &k->fp8_buf, &k->fp8))
            return 0;
    }
    return 1;
done:
    return 0;
}

void ep_layers_destroy(ep *s) {
    for (int r = 0; r < s->R; r++) {
        rank_ok(moefuse_layer_destroy(s->rk[r].layer), r, "moefuse_layer_destroy");
        s->rk[r].layer = NULL;
    }
}

/* Waits for the streams of ranks 0..n-1, at most `seconds` (a hang ends the process).
 * 0 on a CUDA error (recorded). */
int ep_wait(const ep *s, int n, double seconds) {
    const double t0 = now_s();
    const struct timespec nap = {0, 100000};
    for (;;) {
        int pending = 0;
        for (int r = 0; r < n; r++) {
            if (!s->rk[r].stream) continue;
            const cudaError_t e = cudaStreamQuery(s->rk[r].stream);
            if (e == cudaErrorNotReady) {
                pending++;
            } else if (e != cudaSuccess) {
                CHECK(0, "rank %d's stream: %s", r, cudaGetErrorString(e));
                return 0;
            }
        }
        if (!pending) return 1;
        if (now_s() - t0 > seconds) {
            char what[64];
            snprintf(what, sizeof what, "%d of ranks 0..%d", pending, n - 1);
            hang_exit(what, seconds);
        }
        nanosleep(&nap, NULL);
    }
}

void ep_close(ep *s) {
    ep_wait(s, s->R, kWaitSeconds);
    ep_layers_destroy(s);
    if (s->comm) {
        const moefuse_status st = moefuse_comm_destroy(s->comm);
        CHECK(st == MOEFUSE_OK, "moefuse_comm_destroy: %s: %s", moefuse_status_string(st),
              moefuse_last_error());
    }
#ifdef MOEFUSE_HAVE_NCCL
    if (s->nccl) ncclCommDestroy((ncclComm_t)s->nccl);
#endif
    for (int r = 0; r < s->R; r++) {
        rank_state *k = &s->rk[r];
        cudaFree(k->x);
        cudaFree(k->dy);
        cudaFree(k->y);
        cudaFree(k->dx);
        cudaFree(k->ids);
        cudaFree(k->p);
        cudaFree(k->dp);
        cudaFree(k->counts);
        cudaFree(k->dw13);
        cudaFree(k->dw2);
        cudaFree(k->dw13_up);
        cudaFree(k->saved);
        cudaFree(k->fp8_buf);
        if (k->stream) cudaStreamDestroy(k->stream);
    }
    memset(s, 0, sizeof *s);
}

/* Rank r's saved buffer big enough for b. cudaFree / cudaMalloc may synchronize the
 * device, so this runs for every rank before any rank launches. */
int ep_prepare(ep *s, const batch *b, int r) {
    rank_state *k = &s->rk[r];
    size_t bytes = 0;
    if (!rank_ok(moefuse_saved_bytes(k->layer, b->T[r], &bytes), r, "moefuse_saved_bytes"))
        return 0;
    if (bytes <= k->saved_cap) return 1;
    cudaFree(k->saved);
    k->saved = NULL;
    k->saved_cap = 0;
    CUDA_OK(cudaMalloc(&k->saved, bytes));
    k->saved_cap = bytes;
    return 1;
done:
    return 0;
}

/* Inputs of b to every rank's buffers, on the rank's stream (x and dy skipped when
 * routing_only). */
int ep_upload(const ep *s, const batch *b, int routing_only) {
    for (int r = 0; r < s->R; r++) {
        const rank_state *k = &s->rk[r];
        const int64_t o = b->off[r], T = b->T[r];
        if (!routing_only) {
            CUDA_OK(cudaMemcpyAsync(k->x, b->x + o * kH, (size_t)(T * kH) * 2,
                                    cudaMemcpyHostToDevice, k->stream));
            CUDA_OK(cudaMemcpyAsync(k->dy, b->dy + o * kH, (size_t)(T * kH) * 2,
                                    cudaMemcpyHostToDevice, k->stream));
        }
        CUDA_OK(cudaMemcpyAsync(k->ids, b->ids + o * kK, (size_t)(T * kK) * 4,
                                cudaMemcpyHostToDevice, k->stream));
        CUDA_OK(cudaMemcpyAsync(k->p, b->p + o * kK, (size_t)(T * kK) * 4,
                                cudaMemcpyHostToDevice, k->stream));
    }
    return 1;
done:
    return 0;
}

/* Every output buffer of every rank, whole, to 0xff bytes (NaN). */
int ep_poison(const ep *s) {
    const int64_t Er = kE / s->R, cap = s->max_tokens;
    for (int r = 0; r < s->R; r++) {
        const rank_state *k = &s->rk[r];
        CUDA_OK(cudaMemsetAsync(k->y, 0xff, (size_t)(cap * kH) * 2, k->stream));
        CUDA_OK(cudaMemsetAsync(k->dx, 0xff, (size_t)(cap * kH) * 2, k->stream));
        CUDA_OK(cudaMemsetAsync(k->dp, 0xff, (size_t)(cap * kK) * 4, k->stream));
        CUDA_OK(cudaMemsetAsync(k->counts, 0xff, (size_t)Er * 4, k->stream));
        CUDA_OK(cudaMemsetAsync(k->dw13, 0xff, (size_t)(Er * kW13Expert) * 4, k->stream));
        CUDA_OK(cudaMemsetAsync(k->dw2, 0xff, (size_t)(Er * kW2Expert) * 4, k->stream));
        if (k->dw13_up)
            CUDA_OK(cudaMemsetAsync(k->dw13_up, 0xff, (size_t)(Er * kI * kH) * 4, k->stream));
    }
    return 1;
done:
    return 0;
}

/* Rank r's args: its tokens, its experts' weights and gradients. */
moefuse_fwd_args ep_fwd_args(const ep *s, const batch *b, int r) {
    const rank_state *k = &s->rk[r];
    const int none = b->T[r] == 0 && s->null_if_empty;
    const int fp8 = s->precision == MOEFUSE_PRECISION_FP8_BLOCK;
    const int64_t e0 = (int64_t)r * (kE / s->R), h0 = e0 * kI * kH;
    moefuse_fwd_args a = {
        .num_tokens = b->T[r], .x = none ? NULL : k->x, .x_stride = kH,
        .ids = none ? NULL : k->ids, .weights = none ? NULL : k->p,
        .w13 = G.w13 + e0 * kW13Expert, .w2 = G.w2 + e0 * kW2Expert,
        .y = none ? NULL : k->y, .y_stride = kH, .saved = k->saved, .expert_counts = k->counts,
        .fp8_weights = fp8 ? &k->fp8 : NULL,
    };
    if (s->w13_halves) { /* FP8: no bf16 weights, as the PyTorch binding passes them */
        a.w13 = fp8 ? NULL : G.w13_gate + h0;
        a.w13_up = fp8 ? NULL : G.w13_up + h0;
        a.w2 = fp8 ? NULL : a.w2;
    }
    return a;
}

/* The weight gradients go to dw13 / dw2 (and dW13's up half to dw13_up), fp32, or with
 * dw_bf16 as bf16 into the same buffers' bytes. */
moefuse_bwd_args ep_bwd_args(const ep *s, const batch *b, int r) {
    const rank_state *k = &s->rk[r];
    const moefuse_fwd_args a = ep_fwd_args(s, b, r);
    float *up = s->w13_halves ? k->dw13_up : NULL;
    moefuse_bwd_args g = {
        .num_tokens = a.num_tokens, .x = a.x, .x_stride = kH, .ids = a.ids, .weights = a.weights,
        .w13 = a.w13, .w2 = a.w2, .saved = k->saved, .saved_bytes = k->saved_cap, .dy = a.x ? k->dy : NULL, .dy_stride = kH,
        .dx = a.x ? k->dx : NULL, .dx_stride = kH, .dweights = a.x ? k->dp : NULL,
        .dw13 = k->dw13, .dw2 = k->dw2, .accumulate = 0, .fp8_weights = a.fp8_weights,
        .w13_up = a.w13_up, .dw13_up = up,
    };
    if (s->dw_bf16) {
        g.dw13_bf16 = (uint16_t *)k->dw13;
        g.dw2_bf16 = (uint16_t *)k->dw2;
        g.dw13_up_bf16 = (uint16_t *)up;
        g.dw13 = g.dw2 = g.dw13_up = NULL;
    }
    return g;
}

/* Every rank's forward, each on its stream, then every rank's backward; no wait (the
 * ranks' kernels wait on each other, so all must be launched first). */
static void delay_if_last(const ep *s, int r) {
    if (r != s->R - 1 || s->delay_last_ms <= 0) return;
    const struct timespec nap = {s->delay_last_ms / 1000,
                                 (long)(s->delay_last_ms % 1000) * 1000000};
    nanosleep(&nap, NULL);
}

int ep_launch(ep *s, const batch *b) {
    for (int r = 0; r < s->R; r++)
        if (!ep_prepare(s, b, r)) return 0;
    for (int r = 0; r < s->R; r++) {
        delay_if_last(s, r);
        const moefuse_fwd_args a = ep_fwd_args(s, b, r);
        if (!rank_ok(moefuse_forward(s->rk[r].layer, &a, s->rk[r].stream), r, "moefuse_forward"))
            return 0;
    }
    for (int r = 0; r < s->R; r++) {
        delay_if_last(s, r);
        const moefuse_bwd_args g = ep_bwd_args(s, b, r);
        if (!rank_ok(moefuse_backward(s->rk[r].layer, &g, s->rk[r].stream), r, "moefuse_backward"))
            return 0;
    }
    return 1;
}

int ep_check(const ep *s) {
    int ok = 1;
    for (int r = 0; r < s->R; r++)
        ok &= rank_ok(moefuse_layer_check(s->rk[r].layer, s->rk[r].stream), r,
                      "moefuse_layer_check");
    return ok;
}

/* The first n of a rank's cap device rows into dst; rows n..cap-1 must hold the poison. */
int fetch_rows(void *dst, const void *src, int n, int cap, size_t row_bytes,
               const char *what, int r) {
    const size_t all_bytes = (size_t)cap * row_bytes, n_bytes = (size_t)n * row_bytes;
    uint8_t *all = malloc(all_bytes);
    const int ok = all && cudaMemcpy(all, src, all_bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
    CHECK(ok, "rank %d: copy of %s: %s", r, what, cudaGetErrorString(cudaGetLastError()));
    if (ok) {
        memcpy(dst, all, n_bytes);
        int64_t touched = 0;
        for (size_t i = n_bytes; i < all_bytes; i++) touched += all[i] != 0xff;
        CHECK(touched == 0, "rank %d (T = %d): %lld bytes of %s past row T were written", r, n,
              (long long)touched, what);
    }
    free(all);
    return ok;
}

/* A rank's weight gradient of `experts` experts of n elements each into fp32 dst: from
 * src, or with up set from the halves src and up ([experts, n / 2] each: dW13's gate and
 * up rows) packed back; bf16 (dw_bf16) widened to fp32, every bit kept (the poison too). */
static int fetch_dw(float *dst, const void *src, const void *up, int64_t experts, int64_t n,
                    int bf16, const char *what, int r) {
    const size_t es = bf16 ? 2 : 4, bytes = (size_t)(experts * n) * es, half = (size_t)n / 2 * es;
    void *h = bf16 ? malloc(bytes) : (void *)dst;
    cudaError_t e = h ? cudaSuccess : cudaErrorMemoryAllocation;
    if (e == cudaSuccess && !up) e = cudaMemcpy(h, src, bytes, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess && up)
        e = cudaMemcpy2D(h, 2 * half, src, half, half, experts, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess && up)
        e = cudaMemcpy2D((char *)h + half, 2 * half, up, half, half, experts,
                         cudaMemcpyDeviceToHost);
    if (e == cudaSuccess && bf16) mf_bf16_to_float_n(h, dst, experts * n);
    if (bf16) free(h);
    CHECK(e == cudaSuccess, "rank %d: copy of %s: %s", r, what, cudaGetErrorString(e));
    return e == cudaSuccess;
}

/* Every rank's outputs into `out`, in the concatenated order (after ep_wait). */
int ep_gather(const ep *s, const batch *b, result *out) {
    const int64_t Er = kE / s->R;
    int ok = 1;
    for (int r = 0; r < s->R && ok; r++) {
        const rank_state *k = &s->rk[r];
        const int64_t o = b->off[r], e0 = r * Er;
        ok = fetch_rows(out->y + o * kH, k->y, b->T[r], s->max_tokens, kH * 2, "y", r) &&
             fetch_rows(out->dx + o * kH, k->dx, b->T[r], s->max_tokens, kH * 2, "dx", r) &&
             fetch_rows(out->dp + o * kK, k->dp, b->T[r], s->max_tokens, kK * 4, "dweights", r) &&
             fetch_dw(out->dw13 + e0 * kW13Expert, k->dw13, s->w13_halves ? k->dw13_up : NULL,
                      Er, kW13Expert, s->dw_bf16, "dW13", r) &&
             fetch_dw(out->dw2 + e0 * kW2Expert, k->dw2, NULL, Er, kW2Expert, s->dw_bf16, "dW2", r);
        CUDA_OK(cudaMemcpy(out->counts + e0, k->counts, (size_t)Er * 4, cudaMemcpyDeviceToHost));
    }
    return ok;
done:
    return 0;
}

/* One forward + backward of b on every rank, waited for, checked, gathered. */
int ep_step(ep *s, const batch *b, result *out) {
    return ep_poison(s) && ep_upload(s, b, 0) && ep_launch(s, b) &&
           ep_wait(s, s->R, kWaitSeconds) && ep_check(s) && ep_gather(s, b, out);
}

/* b on the ranks of s against the R = 1 layer on the concatenated batch. */
void check_equal(ep *s, const batch *b) {
    if (!ref_run(b, s->R * s->max_tokens, s->mode, s->precision, &G.ref) ||
        !ep_step(s, b, &G.got))
        return;
    const int bad = compare_results(b, &G.ref, "R = 1", &G.got);
    int rows[kMaxRanks];
    const int Er = kE / s->R;
    for (int r = 0; r < s->R; r++) {
        rows[r] = 0;
        for (int e = r * Er; e < (r + 1) * Er; e++) rows[r] += G.ref.counts[e];
    }
    char ts[96], rs[128];
    printf("    R=%d T=%s, rows received %s, %s%s: %s\n", s->R, fmt_ints(ts, sizeof ts, b->T, s->R),
           fmt_ints(rs, sizeof rs, rows, s->R),
           s->mode == MOEFUSE_RECOMPUTE ? "recompute" : "saved activations",
           s->precision == MOEFUSE_PRECISION_FP8_BLOCK ? ", fp8" : "",
           bad ? "DIFFERS from R = 1" : "every output bitwise equal to R = 1");
}
