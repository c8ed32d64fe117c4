/* Expert parallelism with R virtual ranks (the fixture of test_cuda_ep.c, in
 * cuda_ep.{h,c}): the comm's shared buffers, the receive capacity and the memory report.
 *
 *   - layers: R = 2, 4, 8, three layers on one comm (one pool of windows and scratch per
 *     rank, shared), the default receive capacity; forwards of layers 1, 2, 3 then
 *     backwards of 3, 2, 1 on each rank's one stream, each layer with its own batch:
 *     every output of every layer bitwise equal to R = 1 on that layer's batch;
 *   - accumulation: R = 4, two forwards of one layer (two saved buffers) before their
 *     backwards in reverse order: both bitwise equal to R = 1;
 *   - capacity: R = 4, recv_capacity_factor 1.5, every slot of every rank on rank 0's
 *     experts (4x the balanced load): moefuse_layer_check on every rank returns
 *     MOEFUSE_ERR_CAPACITY naming rank 0, its experts, the rows and the capacity; y,
 *     expert_counts and saved keep their poison on every rank; then a balanced call on
 *     the same layers is bitwise equal to R = 1;
 *   - memory: R = 4, moefuse_layer_memory against moefuse_memory_estimate (equal) and
 *     against cudaMemGetInfo around the creates (within the allocation granularity):
 *     a first layer per rank makes the pools, a second equal one adds its own workspaces
 *     only, a third with twice max_tokens grows the pools to its size;
 *   - memory of an FP8 layer on one GPU (no comm): its report, which counts the quantized
 *     operands' workspaces, against cudaMemGetInfo.
 *
 * test_cuda_ep_memory [case-substring]. With no sm_90 device every case prints SKIP. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ep.h"
#include "fixture_cuda.h"
#include "harness.h"
#include "moefuse.h"

#define kLayers 3
#define M kMaxTokens

/* ---- several ep sets on one comm ------------------------------------------------------ */

/* s takes base's comm and streams (a comm's layers run in stream order on each rank):
 * the comm and streams ep_open made for s are destroyed. */
static int ep_join(ep *s, const ep *base) {
    MF_OK(moefuse_comm_destroy(s->comm));
    s->comm = base->comm;
    for (int r = 0; r < s->R; r++) {
        CUDA_OK(cudaStreamDestroy(s->rk[r].stream));
        s->rk[r].stream = base->rk[r].stream;
    }
    return 1;
done:
    return 0;
}

/* Before ep_close of a joined s: what is base's is not s's to free. */
static void ep_unjoin(ep *s) {
    s->comm = NULL;
    for (int r = 0; r < s->R; r++) s->rk[r].stream = NULL;
}

/* Every rank's forward (or backward) of s on b. */
static int launch(ep *s, const batch *b, int backward) {
    for (int r = 0; r < s->R; r++) {
        moefuse_status st;
        if (backward) {
            const moefuse_bwd_args g = ep_bwd_args(s, b, r);
            st = moefuse_backward(s->rk[r].layer, &g, s->rk[r].stream);
        } else {
            const moefuse_fwd_args a = ep_fwd_args(s, b, r);
            st = moefuse_forward(s->rk[r].layer, &a, s->rk[r].stream);
        }
        if (!rank_ok(st, r, backward ? "moefuse_backward" : "moefuse_forward")) return 0;
    }
    return 1;
}

/* n sets s[i] with batches b[i] on s[0]'s comm and streams: forwards in order 0..n-1,
 * backwards in order n-1..0, then each set's outputs against R = 1 on its batch.
 * Returns the number of sets that differ, -1 when a call failed (recorded). */
static int run_nested(ep *s, const batch *b, int n) {
    for (int i = 0; i < n; i++)
        for (int r = 0; r < s[i].R; r++)
            if (!ep_prepare(&s[i], &b[i], r)) return -1;
    for (int i = 0; i < n; i++)
        if (!ep_poison(&s[i]) || !ep_upload(&s[i], &b[i], 0)) return -1;
    for (int i = 0; i < n; i++)
        if (!launch(&s[i], &b[i], 0)) return -1;
    for (int i = n - 1; i >= 0; i--)
        if (!launch(&s[i], &b[i], 1)) return -1;
    if (!ep_wait(&s[0], s[0].R, kWaitSeconds)) return -1;
    int differing = 0;
    for (int i = 0; i < n; i++) {
        if (!ep_check(&s[i]) || !ep_gather(&s[i], &b[i], &G.got) ||
            !ref_run(&b[i], s[i].R * s[i].max_tokens, s[i].mode, s[i].precision, &G.ref))
            return -1;
        const int bad = compare_results(&b[i], &G.ref, "R = 1", &G.got);
        printf("    set %d of %d: %s\n", i + 1, n,
               bad ? "DIFFERS from R = 1" : "every output bitwise equal to R = 1");
        differing += bad != 0;
    }
    return differing;
}

