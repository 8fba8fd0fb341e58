/* The dcr.cond kernels: changes coded against the bits the receiver already holds.
 *
 * Positions: the elements of a chunk are split into classes by the held value's exponent field
 * (small weights have small ulps and change more often); within each class, the changes are
 * gap-coded over the class's own enumeration, which the receiver rebuilds from its own bits.
 * Values: the signed ulp step (sign-magnitude integer difference, in value order) of every change
 * that keeps its sign and class and moves at most 127 ulps; every other change is an escape,
 * coded by absolute position and XOR value. Escapes are not enumerated, so a non-escaped change
 * has the same class before and after: the same frame decodes forward (held = old) and backward
 * (held = new). All arithmetic is on integers: bit-exact by construction.
 *
 * Python glue and the frame layout: cond.py. These functions release the GIL. Beside them, the XOR-mask
 * change scans: the publisher's (``xor_diff``: the mask of two chunks and its changes) and an
 * in-place refit's (``xor_changes``, and ``xor_planes`` straight from a sparse frame's sections):
 * sparse.py's ``xor_diff``, ``xor_changes`` and ``xor_frame``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 4 /* interleaved class counters: no store-to-load chain on runs of one class */

typedef struct {
    uint32_t *rank; uint16_t *cls; int8_t *step; /* non-escaped changes, position order */
    uint32_t *esc_pos; uint64_t *esc_val;        /* escapes, position order */
    Py_ssize_t kk, ke;
} records;

/* Count the classes of unchanged runs of LANES elements, lane by lane (independent counters:
 * no store-to-load chain when neighbours share a class); returns where a change may start. */
#define COUNT_RUN(T)                                                                               \
    static __attribute__((noinline)) Py_ssize_t count_run_##T(const T *restrict a, const T *restrict x, Py_ssize_t i,  \
                                           Py_ssize_t n, int eshift, uint32_t cmask,                 \
                                           uint32_t *restrict c0, uint32_t *restrict c1,             \
                                           uint32_t *restrict c2, uint32_t *restrict c3) {           \
        for (; i + LANES <= n; i += LANES) {                                                       \
            if (x[i] | x[i + 1] | x[i + 2] | x[i + 3]) break;                                      \
            c0[(uint32_t)(a[i] >> eshift) & cmask]++;                                              \
            c1[(uint32_t)(a[i + 1] >> eshift) & cmask]++;                                          \
            c2[(uint32_t)(a[i + 2] >> eshift) & cmask]++;                                          \
            c3[(uint32_t)(a[i + 3] >> eshift) & cmask]++;                                          \
        }                                                                                          \
        return i;                                                                                  \
    }
COUNT_RUN(uint8_t)
COUNT_RUN(uint16_t)
COUNT_RUN(uint32_t)
COUNT_RUN(uint64_t)

/* Skip the unchanged elements from i (below stop): each decrements its class's countdown. Two at
 * a time, branch-free in the classes: both countdowns are read before either is written, and a
 * class met twice must have two left (one read-modify-write per class per pair, so neighbours of
 * one class do not wait on each other's stores; four at a time measured slower: more groups hold
 * a change and fall back). Returns the first element whose countdown is zero (a change), or stop. */
#define SKIP_RUN(T)                                                                                \
    static __attribute__((noinline)) Py_ssize_t skip_run_##T(const T *restrict h, Py_ssize_t i,     \
                                                             Py_ssize_t stop, int eshift,           \
                                                             uint32_t cmask, uint32_t *restrict rem) { \
        for (; i + 2 <= stop; i += 2) {                                                            \
            const uint32_t c0 = (uint32_t)(h[i] >> eshift) & cmask;                                \
            const uint32_t c1 = (uint32_t)(h[i + 1] >> eshift) & cmask;                            \
            const uint32_t r0 = rem[c0], r1 = rem[c1]; /* r1 == r0 when the classes are equal */  \
            const uint32_t same = c0 == c1;                                                        \
            if ((r0 <= same) | (r1 <= same)) break;                                                \
            rem[c0] = r0 - 1;                                                                      \
            rem[c1] = r1 - 1 - same;                                                               \
        }                                                                                          \
        for (; i < stop; i++) {                                                                    \
            const uint32_t c = (uint32_t)(h[i] >> eshift) & cmask;                                 \
            const uint32_t r = rem[c];                                                             \
            if (!r) break;                                                                         \
            rem[c] = r - 1;                                                                        \
        }                                                                                          \
        return i;                                                                                  \
    }
SKIP_RUN(uint8_t)
SKIP_RUN(uint16_t)
SKIP_RUN(uint32_t)
SKIP_RUN(uint64_t)

