/* Float vectors as wide as this CPU's registers, for the CPU kernels (paged_attention.c,
 * layers.c), with GCC/Clang vector extensions: 16 floats with AVX-512, 8 with AVX, 4
 * elsewhere. Wider than the registers, the compiler splits every operation and keeps the
 * pieces on the stack: a 16-float vector on an AVX2 CPU made the decode attention run at a
 * third of its speed, loads and stores to the stack between every two operations.
 * Loads and stores are unaligned (memcpy).
 */
#ifndef TT_VEC_H
#define TT_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define TT_VW 16
#elif defined(__AVX__)
#define TT_VW 8
#else
#define TT_VW 4
#endif

typedef float vf __attribute__((vector_size(TT_VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(TT_VW * sizeof(int32_t))));
typedef float vf4 __attribute__((vector_size(16)));
typedef float vf8 __attribute__((vector_size(32)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* The sum of the lanes, halving: the upper half added to the lower until four are left. */
static inline float vsum(vf v) {
#if TT_VW == 16
    vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif TT_VW == 8
    vf4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
    vf4 b = v;
#endif
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* The dot product of n floats: whole vectors, then the tail one by one. */
static inline float vdot(const float *restrict a, const float *restrict b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
    if (n >= TT_VW) {
        vf acc = vload(a) * vload(b);
        for (i = TT_VW; i + TT_VW <= n; i += TT_VW) acc += vload(a + i) * vload(b + i);
        s = vsum(acc);
    }
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Lanes of x where `take` is set, of y elsewhere. */
static inline vf vselect(vi take, vf x, vf y) { return (vf)(((vi)x & take) | ((vi)y & ~take)); }

/* The larger of each pair of lanes (y where x is NaN). */
static inline vf vmax(vf x, vf y) { return vselect(x > y, x, y); }

/* The largest lane. */
static inline float vmax_lanes(vf v) {
    float m = v[0];
    for (int i = 1; i < TT_VW; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* The largest of m and s[0..n): the whole vectors by vectors, then the rest one by one. */
static inline float vmax_array(const float *s, int64_t n, float m) {
    const int64_t whole = n / TT_VW * TT_VW;
    if (whole) {
        vf mv = vload(s);
        for (int64_t t = TT_VW; t < whole; t += TT_VW) mv = vmax(vload(s + t), mv);
        const float v = vmax_lanes(mv);
        m = v > m ? v : m;
    }
    for (int64_t t = whole; t < n; t++) m = s[t] > m ? s[t] : m;
    return m;
}

/* exp of every lane (clamped to [-87.3, 88.7]): Cephes' expf polynomial, within 2 ulp of
 * expf, rounding x * log2(e) to the nearest integer with the 1.5 * 2^23 trick. */
static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.3f, hi = (vf){0} + 88.7f;
    x = vselect(x < lo, lo, x);
    x = vselect(x > hi, hi, x);
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    vf n = (x * 1.44269504088896341f + magic) - magic;
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf z = x * x;
    vf y = x * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)bits;
}

#endif
