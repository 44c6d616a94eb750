/* record_stream: a block used by a side stream is not reused until the side stream's work
 * has completed. The simulated device holds the side stream to keep its work pending. */
#include <string.h>

#include "check.h"

int main(void) {
    struct CUstream_st *main_stream = stream_n(1), *side = stream_n(2);
    int simulated = tensoralloc_sim_hold_stream(side) == TENSORALLOC_OK;

    void *p = tensoralloc_malloc(8192, 0, main_stream);
    CHECK(p, "malloc");
    tensoralloc_record_stream(p, side);
    CHECK(tensoralloc_last_error()[0] == '\0', "record_stream succeeded");
    tensoralloc_free(p, 8192, 0, main_stream);

    tensoralloc_device_stats s;
    CHECK(tensoralloc_get_device_stats(0, &s) == 0, "stats");
    CHECK(s.allocation[0].current == 0, "the client freed it");
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
    return 0;
}
