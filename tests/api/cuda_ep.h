/* The fixture of the expert-parallel tests (test_cuda_ep.c: bitwise against one rank,
 * and W13 in two halves against packed; test_cuda_ep_failures.c,
 * test_cuda_ep_iterations.c): the model, every expert's weights on the device
 * (cuda_ep.c), a batch of every rank's inputs, the R = 1 reference run and the bitwise
 * comparison, the R ranks and their calls (cuda_ep_ranks.c), and the runner
 * with its watchdog. What the cases check and why is at the top of test_cuda_ep.c. */
#ifndef MOEFUSE_TESTS_CUDA_EP_H
#define MOEFUSE_TESTS_CUDA_EP_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "fixture_cuda.h"
#include "moefuse.h"

/* qwen3-30b-a3b */
#define kModelName "qwen3-30b-a3b"
enum { kH = 2048, kI = 768, kE = 128, kK = 8 };
#define kW13Expert ((int64_t)2 * kI * kH) /* elements of one expert's W13 */
#define kW2Expert ((int64_t)kH * kI)

#define kMaxRanks 8
#define kMaxTokens 512           /* per rank, in every case but the iterations */
#define kIterTokens 256          /* per rank, in the iterations */
#define kIterations 1000
#define kTimeoutMs 200           /* the comm's bound in the timeout case */
#define kTimeoutBoundSeconds 10.0 /* the host's bound there */
#define kWaitSeconds 120.0       /* the host's bound on any other EP run (comm: 30 s a wait) */
#define kCaseSeconds 300         /* the watchdog of one case */

extern char g_skip[512];  /* non-empty: why every case skips */
extern char g_case[160];  /* the running case's name */

typedef struct result {   /* one run's outputs on the host, in the concatenated order */
    uint16_t *y, *dx;     /* [tokens, H] bf16 */
    float *dp;            /* [tokens, K] */
    float *dw13, *dw2;    /* [E, 2I, H], [E, H, I] */
    int32_t *counts;      /* [E] */
} result;

typedef struct fixture {
    int tried, ok;
    uint16_t *w13, *w2;   /* device [E, 2I, H], [E, H, I] bf16: every rank's experts */
    /* device [E, I, H] bf16 each: w13's gate and up halves in arrays of their own (as a
     * trainer's w1 and w3), made by fixture_halves for the first ep.w13_halves */
    uint16_t *w13_gate, *w13_up;
    float *dw13, *dw2;    /* device [E, 2I, H], [E, H, I] fp32: the R = 1 run's */
    cudaStream_t stream;  /* the R = 1 run's */
    result ref, got;      /* host, for kMaxRanks * kMaxTokens tokens */
    int use_nccl;         /* one-rank comms over NCCL (case_nccl_r1) */
} fixture;

extern fixture G;

/* ---- a batch: every rank's inputs, concatenated -------------------------------------- */

typedef struct batch {
    int R;
    int T[kMaxRanks];
    int64_t off[kMaxRanks + 1]; /* rank r's tokens: rows off[r] .. off[r+1]-1 */
    uint16_t *x, *dy;           /* pinned host [off[R], H] */
    int32_t *ids;               /* pinned host [off[R], K] */
    float *p;                   /* pinned host [off[R], K] */
} batch;

typedef enum elem { ELEM_BF16, ELEM_F32, ELEM_I32 } elem;

/* ---- R ranks: a comm, a layer, a stream and buffers per rank ----------------------------- */

typedef struct rank_state {
    moefuse_layer *layer;
    cudaStream_t stream;
    uint16_t *x, *dy, *y, *dx; /* device [max_tokens, H] */
    int32_t *ids;              /* device [max_tokens, K] */
    float *p, *dp;             /* device [max_tokens, K] */
    int32_t *counts;           /* device [E/R] */
    float *dw13, *dw2;         /* device [E/R, 2I, H], [E/R, H, I] fp32 */
    float *dw13_up;            /* device [E/R, I, H] fp32: dW13's up half (ep.w13_halves) */
    void *saved;               /* device, saved_cap bytes */
    size_t saved_cap;
    void *fp8_buf;             /* device: its experts' FP8 weights (precision FP8) */
    moefuse_fp8_weights fp8;
} rank_state;

