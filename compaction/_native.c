/* compaction._native: the offset map's and the cleaner's kernels in C (compaction/offset_map.py,
 * tests/unit/_oracle_compaction_kernels.py holds the same algorithms in numba, the reference
 * tests/unit/test_native_kernels.py compares against), so that
 * `kcompact compact` runs without loading numba's LLVM (~120 MiB resident; reput/jit.py).
 *
 * The offset map (compaction/offset_map.py): an open-addressing table of 16-byte slots in one
 * uint32 array, 4 words a slot: digest_hi (2 words), digest_lo >> 32, offset - base
 * (0xFFFFFFFF = empty); the home slot from the low 32 bits of digest_lo, linear probing.
 *
 * Arrays come in through the buffer protocol as 1-d views, possibly strided (fields of a .bcq
 * structured array: a stride of 48 bytes; reput/_arr.h). Every function releases the GIL while
 * it loops, as the numba kernels do (nogil=True).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY 0xFFFFFFFFu
#define MAX_DELTA 0xFFFFFFFELL
#define PREFETCH_AHEAD 16
#define MAP_OK 0
#define MAP_FULL 1
/* offsets are stored as base + a 32-bit delta: base must leave room for it */
#define MAX_BASE (INT64_MAX - 0xFFFFFFFFLL)

#include "_arr.h"

static inline int64_t home(uint64_t lo, int64_t cap)
{
    return (int64_t)(((lo & 0xFFFFFFFFull) * (uint64_t)cap) >> 32);
}

/* The slot of digest (lo, hi): the one holding it, else the empty slot where it would go;
 * -1 when cap slots were probed without either (a full table, which is not the map's). The
 * one probe loop of insert_entries and lookup: a slot is 4 words, k0 k1 k2 delta. */
static inline int64_t find_slot(const uint32_t *table, int64_t cap, uint64_t lo, uint64_t hi)
{
    uint32_t k0 = (uint32_t)(hi & 0xFFFFFFFFull), k1 = (uint32_t)(hi >> 32),
             k2 = (uint32_t)(lo >> 32);
    int64_t h = home(lo, cap);
    for (int64_t probes = 0; probes < cap; probes++) {
        const uint32_t *s = &table[h * 4];
        if (s[3] == EMPTY)
            return h;
        if (s[0] == k0 && s[1] == k1 && s[2] == k2)
            return h;
        if (++h == cap)
            h = 0;
    }
    return -1;
}

/* insert_entries(table, cap, max_keys, count, base, offsets, dlo, dhi, flags, start, stop)
 *   -> (next index, keys count, status) */