#define ENCODE_PASS(T)                                                                         \
    static int encode_pass_##T(const T *restrict a, const T *restrict x, Py_ssize_t n, int eshift, \
                               uint32_t cmask, uint32_t *restrict cnt, Py_ssize_t k, records *r) { \
        const int top = (int)(sizeof(T) * 8 - 1);                                              \
        const T magmask = (T)~((T)1 << top);                                                   \
        const Py_ssize_t nc = (Py_ssize_t)cmask + 1;                                           \
        uint32_t *restrict rank_out = r->rank, *restrict esc_pos = r->esc_pos;                 \
        uint16_t *restrict cls_out = r->cls;                                                   \
        int8_t *restrict step_out = r->step;                                                   \
        uint64_t *restrict esc_val = r->esc_val;                                               \
        Py_ssize_t kk = 0, ke = 0, i = 0;                                                      \
        for (;;) {                                                                             \
            i = count_run_##T(a, x, i, n, eshift, cmask, cnt, cnt + nc, cnt + 2 * nc, cnt + 3 * nc); \
            if (i >= n) break;                                                                 \
            const Py_ssize_t stop = i + LANES < n ? i + LANES : n;                             \
            for (; i < stop; i++) { /* a block with a change: element by element */             \
                const T av = a[i], xv = x[i];                                                  \
                const uint32_t c = (uint32_t)(av >> eshift) & cmask;                           \
                uint32_t *restrict lane = cnt + (i & (LANES - 1)) * nc;                        \
                if (!xv) { lane[c]++; continue; }                                              \
                if (kk + ke >= k) return -1; /* more changes than counted */                   \
                const T bv = av ^ xv;                                                          \
                if ((av >> top) == (bv >> top) && (((uint32_t)(bv >> eshift) & cmask) == c)) { \
                    int64_t d = (int64_t)(bv & magmask) - (int64_t)(av & magmask);             \
                    if (av >> top) d = -d;                                                     \
                    if (d >= -127 && d <= 127) {                                               \
                        rank_out[kk] = cnt[c] + cnt[nc + c] + cnt[2 * nc + c] + cnt[3 * nc + c]; \
                        cls_out[kk] = (uint16_t)c;                                             \
                        step_out[kk] = (int8_t)d;                                              \
                        kk++;                                                                  \
                        lane[c]++;                                                             \
                        continue;                                                              \
                    }                                                                          \
                }                                                                              \
                esc_pos[ke] = (uint32_t)i;                                                     \
                esc_val[ke] = (uint64_t)xv;                                                    \
                ke++;                                                                          \
            }                                                                                  \
        }                                                                                      \
        r->kk = kk; r->ke = ke;                                                                \
        return (kk + ke == k) ? 0 : -1;                                                        \
    }
ENCODE_PASS(uint8_t)
ENCODE_PASS(uint16_t)
ENCODE_PASS(uint32_t)
ENCODE_PASS(uint64_t)


/* ---- Golomb-Rice coding of each class's gaps (a geometric law per class: within a few percent
 * of its entropy with the best power-of-two parameter, chosen per class by exact cost) ---- */

static uint64_t rice_cost(const uint32_t *g, Py_ssize_t m, int k) {
    uint64_t bits = (uint64_t)m * (uint64_t)(k + 1);
    for (Py_ssize_t j = 0; j < m; j++) bits += g[j] >> k;
    return bits;
}

static int rice_param(const uint32_t *g, Py_ssize_t m, uint64_t *cost) {
    if (!m) { *cost = 0; return 0; }
    uint64_t sum = 0;
    for (Py_ssize_t j = 0; j < m; j++) sum += g[j];
    int k0 = 0;
    while (k0 < 31 && ((uint64_t)1 << (k0 + 1)) <= sum / (uint64_t)m) k0++;
    int best = 0;
    uint64_t best_cost = UINT64_MAX;
    for (int k = k0 > 2 ? k0 - 2 : 0; k <= k0 + 2 && k <= 31; k++) {
        const uint64_t c = rice_cost(g, m, k);
        if (c < best_cost) { best_cost = c; best = k; }
    }
    *cost = best_cost;
    return best;
}

typedef struct { uint8_t *out; size_t len; uint64_t acc; int nbits; } bitwriter;

static inline void put_bits(bitwriter *w, uint64_t v, int nb) { /* nb <= 32 */
    w->acc |= v << w->nbits;
    w->nbits += nb;
    while (w->nbits >= 8) { w->out[w->len++] = (uint8_t)w->acc; w->acc >>= 8; w->nbits -= 8; }
}

static void rice_put(bitwriter *w, uint32_t g, int k) {
    uint64_t q = (uint64_t)(g >> k);
    while (q >= 32) { put_bits(w, 0xFFFFFFFFull, 32); q -= 32; }
    put_bits(w, ((uint64_t)1 << q) - 1, (int)q + 1); /* q ones, then a zero */
    if (k) put_bits(w, g & (((uint64_t)1 << k) - 1), k);
}

static inline uint64_t peek(const uint8_t *buf, uint64_t pos) { /* buf padded with 8 zero bytes */
    uint64_t w;
    memcpy(&w, buf + (pos >> 3), 8);
    return w >> (pos & 7);
}

