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

/* vsum of TT_VW vectors at once: lane i of the result is vsum(x[i]), to the bit (the same
 * lanes added in the same pairs), with the halvings done across the vectors by shuffles, so
 * that each level adds whole vectors: about a third of the work of TT_VW vsums, and one
 * store where those make TT_VW scalar ones. */
static inline vf vsum_each(const vf x[TT_VW]) {
#if TT_VW == 16
    vf y[8], z[4], w[2];
    for (int m = 0; m < 8; m++) /* lane i + 8 onto lane i: tokens 2m, 2m + 1 */
        y[m] = __builtin_shufflevector(x[2 * m], x[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[2 * m], x[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int m = 0; m < 4; m++) /* lane i + 4 onto lane i: tokens 4m .. 4m + 3 */
        z[m] = __builtin_shufflevector(y[2 * m], y[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(y[2 * m], y[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int m = 0; m < 2; m++) /* b0 + b2 and b1 + b3: tokens 8m .. 8m + 7 */
        w[m] = __builtin_shufflevector(z[2 * m], z[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(z[2 * m], z[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                   27, 29, 31);
#elif TT_VW == 8
    vf z[4], w[2];
    for (int m = 0; m < 4; m++) /* lane i + 4 onto lane i: tokens 2m, 2m + 1 */
        z[m] = __builtin_shufflevector(x[2 * m], x[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(x[2 * m], x[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int m = 0; m < 2; m++) /* b0 + b2 and b1 + b3: tokens 4m .. 4m + 3 */
        w[m] = __builtin_shufflevector(z[2 * m], z[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(z[2 * m], z[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
    vf w[2];
    for (int m = 0; m < 2; m++) /* b0 + b2 and b1 + b3: tokens 2m, 2m + 1 */
        w[m] = __builtin_shufflevector(x[2 * m], x[2 * m + 1], 0, 1, 4, 5) +
               __builtin_shufflevector(x[2 * m], x[2 * m + 1], 2, 3, 6, 7);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7);
#endif
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