static PyObject *insert_entries(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("insert_entries", 11);
    static const int ints[] = {1, 2, 3, 4, 9, 10};
    int64_t iv[6];
    if (args_i64(args, ints, 6, iv) < 0)
        return NULL;
    int64_t cap = iv[0], max_keys = iv[1], count = iv[2], base = iv[3], start = iv[4], stop = iv[5];
    Arr a[5] = {0};
    if (arr_get(args[0], &a[0], 4, 1, "table") < 0 || arr_get(args[5], &a[1], 8, 0, "offsets") < 0 ||
        arr_get(args[6], &a[2], 8, 0, "dlo") < 0 || arr_get(args[7], &a[3], 8, 0, "dhi") < 0 ||
        arr_get(args[8], &a[4], 2, 0, "flags") < 0) {
        arr_release(a, 5);
        return NULL;
    }
    /* (the table needs an empty slot whatever it holds: max_keys < cap, and every probe below
     * stops after cap slots) */
    if (a[0].stride != 4 || cap <= 0 || cap > a[0].n / 4 || start < 0 || stop > a[1].n ||
        stop > a[2].n || stop > a[3].n || stop > a[4].n || base > MAX_BASE ||
        max_keys < 0 || max_keys >= cap || count < 0 || count > max_keys)
        ARG_ERROR(a, 5, "insert_entries: cap %lld, max_keys %lld, count %lld, base %lld or "
                  "start/stop %lld/%lld do not fit the arrays (table of %lld words, %lld "
                  "entries)", (long long)cap, (long long)max_keys, (long long)count,
                  (long long)base, (long long)start, (long long)stop, (long long)a[0].n,
                  (long long)a[1].n);
    uint32_t *table = (uint32_t *)a[0].p;
    int64_t next = stop, status = MAP_OK;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = start; i < stop; i++) {
        if (i + PREFETCH_AHEAD < stop)
            __builtin_prefetch(&table[home(ld_u64(&a[2], i + PREFETCH_AHEAD), cap) * 4], 0, 3);
        if (ld_u16(&a[4], i) & 2)
            continue; /* keyless: never deduplicated, not in the map */
        int64_t off = ld_i64(&a[1], i);
        if (off < base || (uint64_t)off - (uint64_t)base > MAX_DELTA) {
            next = i;
            status = MAP_FULL;
            break;
        }
        int64_t delta = off - base;
        uint64_t lo = ld_u64(&a[2], i), hi = ld_u64(&a[3], i);
        int64_t slot = find_slot(table, cap, lo, hi);
        if (slot < 0) { /* no empty slot: a table that is not the map's */
            next = i;
            status = MAP_FULL;
            break;
        }
        uint32_t *s = &table[slot * 4];
        if (s[3] == EMPTY) {
            if (count >= max_keys) {
                next = i;
                status = MAP_FULL;
                break;
            }
            s[0] = (uint32_t)(hi & 0xFFFFFFFFull);
            s[1] = (uint32_t)(hi >> 32);
            s[2] = (uint32_t)(lo >> 32);
            count++;
        }
        s[3] = (uint32_t)delta; /* a key already there: offsets only grow, the newer one wins */
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 5);
    return Py_BuildValue("(LLL)", (long long)next, (long long)count, (long long)status);
}

static inline int64_t lookup(const uint32_t *table, int64_t cap, int64_t base, uint64_t lo,
                             uint64_t hi)
{
    int64_t slot = find_slot(table, cap, lo, hi);
    if (slot < 0 || table[slot * 4 + 3] == EMPTY)
        return -1;
    return base + (int64_t)table[slot * 4 + 3];
}

/* lookup_many(table, cap, base, dlo, dhi, out): out[i] = latest offset of digest i, or -1 */
static PyObject *lookup_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("lookup_many", 6);
    static const int ints[] = {1, 2};
    int64_t iv[2];
    if (args_i64(args, ints, 2, iv) < 0)
        return NULL;
    int64_t cap = iv[0], base = iv[1];
    Arr a[4] = {0};
    if (arr_get(args[0], &a[0], 4, 0, "table") < 0 || arr_get(args[3], &a[1], 8, 0, "dlo") < 0 ||
        arr_get(args[4], &a[2], 8, 0, "dhi") < 0 || arr_get(args[5], &a[3], 8, 1, "out") < 0) {
        arr_release(a, 4);
        return NULL;
    }
    int64_t n = a[1].n;
    if (a[0].stride != 4 || cap <= 0 || cap > a[0].n / 4 || a[2].n < n || a[3].n < n ||
        base > MAX_BASE)
        ARG_ERROR(a, 4, "lookup_many: cap %lld or base %lld do not fit the arrays (table of "
                  "%lld words, %lld digests)", (long long)cap, (long long)base,
                  (long long)a[0].n, (long long)n);
    const uint32_t *table = (const uint32_t *)a[0].p;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            __builtin_prefetch(&table[home(ld_u64(&a[1], i + PREFETCH_AHEAD), cap) * 4], 0, 3);
        int64_t r = lookup(table, cap, base, ld_u64(&a[1], i), ld_u64(&a[2], i));
        memcpy(a[3].p + i * a[3].stride, &r, 8);
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 4);
    Py_RETURN_NONE;
}