typedef struct ep {
    int R, max_tokens;         /* max_tokens: per rank, the same on every rank */
    moefuse_saved_mode mode;
    int null_if_empty;         /* ranks with T = 0 pass NULL token tensors */
    moefuse_pipeline pipeline; /* the ranks' forward (the R = 1 reference runs staged) */
    moefuse_precision precision; /* the ranks' and the R = 1 reference's */
    int delay_last_ms;         /* ep_launch: the host sleeps this long before the last
                                  rank's forward and before its backward (the others'
                                  waits for its rows then really wait) */
    /* config.recv_capacity_factor: ep_open sets R, so that every routing of the equality
     * cases (skew onto one rank included) fits; 0 for the library's default */
    double capacity;
    /* W13 and dW13 in two halves (moefuse.h, "W13 in two halves"): the ranks read
     * G.w13_gate / G.w13_up (FP8: quantized from them by moefuse_quantize_weights_halves,
     * and no bf16 weights passed, as the PyTorch binding passes them) and write dW13's gate
     * half into rank_state.dw13, its up half into rank_state.dw13_up; ep_gather packs them
     * back, so the results compare with the packed layout's. Set before ep_layers_create. */
    int w13_halves;
    /* the weight gradients in bf16 (dw13_bf16, dw2_bf16, dw13_up_bf16), as a trainer with
     * bf16 parameters takes them, written into the first half of the bytes of
     * rank_state.dw13 / dw2 / dw13_up; ep_gather widens them to fp32 (every bit kept) */
    int dw_bf16;
    moefuse_comm *comm;
    void *nccl;                /* an ncclComm_t of one rank when the comm is NCCL's */
    rank_state rk[kMaxRanks];
} ep;

double bf16_to_double(uint16_t v);
double now_s(void);
const char *fmt_ints(char *buf, size_t size, const int *v, int n);
void hang_exit(const char *what, double seconds);
int result_alloc(result *r, int64_t tokens);
void result_free(result *r);
int fixture_setup(void);
int fixture_halves(void);
int ready(void);
void draw_routing(const batch *b, routing r, int skew_rank, int32_t *ids, float *p);
int batch_make(batch *b, int R, const int *T, routing r, int skew_rank);
void batch_free(batch *b);
double elem_value(elem k, const void *base, int64_t i);
int64_t count_nan(elem k, const void *v, int64_t n);
int same_bits(int rank, const char *what, elem k, const void *got, const void *want,
              const char *want_name, int64_t n, int64_t cols, const char *row_name,
              int64_t row0);
/* want_name: what made `want`, for the messages ("R = 1") */
int compare_results(const batch *b, const result *want, const char *want_name,
                    const result *got);
/* what: the run that made res, for the messages ("the R = 1 run") */
void check_reference(const batch *b, const result *res, const char *what);
int ref_run(const batch *b, int max_tokens, moefuse_saved_mode mode, moefuse_precision precision,
            result *out);
/* FP8: the layer's experts of G.w13 / G.w2 (from expert e0; halves: of G.w13_gate and
 * G.w13_up, by moefuse_quantize_weights_halves) quantized into a new device buffer (*buf,
 * poisoned first, freed by the caller) viewed by *w, on `stream`. */
int fp8_weights_make(moefuse_layer *layer, int64_t e0, int halves, cudaStream_t stream,
                     void **buf, moefuse_fp8_weights *w);
int rank_ok(moefuse_status st, int r, const char *what);
int open_nccl_comm(ep *s);
int ep_open(ep *s, int R, int max_tokens, moefuse_saved_mode mode);
moefuse_config ep_config(const ep *s, int r);
moefuse_status ep_layer_create(ep *s, int r);
int ep_layers_create(ep *s);
void ep_layers_destroy(ep *s);
int ep_wait(const ep *s, int n, double seconds);
void ep_close(ep *s);
int ep_prepare(ep *s, const batch *b, int r);
int ep_upload(const ep *s, const batch *b, int routing_only);
int ep_poison(const ep *s);
moefuse_fwd_args ep_fwd_args(const ep *s, const batch *b, int r);
moefuse_bwd_args ep_bwd_args(const ep *s, const batch *b, int r);
int ep_launch(ep *s, const batch *b);
int ep_check(const ep *s);
int fetch_rows(void *dst, const void *src, int n, int cap, size_t row_bytes,
               const char *what, int r);
int ep_gather(const ep *s, const batch *b, result *out);
int ep_step(ep *s, const batch *b, result *out);
void check_equal(ep *s, const batch *b);

/* Runs `cases` in order under the watchdog (argv: [case-substring]) and returns the exit
 * status. */
int ep_main(int argc, char **argv, const named_case *cases, int n);

#endif
