/* What the tests of tests/cpu/ share; see cpu_test_util.h. */
#include "cpu_test_util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "%s: out of memory (%zu bytes)\n", program_invocation_short_name,
                bytes);
        exit(2);
    }
    return p;
}
