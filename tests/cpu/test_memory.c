/* The receive capacity and the memory report without a GPU: config.recv_capacity_factor
 * validation, moefuse_memory_estimate's arithmetic against the rules moefuse.h and
 * docs/decisions/0022-shared-windows-and-receive-capacity state (worked out here
 * independently, for qwen3-30b-a3b at R = 8, T = 16384), the struct_size contract, and
 * moefuse_layer_memory of a CPU layer. test_cuda_ep_memory checks a CUDA layer's report
 * against this estimate and against cudaMemGetInfo. */
#include "harness.h"
#include "moefuse.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { H = 2048, I = 768, E = 128, K = 8, R = 8, T = 16384 };

static moefuse_config qwen30(void) {
    moefuse_config c;
    moefuse_config_init(&c, H, I, E, K, T);
    c.num_ranks = R;
    c.backend = MOEFUSE_BACKEND_CUDA;
    return c;
}

static moefuse_status estimate(const moefuse_config *c, int with_comm, moefuse_memory *m) {
    memset(m, 0, sizeof *m);
    m->struct_size = sizeof *m;
    return moefuse_memory_estimate(c, with_comm, m);
}

static size_t a256(size_t n) { return (n + 255) / 256 * 256; }

static int64_t padded(int64_t rows, int experts) {
    return (rows + (int64_t)experts * 127 + 127) / 128 * 128;
}

static void test_factor_validation(void) {
    const double bad[] = {0.5, -1.0, NAN, 1e7};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        moefuse_config c;
        moefuse_config_init(&c, 64, 32, 8, 2, 16);
        c.recv_capacity_factor = bad[i];
        moefuse_layer *layer = NULL;
        const moefuse_status st = moefuse_layer_create(&c, NULL, &layer);
        CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && layer == NULL &&
                  strstr(moefuse_last_error(), "recv_capacity_factor"),
              "recv_capacity_factor = %g: %s (%s), expected MOEFUSE_ERR_INVALID_CONFIG naming it",
              bad[i], moefuse_status_string(st), moefuse_last_error());
        if (layer) moefuse_layer_destroy(layer);
    }
    moefuse_config c;
    moefuse_config_init(&c, 64, 32, 8, 2, 16);
    CHECK(c.recv_capacity_factor == 0, "moefuse_config_init: factor %g, expected 0 (default)",
          c.recv_capacity_factor);
    c.recv_capacity_factor = 1.0;
    moefuse_layer *layer = NULL;
    CHECK(moefuse_layer_create(&c, NULL, &layer) == MOEFUSE_OK, "factor 1.0: %s",
          moefuse_last_error());
    moefuse_layer_destroy(layer);
}

