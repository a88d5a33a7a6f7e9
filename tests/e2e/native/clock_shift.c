/* Shifts this process's wall clock by CLOCK_SHIFT_SECONDS (LD_PRELOAD), leaving every other clock alone.
 *
 * For the clock-skew tests (tests/e2e/test_clock_skew.py): one worker's CLOCK_REALTIME (time.time,
 * datetime.now) runs ahead or behind, as a host whose clock drifted; its monotonic clock, and with it
 * every sleep and timeout, stays true. libfaketime shifts the same clock but breaks Python's
 * time.sleep (clock_nanosleep on CLOCK_MONOTONIC returns EINVAL, or hangs), so the tests build this. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long shift_ns(void) {
    static int read = 0;
    static long long shift = 0;
    if (!read) {
        const char *value = getenv("CLOCK_SHIFT_SECONDS");
        shift = value ? (long long)(atof(value) * 1e9) : 0;
        read = 1;
    }
    return shift;
}

static void shift_timespec(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + shift_ns();
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000LL;
        ts->tv_sec -= 1;
    }
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *) = 0;
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int result = real(clock, ts);
    if (result == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) shift_timespec(ts);
    return result;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int result = clock_gettime(CLOCK_REALTIME, &ts);
    if (result == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    (void)tz;
    return result;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
