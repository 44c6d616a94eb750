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

#endif