/* qwen3-30b-a3b, R = 8, T = 16384, the default capacity 2x: every field by hand. */
static void test_estimate_qwen30(void) {
    const moefuse_config c = qwen30();
    moefuse_memory m;
    CHECK(estimate(&c, 1, &m) == MOEFUSE_OK, "estimate: %s", moefuse_last_error());
    const int EL = E / R;
    const int64_t cap = 2 * (int64_t)T * K, rows = padded(cap, EL);
    CHECK(cap == 262144 && rows == 264192, "hand arithmetic: cap %lld rows %lld",
          (long long)cap, (long long)rows);
    CHECK(m.version == MOEFUSE_MEMORY_VERSION && m.shared_layers == 1,
          "version %d, shared_layers %d", m.version, m.shared_layers);
    CHECK(m.recv_capacity_rows == cap && m.rows_cap == rows, "capacity %lld, rows_cap %lld",
          (long long)m.recv_capacity_rows, (long long)m.rows_cap);
    /* windows: xs and dys [rows, H] bf16, row sources and p [rows] 4 B, the combine slot
     * rows [T*K, H] bf16, d p [T*K] fp32, and the sync words: 16 + 4 flags * R +
     * 2 parities * R * E counts + arrivals and targets per 128-row block */
    const size_t sync = (size_t)(16 + 4 * R + 2 * R * E + 2 * (rows / 128)) * 4;
    const size_t windows = (size_t)(2 * rows * H * 2 + 2 * rows * 4) +
                           (size_t)T * K * H * 2 + (size_t)T * K * 4 + sync;
    CHECK(m.comm_window_bytes == windows && m.layer_window_bytes == windows,
          "windows %zu / %zu, expected %zu", m.comm_window_bytes, m.layer_window_bytes, windows);
    CHECK(windows == 2703794496u, "hand arithmetic: windows %zu", windows);
    /* scratch: act [rows, I], dh [rows, 2I] bf16, d p partials [rows, I / 256] fp32 */
    const size_t scratch = (size_t)rows * I * 2 + (size_t)rows * 2 * I * 2 + (size_t)rows * 3 * 4;
    CHECK(m.comm_scratch_bytes == scratch && m.layer_scratch_bytes == scratch,
          "scratch %zu, expected %zu", m.comm_scratch_bytes, scratch);
    /* saved: header, counts, offsets, row_block_expert, slot_row [T*K], gate_up [rows, 2I] */
    const size_t saved = a256(64) + a256(EL * 4) + a256((EL + 1) * 4) + a256(rows / 128 * 4) +
                         a256((size_t)T * K * 4) + a256((size_t)rows * 2 * I * 2);
    CHECK(m.saved_bytes == saved && saved == 812131328u, "saved %zu, expected %zu",
          m.saved_bytes, saved);
    /* the layer's own: plan and send maps, a few MB */
    CHECK(m.workspace_bytes > (size_t)T * K * 4 && m.workspace_bytes < ((size_t)16 << 20),
          "own workspaces %zu bytes", m.workspace_bytes);
    printf("    qwen3-30b-a3b R=8 T=16384: windows %.2f GB, scratch %.2f GB, saved %.3f GB "
           "per call, own %.1f MB\n", windows / 1e9, scratch / 1e9, saved / 1e9,
           m.workspace_bytes / 1e6);

    /* MOEFUSE_RECOMPUTE: no gate_up saved, a gate_up scratch instead */
    moefuse_config rc = c;
    rc.saved_mode = MOEFUSE_RECOMPUTE;
    moefuse_memory r;
    CHECK(estimate(&rc, 1, &r) == MOEFUSE_OK, "recompute: %s", moefuse_last_error());
    CHECK(r.saved_bytes == saved - a256((size_t)rows * 2 * I * 2) &&
              r.comm_scratch_bytes == scratch + (size_t)rows * 2 * I * 2,
          "recompute: saved %zu, scratch %zu", r.saved_bytes, r.comm_scratch_bytes);
}

/* The capacity's bounds: above R it is the worst case; without a comm, T * K. */
static void test_capacity_bounds(void) {
    moefuse_config c = qwen30();
    moefuse_memory m;
    c.recv_capacity_factor = 100;
    CHECK(estimate(&c, 1, &m) == MOEFUSE_OK && m.recv_capacity_rows == (int64_t)R * T * K,
          "factor 100 at R = 8: %lld rows, expected R * T * K", (long long)m.recv_capacity_rows);
    c.recv_capacity_factor = 1.25;
    CHECK(estimate(&c, 1, &m) == MOEFUSE_OK &&
              m.recv_capacity_rows == (int64_t)ceil(1.25 * T * K),
          "factor 1.25: %lld rows", (long long)m.recv_capacity_rows);
    c.recv_capacity_factor = 1.0;
    c.num_ranks = 1;
    CHECK(estimate(&c, 1, &m) == MOEFUSE_OK && m.recv_capacity_rows == (int64_t)T * K,
          "one-rank comm: %lld rows", (long long)m.recv_capacity_rows);
    c.recv_capacity_factor = 3.0;  // ignored without a comm: one rank receives T * K
    CHECK(estimate(&c, 0, &m) == MOEFUSE_OK && m.recv_capacity_rows == (int64_t)T * K &&
              m.shared_layers == 0 && m.comm_window_bytes == 0 && m.comm_scratch_bytes == 0 &&
              m.rows_cap == padded((int64_t)T * K, E) &&
              m.workspace_bytes > (size_t)m.rows_cap * H * 2 * 2,
          "no comm: %lld rows, shared %d, windows %zu, own %zu", (long long)m.recv_capacity_rows,
          m.shared_layers, m.comm_window_bytes, m.workspace_bytes);
    c.num_ranks = 8;
    CHECK(estimate(&c, 0, &m) == MOEFUSE_ERR_INVALID_CONFIG, "R = 8 without a comm: %s",
          moefuse_last_error());
    c = qwen30();
    c.backend = MOEFUSE_BACKEND_CPU;
    CHECK(estimate(&c, 1, &m) == MOEFUSE_ERR_INVALID_CONFIG, "CPU backend: %s",
          moefuse_last_error());
}

