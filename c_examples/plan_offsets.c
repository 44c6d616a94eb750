/* Offset planning: lay out allocations with known lifetimes in one arena, compare the
 * "pytorch" baseline with the default planner, check the plan and the lower bound, and see
 * bad input rejected with a last error. */
#include <string.h>

#include "check.h"

int main(void) {
    /* A lives at step 0, B at steps 0..2, C at step 1: C cannot share bytes with B. */
    const uint64_t sizes[3] = {64, 64, 128};
    const uint64_t first[3] = {0, 0, 1};
    const uint64_t last[3] = {0, 2, 1};
    uint64_t offsets[3], arena = 0, bound = 0;

    CHECK(tensoralloc_plan_lower_bound(3, sizes, first, last, 64, &bound) == 0, "lower bound");
    CHECK(bound == 192, "B and C are live together: 192 bytes, got %llu", (unsigned long long)bound);

    /* PyTorch's plan fills the gap A leaves only with something that fits, and grows at the end. */
    CHECK(tensoralloc_plan_offsets(3, sizes, first, last, 64, "pytorch", offsets, &arena) == 0, "pytorch plan");
    printf("pytorch: A@%llu B@%llu C@%llu arena %llu\n", (unsigned long long)offsets[0],
           (unsigned long long)offsets[1], (unsigned long long)offsets[2], (unsigned long long)arena);
    CHECK(arena == 256, "pytorch arena 256, got %llu", (unsigned long long)arena);
    CHECK(tensoralloc_plan_validate(3, sizes, first, last, 64, offsets, arena) == 0, "pytorch plan is valid");

    /* The default planner reaches the lower bound. */
    CHECK(tensoralloc_plan_offsets(3, sizes, first, last, 64, NULL, offsets, &arena) == 0, "default plan");
    printf("default: A@%llu B@%llu C@%llu arena %llu\n", (unsigned long long)offsets[0],
           (unsigned long long)offsets[1], (unsigned long long)offsets[2], (unsigned long long)arena);
    CHECK(arena == 192, "default arena 192, got %llu", (unsigned long long)arena);
    CHECK(tensoralloc_plan_validate(3, sizes, first, last, 64, offsets, arena) == 0, "default plan is valid");
    for (int i = 0; i < 3; i++) {
        CHECK(offsets[i] % 64 == 0, "offset %d aligned", i);
    }

    /* Every named algorithm gives a valid plan; 512-byte alignment rounds sizes up. */
    const char *names[] = {"default", "best", "exact", "greedy-by-size", "greedy-by-breadth",
                           "greedy-by-area", "greedy-by-lifetime", "greedy-by-time",
                           "first-fit-by-size", "pytorch"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        CHECK(tensoralloc_plan_offsets(3, sizes, first, last, 512, names[k], offsets, &arena) == 0, "%s", names[k]);
        CHECK(tensoralloc_plan_validate(3, sizes, first, last, 512, offsets, arena) == 0, "%s valid", names[k]);
        CHECK(offsets[0] % 512 == 0 && offsets[1] % 512 == 0 && offsets[2] % 512 == 0, "%s aligned", names[k]);
        printf("%-18s arena %llu\n", names[k], (unsigned long long)arena);
    }

    /* A wrong plan is caught. */
    const uint64_t overlapping[3] = {0, 0, 64};
    CHECK(tensoralloc_plan_validate(3, sizes, first, last, 64, overlapping, 256) == TENSORALLOC_ERR_INVALID_ARGUMENT,
          "overlap caught");
    printf("overlap: %s\n", tensoralloc_last_error());

    /* Bad input: nonzero status, a last error, nothing written. */
    arena = 12345;
    CHECK(tensoralloc_plan_offsets(3, sizes, first, last, 64, "no-such", offsets, &arena) != 0, "unknown algorithm");
    printf("unknown algorithm: %s\n", tensoralloc_last_error());
    CHECK(arena == 12345, "nothing written on error");
    const uint64_t backwards[3] = {0, 3, 1};
    CHECK(tensoralloc_plan_offsets(3, sizes, backwards, last, 64, NULL, offsets, &arena) != 0, "first > last");
    printf("first > last: %s\n", tensoralloc_last_error());
    CHECK(tensoralloc_plan_offsets(3, sizes, first, last, 0, NULL, offsets, &arena) != 0, "alignment 0");
    CHECK(tensoralloc_plan_offsets(3, sizes, first, last, 48, NULL, offsets, &arena) != 0, "alignment 48");
    printf("alignment 48: %s\n", tensoralloc_last_error());
    CHECK(tensoralloc_plan_offsets(3, NULL, first, last, 64, NULL, offsets, &arena) != 0, "NULL sizes");
    CHECK(tensoralloc_plan_offsets(3, sizes, first, last, 64, NULL, NULL, &arena) != 0, "NULL offsets");
    CHECK(tensoralloc_plan_offsets(3, sizes, first, last, 64, NULL, offsets, NULL) != 0, "NULL arena_size");
    printf("NULL arena_size: %s\n", tensoralloc_last_error());

    /* No allocations: an empty arena, NULL arrays allowed. */
    CHECK(tensoralloc_plan_offsets(0, NULL, NULL, NULL, 64, NULL, NULL, &arena) == 0 && arena == 0, "empty");
    CHECK(strlen(tensoralloc_last_error()) == 0, "no error after success");
    printf("plan_offsets: ok\n");
    return 0;
}
