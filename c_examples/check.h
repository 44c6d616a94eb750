/* Small helpers shared by the C examples: CHECK(cond, ...) prints and exits on failure. */
#ifndef TENSORALLOC_EXAMPLE_CHECK_H
#define TENSORALLOC_EXAMPLE_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tensoralloc.h"

#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                         \
            fprintf(stderr, " (last error: %s)\n", tensoralloc_last_error());     \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

/* A stream handle for the examples: any value is a stream to the simulated device. */
static inline struct CUstream_st *stream_n(uintptr_t n) {
    return (struct CUstream_st *)(n * 0x100);
}

#endif
