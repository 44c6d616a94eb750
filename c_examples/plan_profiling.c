/* The profiling allocator: record an iteration, plan it, validate a later one, serve
 * iterations from one blob, survive an iteration that differs from the plan, and carry the
 * plan over in JSON. */
#include <string.h>

#include "check.h"
#include "cuda_shim.h"

/* One "iteration": a and b live together, c reuses a's bytes. `grow` changes c's size. */
static void iteration(tensoralloc_profiling *p, size_t grow) {
    char *a = tensoralloc_profiling_malloc(p, 1000);
    char *b = tensoralloc_profiling_malloc(p, 2000);
    CHECK(a && b, "malloc");
    memset(a, 1, 1000);
    memset(b, 2, 2000);
    CHECK(tensoralloc_profiling_release(p, a) == 0, "release a");
    char *c = tensoralloc_profiling_malloc(p, 1000 + grow);
    CHECK(c, "malloc c");
    memset(c, 3, 1000 + grow);
    for (int i = 0; i < 2000; i++) {
        CHECK(b[i] == 2, "b intact at %d", i);
    }
    CHECK(tensoralloc_profiling_release(p, b) == 0, "release b");
    CHECK(tensoralloc_profiling_release(p, c) == 0, "release c");
}

static void run(tensoralloc_profiling *p, const char *where) {
    tensoralloc_profiling_stats s;
    bool matched = false;

    CHECK(tensoralloc_profiling_begin_recording(p) == 0, "begin recording");
    iteration(p, 0);
    CHECK(tensoralloc_profiling_end_recording(p) == 0, "end recording");
    CHECK(tensoralloc_profiling_plan(p, NULL) == 0, "plan");
    CHECK(tensoralloc_profiling_get_stats(p, &s) == 0, "stats");
    printf("%s: plan of %llu allocations, blob %llu bytes\n", where, (unsigned long long)s.plan_allocations,
           (unsigned long long)s.plan_blob_bytes);
    CHECK(s.plan_allocations == 3 && s.plan_planned == 3, "three planned");
    CHECK(s.plan_blob_bytes == 1024 + 2048, "c reuses a's bytes: %llu", (unsigned long long)s.plan_blob_bytes);

    CHECK(tensoralloc_profiling_begin_validating(p) == 0, "begin validating");
    iteration(p, 0);
    CHECK(tensoralloc_profiling_end_validating(p, &matched) == 0 && matched, "same iteration matches");
    CHECK(tensoralloc_profiling_begin_validating(p) == 0, "begin validating");
    iteration(p, 24);
    CHECK(tensoralloc_profiling_end_validating(p, &matched) == 0 && !matched, "changed iteration does not match");

    for (int k = 0; k < 3; k++) {
        CHECK(tensoralloc_profiling_begin_serving(p) == 0, "begin serving");
        iteration(p, 0);
        CHECK(tensoralloc_profiling_end_serving(p) == 0, "end serving");
    }
    CHECK(tensoralloc_profiling_get_stats(p, &s) == 0, "stats");
    CHECK(s.served_from_blob == 9 && s.mismatches == 0, "all from the blob: %llu", (unsigned long long)s.served_from_blob);

    /* A changed iteration is served correctly; the stray allocation is counted. */
    CHECK(tensoralloc_profiling_begin_serving(p) == 0, "begin serving");
    iteration(p, 5000);
    CHECK(tensoralloc_profiling_end_serving(p) == 0, "end serving");
    CHECK(tensoralloc_profiling_get_stats(p, &s) == 0, "stats");
    printf("%s: %llu served from the blob, %llu mismatches\n", where, (unsigned long long)s.served_from_blob,
           (unsigned long long)s.mismatches);
    CHECK(s.served_from_blob == 11 && s.mismatches == 1 && s.live_allocations == 0, "one mismatch");
}