/* Unpack the gaps of every class (class by class, ccount[c] each, parameter params[c]). */
static const char *rice_unpack(const uint8_t *buf, size_t len, const uint32_t *ccount, const uint8_t *params,
                               Py_ssize_t nc, uint32_t *gaps) {
    const uint64_t total = (uint64_t)len * 8;
    uint64_t pos = 0;
    Py_ssize_t at = 0;
    for (Py_ssize_t c = 0; c < nc; c++) {
        const int k = params[c];
        if (k > 31) return "a Rice parameter is out of range";
        for (uint32_t j = 0; j < ccount[c]; j++) {
            uint64_t q = 0;
            for (;;) {
                const int t = __builtin_ctzll(~peek(buf, pos) | ((uint64_t)1 << 56));
                q += (uint64_t)t;
                pos += (uint64_t)t;
                if (pos > total) return "the gap bits are truncated";
                if (t < 56) { pos++; break; }
            }
            if (q >> (32 - k)) return "a gap is out of range";
            const uint64_t r = k ? peek(buf, pos) & (((uint64_t)1 << k) - 1) : 0;
            pos += (uint64_t)k;
            if (pos > total) return "the gap bits are truncated";
            gaps[at++] = (uint32_t)((q << k) | r);
        }
    }
    if ((pos + 7) / 8 != len) return "the gap bits have trailing bytes";
    return NULL;
}

/* encode(old, mask, itemsize, eshift, ebits, k) ->
 *   (class_counts u32[nc], rice_params u8[nc], gap_bits, steps u8[kk], esc_gaps u32[ke], esc_vals itemsize[ke]) */
static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer old, mask;
    int itemsize, eshift, ebits;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "y*y*iiin", &old, &mask, &itemsize, &eshift, &ebits, &k)) return NULL;
    PyObject *result = NULL;
    uint32_t *cnt = NULL, *ccount = NULL, *offs = NULL, *gaps = NULL;
    uint8_t *params = NULL;
    int64_t *last = NULL;
    records r = {0};
    Py_ssize_t n = old.len / (itemsize > 0 ? itemsize : 1);
    if (!(itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8) || old.len != mask.len ||
        old.len % itemsize || ebits < 0 || ebits > 11 || eshift < 0 || eshift + ebits > itemsize * 8 ||
        k < 0 || k > n || n >= ((Py_ssize_t)1 << 32)) {
        PyErr_SetString(PyExc_ValueError, "cond encode: bad arguments");
        goto done;
    }
    const uint32_t cmask = (1u << ebits) - 1u;
    const Py_ssize_t nc = (Py_ssize_t)cmask + 1;
    cnt = calloc((size_t)(LANES * nc), sizeof(uint32_t));
    ccount = calloc((size_t)nc, sizeof(uint32_t));
    offs = calloc((size_t)nc, sizeof(uint32_t));
    last = malloc((size_t)nc * sizeof(int64_t));
    Py_ssize_t kc = k ? k : 1;
    r.rank = malloc(kc * 4); r.cls = malloc(kc * 2); r.step = malloc(kc);
    r.esc_pos = malloc(kc * 4); r.esc_val = malloc(kc * 8);
    if (!cnt || !ccount || !offs || !last || !r.rank || !r.cls || !r.step || !r.esc_pos || !r.esc_val) {
        PyErr_NoMemory();
        goto done;
    }
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    switch (itemsize) {
    case 1: rc = encode_pass_uint8_t(old.buf, mask.buf, n, eshift, cmask, cnt, k, &r); break;
    case 2: rc = encode_pass_uint16_t(old.buf, mask.buf, n, eshift, cmask, cnt, k, &r); break;
    case 4: rc = encode_pass_uint32_t(old.buf, mask.buf, n, eshift, cmask, cnt, k, &r); break;
    default: rc = encode_pass_uint64_t(old.buf, mask.buf, n, eshift, cmask, cnt, k, &r); break;
    }
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_SetString(PyExc_ValueError, "cond encode: the mask has a different number of changes than k");
        goto done;
    }
    gaps = malloc((size_t)(r.kk ? r.kk : 1) * 4);
    params = malloc((size_t)nc);
    if (!gaps || !params) { PyErr_NoMemory(); goto done; }
    PyObject *counts_b = PyBytes_FromStringAndSize(NULL, nc * 4);
    PyObject *steps_b = PyBytes_FromStringAndSize(NULL, r.kk);
    PyObject *egaps_b = PyBytes_FromStringAndSize(NULL, r.ke * 4);
    PyObject *evals_b = PyBytes_FromStringAndSize(NULL, r.ke * itemsize);
    if (!counts_b || !steps_b || !egaps_b || !evals_b) {
        Py_XDECREF(counts_b); Py_XDECREF(steps_b); Py_XDECREF(egaps_b); Py_XDECREF(evals_b);
        goto done;
    }
    uint8_t *steps = (uint8_t *)PyBytes_AS_STRING(steps_b);
    uint32_t *egaps = (uint32_t *)PyBytes_AS_STRING(egaps_b);
    char *evals = PyBytes_AS_STRING(evals_b);
    uint64_t bits = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < r.kk; j++) ccount[r.cls[j]]++;
    uint32_t acc = 0;
    for (Py_ssize_t c = 0; c < nc; c++) { offs[c] = acc; acc += ccount[c]; last[c] = -1; }
    for (Py_ssize_t j = 0; j < r.kk; j++) { /* counting sort by class, stable: gaps within each class */
        const uint16_t c = r.cls[j];
        const uint32_t at = offs[c]++;
        gaps[at] = (uint32_t)((int64_t)r.rank[j] - last[c] - 1);
        last[c] = r.rank[j];
        const int32_t d = r.step[j];
        steps[at] = (uint8_t)(((uint32_t)d << 1) ^ (uint32_t)(d >> 31)); /* zigzag: 1..254 */
    }
    int64_t prev = -1;
    for (Py_ssize_t j = 0; j < r.ke; j++) {
        egaps[j] = (uint32_t)((int64_t)r.esc_pos[j] - prev - 1);
        prev = r.esc_pos[j];
        const uint64_t v = r.esc_val[j];
        memcpy(evals + j * itemsize, &v, (size_t)itemsize); /* little-endian hosts only (checked in cond.py) */
    }
    for (Py_ssize_t c = 0, at = 0; c < nc; at += ccount[c], c++) {
        uint64_t cost;
        params[c] = (uint8_t)rice_param(gaps + at, ccount[c], &cost);
        bits += cost;
    }
    Py_END_ALLOW_THREADS
    PyObject *bits_b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((bits + 7) / 8 + 8));
    if (!bits_b) { Py_DECREF(counts_b); Py_DECREF(steps_b); Py_DECREF(egaps_b); Py_DECREF(evals_b); goto done; }
    bitwriter w = {(uint8_t *)PyBytes_AS_STRING(bits_b), 0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0, at = 0; c < nc; at += ccount[c], c++)
        for (uint32_t j = 0; j < ccount[c]; j++) rice_put(&w, gaps[at + j], params[c]);
    if (w.nbits) w.out[w.len++] = (uint8_t)w.acc;
    Py_END_ALLOW_THREADS
    _PyBytes_Resize(&bits_b, (Py_ssize_t)w.len);
    memcpy(PyBytes_AS_STRING(counts_b), ccount, (size_t)nc * 4);
    PyObject *params_b = PyBytes_FromStringAndSize((const char *)params, nc);
    result = bits_b && params_b ? Py_BuildValue("(NNNNNN)", counts_b, params_b, bits_b, steps_b, egaps_b, evals_b) : NULL;
