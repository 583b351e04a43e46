/* The key-value map's bulk-build kernels in C (kcompact.connectors.apps.kv._native), next to the
 * map they build: the numba twins in tests/unit/_oracle_kv_kernels.py are the same algorithms,
 * the reference tests/unit/test_native_kernels.py compares against, so that `kv build` runs without loading numba's LLVM (reput/jit.py).
 *
 * A DigestTable row is five 64-bit words: digest lo, digest hi, offset, timestamp, meta (used bit,
 * flags, partition); the table's capacity is a power of two, linear probing. The records' keys
 * and values come from the partition reader's columns (reput/reader.py), not from here.
 *
 * Arrays come in through the buffer protocol as 1-d views, possibly strided (reput/_arr.h).
 * Every function releases the GIL while it loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_arr.h"

/* a DigestTable row: five 64-bit words (lo, hi, offset, timestamp, meta) */
#define KV_USED (1ull << 63)
#define KV_TOMBSTONE 1
#define KV_KEYLESS 2

/* the row of (lo, hi), or the free row where it goes; -1 when the table is full without it */
static inline int64_t kv_probe(const uint64_t *rows, int64_t cap, uint64_t lo, uint64_t hi)
{
    uint64_t mask = (uint64_t)cap - 1;
    int64_t s = (int64_t)(lo & mask);
    for (int64_t probes = 0; rows[s * 5 + 4] & KV_USED; probes++) {
        if (rows[s * 5] == lo && rows[s * 5 + 1] == hi)
            return s;
        if (probes == cap)
            return -1;
        s = (int64_t)(((uint64_t)s + 1) & mask);
    }
    return s;
}

#define TABLE_FULL "%s: the table is full (grow it before inserting)"

/* a C-contiguous (cap, 5) uint64 table, cap a power of two */
static int kv_table(PyObject *o, Arr *a, int64_t *cap, const char *name)
{
    if (arr_get(o, a, 8, 1, name) < 0)
        return -1;
    *cap = a->n / 5;
    if (a->stride != 8 || a->n % 5 != 0 || *cap <= 0 || (*cap & (*cap - 1)) != 0) {
        arr_release(a, 1);
        a->v.obj = NULL;
        PyErr_Format(PyExc_ValueError, "%s: a contiguous (2**k, 5) uint64 table is required",
                     name);
        return -1;
    }
    return 0;
}

/* kv_upsert_latest(rows, offsets, timestamps, dlo, dhi, flags, end, partition)
 *   -> (covered, keyless, added) */
static PyObject *kv_upsert_latest(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kv_upsert_latest", 8);
    static const int ints[] = {6, 7};
    int64_t iv[2];
    if (args_i64(args, ints, 2, iv) < 0)
        return NULL;
    int64_t end = iv[0], part = iv[1];
    Arr t = {{0}}, a[5] = {{{0}}};
    int64_t cap;
    if (kv_table(args[0], &t, &cap, "rows") < 0)
        return NULL;
    if (arr_get(args[1], &a[0], 8, 0, "offsets") < 0 || arr_get(args[2], &a[1], 8, 0, "timestamps") < 0 ||
        arr_get(args[3], &a[2], 8, 0, "dlo") < 0 || arr_get(args[4], &a[3], 8, 0, "dhi") < 0 ||
        arr_get(args[5], &a[4], 2, 0, "flags") < 0) {
        arr_release(&t, 1);
        arr_release(a, 5);
        return NULL;
    }
    int64_t n = a[0].n;
    if (a[1].n < n || a[2].n < n || a[3].n < n || a[4].n < n) {
        arr_release(&t, 1);
        arr_release(a, 5);
        PyErr_SetString(PyExc_ValueError, "kv_upsert_latest: columns of different lengths");
        return NULL;
    }
    uint64_t *rows = (uint64_t *)t.p;
    int64_t covered = 0, keyless = 0, added = 0, full = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        int64_t off = ld_i64(&a[0], i);
        if (off >= end)
            break;
        covered++;
        uint16_t f = ld_u16(&a[4], i);
        if (f & KV_KEYLESS) {
            keyless++;
            continue;
        }
        uint64_t lo = ld_u64(&a[2], i), hi = ld_u64(&a[3], i);
        int64_t at = kv_probe(rows, cap, lo, hi);
        if (at < 0) {
            full = 1;
            break;
        }
        uint64_t *r = &rows[at * 5];
        if (!(r[4] & KV_USED)) {
            r[0] = lo;
            r[1] = hi;
            added++;
        }
        r[2] = (uint64_t)off;
        r[3] = (uint64_t)ld_i64(&a[1], i);
        r[4] = KV_USED | ((uint64_t)f << 32) | (uint64_t)(uint32_t)part;
    }
    Py_END_ALLOW_THREADS
    arr_release(&t, 1);
    arr_release(a, 5);
    if (full) {
        PyErr_Format(PyExc_ValueError, TABLE_FULL, "kv_upsert_latest");
        return NULL;
    }
    return Py_BuildValue("(LLL)", (long long)covered, (long long)keyless, (long long)added);
}

