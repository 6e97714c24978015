/* Replaying a recorded list of C kernel calls in one call from Python.

   CPU step replay (vlite/worker/cpu_graphs.py) records a decode forward as the list of C
   calls it makes; calling them back one by one through ctypes costs a few microseconds
   each (the arguments are converted every time), about a millisecond per token. Here the
   list is walked in C.

   Every recorded kernel takes pointers, integers and at most 8 floats. On the x86-64
   System V ABI the integer-class arguments fill six registers and then the stack, in
   order, and the floating-point ones fill xmm0-xmm7, independently of the integers: so a
   kernel whose integer arguments are a[0..n) and float arguments f[0..m) is called
   correctly through a pointer of type vl_any_fn, which passes 32 integers and 8 doubles
   (the unused ones are ignored). A float travels in the low 32 bits of a double's
   register. The Python side checks the platform, and calls vl_replay_probe through this
   path before using it (call_replay.py). */
#include <stdint.h>
#include <string.h>

#define VL_REPLAY_INTS 32
#define VL_REPLAY_FLOATS 8

#define I8 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t
#define D8 double, double, double, double, double, double, double, double
typedef int64_t (*vl_any_fn)(I8, I8, I8, I8, D8);
#define A8(k) a[k], a[k + 1], a[k + 2], a[k + 3], a[k + 4], a[k + 5], a[k + 6], a[k + 7]
#define F8(f) f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]

typedef struct {
    void *fn;
    int32_t threads_at;    /* index in ints[] that takes the thread count, or -1 */
    int32_t checks_result; /* the kernel returns int: nonzero is a failure */
    int64_t ints[VL_REPLAY_INTS];
    double floats[VL_REPLAY_FLOATS];
} vl_call;

/* Run calls[0..n) in order; 0, or 1 + the index of the first call that failed. */
int64_t vl_replay(const vl_call *calls, int64_t n, int64_t threads) {
    int64_t a[VL_REPLAY_INTS];
    for (int64_t i = 0; i < n; i++) {
        const vl_call *c = &calls[i];
        memcpy(a, c->ints, sizeof a);
        if (c->threads_at >= 0) a[c->threads_at] = threads;
        int64_t result = ((vl_any_fn)c->fn)(A8(0), A8(8), A8(16), A8(24), F8(c->floats));
        if (c->checks_result && (int32_t)result != 0) return i + 1;
    }
    return 0;
}

/* 0 when called with 1..9, 2.5f and -7 (three integers on the stack, one float between
   them, an int last): the replay path's self-test. */
int32_t vl_replay_probe(int64_t a0, int64_t a1, int64_t a2, int64_t a3, int64_t a4, int64_t a5,
                        int64_t a6, int64_t a7, int64_t a8, float f, int32_t b) {
    int64_t expected = 1;
    int64_t got[9] = {a0, a1, a2, a3, a4, a5, a6, a7, a8};
    for (int i = 0; i < 9; i++, expected++)
        if (got[i] != expected) return 1;
    return f == 2.5f && b == -7 ? 0 : 1;
}
