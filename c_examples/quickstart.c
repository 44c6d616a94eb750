/* Quickstart: allocate on two streams, free, and print the device statistics.
 *
 *   scripts/quickstart     (builds and runs this on the GPU, or on the simulated device)
 */
#include "check.h"
#include "cuda_shim.h"

int main(void) {
    cuda_start();
    CUstream compute, copy;
    CU(cuStreamCreate(&compute, 0));
    CU(cuStreamCreate(&copy, 0));

    void *a = tensoralloc_malloc(1000, 0, compute);        /* small pool: 2 MiB segment */
    void *b = tensoralloc_malloc(30u << 20, 0, compute);   /* large pool: own segment */
    void *c = tensoralloc_malloc(4096, 0, copy);           /* another stream's segment */
    CHECK(a && b && c, "allocations failed");
    CU(cuMemsetD8Async(dptr(a), 1, 1000, compute)); /* use memory on its stream */

    tensoralloc_free(a, 1000, 0, compute);
    void *again = tensoralloc_malloc(1000, 0, compute);
    CHECK(again == a, "a freed block is reused on its stream");

    tensoralloc_device_stats s;
    CHECK(tensoralloc_get_device_stats(0, &s) == TENSORALLOC_OK, "stats");
    printf("allocated: %lld bytes in %lld allocations (peak %lld bytes)\n",
           (long long)s.allocated_bytes[TENSORALLOC_STAT_AGGREGATE].current,
           (long long)s.allocation[TENSORALLOC_STAT_AGGREGATE].current,
           (long long)s.allocated_bytes[TENSORALLOC_STAT_AGGREGATE].peak);
    printf("reserved:  %lld bytes in %lld segments\n",
           (long long)s.reserved_bytes[TENSORALLOC_STAT_AGGREGATE].current,
           (long long)s.segment[TENSORALLOC_STAT_AGGREGATE].current);

    tensoralloc_free(again, 1000, 0, compute);
    tensoralloc_free(b, 30u << 20, 0, compute);
    tensoralloc_free(c, 4096, 0, copy);
    tensoralloc_empty_cache();
    CHECK(tensoralloc_get_device_stats(0, &s) == TENSORALLOC_OK, "stats");
    CHECK(s.reserved_bytes[TENSORALLOC_STAT_AGGREGATE].current == 0, "empty_cache returned everything");
    printf("after empty_cache: %lld bytes reserved\n", (long long)s.reserved_bytes[0].current);
    CU(cuStreamDestroy(compute));
    CU(cuStreamDestroy(copy));
    return 0;
}
