/* Expert parallelism with R virtual ranks (the fixture of test_cuda_ep.c, in
 * cuda_ep.{h,c}), many iterations:
 *
 *   - 1000 forward + backward iterations, R = 2, routing re-drawn every iteration and
 *     no host synchronization between iterations; iterations 0, 1, 2, 499 and 999
 *     against R = 1, every iteration's moefuse_layer_check at the end, time printed.
 *
 * test_cuda_ep_iterations [case-substring]. With no sm_90 device every case prints SKIP. */
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

static int iteration_checked(int it) {
    return it <= 2 || it == kIterations / 2 - 1 || it == kIterations - 1;
}

/* kIterations forward + backward on R = 2, new routing every iteration, launched back to
 * back: the routing of every iteration is drawn before the loop into pinned memory and
 * copied on the ranks' streams, so nothing waits on the host between iterations except
 * at the checked ones (poisoned, waited for, compared with a fresh R = 1 run). The time
 * per iteration is over the unchecked stretches 3..999. */
static void case_iterations(void) {
    if (!ready()) return;
    const int R = 2, T[2] = {kIterTokens, kIterTokens};
    batch b;
    ep s;
    memset(&s, 0, sizeof s);
    int32_t *ids = NULL;
    float *p = NULL;
    if (!batch_make(&b, R, T, ROUTE_RANDOM, -1) ||
        !ep_open(&s, R, kIterTokens, MOEFUSE_SAVE_ACTIVATIONS) || !ep_layers_create(&s))
        goto done;
    const int64_t slots = b.off[R] * kK;
    CUDA_OK(cudaMallocHost((void **)&ids, (size_t)(kIterations * slots) * 4));
    CUDA_OK(cudaMallocHost((void **)&p, (size_t)(kIterations * slots) * 4));
    for (int it = 0; it < kIterations; it++)
        draw_routing(&b, ROUTE_RANDOM, -1, ids + it * slots, p + it * slots);
    if (!ep_upload(&s, &b, 0)) goto done; /* x and dy: the same every iteration */
    double t0 = now_s(), busy = 0;
    int timed = 0, last = -1, differing = 0;
    for (int it = 0; it < kIterations; it++) {
        batch v = b;
        v.ids = ids + it * slots;
        v.p = p + it * slots;
        const int checked = iteration_checked(it);
        if (checked && !ep_poison(&s)) goto done;
        if (!ep_upload(&s, &v, 1) || !ep_launch(&s, &v)) goto done;
        if (!checked) continue;
        if (!ep_wait(&s, R, kWaitSeconds)) goto done;
        if (last >= 2) {
            busy += now_s() - t0;
            timed += it - last;
        }
        if (!ep_gather(&s, &v, &G.got) ||
            !ref_run(&v, R * kIterTokens, s.mode, s.precision, &G.ref))
            goto done;
        const int bad = compare_results(&v, &G.ref, "R = 1", &G.got);
        differing += bad != 0;
        printf("    iteration %d: %s\n", it, bad ? "DIFFERS from R = 1" : "bitwise equal to R = 1");
        last = it;
        t0 = now_s();
    }
    if (!ep_wait(&s, R, kWaitSeconds)) goto done;
    CHECK(ep_check(&s), "moefuse_layer_check after %d iterations (see above)", kIterations);
    CHECK(differing == 0, "%d checked iterations differ from R = 1", differing);
    if (timed > 0)
        printf("    %.3f ms per iteration (forward + backward, R=%d, T=%d per rank, over %d "
               "iterations without a host synchronization)\n", 1e3 * busy / timed, R,
               kIterTokens, timed);
done:
    cudaFreeHost(ids);
    cudaFreeHost(p);
    ep_close(&s);
    batch_free(&b);
}
/* test_cuda_ep_iterations [case-substring] */
int main(int argc, char **argv) {
    static const named_case cases[] = {
        {case_iterations, "1000 iterations R=2 T=256, routing redrawn"},
    };
    return ep_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]));
}
