/* BLAKE3 digests of many byte runs of one buffer, in one call and without the interpreter lock.
 *
 * A bundle (many small tensors stored back to back) carries a digest per member. One call of the
 * `blake3` package per member holds the interpreter lock for the whole of each (it releases it only
 * for large inputs), so a bundle of thousands of members kept every other thread of a publish or a
 * receive waiting. Here the loop over the runs is C (BLAKE3's own implementation, vendored in
 * blake3/, its SIMD kernel picked from the CPU), the lock released around it; the hex strings are
 * built after.
 *
 *   runs_hex(buffer, starts, prefix=None) -> tuple of str
 *   rows_hex(rows) -> str or None (a policy digest's text hashed in one pass: see rows_hex below)
 *
 * `buffer`: any contiguous buffer; `starts`: a contiguous buffer of n + 1 int64 byte offsets,
 * non-decreasing, the last at most the buffer's length; run i is buffer[starts[i]:starts[i+1]].
 * Digest i is BLAKE3(run i) as 64 lowercase hex digits, or with `prefix` (bytes) BLAKE3(prefix ||
 * BLAKE3(run i)): the block scheme's digest of a run of one block (dcr_core.digest).
 *
 * Runs of equal length (the experts of a layer share a shape) are hashed side by side: BLAKE3's
 * SIMD kernels compress one block of 8 or 16 inputs at once, and one small run alone fills few of
 * them (a run of 5 KB is 5 chunks). So a group of equal runs made of whole 64-byte blocks goes
 * through BLAKE3's tree level by level, each level one `blake3_hash_many` call across the group:
 * chunk j of every run (counter j), then the parents of the left-balanced tree, the root flagged
 * ROOT, whose chaining value is the digest. Any other run is hashed alone. Both give BLAKE3's digest.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blake3/blake3_impl.h"

static const char HEX[] = "0123456789abcdef";

typedef struct {
    const uint8_t *buf;
    const int64_t *s;
    const Py_ssize_t *idx; /* the group's runs */
    size_t m;              /* how many */
    const uint8_t **ptrs;  /* m input pointers */
    uint8_t *pb;           /* m parent blocks (64 bytes each) */
    uint8_t *arena;        /* parents' chaining values: (chunks - 1) x m x 32 */
    size_t used;
    uint8_t *chunks;       /* chunk chaining values: chunks x m x 32 */
} group;

/* The chaining values (m x 32 bytes) of chunks [lo, hi) of every run of the group, as one subtree. */
static uint8_t *subtree(group *g, size_t lo, size_t hi, int root) {
    size_t m = g->m;
    if (hi - lo == 1)
        return g->chunks + lo * m * BLAKE3_OUT_LEN;
    size_t left = 1;
    while (left * 2 < hi - lo)
        left *= 2; /* the largest power of two below the count: BLAKE3's left-balanced tree */
    uint8_t *l = subtree(g, lo, lo + left, 0), *r = subtree(g, lo + left, hi, 0);
    for (size_t k = 0; k < m; k++) {
        memcpy(g->pb + 64 * k, l + BLAKE3_OUT_LEN * k, BLAKE3_OUT_LEN);
        memcpy(g->pb + 64 * k + BLAKE3_OUT_LEN, r + BLAKE3_OUT_LEN * k, BLAKE3_OUT_LEN);
        g->ptrs[k] = g->pb + 64 * k;
    }
    uint8_t *out = g->arena + g->used;
    g->used += m * BLAKE3_OUT_LEN;
    blake3_hash_many(g->ptrs, m, 1, IV, 0, false, PARENT | (root ? ROOT : 0), 0, 0, out);
    return out;
}

/* Digests (m x 32 bytes, into `out`) of the group's runs, each `len` bytes (whole blocks). 0: no memory. */
static int hash_group(group *g, int64_t len, uint8_t *out) {
    size_t m = g->m, nchunks = (size_t)((len + BLAKE3_CHUNK_LEN - 1) / BLAKE3_CHUNK_LEN);
    g->chunks = malloc(nchunks * m * BLAKE3_OUT_LEN);
    g->arena = nchunks > 1 ? malloc((nchunks - 1) * m * BLAKE3_OUT_LEN) : NULL;
    if (g->chunks == NULL || (nchunks > 1 && g->arena == NULL)) {
        free(g->chunks);
        free(g->arena);
        return 0;
    }
    g->used = 0;
    for (size_t j = 0; j < nchunks; j++) {
        int64_t at = (int64_t)j * BLAKE3_CHUNK_LEN, left = len - at;
        size_t blocks = (size_t)((left < BLAKE3_CHUNK_LEN ? left : BLAKE3_CHUNK_LEN) / BLAKE3_BLOCK_LEN);
        for (size_t k = 0; k < m; k++)
            g->ptrs[k] = g->buf + g->s[g->idx[k]] + at;
        blake3_hash_many(g->ptrs, m, blocks, IV, j, false, 0, CHUNK_START, CHUNK_END | (nchunks == 1 ? ROOT : 0),
                         g->chunks + j * m * BLAKE3_OUT_LEN);
    }
    memcpy(out, subtree(g, 0, nchunks, 1), m * BLAKE3_OUT_LEN);
    free(g->chunks);
    free(g->arena);
    return 1;
}

