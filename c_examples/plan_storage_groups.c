/* The storage-group planner (Static Runtime's memory planner): values that never live
 * together share a group; sizes reported in one iteration lay out the next one's buffer;
 * groups grow; managed outputs get their own buffer until released. */
#include "check.h"
#include "cuda_shim.h"

int main(void) {
    /* v0..v3 form a chain (each dies as the one after next is made); v4 is an output. */
    const uint64_t first[5] = {0, 1, 2, 3, 3};
    const uint64_t last[5] = {1, 2, 3, 4, 4};
    const bool output[5] = {false, false, false, false, true};
    size_t sizes[5] = {1000, 3000, 2000, 100, 500};
    tensoralloc_storage_plan *p = tensoralloc_storage_plan_new(5, first, last, output, -1, NULL);
    CHECK(p, "new");

    size_t g[5];
    for (int v = 0; v < 5; v++) {
        CHECK(tensoralloc_storage_plan_group_of(p, (size_t)v, &g[v]) == 0, "group of %d", v);
    }
    printf("groups: %zu %zu %zu %zu, output %s\n", g[0], g[1], g[2], g[3], g[4] == SIZE_MAX ? "own" : "shared");
    CHECK(g[0] == g[2] && g[1] == g[3] && g[0] != g[1] && g[4] == SIZE_MAX, "v2 reuses v0's group, v3 v1's");

    tensoralloc_storage_plan_stats s;
    void *ptr[5];
    for (int iter = 0; iter < 3; iter++) {
        if (iter == 2) {
            sizes[2] = 5000; /* v2 grows: no room this iteration, room the next */
        }
        CHECK(tensoralloc_storage_plan_allocate(p) == 0, "allocate");
        for (int v = 0; v < 5; v++) {
            CHECK(tensoralloc_storage_plan_place(p, (size_t)v, sizes[v], &ptr[v]) == 0, "place %d", v);
        }
        printf("iteration %d: v0 %p v2 %p output %p\n", iter, ptr[0], ptr[2], ptr[4]);
        if (iter == 0) {
            CHECK(ptr[0] == NULL && ptr[4] == NULL, "first iteration: sizes unknown, client allocates");
        } else {
            CHECK(ptr[0] && ptr[1] && ptr[3] && ptr[4], "placed in the buffers");
            CHECK(ptr[1] == ptr[3], "shared group, same bytes");
        }
        if (iter == 1) {
            CHECK(ptr[0] == ptr[2], "v0 and v2 share bytes");
        }
        if (iter == 2) {
            CHECK(ptr[2] == NULL, "v2 grew beyond its group: client allocates it this time");
        }
        CHECK(tensoralloc_storage_plan_deallocate(p) == 0, "deallocate");
        CHECK(tensoralloc_storage_plan_get_stats(p, &s) == 0, "stats");
        printf("  managed %llu bytes, %llu values, %llu reused, outputs %llu bytes\n",
               (unsigned long long)s.managed_bytes, (unsigned long long)s.managed_values,
               (unsigned long long)s.reused_values, (unsigned long long)s.output_buffer_bytes);
        CHECK(tensoralloc_storage_plan_allocate(p) == TENSORALLOC_ERR_INVALID_ARGUMENT, "outputs not released");
        CHECK(tensoralloc_storage_plan_release_outputs(p) == 0, "release outputs");
    }
    CHECK(tensoralloc_storage_plan_get_stats(p, &s) == 0, "stats");
    CHECK(s.managed_bytes == 5056 + 3008, "groups sized by their largest value: %llu", (unsigned long long)s.managed_bytes);
    CHECK(s.managed_values == 4 && s.reused_values == 2 && s.groups == 2, "counters");
    CHECK(s.output_buffer_bytes == 512 && s.iterations == 3, "output buffer");

    /* Bad input. */
    CHECK(tensoralloc_storage_plan_place(p, 0, 10, &ptr[0]) == TENSORALLOC_ERR_INVALID_ARGUMENT, "no iteration");
    printf("no iteration: %s\n", tensoralloc_last_error());
    CHECK(tensoralloc_storage_plan_group_of(p, 99, &g[0]) == TENSORALLOC_ERR_INVALID_ARGUMENT, "unknown value");
    const uint64_t backwards[1] = {5};
    const uint64_t early[1] = {2};
    CHECK(tensoralloc_storage_plan_new(1, backwards, early, NULL, -1, NULL) == NULL, "first > last");
    printf("first > last: %s\n", tensoralloc_last_error());
    CHECK(tensoralloc_storage_plan_new(1, NULL, early, NULL, -1, NULL) == NULL, "NULL array");
    tensoralloc_storage_plan_free(p);
    tensoralloc_storage_plan_free(NULL);

    /* The same on device 0: each iteration's buffer comes from the caching device allocator. */
    cuda_start();
    CUstream stream;
    CU(cuStreamCreate(&stream, 0));
    tensoralloc_storage_plan *d = tensoralloc_storage_plan_new(5, first, last, output, 0, stream);
    if (d) {
        for (int iter = 0; iter < 2; iter++) {
            CHECK(tensoralloc_storage_plan_allocate(d) == 0, "device allocate");
            CHECK(tensoralloc_storage_plan_place(d, 1, 4096, &ptr[1]) == 0, "device place");
            CHECK(tensoralloc_storage_plan_deallocate(d) == 0, "device deallocate");
            CHECK(tensoralloc_storage_plan_release_outputs(d) == 0, "device release");
        }
        CHECK(ptr[1] != NULL, "device buffer in the second iteration");
        tensoralloc_storage_plan_free(d);
    } else {
        printf("no device: %s\n", tensoralloc_last_error());
    }
    printf("plan_storage_groups: ok\n");
    return 0;
}
