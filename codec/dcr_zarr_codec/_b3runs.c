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
 *
 * `buffer`: any contiguous buffer; `starts`: a contiguous buffer of n + 1 int64 byte offsets,
 * non-decreasing, the last at most the buffer's length; run i is buffer[starts[i]:starts[i+1]].
 * Digest i is BLAKE3(run i) as 64 lowercase hex digits, or with `prefix` (bytes) BLAKE3(prefix ||
 * BLAKE3(run i)): the block scheme's digest of a run of one block (dcr_core.digest).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blake3/blake3.h"

static const char HEX[] = "0123456789abcdef";

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
    Py_BEGIN_ALLOW_THREADS
    blake3_hasher h;
    uint8_t d[BLAKE3_OUT_LEN];
    for (Py_ssize_t i = 0; i < n; i++) {
        blake3_hasher_init(&h);
        blake3_hasher_update(&h, buf + s[i], (size_t)(s[i + 1] - s[i]));
        blake3_hasher_finalize(&h, d, BLAKE3_OUT_LEN);
        if (pbuf != NULL) {
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

static PyMethodDef methods[] = {
    {"runs_hex", (PyCFunction)(void (*)(void))runs_hex, METH_VARARGS | METH_KEYWORDS,
     "runs_hex(buffer, starts, prefix=None): BLAKE3 hex digests of buffer[starts[i]:starts[i+1]]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_b3runs", NULL, -1, methods};

PyMODINIT_FUNC PyInit__b3runs(void) { return PyModule_Create(&module); }
