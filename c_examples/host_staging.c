/* Staging host data through pinned buffers on two streams.
 *
 * Each chunk of an ordinary host array is copied into a pinned buffer from
 * tensoralloc_host_malloc, handed to one of two streams (where a real program would enqueue
 * cudaMemcpyAsync from the buffer), marked with tensoralloc_host_record_event and freed at
 * once. The pinned cache reuses a buffer only after the stream it was handed to has finished
 * with it. On the simulated device the second stream is held, so its buffers stay busy and
 * must never be handed out again until it is released. */
#include <string.h>

#include "check.h"
#include "cuda_shim.h"

enum { CHUNK = 1 << 16, CHUNKS = 8 };

static unsigned char source[CHUNK * CHUNKS];

int main(void) {
    cuda_start();
    CUstream streams[2];
    CU(cuStreamCreate(&streams[0], 0));
    CU(cuStreamCreate(&streams[1], 0));
    int simulated = tensoralloc_sim_hold_stream(streams[1]) == TENSORALLOC_OK;
    for (size_t i = 0; i < sizeof source; i++) source[i] = (unsigned char)(i * 31u + 7u);

    void *busy[CHUNKS];
    int n_busy = 0;
    for (int i = 0; i < CHUNKS; i++) {
        void *ctx = NULL;
        unsigned char *buf = tensoralloc_host_malloc(CHUNK, &ctx);
        CHECK(buf != NULL && ctx != NULL, "pinned buffer for chunk %d", i);
        for (int j = 0; j < n_busy; j++)
            CHECK(buf != busy[j], "chunk %d got a buffer the held stream still reads", i);
        memcpy(buf, source + (size_t)i * CHUNK, CHUNK);
        CHECK(memcmp(buf, source + (size_t)i * CHUNK, CHUNK) == 0, "chunk %d staged", i);
        struct CUstream_st *stream = streams[i % 2];
        /* A real program: cudaMemcpyAsync(device + i * CHUNK, buf, CHUNK, H2D, stream). */
        CHECK(tensoralloc_host_record_event(buf, ctx, stream), "record_event on our buffer");
        tensoralloc_host_free(buf, ctx);
        CHECK(tensoralloc_last_error()[0] == '\0', "free of chunk %d", i);
        if (simulated && i % 2 == 1) busy[n_busy++] = buf;
    }
    printf("staged %d chunks of %d bytes on two streams\n", CHUNKS, CHUNK);

    tensoralloc_host_stats s;
    CHECK(tensoralloc_host_get_stats(&s) == TENSORALLOC_OK, "stats");
    CHECK(s.allocations_current == 0, "every buffer was freed");
    if (simulated) {
        /* The first stream finishes at once, so its buffer is reused by the next chunk; each
         * buffer handed to the held second stream stays busy, so every second chunk pins a new one. */
        CHECK(s.driver_allocations == CHUNKS / 2, "%llu buffers pinned", (unsigned long long)s.driver_allocations);
        CHECK(s.active_blocks_current == CHUNKS / 2, "%llu buffers busy", (unsigned long long)s.active_blocks_current);
        printf("%llu pinned buffers served %d chunks; %llu wait for the held stream\n",
               (unsigned long long)s.driver_allocations, CHUNKS, (unsigned long long)s.active_blocks_current);
        tensoralloc_host_empty_cache();
        CHECK(tensoralloc_host_get_stats(&s) == TENSORALLOC_OK, "stats");
        CHECK(s.reserved_bytes_current == (unsigned long long)CHUNKS / 2 * CHUNK,
              "busy buffers survive empty_cache: %llu bytes", (unsigned long long)s.reserved_bytes_current);
        tensoralloc_sim_release_stream(streams[1]);
    }
    tensoralloc_host_empty_cache();
    CHECK(tensoralloc_host_get_stats(&s) == TENSORALLOC_OK, "stats");
    CHECK(s.reserved_bytes_current == 0, "all buffers returned: %llu bytes left", (unsigned long long)s.reserved_bytes_current);
    CHECK(s.reserved_bytes_peak >= CHUNK, "peak kept");
    printf("after the streams finished, empty_cache returned every buffer (peak %llu bytes)\n",
           (unsigned long long)s.reserved_bytes_peak);

    /* Foreign pointers: record_event says false and changes nothing; free reports them. */
    int x = 0;
    CHECK(!tensoralloc_host_record_event(&x, NULL, streams[0]), "not our pointer");
    CHECK(tensoralloc_last_error()[0] == '\0', "a foreign pointer is not an error for record_event");
    tensoralloc_host_free(&x, NULL);
    CHECK(strstr(tensoralloc_last_error(), "not a block") != NULL, "unknown pointer reported");
    CHECK(tensoralloc_host_get_stats(NULL) == TENSORALLOC_ERR_INVALID_ARGUMENT, "NULL stats rejected");

    /* Double free is reported; the buffer is cached once. */
    void *ctx = NULL;
    void *p = tensoralloc_host_malloc(100, &ctx);
    CHECK(p != NULL, "small buffer");
    tensoralloc_host_free(p, ctx);
    tensoralloc_host_free(p, ctx);
    CHECK(strstr(tensoralloc_last_error(), "double free") != NULL, "double free reported");
    CHECK(tensoralloc_host_malloc(0, &ctx) == NULL && ctx == NULL, "0 bytes give NULL");
    CHECK(tensoralloc_last_error()[0] == '\0', "0 bytes are not an error");
    printf("foreign pointers, double frees and NULL arguments were reported\n");
    return 0;
}