/* kv_merge(rows, other) -> (added, both): across partitions the highest (timestamp, partition)
 * wins */
static PyObject *kv_merge(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kv_merge", 2);
    Arr t = {{0}}, o = {{0}};
    int64_t cap, ocap;
    if (kv_table(args[0], &t, &cap, "rows") < 0)
        return NULL;
    if (kv_table(args[1], &o, &ocap, "other") < 0) {
        arr_release(&t, 1);
        return NULL;
    }
    uint64_t *rows = (uint64_t *)t.p;
    const uint64_t *other = (const uint64_t *)o.p;
    int64_t added = 0, both = 0, full = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t j = 0; j < ocap; j++) {
        const uint64_t *x = &other[j * 5];
        if (!(x[4] & KV_USED))
            continue;
        int64_t at = kv_probe(rows, cap, x[0], x[1]);
        if (at < 0) {
            full = 1;
            break;
        }
        uint64_t *r = &rows[at * 5];
        if (r[4] & KV_USED) {
            both++;
            int64_t ts_new = (int64_t)x[3], ts_old = (int64_t)r[3];
            uint64_t p_new = x[4] & 0xFFFFFFFFull, p_old = r[4] & 0xFFFFFFFFull;
            if (ts_new < ts_old || (ts_new == ts_old && p_new < p_old))
                continue;
        } else {
            added++;
        }
        memcpy(r, x, 5 * 8);
    }
    Py_END_ALLOW_THREADS
    arr_release(&t, 1);
    arr_release(&o, 1);
    if (full) {
        PyErr_Format(PyExc_ValueError, TABLE_FULL, "kv_merge");
        return NULL;
    }
    return Py_BuildValue("(LL)", (long long)added, (long long)both);
}

/* kv_rehash(rows, new): every used row of rows into new */
static PyObject *kv_rehash(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kv_rehash", 2);
    Arr t = {{0}}, o = {{0}};
    int64_t cap, ncap;
    if (kv_table(args[0], &t, &cap, "rows") < 0)
        return NULL;
    if (kv_table(args[1], &o, &ncap, "new") < 0) {
        arr_release(&t, 1);
        return NULL;
    }
    const uint64_t *rows = (const uint64_t *)t.p;
    uint64_t *nw = (uint64_t *)o.p;
    int full = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t j = 0; j < cap; j++)
        if (rows[j * 5 + 4] & KV_USED) {
            int64_t at = kv_probe(nw, ncap, rows[j * 5], rows[j * 5 + 1]);
            if (at < 0) {
                full = 1;
                break;
            }
            memcpy(&nw[at * 5], &rows[j * 5], 40);
        }
    Py_END_ALLOW_THREADS
    arr_release(&t, 1);
    arr_release(&o, 1);
    if (full) {
        PyErr_Format(PyExc_ValueError, TABLE_FULL, "kv_rehash");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* kv_gather(src, starts, lengths, prefix, out, out_pos, offs, first) -> new out_pos: prefix
 * (a byte, or nothing when negative) then src[starts[i]:+lengths[i]] appended to out for each
 * i, each start recorded in offs[first + i], offs[first + n] = the end */
static PyObject *kv_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kv_gather", 8);
    static const int ints[] = {3, 5, 7};
    int64_t iv[3];
    if (args_i64(args, ints, 3, iv) < 0)
        return NULL;
    int64_t prefix = iv[0], pos = iv[1], first = iv[2];
    Arr a[5] = {{0}};
    if (arr_get(args[0], &a[0], 1, 0, "src") < 0 || arr_get(args[1], &a[1], 8, 0, "starts") < 0 ||
        arr_get(args[2], &a[2], 8, 0, "lengths") < 0 || arr_get(args[4], &a[3], 1, 1, "out") < 0 ||
        arr_get(args[6], &a[4], 8, 1, "offs") < 0) {
        arr_release(a, 5);
        return NULL;
    }
    int64_t n = a[1].n;
    int bad = a[0].stride != 1 || a[3].stride != 1 || a[2].n < n || first < 0 || pos < 0 ||
              prefix > 255 || first > a[4].n - n - 1 || pos > a[3].n;
    /* bounds of every copy before any, written so that no sum can overflow */
    int64_t need = pos, extra = prefix >= 0;
    for (int64_t i = 0; !bad && i < n; i++) {
        int64_t s = ld_i64(&a[1], i), l = ld_i64(&a[2], i);
        bad |= s < 0 || l < 0 || s > a[0].n || l > a[0].n - s || l > a[3].n - need - extra;
        if (!bad)
            need += l + extra;
    }
    if (bad)
        ARG_ERROR(a, 5, "kv_gather: a range is outside its source, or the ranges do not fit "
                  "out (%lld bytes from %lld) or offs (%lld from %lld)", (long long)a[3].n,
                  (long long)pos, (long long)a[4].n, (long long)first);
    const char *src = a[0].p;
    char *out = a[3].p;
    int64_t q = pos;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        memcpy(a[4].p + (first + i) * a[4].stride, &q, 8);
        if (prefix >= 0)
            out[q++] = (char)prefix;
        int64_t l = ld_i64(&a[2], i);
        memcpy(out + q, src + ld_i64(&a[1], i), (size_t)l);
        q += l;
    }
    memcpy(a[4].p + (first + n) * a[4].stride, &q, 8);
    Py_END_ALLOW_THREADS
    arr_release(a, 5);
    return PyLong_FromLongLong(q);
}

