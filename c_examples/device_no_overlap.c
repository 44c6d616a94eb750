/* Allocates many sizes on several streams, fills each allocation with its own pattern and
 * checks that no two live allocations overlap and that no pattern was overwritten. */
#include "check.h"
#include "cuda_shim.h"

#define N 600

struct live {
    unsigned char *p;
    size_t size;
    unsigned char tag;
    CUstream stream;
};

static int overlaps(const struct live *a, const struct live *b) {
    return a->p < b->p + b->size && b->p < a->p + a->size;
}

int main(void) {
    static const size_t sizes[] = {1, 511, 512, 513, 4096, 65536, 1u << 20, (1u << 20) + 1,
                                   3u << 20, 9u << 20, 10u << 20, 25u << 20};
    static struct live lives[N];
    static unsigned char seen[25u << 20]; /* the largest size */
    cuda_start();
    CUstream streams[4];
    for (int i = 0; i < 4; i++) CU(cuStreamCreate(&streams[i], 0));
    unsigned seed = 12345;
    for (int i = 0; i < N; i++) {
        seed = seed * 1103515245u + 12345u;
        size_t size = sizes[(seed >> 8) % (sizeof sizes / sizeof sizes[0])];
        CUstream s = streams[(seed >> 16) % 4];
        unsigned char *p = tensoralloc_malloc(size, 0, s);
        CHECK(p != NULL, "malloc(%zu)", size);
        lives[i] = (struct live){p, size, (unsigned char)(i % 251 + 1), s};
        CU(cuMemsetD8Async(dptr(p), lives[i].tag, size, s));
        /* Free every third one as we go, so blocks are reused and split. */
        if (i % 3 == 2) {
            struct live *v = &lives[i - 1];
            tensoralloc_free(v->p, v->size, 0, v->stream);
            v->p = NULL;
        }
    }
    int count = 0;
    for (int i = 0; i < N; i++) {
        if (!lives[i].p) continue;
        count++;
        CU(cuMemcpyDtoHAsync(seen, dptr(lives[i].p), lives[i].size, lives[i].stream));
        CU(cuStreamSynchronize(lives[i].stream));
        for (size_t k = 0; k < lives[i].size; k++)
            CHECK(seen[k] == lives[i].tag, "allocation %d overwritten at %zu", i, k);
        for (int j = i + 1; j < N; j++)
            if (lives[j].p) CHECK(!overlaps(&lives[i], &lives[j]), "allocations %d and %d overlap", i, j);
    }
    printf("%d live allocations on 4 streams: patterns intact, no overlap\n", count);
    for (int i = 0; i < N; i++)
        if (lives[i].p) tensoralloc_free(lives[i].p, lives[i].size, 0, lives[i].stream);
    tensoralloc_device_stats s;
    CHECK(tensoralloc_get_device_stats(0, &s) == 0, "stats");
    CHECK(s.allocation[0].current == 0 && s.allocated_bytes[0].current == 0, "everything freed");
    CHECK(s.inactive_split[0].current == 0, "freed blocks merged back into whole segments");
    tensoralloc_empty_cache();
    uint64_t used = 1;
    if (tensoralloc_sim_device_used(0, &used) == TENSORALLOC_OK)
        CHECK(used == 0, "the driver got every segment back (%llu bytes left)", (unsigned long long)used);
    for (int i = 0; i < 4; i++) CU(cuStreamDestroy(streams[i]));
    return 0;
}