done:
    free(cnt); free(ccount); free(offs); free(last); free(gaps); free(params);
    free(r.rank); free(r.cls); free(r.step); free(r.esc_pos); free(r.esc_val);
    PyBuffer_Release(&old);
    PyBuffer_Release(&mask);
    return result;
}

#define NONE_LEFT UINT64_MAX
#define NONE_LEFT32 UINT32_MAX /* a countdown that never reaches 0: chunks hold < 2^32 elements */

#define DECODE_PASS(T)                                                                             \
    static const char *decode_pass_##T(const T *h, T *out, Py_ssize_t n, int eshift, uint32_t cmask, \
                                       int forward, int in_place, const uint32_t *ccount,           \
                                       const uint32_t *gaps,                                        \
                                       const uint8_t *steps, Py_ssize_t kk, const uint32_t *egaps,  \
                                       const char *evals, Py_ssize_t ke, uint32_t *rem,             \
                                       uint32_t *ptr, uint32_t *end) {                              \
        const int top = (int)(sizeof(T) * 8 - 1);                                                  \
        const T magmask = (T)~((T)1 << top);                                                       \
        const Py_ssize_t nc = (Py_ssize_t)cmask + 1;                                               \
        uint64_t acc = 0;                                                                          \
        for (Py_ssize_t c = 0; c < nc; c++) { /* rem[c]: elements of class c before its next change */ \
            ptr[c] = (uint32_t)acc; acc += ccount[c]; end[c] = (uint32_t)acc;                       \
            if (acc > (uint64_t)kk) return "class counts exceed the changes";                       \
            rem[c] = ptr[c] < end[c] ? gaps[ptr[c]] : NONE_LEFT32;                                 \
        }                                                                                          \
        if (acc != (uint64_t)kk) return "class counts do not add up to the changes";               \
        Py_ssize_t e = 0, i = 0;                                                                   \
        uint64_t next_esc = ke ? egaps[0] : NONE_LEFT;                                             \
        for (;;) {                                                                                 \
            const Py_ssize_t stop = next_esc < (uint64_t)n ? (Py_ssize_t)next_esc : n;             \
            for (;;) { /* between escapes: skip to the next change, apply it */                     \
                i = skip_run_##T(h, i, stop, eshift, cmask, rem);                                  \
                if (i >= stop) break;                                                              \
                const T hv = h[i];                                                                 \
                const uint32_t c = (uint32_t)(hv >> eshift) & cmask;                               \
                if (ptr[c] >= end[c]) return "a change lies outside its class";                   \
                const uint32_t j = ptr[c]++;                                                       \
                const uint32_t z = steps[j];                                                       \
                int64_t d = (z & 1u) ? -(int64_t)((z + 1) >> 1) : (int64_t)(z >> 1); /* unzigzag */ \
                if (d == 0 || d > 127 || d < -127) return "a step is out of range";                \
                if (hv >> top) d = -d;                                                             \
                if (!forward) d = -d;                                                              \
                const int64_t mag = (int64_t)(hv & magmask) + d;                                   \
                if (mag < 0 || (uint64_t)mag > (uint64_t)magmask) return "a step leaves the type"; \
                const T nv = (T)((hv & (T)~magmask) | (T)mag);                                     \
                if ((((uint32_t)(nv >> eshift)) & cmask) != c) return "a step changes the class";  \
                out[i] = in_place ? nv : (T)(hv ^ nv);                                             \
                rem[c] = ptr[c] < end[c] ? gaps[ptr[c]] : NONE_LEFT32;                             \
                i++;                                                                               \
            }                                                                                      \
            if (i >= n) break;                                                                     \
            uint64_t v = 0; /* i is the next escape: not enumerated in any class */                \
            memcpy(&v, evals + e * sizeof(T), sizeof(T));                                          \
            if (!v) return "an escape changes nothing";                                            \
            out[i] = in_place ? (T)(h[i] ^ (T)v) : (T)v;                                           \
            e++;                                                                                   \
            next_esc = e < ke ? next_esc + 1 + egaps[e] : NONE_LEFT;                               \
            i++;                                                                                   \
        }                                                                                          \
        if (e != ke) return "an escape lies outside the chunk";                                    \
        for (Py_ssize_t c = 0; c < nc; c++)                                                        \
            if (ptr[c] != end[c]) return "a change lies outside its class";                        \
        return NULL;                                                                               \
    }
