/* A program that never touches CUDA but uses the dynamic loader and fork: preloaded, it must
 * behave exactly as without the preload (and print nothing on stderr). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int (*puts_fn)(const char *);
typedef size_t (*strlen_fn)(const char *);

int main(void) {
    /* RTLD_NEXT is relative to the caller: from the executable it finds libc's puts. */
    puts_fn next_puts = (puts_fn)dlsym(RTLD_NEXT, "puts");
    strlen_fn any_strlen = (strlen_fn)dlsym(RTLD_DEFAULT, "strlen");
    void *self = dlopen(NULL, RTLD_NOW);
    void *via_handle = self ? dlsym(self, "puts") : NULL;
    if (!next_puts || !any_strlen || via_handle != (void *)next_puts) {
        fprintf(stderr, "dlsym failed: %p %p %p\n", (void *)next_puts, (void *)any_strlen, via_handle);
        return 1;
    }
    next_puts("result: dlsym(RTLD_NEXT) works");
    printf("result: strlen says %zu\n", any_strlen("tensoralloc"));
    printf("result: no such symbol: %s\n", dlsym(RTLD_DEFAULT, "no_such_symbol_anywhere") ? "found" : "null");
    char *buf = malloc(1 << 20);
    memset(buf, 7, 1 << 20);
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) _exit(buf[12345] == 7 ? 0 : 1);
    int status = 0;
    waitpid(child, &status, 0);
    printf("result: child exit %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    free(buf);
    return 0;
}
