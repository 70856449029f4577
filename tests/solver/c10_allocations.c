// An allocation counter that planning does not own, for tests: preloaded into a Python
// process (LD_PRELOAD), it counts the bytes the c10 CPU allocator holds (posix_memalign
// calls made from libc10 and their frees) and their running peak.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>

#define SLOTS (1u << 22)
static void *keys[SLOTS];
static size_t sizes[SLOTS];
static volatile int lock_;
static long long current_, peak_;
static void *sites[64];
static char site_ok[64];
static int nsites;

static int (*real_memalign)(void **, size_t, size_t);
static void (*real_free)(void *);

static void lock(void) { while (__sync_lock_test_and_set(&lock_, 1)) {} }
static void unlock(void) { __sync_lock_release(&lock_); }
static size_t slot(void *p) { return ((uintptr_t)p >> 6) * 2654435761u & (SLOTS - 1); }

static int from_c10(void *ret) {
    for (int i = 0; i < nsites; i++) if (sites[i] == ret) return site_ok[i];
    Dl_info info;
    int ok = dladdr(ret, &info) && info.dli_fname && strstr(info.dli_fname, "libc10.so") != NULL;
    if (nsites < 64) { sites[nsites] = ret; site_ok[nsites] = ok; nsites++; }
    return ok;
}

int posix_memalign(void **out, size_t align, size_t n) {
    if (!real_memalign) real_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    int err = real_memalign(out, align, n);
    if (err == 0 && *out) {
        void *ret = __builtin_return_address(0);
        lock();
        if (from_c10(ret)) {
            size_t s = slot(*out);
            while (keys[s]) s = (s + 1) & (SLOTS - 1);
            keys[s] = *out; sizes[s] = n;
            current_ += n;
            if (current_ > peak_) peak_ = current_;
        }
        unlock();
    }
    return err;
}

void free(void *p) {
    if (!real_free) real_free = dlsym(RTLD_NEXT, "free");
    if (p) {
        lock();
        size_t s = slot(p);
        while (keys[s] && keys[s] != p) s = (s + 1) & (SLOTS - 1);
        if (keys[s] == p) {
            current_ -= sizes[s];
            // backward-shift deletion keeps the probe chains intact
            size_t hole = s, j = s;
            for (;;) {
                j = (j + 1) & (SLOTS - 1);
                if (!keys[j]) break;
                size_t home = slot(keys[j]);
                if ((hole <= j) ? (home <= hole || home > j) : (home <= hole && home > j)) {
                    keys[hole] = keys[j]; sizes[hole] = sizes[j]; hole = j;
                }
            }
            keys[hole] = 0;
        }
        unlock();
    }
    real_free(p);
}

long long c10count_current(void) { return current_; }
long long c10count_peak(void) { return peak_; }
void c10count_reset(void) { lock(); peak_ = current_; unlock(); }