DECODE_PASS(uint8_t)
DECODE_PASS(uint16_t)
DECODE_PASS(uint32_t)
DECODE_PASS(uint64_t)

/* decode(held, out, itemsize, eshift, ebits, forward, in_place, class_counts, rice_params, gap_bits, steps,
 * esc_gaps, esc_vals) writes the XOR mask into ``out`` (zeroed by the caller), or, with ``in_place``
 * (``out`` is ``held``), the new bits over the held ones; ValueError on any inconsistency (then, in
 * place, the changes before the inconsistency are already written: the caller's tensor digest or
 * undo takes care of it). */
static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer held, out, counts, params, bits, steps, egaps, evals;
    int itemsize, eshift, ebits, forward, in_place;
    if (!PyArg_ParseTuple(args, "y*w*iiippy*y*y*y*y*y*", &held, &out, &itemsize, &eshift, &ebits, &forward,
                          &in_place, &counts, &params, &bits, &steps, &egaps, &evals))
        return NULL;
    PyObject *result = NULL;
    const char *err = NULL;
    uint32_t *ptr = NULL, *end = NULL, *gaps = NULL;
    uint8_t *padded = NULL;
    uint32_t *rem = NULL;
    Py_ssize_t n = held.len / (itemsize > 0 ? itemsize : 1);
    Py_ssize_t kk = steps.len, ke = egaps.len / 4;
    if (!(itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8) || held.len != out.len ||
        held.len % itemsize || ebits < 0 || ebits > 11 || eshift < 0 || eshift + ebits > itemsize * 8 ||
        n >= ((Py_ssize_t)1 << 32)) {
        PyErr_SetString(PyExc_ValueError, "cond decode: bad arguments");
        goto done;
    }
    const uint32_t cmask = (1u << ebits) - 1u;
    const Py_ssize_t nc = (Py_ssize_t)cmask + 1;
    if (counts.len != nc * 4 || params.len != nc || egaps.len % 4 || evals.len != ke * itemsize) {
        PyErr_SetString(PyExc_ValueError, "cond frame sections have inconsistent sizes");
        goto done;
    }
    ptr = malloc((size_t)nc * 4); end = malloc((size_t)nc * 4);
    rem = malloc((size_t)nc * 4);
    gaps = malloc((size_t)(kk ? kk : 1) * 4);
    padded = calloc((size_t)bits.len + 8, 1);
    if (!ptr || !end || !rem || !gaps || !padded) { PyErr_NoMemory(); goto done; }
    memcpy(padded, bits.buf, (size_t)bits.len);
    Py_BEGIN_ALLOW_THREADS
    uint64_t total = 0;
    for (Py_ssize_t c = 0; c < nc; c++) total += ((const uint32_t *)counts.buf)[c];
    if (total != (uint64_t)kk) err = "class counts do not add up to the changes";
    if (!err) err = rice_unpack(padded, (size_t)bits.len, counts.buf, params.buf, nc, gaps);
    if (!err) switch (itemsize) {
#define CALL(T) err = decode_pass_##T(held.buf, out.buf, n, eshift, cmask, forward, in_place, counts.buf, gaps, \
                                      steps.buf, kk, egaps.buf, evals.buf, ke, rem, ptr, end)
    case 1: CALL(uint8_t); break;
    case 2: CALL(uint16_t); break;
    case 4: CALL(uint32_t); break;
    default: CALL(uint64_t); break;
