/* The invariants of a routing plan (src/host/internal.h, mf_plan), checked against
 * the ids it was built from. Shared by the plan tests and the fuzz target. */
#ifndef MOEFUSE_PLAN_CHECK_H
#define MOEFUSE_PLAN_CHECK_H

#include "internal.h"

/* Returns NULL when the plan is right, else a static message naming the first broken
 * invariant. */
const char *plan_check(const mf_plan *plan, const int32_t *ids, int num_experts);

#endif