/* struct_size: too small refused, larger filled up to this version's size only. */
static void test_struct_size(void) {
    const moefuse_config c = qwen30();
    struct {
        moefuse_memory m;
        unsigned char tail[32];
    } big;
    memset(&big, 0xab, sizeof big);
    big.m.struct_size = sizeof big;
    CHECK(moefuse_memory_estimate(&c, 1, &big.m) == MOEFUSE_OK, "larger struct: %s",
          moefuse_last_error());
    int tail_kept = 1;
    for (size_t i = 0; i < sizeof big.tail; i++) tail_kept &= big.tail[i] == 0xab;
    CHECK(tail_kept && big.m.struct_size == sizeof big && big.m.version == MOEFUSE_MEMORY_VERSION,
          "bytes past sizeof(moefuse_memory) written, or header changed");
    moefuse_memory small;
    memset(&small, 0, sizeof small);
    small.struct_size = sizeof small - 8;
    CHECK(moefuse_memory_estimate(&c, 1, &small) == MOEFUSE_ERR_SHAPE &&
              strstr(moefuse_last_error(), "struct_size"),
          "short struct_size: %s", moefuse_last_error());
}

static void test_cpu_layer_report(void) {
    moefuse_config c;
    moefuse_config_init(&c, 64, 32, 8, 2, 16);
    moefuse_layer *layer = NULL;
    CHECK(moefuse_layer_create(&c, NULL, &layer) == MOEFUSE_OK, "create: %s",
          moefuse_last_error());
    if (!layer) return;
    moefuse_memory m;
    memset(&m, 0xff, sizeof m);
    m.struct_size = sizeof m;
    size_t saved = 0;
    CHECK(moefuse_layer_memory(layer, &m) == MOEFUSE_OK &&
              moefuse_saved_bytes(layer, 16, &saved) == MOEFUSE_OK,
          "report: %s", moefuse_last_error());
    CHECK(m.saved_bytes == saved && m.comm_window_bytes == 0 && m.workspace_bytes == 0 &&
              m.shared_layers == 0 && m.recv_capacity_rows == 16 * 2,
          "CPU layer: saved %zu (want %zu), windows %zu, own %zu", m.saved_bytes, saved,
          m.comm_window_bytes, m.workspace_bytes);
    CHECK(moefuse_layer_memory(layer, NULL) == MOEFUSE_ERR_NULL_POINTER, "NULL out");
    moefuse_layer_destroy(layer);
}

/* FP8_BLOCK, one GPU: the quantized operands' workspaces are the layer's own, and
 * counted: the row codes [rows, W] with their scales [W / 128, rows rounded to 4] fp32,
 * the weight gradients' token codes [rows, W] and [rows, max(H, I)] with a scale per 128
 * rows and column (W = max(H, 2I)); no bf16 x rows [rows, H] (x's codes come from the
 * dispatch, the backward's quantizers gather x); and d p's partials per 128 columns of I
 * (FP8's dgrad2 tile) instead of BF16's 256 (I = 768: 6 against 3 per row). */