#undef CALL
    }
    Py_END_ALLOW_THREADS
    if (err) {
        PyErr_Format(PyExc_ValueError, "cond frame does not decode against the held bits: %s", err);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    free(ptr); free(end); free(rem); free(gaps); free(padded);
    PyBuffer_Release(&held); PyBuffer_Release(&out); PyBuffer_Release(&counts); PyBuffer_Release(&params);
    PyBuffer_Release(&bits);
    PyBuffer_Release(&steps); PyBuffer_Release(&egaps); PyBuffer_Release(&evals);
    return result;
}

/* xor_changes(held, mask, out, positions, old, new, itemsize, wide, base) -> k: ``out = held ^ mask``, and,
 * for every non-zero element i of ``mask`` in ascending order, ``positions[j] = base + i`` (int64 when
 * ``wide``, else uint32), ``old[j] = held[i]``, ``new[j] = out[i]``. -1 when the mask has more
 * changes than the outputs hold (nothing past them is written). One pass where numpy needs four
 * (XOR, a word scan, two gathers); the mask is scanned by 64-bit words, so zero runs cost little. */
#define XOR_CHANGES(T, P)                                                                          \
    static Py_ssize_t xor_changes_##T##_##P(const T *restrict held, const T *restrict mask, T *restrict out, \
                                            Py_ssize_t n, P *restrict pos, T *restrict old,            \
                                            T *restrict nw, Py_ssize_t cap, int64_t base) {          \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = held[i] ^ mask[i];                             \
        const Py_ssize_t per = 8 / (Py_ssize_t)sizeof(T), whole = n / per * per;                   \
        Py_ssize_t k = 0;                                                                          \
        for (Py_ssize_t i = 0; i < n; i += per) {                                                  \
            if (i < whole) {                                                                       \
                uint64_t w;                                                                        \
                memcpy(&w, mask + i, 8);                                                           \
                if (!w) continue;                                                                  \
                if (k + per <= cap) { /* branch-free: write every element, keep the changed */    \
                    for (Py_ssize_t e = i; e < i + per; e++) {                                     \
                        pos[k] = (P)(base + e); old[k] = held[e]; nw[k] = out[e];                  \
                        k += mask[e] != 0;                                                         \
                    }                                                                              \
                    continue;                                                                      \
                }                                                                                  \
            }                                                                                      \
            for (Py_ssize_t e = i; e < i + per && e < n; e++) { /* the tail, or near the outputs' end */ \
                if (!mask[e]) continue;                                                            \
                if (k == cap) return -1;                                                           \
                pos[k] = (P)(base + e); old[k] = held[e]; nw[k] = out[e]; k++;                     \
            }                                                                                      \
        }                                                                                          \
        return k;                                                                                  \
    }
#define XOR_CHANGES_2(T) XOR_CHANGES(T, uint32_t) XOR_CHANGES(T, int64_t)
XOR_CHANGES_2(uint8_t)
XOR_CHANGES_2(uint16_t)
XOR_CHANGES_2(uint32_t)
XOR_CHANGES_2(uint64_t)

/* k = NAME_<element type>_<position type>(...): the kernel for ``itemsize`` and ``wide`` (int64 positions). */
#define BY_WIDTHS(NAME, ...)                                                                       \
    switch (itemsize) {                                                                            \
    case 1: k = wide ? NAME##_uint8_t_int64_t(__VA_ARGS__) : NAME##_uint8_t_uint32_t(__VA_ARGS__); break;     \
    case 2: k = wide ? NAME##_uint16_t_int64_t(__VA_ARGS__) : NAME##_uint16_t_uint32_t(__VA_ARGS__); break;   \
    case 4: k = wide ? NAME##_uint32_t_int64_t(__VA_ARGS__) : NAME##_uint32_t_uint32_t(__VA_ARGS__); break;   \
    default: k = wide ? NAME##_uint64_t_int64_t(__VA_ARGS__) : NAME##_uint64_t_uint32_t(__VA_ARGS__); break;  \
    }

static PyObject *xor_changes(PyObject *self, PyObject *args) {
    Py_buffer held, mask, out, pos, old, nw;
    int itemsize, wide;
    long long base;
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*w*ipL", &held, &mask, &out, &pos, &old, &nw, &itemsize, &wide, &base))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = held.len / (itemsize > 0 ? itemsize : 1), cap = old.len / (itemsize > 0 ? itemsize : 1);
    if (!(itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8) || held.len % itemsize ||
        mask.len != held.len || out.len != held.len || old.len != nw.len || old.len % itemsize ||
        pos.len != cap * (wide ? 8 : 4) || base < 0 || (!wide && base + n > ((long long)1 << 32))) {
        PyErr_SetString(PyExc_ValueError, "xor_changes: bad arguments");
        goto done;
    }
    Py_ssize_t k = 0;
    Py_BEGIN_ALLOW_THREADS
    BY_WIDTHS(xor_changes, held.buf, mask.buf, out.buf, n, pos.buf, old.buf, nw.buf, cap, base);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(k);
done:
    PyBuffer_Release(&held); PyBuffer_Release(&mask); PyBuffer_Release(&out);
    PyBuffer_Release(&pos); PyBuffer_Release(&old); PyBuffer_Release(&nw);
    return result;
}

