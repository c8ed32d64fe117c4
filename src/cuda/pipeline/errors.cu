/* moefuse_layer_check: the layer's device error record (mf_plan_error, written by the
 * plan, the saved check and the transport's waits) read back, cleared, and turned into
 * an error that names the argument, the rank, the peer or the stage. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "pipeline/state.h"

namespace mf {
namespace pipeline {

moefuse_status check(moefuse_layer *layer, void *stream_) {
    cuda_state *s = state_of(layer);
    const cudaStream_t stream = (cudaStream_t)stream_;
    mf_plan_error rec;
    MF_CUDA_TRY(cudaMemcpyAsync(&rec, &s->plan_state->record, sizeof rec,
                                cudaMemcpyDeviceToHost, stream));
    MF_CUDA_TRY(cudaStreamSynchronize(stream));
    if (rec.code == 0) return MOEFUSE_OK;
    MF_CUDA_TRY(cudaMemsetAsync(&s->plan_state->record, 0, sizeof rec, stream));
    MF_CUDA_TRY(cudaStreamSynchronize(stream));
    if (rec.code == MOEFUSE_ERR_EXPERT_ID)
        return mf_fail(MOEFUSE_ERR_EXPERT_ID,
                       "moefuse_forward: fwd_args.ids[%d][%d] = %d: expected -1 (dropped) or "
                       "an expert in [0, %d); that call wrote no output",
                       rec.token, rec.slot, rec.value, layer->cfg.num_experts);
    if (rec.code == MOEFUSE_ERR_DUPLICATE_EXPERT)
        return mf_fail(MOEFUSE_ERR_DUPLICATE_EXPERT,
                       "moefuse_forward: fwd_args.ids[%d][%d] = %d: expert already routed "
                       "earlier in token %d; expected no expert twice in a token; that call "
                       "wrote no output",
                       rec.token, rec.slot, rec.value, rec.token);
    if (rec.code == MOEFUSE_ERR_SAVED_STATE) {
        static const char *const what[] = {"header word", "expert_offsets/counts entry",
                                           "row_block_expert of block", "slot", "row"};
        return mf_fail(MOEFUSE_ERR_SAVED_STATE,
                       "moefuse_backward: bwd_args.saved: %s %d holds %d, which does not match "
                       "a forward of this layer with these num_tokens and ids; expected the "
                       "buffer that forward filled; that call wrote no dx and no dweights "
                       "(the weight gradients: zeros in write mode, unchanged when accumulating)",
                       rec.slot >= 0 && rec.slot < 5 ? what[rec.slot] : "entry", rec.token,
                       rec.value);
    }
    if (rec.code == MOEFUSE_ERR_CAPACITY) {
        const int EL = layer->num_local_experts, q = rec.token;
        return mf_fail(MOEFUSE_ERR_CAPACITY,
                       "rank %d: the routing sent rank %d (experts %d..%d) %d rows, over its "
                       "receive capacity of %d rows (config.recv_capacity_factor %g x "
                       "max_tokens %d x top_k %d; or a rank with other such config values); "
                       "that call sent no row and wrote no y, saved or expert_counts on any "
                       "rank; the next call works; expected a more balanced routing or a "
                       "larger recv_capacity_factor",
                       layer->cfg.rank, q, q * EL, (q + 1) * EL - 1, rec.value, rec.expected,
                       layer->cfg.recv_capacity_factor > 0 ? layer->cfg.recv_capacity_factor
                                                           : MF_RECV_CAPACITY_DEFAULT,
                       layer->cfg.max_tokens, layer->cfg.top_k);
    }
    if (rec.code == MOEFUSE_ERR_TIMEOUT) {
        static const char *const stage[] = {
            "forward: row counts", "forward: x rows", "forward: y slot rows",
            "backward: start of the call", "backward: dy and x rows",
            "backward: dx slot rows and d p"};
        const char *st = rec.slot >= 0 && rec.slot < 6 ? stage[rec.slot] : "?";
        if (rec.token < 0)  // gemm1 waiting for the rows of one receive block
            return mf_fail(MOEFUSE_ERR_TIMEOUT,
                           "rank %d: timeout after %d ms waiting for the rows of its receive "
                           "block %d at stage '%s': %u rows counted in, expected %u; that "
                           "call wrote no output on this rank; destroy and create every "
                           "rank's layer",
                           layer->cfg.rank, layer->comm ? layer->comm->timeout_ms : 0,
                           -1 - rec.token, st, (unsigned)rec.value, (unsigned)rec.expected);
        if (rec.value & 1)
            return mf_fail(MOEFUSE_ERR_TIMEOUT,
                           "rank %d: peer rank %d reported a failed call (a timeout on its side, "
                           "or at the start of a backward a saved buffer it rejected) "
                           "at stage '%s' (flag 0x%x, epoch %u); that call wrote no output on "
                           "this rank; destroy and create every rank's layer",
                           layer->cfg.rank, rec.token, st, (unsigned)rec.value,
                           (unsigned)rec.expected >> 1);
        return mf_fail(MOEFUSE_ERR_TIMEOUT,
                       "rank %d: timeout after %d ms waiting for rank %d at stage '%s': its flag "
                       "was 0x%x (epoch %u), expected epoch %u; that call wrote no output on "
                       "this rank; destroy and create every rank's layer",
                       layer->cfg.rank, layer->comm ? layer->comm->timeout_ms : 0, rec.token, st,
                       (unsigned)rec.value, (unsigned)rec.value >> 1,
                       (unsigned)rec.expected >> 1);
    }
    return mf_fail(MOEFUSE_ERR_CUDA, "moefuse_layer_check: unexpected device error record %d",
                   rec.code);
}

}  // namespace pipeline
}  // namespace mf