/* n sets of R ranks with batches of M tokens per rank (set 1 with dropped slots) on one
 * comm; shared_layer: every set uses set 0's layers (else each its own). */
static void nested_case(int R, int n, int shared_layer) {
    if (!ready()) return;
    ep s[kLayers];
    batch b[kLayers];
    memset(s, 0, sizeof s);
    memset(b, 0, sizeof b);
    int T[kMaxRanks];
    for (int r = 0; r < R; r++) T[r] = M;
    for (int i = 0; i < n; i++) {
        ep *e = &s[i];
        if (!batch_make(&b[i], R, T, i == 1 ? ROUTE_DROPPED : ROUTE_RANDOM, -1) ||
            !ep_open(e, R, M, MOEFUSE_SAVE_ACTIVATIONS))
            goto done;
        e->capacity = 0;  // the library's default: random routing stays far below 2x
        if (i > 0 && !ep_join(e, &s[0])) goto done;
        if (i > 0 && shared_layer) {
            for (int r = 0; r < R; r++) e->rk[r].layer = s[0].rk[r].layer;
        } else if (!ep_layers_create(e)) {
            goto done;
        }
    }
    const int differing = run_nested(s, b, n);
    CHECK(differing == 0, "R=%d: %d of %d sets differ from R = 1 (or a call failed)", R,
          differing, n);
done:  /* sets never opened are zeros: ep_close and batch_free do nothing with them */
    for (int i = n - 1; i >= 0; i--) {
        if (i > 0) {
            if (shared_layer)
                for (int r = 0; r < R; r++) s[i].rk[r].layer = NULL;
            ep_unjoin(&s[i]);
        }
        ep_close(&s[i]);
        batch_free(&b[i]);
    }
}

static void case_layers_r2(void) { nested_case(2, kLayers, 0); }
static void case_layers_r4(void) { nested_case(4, kLayers, 0); }
static void case_layers_r8(void) { nested_case(8, kLayers, 0); }
static void case_accumulation_r4(void) { nested_case(4, 2, 1); }

/* ---- capacity -------------------------------------------------------------------------- */

/* 1 when all `bytes` of the device buffer still hold the poison 0xff (recorded if not). */
static int still_poisoned(const void *dev, size_t bytes, int r, const char *what) {
    uint8_t *h = malloc(bytes ? bytes : 1);
    int ok = h && cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
    CHECK(ok, "rank %d: copy of %s", r, what);
    size_t touched = 0;
    for (size_t i = 0; ok && i < bytes; i++) touched += h[i] != 0xff;
    CHECK(touched == 0, "rank %d: %zu bytes of %s written by a call that failed", r, touched,
          what);
    free(h);
    return ok && touched == 0;
}

static void case_capacity(void) {
    if (!ready()) return;
    const int R = 4, T[4] = {M, M, M, M};
    const double factor = 1.5;
    batch skew, fair;
    ep s;
    memset(&s, 0, sizeof s);
    memset(&skew, 0, sizeof skew);
    memset(&fair, 0, sizeof fair);
    if (!batch_make(&skew, R, T, ROUTE_RANDOM, 0) || !batch_make(&fair, R, T, ROUTE_RANDOM, -1) ||
        !ep_open(&s, R, M, MOEFUSE_SAVE_ACTIVATIONS))
        goto done;
    s.capacity = factor;
    if (!ep_layers_create(&s)) goto done;
    for (int r = 0; r < R; r++) {
        if (!ep_prepare(&s, &skew, r)) goto done;
        CUDA_OK(cudaMemsetAsync(s.rk[r].saved, 0xff, s.rk[r].saved_cap, s.rk[r].stream));
    }
    if (!ep_poison(&s) || !ep_upload(&s, &skew, 0) || !launch(&s, &skew, 0) ||
        !ep_wait(&s, R, kWaitSeconds))
        goto done;
    /* rank 0 is sent every slot: R * M * K rows; its capacity ceil(1.5 * M * K) */
    char rows[64], cap[64], experts[64];
    snprintf(rows, sizeof rows, " %d rows", R * M * kK);
    snprintf(cap, sizeof cap, "capacity of %d rows", (int)(factor * M * kK + 0.999));
    snprintf(experts, sizeof experts, "rank 0 (experts 0..%d)", kE / R - 1);
    for (int r = 0; r < R; r++) {
        const moefuse_status st = moefuse_layer_check(s.rk[r].layer, s.rk[r].stream);
        const char *msg = moefuse_last_error();
        CHECK(st == MOEFUSE_ERR_CAPACITY && strstr(msg, experts) && strstr(msg, rows) &&
                  strstr(msg, cap),
              "rank %d: %s (%s), expected MOEFUSE_ERR_CAPACITY naming '%s', '%s' and '%s'", r,
              moefuse_status_string(st), msg, experts, rows + 1, cap);
        if (r == 0) printf("    rank 0: %s: %s\n", moefuse_status_string(st), msg);
        still_poisoned(s.rk[r].y, (size_t)M * kH * 2, r, "y");
        still_poisoned(s.rk[r].counts, (size_t)(kE / R) * 4, r, "expert_counts");
        still_poisoned(s.rk[r].saved, s.rk[r].saved_cap, r, "saved");
    }
    printf("    then a balanced call on the same layers:\n");
    check_equal(&s, &fair);
done:
    ep_close(&s);
    batch_free(&skew);
    batch_free(&fair);
}

