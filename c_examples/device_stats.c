/* Statistics: counts and bytes per pool, peaks and their reset, accumulated totals. */
#include "check.h"
#include "cuda_shim.h"

int main(void) {
    cuda_start();
    CUstream s1;
    CU(cuStreamCreate(&s1, 0));
    tensoralloc_device_stats s;
    CHECK(tensoralloc_reset_peak_stats(0) == 0 && tensoralloc_reset_accumulated_stats(0) == 0, "reset");

    void *small = tensoralloc_malloc(1000, 0, s1);
    void *large = tensoralloc_malloc(5u << 20, 0, s1);
    CHECK(small && large, "malloc");
    CHECK(tensoralloc_get_device_stats(0, &s) == 0, "stats");
    CHECK(s.allocation[TENSORALLOC_STAT_SMALL_POOL].current == 1, "one small");
    CHECK(s.allocation[TENSORALLOC_STAT_LARGE_POOL].current == 1, "one large");
    CHECK(s.allocated_bytes[TENSORALLOC_STAT_SMALL_POOL].current == 1024, "rounded to 512 B");
    CHECK(s.requested_bytes[TENSORALLOC_STAT_SMALL_POOL].current == 1000, "requested bytes unrounded");
    CHECK(s.allocated_bytes[TENSORALLOC_STAT_AGGREGATE].current == 1024 + (5 << 20), "aggregate");
    CHECK(s.reserved_bytes[TENSORALLOC_STAT_SMALL_POOL].current == 2 << 20, "2 MiB small segment");
    CHECK(s.reserved_bytes[TENSORALLOC_STAT_LARGE_POOL].current == 20 << 20, "20 MiB large segment");

    tensoralloc_free(large, 5u << 20, 0, s1);
    CHECK(tensoralloc_get_device_stats(0, &s) == 0, "stats");
    CHECK(s.allocated_bytes[0].peak == 1024 + (5 << 20), "peak remembers the large block");
    CHECK(s.allocation[0].allocated == 2 && s.allocation[0].freed == 1, "accumulated");
    CHECK(tensoralloc_reset_peak_stats(0) == 0, "reset peaks");
    CHECK(tensoralloc_get_device_stats(0, &s) == 0, "stats");
    CHECK(s.allocated_bytes[0].peak == 1024, "peak reset to current");

    /* Bad input: clear errors, documented return values. */
    CHECK(tensoralloc_get_device_stats(0, NULL) == TENSORALLOC_ERR_INVALID_ARGUMENT, "NULL out");
    CHECK(tensoralloc_get_device_stats(99, &s) == TENSORALLOC_ERR_INVALID_ARGUMENT, "bad device");
    CHECK(tensoralloc_get_device_stats(-1, &s) == TENSORALLOC_ERR_INVALID_ARGUMENT, "negative device");
    printf("bad device: %s\n", tensoralloc_last_error());
    CHECK(tensoralloc_malloc(0, 0, s1) == NULL && tensoralloc_last_error()[0] == '\0', "size 0: NULL, no error");
    CHECK(tensoralloc_malloc((size_t)-1, 0, s1) == NULL, "absurd size");
    printf("absurd size: %s\n", tensoralloc_last_error());
    CHECK(tensoralloc_malloc(64, 99, s1) == NULL, "bad device");
    CHECK(tensoralloc_malloc(64, -3, s1) == NULL, "negative device");

    int not_ours;
    tensoralloc_free(&not_ours, 4, 0, s1);
    printf("unknown free: %s\n", tensoralloc_last_error());
    tensoralloc_free(small, 1000, 0, s1);
    tensoralloc_free(small, 1000, 0, s1); /* double free: reported, ignored */
    CHECK(tensoralloc_last_error()[0] != '\0', "double free reported");
    tensoralloc_free(NULL, 0, 0, s1);
    CHECK(tensoralloc_last_error()[0] == '\0', "freeing NULL is a no-op");
    CHECK(tensoralloc_get_device_stats(0, &s) == 0, "stats");
    CHECK(s.num_invalid_frees == 2, "two invalid frees counted, got %lld", (long long)s.num_invalid_frees);
    CHECK(s.allocation[0].current == 0, "nothing corrupted");
    printf("statistics checked\n");
    return 0;
}