/* xor_diff(new, old, mask, positions, values, news, itemsize, wide, base) -> k: the publisher's
 * pass over one chunk: ``mask = new ^ old``, and, for every non-zero element i of ``mask`` in
 * ascending order, ``positions[j] = base + i`` (int64 when ``wide``, else uint32), ``values[j] =
 * mask[i]``, ``news[j] = new[i]``. The mask is written whole in any case; -1 when it has more
 * changes than the outputs hold (the caller finds them in the mask instead). One pass, 64-bit word
 * by word: where numpy needs an XOR, a word scan, a compare of the hit words and three gathers. */
#define XOR_DIFF(T, P)                                                                             \
    static Py_ssize_t xor_diff_##T##_##P(const T *restrict nw, const T *restrict old, T *restrict mask, \
                                         Py_ssize_t n, P *restrict pos, T *restrict val,             \
                                         T *restrict news, Py_ssize_t cap, int64_t base) {         \
        const Py_ssize_t per = 8 / (Py_ssize_t)sizeof(T), whole = n / per * per;                   \
        Py_ssize_t k = 0;                                                                          \
        int full = 0;                                                                              \
        for (Py_ssize_t i = 0; i < whole; i += per) {                                              \
            uint64_t a, b;                                                                         \
            memcpy(&a, nw + i, 8);                                                                 \
            memcpy(&b, old + i, 8);                                                                \
            a ^= b;                                                                                \
            memcpy(mask + i, &a, 8);                                                               \
            if (!a || full) continue;                                                              \
            if (k + per <= cap) { /* branch-free: write every element, keep the changed */         \
                for (Py_ssize_t e = i; e < i + per; e++) {                                         \
                    pos[k] = (P)(base + e); val[k] = mask[e]; news[k] = nw[e];                     \
                    k += mask[e] != 0;                                                             \
                }                                                                                  \
                continue;                                                                          \
            }                                                                                      \
            for (Py_ssize_t e = i; e < i + per; e++) { /* near the outputs' end */                 \
                if (!mask[e]) continue;                                                            \
                if (k == cap) { full = 1; break; }                                                 \
                pos[k] = (P)(base + e); val[k] = mask[e]; news[k] = nw[e]; k++;                    \
            }                                                                                      \
        }                                                                                          \
        for (Py_ssize_t e = whole; e < n; e++) { /* the tail */                                   \
            mask[e] = nw[e] ^ old[e];                                                              \
            if (!mask[e] || full) continue;                                                        \
            if (k == cap) { full = 1; continue; }                                                  \
            pos[k] = (P)(base + e); val[k] = mask[e]; news[k] = nw[e]; k++;                        \
        }                                                                                          \
        return full ? -1 : k;                                                                      \
    }
#define XOR_DIFF_2(T) XOR_DIFF(T, uint32_t) XOR_DIFF(T, int64_t)
XOR_DIFF_2(uint8_t)
XOR_DIFF_2(uint16_t)
XOR_DIFF_2(uint32_t)
XOR_DIFF_2(uint64_t)

static PyObject *xor_diff(PyObject *self, PyObject *args) {
    Py_buffer nw, old, mask, pos, val, news;
    int itemsize, wide;
    long long base;
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*w*ipL", &nw, &old, &mask, &pos, &val, &news, &itemsize, &wide, &base))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = nw.len / (itemsize > 0 ? itemsize : 1), cap = val.len / (itemsize > 0 ? itemsize : 1);
    if (!(itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8) || nw.len % itemsize ||
        old.len != nw.len || mask.len != nw.len || val.len != news.len || val.len % itemsize ||
        pos.len != cap * (wide ? 8 : 4) || base < 0 || (!wide && base + n > ((long long)1 << 32))) {
        PyErr_SetString(PyExc_ValueError, "xor_diff: bad arguments");
        goto done;
    }
    Py_ssize_t k = 0;
    Py_BEGIN_ALLOW_THREADS
    BY_WIDTHS(xor_diff, nw.buf, old.buf, mask.buf, n, pos.buf, val.buf, news.buf, cap, base);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(k);
done:
    PyBuffer_Release(&nw); PyBuffer_Release(&old); PyBuffer_Release(&mask);
    PyBuffer_Release(&pos); PyBuffer_Release(&val); PyBuffer_Release(&news);
    return result;
}