/* ---- memory ------------------------------------------------------------------------------ */

/* Device bytes in use now, after the device is idle. */
static size_t used_bytes(void) {
    size_t free_b = 0, total = 0;
    cudaDeviceSynchronize();
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 0;
    return total - free_b;
}

static moefuse_memory report_of(const moefuse_layer *layer) {
    moefuse_memory m;
    memset(&m, 0, sizeof m);
    m.struct_size = sizeof m;
    const moefuse_status st = moefuse_layer_memory(layer, &m);
    CHECK(st == MOEFUSE_OK, "moefuse_layer_memory: %s", moefuse_last_error());
    return m;
}

/* used grew by `want` bytes, within the allocation granularity: cudaMalloc rounds each
 * allocation up to 2 MiB pages (small ones share pages), and a stream or event may take
 * a little; kSlack per rank covers about 30 allocations. */
#define kSlack ((size_t)64 << 20)
static void check_grew(const char *what, size_t before, size_t after, size_t want, int R) {
    const size_t got = after - before;
    const int ok = after >= before && got + (size_t)R * (4u << 20) >= want &&
                   got <= want + (size_t)R * kSlack;
    CHECK(ok, "%s: cudaMemGetInfo says %zu bytes more, the report %zu (slack %zu)", what, got,
          want, (size_t)R * kSlack);
    printf("    %s: %.1f MiB allocated, %.1f MiB reported\n", what, got / 1048576.0,
           want / 1048576.0);
}

static size_t layer_total(const moefuse_memory *m, int with_pool) {
    return m->workspace_bytes + (with_pool ? m->comm_window_bytes + m->comm_scratch_bytes : 0);
}