static void test_estimate_fp8(void) {
    moefuse_config c = qwen30();
    c.num_ranks = 1;
    c.max_tokens = 4096;
    moefuse_memory b16, f8;
    CHECK(estimate(&c, 0, &b16) == MOEFUSE_OK, "bf16: %s", moefuse_last_error());
    c.precision = MOEFUSE_PRECISION_FP8_BLOCK;
    CHECK(estimate(&c, 0, &f8) == MOEFUSE_OK, "fp8: %s", moefuse_last_error());
    const int64_t rows = padded(4096 * K, E), W = 2 * I > H ? 2 * I : H, V = H > I ? H : I;
    const size_t fp8 = (size_t)(rows * W + W / 128 * ((rows + 3) / 4 * 4) * 4) +
                       (size_t)(rows * W + rows / 128 * W * 4) +
                       (size_t)(rows * V + rows / 128 * V * 4);
    const size_t xs = (size_t)(rows * H * 2);
    const size_t dp_more = (size_t)(rows * (I / 128 - I / 256) * 4);
    CHECK(f8.workspace_bytes == b16.workspace_bytes + fp8 - xs + dp_more &&
              f8.saved_bytes == b16.saved_bytes,
          "fp8 own %zu, bf16 own %zu + FP8 operands %zu - x rows %zu + d p partials %zu; "
          "saved %zu / %zu", f8.workspace_bytes, b16.workspace_bytes, fp8, xs, dp_more,
          f8.saved_bytes, b16.saved_bytes);
}

/* FP8_BLOCK with a comm (qwen3-30b-a3b, R = 8, T = 16384): the same operand arrays, each
 * 256-byte aligned, in the comm's scratch (shared by its layers, as act and dh are), with
 * d p's partials per 128 columns there too; the layer's own workspaces and its windows and
 * saved state as BF16's. */
static void test_estimate_fp8_comm(void) {
    moefuse_config c = qwen30();
    moefuse_memory b16, f8;
    CHECK(estimate(&c, 1, &b16) == MOEFUSE_OK, "bf16: %s", moefuse_last_error());
    c.precision = MOEFUSE_PRECISION_FP8_BLOCK;
    CHECK(estimate(&c, 1, &f8) == MOEFUSE_OK, "fp8: %s", moefuse_last_error());
    const int64_t rows = padded(2 * (int64_t)T * K, E / R), W = 2 * I > H ? 2 * I : H,
                  V = H > I ? H : I;
    const size_t fp8 = a256((size_t)(rows * W)) + a256((size_t)(W / 128 * rows * 4)) +
                       a256((size_t)(rows * W)) + a256((size_t)(rows / 128 * W * 4)) +
                       a256((size_t)(rows * V)) + a256((size_t)(rows / 128 * V * 4)) +
                       (size_t)(rows * (I / 128 - I / 256) * 4);   /* d p partials */
    CHECK(f8.comm_scratch_bytes == b16.comm_scratch_bytes + fp8 &&
              f8.layer_scratch_bytes == b16.layer_scratch_bytes + fp8,
          "fp8 scratch %zu / %zu, bf16 %zu + FP8 operands %zu", f8.comm_scratch_bytes,
          f8.layer_scratch_bytes, b16.comm_scratch_bytes, fp8);
    CHECK(f8.workspace_bytes == b16.workspace_bytes &&
              f8.comm_window_bytes == b16.comm_window_bytes && f8.saved_bytes == b16.saved_bytes,
          "fp8 own %zu / bf16 %zu, windows %zu / %zu, saved %zu / %zu", f8.workspace_bytes,
          b16.workspace_bytes, f8.comm_window_bytes, b16.comm_window_bytes, f8.saved_bytes,
          b16.saved_bytes);
    printf("    FP8 operands in the comm's scratch: %.2f GB (once per GPU)\n", fp8 / 1e9);
}

int main(void) {
    th_seed_from_env_or_clock();
    th_run("recv_capacity_factor validation", test_factor_validation);
    th_run("estimate: qwen3-30b-a3b R=8 T=16384 by hand", test_estimate_qwen30);
    th_run("capacity bounds: above R, one rank, no comm", test_capacity_bounds);
    th_run("struct_size contract", test_struct_size);
    th_run("a CPU layer's report", test_cpu_layer_report);
    th_run("estimate: FP8 operands' workspaces, one GPU", test_estimate_fp8);
    th_run("estimate: FP8 operands in the comm's scratch, R=8", test_estimate_fp8_comm);
    return th_finish();
}