/* decide(table, cap, base, last_mapped, now_s, retention_s, offsets, dlo, dhi, flags,
 *        clean_time, keep, new_clean) -> (kept, dropped, tombstones dropped, stamped) */
static PyObject *decide(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("decide", 13);
    static const int ints[] = {1, 2, 3, 4, 5};
    int64_t iv[5];
    if (args_i64(args, ints, 5, iv) < 0)
        return NULL;
    int64_t cap = iv[0], base = iv[1], last_mapped = iv[2], now_s = iv[3], retention_s = iv[4];
    Arr a[8] = {0};
    if (arr_get(args[0], &a[0], 4, 0, "table") < 0 || arr_get(args[6], &a[1], 8, 0, "offsets") < 0 ||
        arr_get(args[7], &a[2], 8, 0, "dlo") < 0 || arr_get(args[8], &a[3], 8, 0, "dhi") < 0 ||
        arr_get(args[9], &a[4], 2, 0, "flags") < 0 ||
        arr_get(args[10], &a[5], 4, 0, "clean_time") < 0 ||
        arr_get(args[11], &a[6], 1, 1, "keep") < 0 ||
        arr_get(args[12], &a[7], 4, 1, "new_clean") < 0) {
        arr_release(a, 8);
        return NULL;
    }
    int64_t n = a[1].n;
    /* clean times are u32 seconds: now_s must be one, and no difference may overflow */
    if (a[0].stride != 4 || cap <= 0 || cap > a[0].n / 4 || a[2].n < n || a[3].n < n ||
        a[4].n < n || a[5].n < n || a[6].n < n || a[7].n < n || base > MAX_BASE ||
        now_s < 0 || now_s > 0xFFFFFFFFLL || retention_s < 0)
        ARG_ERROR(a, 8, "decide: cap %lld, base %lld, now_s %lld or retention_s %lld out of "
                  "range, or arrays shorter than the %lld entries", (long long)cap,
                  (long long)base, (long long)now_s, (long long)retention_s, (long long)n);
    const uint32_t *table = (const uint32_t *)a[0].p;
    int64_t kept = 0, dropped = 0, tdropped = 0, stamped = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            __builtin_prefetch(&table[home(ld_u64(&a[2], i + PREFETCH_AHEAD), cap) * 4], 0, 3);
        int64_t off = ld_i64(&a[1], i);
        uint16_t f = ld_u16(&a[4], i);
        uint32_t ct = ld_u32(&a[5], i);
        int k = 1;
        if ((f & 2) == 0 && off <= last_mapped) {
            int64_t latest = lookup(table, cap, base, ld_u64(&a[2], i), ld_u64(&a[3], i));
            if (latest > off)
                k = 0;
        }
        if (k && (f & 3) == 1) { /* a keyed tombstone still the latest for its key */
            /* clean_time is whole seconds (floored): only a strict '>' guarantees that
             * delete.retention.ms has really passed since the tombstone was first cleaned */
            if (ct != 0 && now_s - (int64_t)ct > retention_s) {
                k = 0;
                tdropped++;
            } else if (ct == 0 && off <= last_mapped) {
                ct = (uint32_t)now_s;
                stamped++;
            }
        }
        a[6].p[i * a[6].stride] = (char)k;
        memcpy(a[7].p + i * a[7].stride, &ct, 4);
        if (k)
            kept++;
        else
            dropped++;
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 8);
    return Py_BuildValue("(LLLL)", (long long)kept, (long long)dropped, (long long)tdropped,
                         (long long)stamped);
}

static PyMethodDef methods[] = {
    {"insert_entries", (PyCFunction)(void (*)(void))insert_entries, METH_FASTCALL, NULL},
    {"lookup_many", (PyCFunction)(void (*)(void))lookup_many, METH_FASTCALL, NULL},
    {"decide", (PyCFunction)(void (*)(void))decide, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kcompact.compaction._native",
    "The offset map's and the cleaner's kernels in C (see compaction/_native.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