int main(void) {
    tensoralloc_profiling *host = tensoralloc_profiling_new(-1, NULL, 64);
    CHECK(host, "host profiler");
    run(host, "host");

    /* Save the plan, load it into a fresh allocator, serve from it. */
    size_t len = 0;
    CHECK(tensoralloc_profiling_save_json(host, NULL, 0, &len) == 0 && len > 0, "json length");
    char *json = malloc(len + 1);
    CHECK(json, "malloc");
    CHECK(tensoralloc_profiling_save_json(host, json, len, &len) == TENSORALLOC_ERR_INVALID_ARGUMENT, "too small");
    CHECK(tensoralloc_profiling_save_json(host, json, len + 1, &len) == 0, "save");
    printf("plan: %s\n", json);
    tensoralloc_profiling *loaded = tensoralloc_profiling_new(-1, NULL, 64);
    CHECK(loaded && tensoralloc_profiling_load_json(loaded, json) == 0, "load");
    CHECK(tensoralloc_profiling_begin_serving(loaded) == 0, "serve loaded plan");
    iteration(loaded, 0);
    CHECK(tensoralloc_profiling_end_serving(loaded) == 0, "end serving");
    tensoralloc_profiling_stats s;
    CHECK(tensoralloc_profiling_get_stats(loaded, &s) == 0 && s.served_from_blob == 3, "served from loaded plan");
    CHECK(tensoralloc_profiling_load_json(loaded, "{\"not\": \"a plan\"}") == TENSORALLOC_ERR_INVALID_ARGUMENT,
          "bad json refused");
    printf("bad json: %s\n", tensoralloc_last_error());
    free(json);

    /* Misuse: clear errors, nothing corrupted. */
    int local;
    CHECK(tensoralloc_profiling_release(host, &local) == TENSORALLOC_ERR_UNKNOWN_POINTER, "unknown pointer");
    printf("unknown pointer: %s\n", tensoralloc_last_error());
    CHECK(tensoralloc_profiling_end_serving(host) == TENSORALLOC_ERR_INVALID_ARGUMENT, "not serving");
    CHECK(tensoralloc_profiling_begin_recording(NULL) == TENSORALLOC_ERR_INVALID_ARGUMENT, "NULL handle");
    CHECK(tensoralloc_profiling_new(-1, NULL, 3) == NULL, "bad alignment");
    CHECK(tensoralloc_profiling_malloc(host, 0) == NULL && tensoralloc_last_error()[0] == '\0', "0 bytes: NULL");
    tensoralloc_profiling_free(loaded);
    tensoralloc_profiling_free(host);
    tensoralloc_profiling_free(NULL);

    /* The same on device 0: the blob comes from the caching device allocator. */
    cuda_start();
    CUstream stream;
    CU(cuStreamCreate(&stream, 0));
    tensoralloc_profiling *dev = tensoralloc_profiling_new(0, stream, 512);
    if (dev) {
        /* Device memory is not host-writable on a real GPU: record and serve without touching it. */
        CHECK(tensoralloc_profiling_begin_recording(dev) == 0, "device recording");
        void *a = tensoralloc_profiling_malloc(dev, 1 << 20);
        void *b = tensoralloc_profiling_malloc(dev, 1 << 20);
        CHECK(a && b && tensoralloc_profiling_release(dev, a) == 0 && tensoralloc_profiling_release(dev, b) == 0,
              "device allocations");
        CHECK(tensoralloc_profiling_end_recording(dev) == 0 && tensoralloc_profiling_plan(dev, NULL) == 0, "device plan");
        CHECK(tensoralloc_profiling_begin_serving(dev) == 0, "device serving");
        void *c = tensoralloc_profiling_malloc(dev, 1 << 20);
        void *d = tensoralloc_profiling_malloc(dev, 1 << 20);
        CHECK(c && d && c != d, "served");
        CHECK(tensoralloc_profiling_release(dev, c) == 0 && tensoralloc_profiling_release(dev, d) == 0, "release");
        CHECK(tensoralloc_profiling_end_serving(dev) == 0, "end");
        CHECK(tensoralloc_profiling_get_stats(dev, &s) == 0 && s.served_from_blob == 2, "device blob");
        printf("device: blob %llu bytes\n", (unsigned long long)s.blob_bytes);
        tensoralloc_profiling_free(dev);
    } else {
        printf("no device: %s\n", tensoralloc_last_error());
    }
    printf("plan_profiling: ok\n");
    return 0;
}