/* kv_sort_rows(keys, koffs, width, out): fixed-width sort rows, the key zero-padded to
 * width - 4 bytes then its length big-endian (unsigned byte order = the keys' order) */
static PyObject *kv_sort_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kv_sort_rows", 4);
    static const int ints[] = {2};
    int64_t width;
    if (args_i64(args, ints, 1, &width) < 0)
        return NULL;
    Arr a[3] = {{0}};
    if (arr_get(args[0], &a[0], 1, 0, "keys") < 0 || arr_get(args[1], &a[1], 8, 0, "koffs") < 0 ||
        arr_get(args[3], &a[2], 1, 1, "out") < 0) {
        arr_release(a, 3);
        return NULL;
    }
    int64_t n = a[1].n - 1;
    int bad = n < 0 || width < 4 || a[0].stride != 1 || a[2].stride != 1 ||
              (n > 0 && width > a[2].n / n);
    for (int64_t i = 0; !bad && i < n; i++) {
        int64_t s = ld_i64(&a[1], i), e = ld_i64(&a[1], i + 1);
        bad |= s < 0 || e < s || e > a[0].n || e - s > width - 4;
    }
    if (bad) {
        arr_release(a, 3);
        PyErr_SetString(PyExc_ValueError, "kv_sort_rows: a key is outside its array or wider "
                        "than width - 4");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        int64_t s = ld_i64(&a[1], i), m = ld_i64(&a[1], i + 1) - s;
        uint8_t *row = (uint8_t *)a[2].p + i * width;
        memcpy(row, a[0].p + s, (size_t)m);
        memset(row + m, 0, (size_t)(width - 4 - m));
        row[width - 4] = (uint8_t)(m >> 24);
        row[width - 3] = (uint8_t)(m >> 16);
        row[width - 2] = (uint8_t)(m >> 8);
        row[width - 1] = (uint8_t)m;
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"kv_upsert_latest", (PyCFunction)(void (*)(void))kv_upsert_latest, METH_FASTCALL, NULL},
    {"kv_merge", (PyCFunction)(void (*)(void))kv_merge, METH_FASTCALL, NULL},
    {"kv_rehash", (PyCFunction)(void (*)(void))kv_rehash, METH_FASTCALL, NULL},
    {"kv_gather", (PyCFunction)(void (*)(void))kv_gather, METH_FASTCALL, NULL},
    {"kv_sort_rows", (PyCFunction)(void (*)(void))kv_sort_rows, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kcompact.connectors.apps.kv._native",
    "The key-value map's bulk-build kernels in C (see the comment at the top of _native.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
