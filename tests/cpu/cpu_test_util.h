/* What the tests of tests/cpu/ share (linked into each of them; not named test_*: it is
 * no test of its own). */
#ifndef MOEFUSE_CPU_TEST_UTIL_H
#define MOEFUSE_CPU_TEST_UTIL_H

#include <stddef.h>

/* malloc that never returns NULL (0 bytes: 1): out of memory ends the test binary with
 * exit code 2 and a message naming it. */
void *xmalloc(size_t bytes);

#endif