/* xor_planes(held, gaps, values, out, positions, old, new, itemsize, wide, base) -> k: the same
 * outputs as xor_changes for the mask a sparse frame describes, from the frame's decompressed
 * sections themselves (no dense mask is built or read): ``gaps`` holds 4 byte planes of k uint32
 * gaps (position i = gap_0 + ... + gap_i + i), ``values`` itemsize byte planes of the k XOR values.
 * ``out = held`` with every value XORed in. A zero value changes nothing and is not listed (as
 * xor_changes does not list a zero mask element). -1 when there are more changes than the outputs
 * hold, -2 when a position falls outside ``held`` (the caller decides what that means). */
#define PIECE 8192 /* elements copied ahead of the changes at a time */
#define XOR_PLANES(T, P)                                                                           \
    static Py_ssize_t xor_planes_##T##_##P(const T *restrict held, const uint8_t *restrict g,       \
                                           const uint8_t *restrict v, Py_ssize_t kk, T *restrict out, \
                                           Py_ssize_t n, P *restrict pos, T *restrict old,            \
                                           T *restrict nw, Py_ssize_t cap, int64_t base) {          \
        uint64_t p = 0, copied = 0; /* out[:copied] holds held's bits: copied a piece at a time, */ \
        Py_ssize_t k = 0;           /* just ahead of the changes, so a piece is patched in cache */ \
        for (Py_ssize_t j = 0; j < kk; j++) {                                                      \
            const uint64_t gap = (uint64_t)g[j] | (uint64_t)g[kk + j] << 8 |                       \
                                 (uint64_t)g[2 * kk + j] << 16 | (uint64_t)g[3 * kk + j] << 24;    \
            p += gap + (j > 0);                                                                    \
            if (p >= (uint64_t)n) return -2;                                                       \
            if (p >= copied) {                                                                     \
                uint64_t to = (p / PIECE + 1) * PIECE;                                             \
                if (to > (uint64_t)n) to = (uint64_t)n;                                            \
                memcpy(out + copied, held + copied, (size_t)(to - copied) * sizeof(T));            \
                copied = to;                                                                       \
            }                                                                                      \
            T x = 0;                                                                               \
            for (size_t b = 0; b < sizeof(T); b++) x |= (T)((T)v[b * kk + j] << (8 * b));          \
            if (!x) continue;                                                                      \
            if (k == cap) return -1;                                                               \
            const T o = out[p], r = (T)(o ^ x);                                                    \
            out[p] = r; pos[k] = (P)(base + (int64_t)p); old[k] = o; nw[k] = r; k++;                \
        }                                                                                          \
        if (copied < (uint64_t)n) memcpy(out + copied, held + copied, (size_t)((uint64_t)n - copied) * sizeof(T)); \
        return k;                                                                                  \
    }
#define XOR_PLANES_2(T) XOR_PLANES(T, uint32_t) XOR_PLANES(T, int64_t)
XOR_PLANES_2(uint8_t)
XOR_PLANES_2(uint16_t)
XOR_PLANES_2(uint32_t)
XOR_PLANES_2(uint64_t)

static PyObject *xor_planes(PyObject *self, PyObject *args) {
    Py_buffer held, gaps, vals, out, pos, old, nw;
    int itemsize, wide;
    long long base;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*w*ipL", &held, &gaps, &vals, &out, &pos, &old, &nw, &itemsize, &wide,
                          &base))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = held.len / (itemsize > 0 ? itemsize : 1), cap = old.len / (itemsize > 0 ? itemsize : 1);
    Py_ssize_t kk = gaps.len / 4;
    if (!(itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8) || held.len % itemsize ||
        gaps.len % 4 || vals.len != kk * itemsize || out.len != held.len || old.len != nw.len ||
        old.len % itemsize || pos.len != cap * (wide ? 8 : 4) || base < 0 ||
        (!wide && base + n > ((long long)1 << 32))) {
        PyErr_SetString(PyExc_ValueError, "xor_planes: bad arguments");
        goto done;
    }
    Py_ssize_t k = 0;
    Py_BEGIN_ALLOW_THREADS
    BY_WIDTHS(xor_planes, held.buf, gaps.buf, vals.buf, kk, out.buf, n, pos.buf, old.buf, nw.buf, cap, base);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(k);
done:
    PyBuffer_Release(&held); PyBuffer_Release(&gaps); PyBuffer_Release(&vals); PyBuffer_Release(&out);
    PyBuffer_Release(&pos); PyBuffer_Release(&old); PyBuffer_Release(&nw);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS, "encode(old, mask, itemsize, eshift, ebits, k) -> sections"},
    {"decode", decode, METH_VARARGS, "decode(held, out, itemsize, eshift, ebits, forward, in_place, *sections)"},
    {"xor_changes", xor_changes, METH_VARARGS, "xor_changes(held, mask, out, positions, old, new, itemsize, wide, base) -> k"},
    {"xor_diff", xor_diff, METH_VARARGS, "xor_diff(new, old, mask, positions, values, news, itemsize, wide, base) -> k"},
    {"xor_planes", xor_planes, METH_VARARGS, "xor_planes(held, gaps, values, out, positions, old, new, itemsize, wide, base) -> k"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_condk", "dcr.cond kernels", -1, methods};

PyMODINIT_FUNC PyInit__condk(void) { return PyModule_Create(&module); }