static void case_memory(void) {
    if (!ready()) return;
    const int R = 4, T = 4096;
    ep s;
    memset(&s, 0, sizeof s);
    moefuse_layer *second[kMaxRanks] = {0}, *third[kMaxRanks] = {0};
    if (!ep_open(&s, R, T, MOEFUSE_SAVE_ACTIVATIONS)) goto done;
    s.capacity = 0;  // the default: 2x the balanced load, half the worst case at R = 4
    /* a first create loads the kernels (device memory of its own): measure after it */
    if (!ep_layers_create(&s)) goto done;
    ep_layers_destroy(&s);

    size_t before = used_bytes();
    if (!ep_layers_create(&s)) goto done;
    size_t after = used_bytes();
    const moefuse_config cfg = ep_config(&s, 0);
    moefuse_memory want;
    memset(&want, 0, sizeof want);
    want.struct_size = sizeof want;
    MF_OK(moefuse_memory_estimate(&cfg, 1, &want));
    const moefuse_memory first = report_of(s.rk[0].layer);
    CHECK(!memcmp(&first, &want, sizeof first),
          "rank 0's report differs from moefuse_memory_estimate of its config");
    CHECK(first.shared_layers == 1 && first.comm_window_bytes == first.layer_window_bytes &&
              first.recv_capacity_rows == 2 * (int64_t)T * kK &&
              first.rows_cap == (2 * (int64_t)T * kK + (kE / R) * 127 + 127) / 128 * 128,
          "first layer: shared_layers %d, windows %zu / %zu, capacity %lld rows, rows_cap %lld",
          first.shared_layers, first.comm_window_bytes, first.layer_window_bytes,
          (long long)first.recv_capacity_rows, (long long)first.rows_cap);
    size_t saved = 0;
    MF_OK(moefuse_saved_bytes(s.rk[0].layer, T, &saved));
    CHECK(first.saved_bytes == saved, "saved_bytes %zu, moefuse_saved_bytes %zu",
          first.saved_bytes, saved);
    printf("    R=%d T=%d: windows %.1f MiB + scratch %.1f MiB shared, own %.1f MiB, saved "
           "%.1f MiB per call\n", R, T, first.comm_window_bytes / 1048576.0,
           first.comm_scratch_bytes / 1048576.0, first.workspace_bytes / 1048576.0,
           first.saved_bytes / 1048576.0);
    check_grew("first layer per rank", before, after, R * layer_total(&first, 1), R);

    /* a second equal layer per rank: its own workspaces only */
    before = used_bytes();
    for (int r = 0; r < R; r++) {
        const moefuse_config c = ep_config(&s, r);
        MF_OK(moefuse_layer_create(&c, s.comm, &second[r]));
    }
    after = used_bytes();
    const moefuse_memory two = report_of(second[0]);
    CHECK(two.shared_layers == 2 && two.comm_window_bytes == first.comm_window_bytes &&
              two.comm_scratch_bytes == first.comm_scratch_bytes,
          "second layer: shared_layers %d, windows %zu (first %zu)", two.shared_layers,
          two.comm_window_bytes, first.comm_window_bytes);
    check_grew("second equal layer per rank", before, after, R * layer_total(&two, 0), R);

    /* a third with twice max_tokens: the pools grow to its size */
    before = used_bytes();
    for (int r = 0; r < R; r++) {
        moefuse_config c = ep_config(&s, r);
        c.max_tokens = 2 * T;
        MF_OK(moefuse_layer_create(&c, s.comm, &third[r]));
    }
    after = used_bytes();
    const moefuse_memory big = report_of(third[0]), old = report_of(s.rk[0].layer);
    CHECK(big.shared_layers == 3 && big.comm_window_bytes == big.layer_window_bytes &&
              old.comm_window_bytes == big.comm_window_bytes &&
              old.layer_window_bytes == first.layer_window_bytes &&
              big.comm_window_bytes > first.comm_window_bytes,
          "third, larger layer: windows %zu (its need %zu), the first layer's report %zu / %zu",
          big.comm_window_bytes, big.layer_window_bytes, old.comm_window_bytes,
          old.layer_window_bytes);
    const size_t grown = big.comm_window_bytes + big.comm_scratch_bytes -
                         first.comm_window_bytes - first.comm_scratch_bytes;
    check_grew("third layer, twice max_tokens", before, after,
               R * (layer_total(&big, 0) + grown), R);
done:
    for (int r = 0; r < R; r++) {
        if (third[r]) moefuse_layer_destroy(third[r]);
        if (second[r]) moefuse_layer_destroy(second[r]);
    }
    ep_close(&s);
}

static void case_memory_fp8(void) {
    if (!ready()) return;
    moefuse_config c;
    moefuse_config_init(&c, 2048, 768, 128, 8, 4096);
    c.backend = MOEFUSE_BACKEND_CUDA;
    c.precision = MOEFUSE_PRECISION_FP8_BLOCK;
    moefuse_layer *warm = NULL, *layer = NULL;
    MF_OK(moefuse_layer_create(&c, NULL, &warm));   /* loads the kernels */
    const size_t before = used_bytes();
    MF_OK(moefuse_layer_create(&c, NULL, &layer));
    const size_t after = used_bytes();
    {
        const moefuse_memory m = report_of(layer);
        c.precision = MOEFUSE_PRECISION_BF16;
        moefuse_memory b16;
        memset(&b16, 0, sizeof b16);
        b16.struct_size = sizeof b16;
        MF_OK(moefuse_memory_estimate(&c, 0, &b16));
        CHECK(m.workspace_bytes > b16.workspace_bytes, "FP8 own %zu, bf16 own %zu",
              m.workspace_bytes, b16.workspace_bytes);
        check_grew("an FP8 layer, qwen3-30b-a3b T=4096", before, after, layer_total(&m, 0), 1);
    }
done:
    if (layer) moefuse_layer_destroy(layer);
    if (warm) moefuse_layer_destroy(warm);
}

/* test_cuda_ep_memory [case-substring] */
int main(int argc, char **argv) {
    static const named_case cases[] = {
        {case_layers_r2, "layers: R=2, 3 layers on one comm, fwd 1..3 then bwd 3..1"},
        {case_layers_r4, "layers: R=4, 3 layers on one comm, fwd 1..3 then bwd 3..1"},
        {case_layers_r8, "layers: R=8, 3 layers on one comm, fwd 1..3 then bwd 3..1"},
        {case_accumulation_r4, "accumulation: R=4, two forwards of a layer, backwards reversed"},
        {case_capacity, "capacity: R=4, factor 1.5, every slot on rank 0, then a fair call"},
        {case_memory, "memory: R=4 T=4096, the report against the estimate and cudaMemGetInfo"},
        {case_memory_fp8, "memory: FP8 on one GPU, the report against cudaMemGetInfo"},
    };
    return ep_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]));
}
