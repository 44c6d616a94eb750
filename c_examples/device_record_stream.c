/* record_stream: a block used by a side stream is not reused until the side stream's work
 * has completed. The simulated device holds the side stream to keep its work pending. */
#include <string.h>

#include "check.h"
#include "cuda_shim.h"

int main(void) {
    cuda_start();
    CUstream main_stream, side;
    CU(cuStreamCreate(&main_stream, 0));
    CU(cuStreamCreate(&side, 0));
    int simulated = tensoralloc_sim_hold_stream(side) == TENSORALLOC_OK;

    void *p = tensoralloc_malloc(8192, 0, main_stream);
    CHECK(p, "malloc");
    CU(cuMemsetD8Async(dptr(p), 0, 8192, main_stream));
    CU(cuStreamSynchronize(main_stream)); /* the side stream may use p from now on */
    CU(cuMemsetD8Async(dptr(p), 7, 8192, side));
    tensoralloc_record_stream(p, side);
    CHECK(tensoralloc_last_error()[0] == '\0', "record_stream succeeded");
    tensoralloc_free(p, 8192, 0, main_stream);

    tensoralloc_device_stats s;
    CHECK(tensoralloc_get_device_stats(0, &s) == 0, "stats");
    CHECK(s.allocation[0].current == 0, "the client freed it");
    if (!simulated) CU(cuStreamSynchronize(side)); /* on a GPU: let the side stream finish */
    void *q = tensoralloc_malloc(8192, 0, main_stream);
    if (simulated) {
        CHECK(s.active[0].current == 1, "the side stream still uses it");
        CHECK(q != p, "not reused while the side stream is busy");
        tensoralloc_sim_release_stream(side);
        printf("deferred while the side stream was held\n");
    }
    tensoralloc_free(q, 8192, 0, main_stream);
    void *r = tensoralloc_malloc(8192, 0, main_stream);
    CHECK(r == p, "reused once the side stream's event completed");
    printf("reused after the side stream completed\n");

    /* Unknown pointers are reported, not trusted. */
    int x;
    tensoralloc_record_stream(&x, side);
    CHECK(strstr(tensoralloc_last_error(), "not a live allocation") != NULL, "unknown pointer reported");
    tensoralloc_free(r, 8192, 0, main_stream);
    CU(cuStreamDestroy(main_stream));
    CU(cuStreamDestroy(side));
    return 0;
}