typedef struct {
    int64_t len;
    Py_ssize_t i;
} sized;

static int by_length(const void *a, const void *b) {
    const sized *x = a, *y = b;
    return x->len < y->len ? -1 : x->len > y->len ? 1 : (x->i > y->i) - (x->i < y->i);
}

/* Every run's raw digest into d (n x 32 bytes); 0: no memory. The interpreter lock is not held. */
static int digest_runs(const uint8_t *buf, const int64_t *s, Py_ssize_t n, uint8_t *d) {
    sized *runs = malloc((n ? n : 1) * sizeof *runs);
    Py_ssize_t *order = malloc((n ? n : 1) * sizeof *order);
    const uint8_t **ptrs = malloc((n ? n : 1) * sizeof *ptrs);
    uint8_t *pb = malloc((n ? n : 1) * 64), *tmp = malloc((n ? n : 1) * BLAKE3_OUT_LEN);
    int ok = runs && order && ptrs && pb && tmp;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        int64_t len = s[i + 1] - s[i];
        if (len > 0 && len % BLAKE3_BLOCK_LEN == 0) {
            runs[k].len = len; /* whole blocks: hashed in a group of its length */
            runs[k++].i = i;
        } else {
            blake3_hasher h;
            blake3_hasher_init(&h);
            blake3_hasher_update(&h, buf + s[i], (size_t)len);
            blake3_hasher_finalize(&h, d + (size_t)i * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
        }
    }
    if (ok && k) {
        qsort(runs, (size_t)k, sizeof *runs, by_length);
        for (Py_ssize_t q = 0; q < k; q++)
            order[q] = runs[q].i;
    }
    for (Py_ssize_t a = 0; ok && a < k;) {
        int64_t len = s[order[a] + 1] - s[order[a]];
        Py_ssize_t b = a + 1;
        while (b < k && s[order[b] + 1] - s[order[b]] == len)
            b++;
        group g = {buf, s, order + a, (size_t)(b - a), ptrs, pb, NULL, 0, NULL};
        if (!hash_group(&g, len, tmp)) {
            ok = 0;
            break;
        }
        for (Py_ssize_t q = a; q < b; q++)
            memcpy(d + (size_t)order[q] * BLAKE3_OUT_LEN, tmp + (size_t)(q - a) * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
        a = b;
    }
    free(runs);
    free(order);
    free(ptrs);
    free(pb);
    free(tmp);
    return ok;
}

static PyObject *runs_hex(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"buffer", "starts", "prefix", NULL};
    Py_buffer data, st, pre = {0};
    PyObject *prefix = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*y*|O", kwlist, &data, &st, &prefix))
        return NULL;
    PyObject *out = NULL;
    char *hex = NULL;
    int have_prefix = prefix != Py_None;
    if (have_prefix && PyObject_GetBuffer(prefix, &pre, PyBUF_SIMPLE) < 0)
        goto done;
    if (st.len % 8 || st.len < 8) {
        PyErr_SetString(PyExc_ValueError, "starts must hold at least one int64 offset");
        goto done;
    }
    Py_ssize_t n = st.len / 8 - 1;
    const int64_t *s = (const int64_t *)st.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < 0 || s[i] > s[i + 1] || s[i + 1] > data.len) {
            PyErr_Format(PyExc_ValueError, "run %zd [%lld, %lld) is not within the buffer of %zd bytes", i,
                         (long long)s[i], (long long)s[i + 1], data.len);
            goto done;
        }
    }
    hex = PyMem_RawMalloc(n ? (size_t)n * 64 : 1);
    if (hex == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *buf = (const uint8_t *)data.buf;
    const uint8_t *pbuf = have_prefix ? (const uint8_t *)pre.buf : NULL;
    size_t plen = have_prefix ? (size_t)pre.len : 0;
    uint8_t *raw = PyMem_RawMalloc(n ? (size_t)n * BLAKE3_OUT_LEN : 1);
    if (raw == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = digest_runs(buf, s, n, raw);
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        uint8_t *d = raw + (size_t)i * BLAKE3_OUT_LEN;
        if (pbuf != NULL) {
            blake3_hasher h;
            blake3_hasher_init(&h);
            blake3_hasher_update(&h, pbuf, plen);
            blake3_hasher_update(&h, d, BLAKE3_OUT_LEN);
            blake3_hasher_finalize(&h, d, BLAKE3_OUT_LEN);
        }
        char *o = hex + (size_t)i * 64;
        for (int k = 0; k < BLAKE3_OUT_LEN; k++) {
            o[2 * k] = HEX[d[k] >> 4];
            o[2 * k + 1] = HEX[d[k] & 15];
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(raw);
    if (!ok) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyTuple_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *str = PyUnicode_FromStringAndSize(hex + (size_t)i * 64, 64);
        if (str == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyTuple_SET_ITEM(out, i, str);
    }
done:
    PyMem_RawFree(hex);
    if (have_prefix && pre.obj != NULL)
        PyBuffer_Release(&pre);
    PyBuffer_Release(&data);
    PyBuffer_Release(&st);
    return out;
}

/* The policy digest's text (dcr_core.digest.policy_digest) hashed in one pass: for each row
 * (name, dtype, shape, digest), "name\0dtype\0d1,d2,...\0digest\n", UTF-8, in the order given.
 * Returns the BLAKE3 hex digest, or None for a row this does not take as it is (not a 4-tuple of
 * exact str, str, tuple or list of exact ints within 64 bits, str; or text that is not UTF-8): the
 * caller then builds the text in Python, which says what is wrong. */
typedef struct {
    blake3_hasher h;
    char buf[1 << 16];
    size_t used;
} text_hasher;

static void text_put(text_hasher *t, const char *s, size_t n) {
    if (n > sizeof t->buf - t->used) {
        blake3_hasher_update(&t->h, t->buf, t->used);
        t->used = 0;
        if (n > sizeof t->buf) {
            blake3_hasher_update(&t->h, s, n);
            return;
        }
    }
    memcpy(t->buf + t->used, s, n);
    t->used += n;
}

static int put_str(text_hasher *t, PyObject *o) {
    if (!PyUnicode_CheckExact(o))
        return 0;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(o, &n);
    if (s == NULL) {
        PyErr_Clear();
        return 0;
    }
    text_put(t, s, (size_t)n);
    return 1;
}

static int put_shape(text_hasher *t, PyObject *o) {
    if (!PyTuple_CheckExact(o) && !PyList_CheckExact(o))
        return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject **dims = PySequence_Fast_ITEMS(o);
    char num[32];
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!PyLong_CheckExact(dims[k]))
            return 0;
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(dims[k], &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        char *end = num + sizeof num, *at = end; /* decimal, as str(int) writes it */
        unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
        do {
            *--at = (char)('0' + u % 10);
            u /= 10;
        } while (u);
        if (v < 0)
            *--at = '-';
        if (k)
            *--at = ',';
        text_put(t, at, (size_t)(end - at));
    }
    return 1;
}

static PyObject *rows_hex(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "rows must be a sequence");
    if (seq == NULL)
        return NULL;
    text_hasher *t = PyMem_RawMalloc(sizeof *t);
    if (t == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    blake3_hasher_init(&t->h);
    t->used = 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **rows = PySequence_Fast_ITEMS(seq);
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *row = rows[i];
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 4) {
            ok = 0;
            break;
        }
        ok = put_str(t, PyTuple_GET_ITEM(row, 0));
        if (ok) {
            text_put(t, "\0", 1);
            ok = put_str(t, PyTuple_GET_ITEM(row, 1));
        }
        if (ok) {
            text_put(t, "\0", 1);
            ok = put_shape(t, PyTuple_GET_ITEM(row, 2));
        }
        if (ok) {
            text_put(t, "\0", 1);
            ok = put_str(t, PyTuple_GET_ITEM(row, 3));
        }
        if (ok)
            text_put(t, "\n", 1);
    }
    Py_DECREF(seq);
    if (!ok) {
        PyMem_RawFree(t);
        Py_RETURN_NONE;
    }
    uint8_t d[BLAKE3_OUT_LEN];
    char hex[2 * BLAKE3_OUT_LEN];
    blake3_hasher_update(&t->h, t->buf, t->used);
    blake3_hasher_finalize(&t->h, d, BLAKE3_OUT_LEN);
    PyMem_RawFree(t);
    for (int k = 0; k < BLAKE3_OUT_LEN; k++) {
        hex[2 * k] = HEX[d[k] >> 4];
        hex[2 * k + 1] = HEX[d[k] & 15];
    }
    return PyUnicode_FromStringAndSize(hex, sizeof hex);
}

static PyMethodDef methods[] = {
    {"runs_hex", (PyCFunction)(void (*)(void))runs_hex, METH_VARARGS | METH_KEYWORDS,
     "runs_hex(buffer, starts, prefix=None): BLAKE3 hex digests of buffer[starts[i]:starts[i+1]]"},
    {"rows_hex", (PyCFunction)rows_hex, METH_O,
     "rows_hex(rows): BLAKE3 hex digest of the policy digest's text of (name, dtype, shape, digest) rows, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_b3runs", NULL, -1, methods};

PyMODINIT_FUNC PyInit__b3runs(void) { return PyModule_Create(&module); }
