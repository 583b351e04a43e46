/* reput._native: the compaction kernels in C, so that a compaction needs no JIT compiler, and
 * the per-message column extraction of the Kafka consumer path (message_columns).
 *
 * The same algorithms as the numba kernels they replace (compaction/offset_map.py
 * _insert_entries/_lookup_many, compaction/compactor.py _decide/_gather_kept,
 * reput/_kernels.py lower_bound_strided), which stay as the fallback when this module is not
 * built and as the reference the tests compare against (tests/unit/test_native_kernels.py).
 * Loading numba means loading LLVM (~120 MiB resident); a `kcompact compact` whose offset map
 * budget is 128 MiB should not pay that. See reput/_jit.py.
 *
 * Arrays come in through the buffer protocol as 1-d views, possibly strided (fields of a .bcq
 * structured array: a stride of 48 bytes). Loads go through memcpy, so unaligned views are fine.
 * Every function releases the GIL while it loops, as the numba kernels do (nogil=True).
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

#include "_arr.h"

static inline int64_t home(uint64_t lo, int64_t cap)
{
    return (int64_t)(((lo & 0xFFFFFFFFull) * (uint64_t)cap) >> 32);
}

static int args_i64(PyObject *const *args, const int *which, int n, int64_t *out)
{
    for (int i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(args[which[i]]);
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

#define CHECK_NARGS(name, want)                                                              \
    if (nargs != (want)) {                                                                   \
        PyErr_Format(PyExc_TypeError, name "() takes %d arguments (%zd given)", (want), nargs); \
        return NULL;                                                                         \
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
    if (a[0].stride != 4 || a[0].n < cap * 4 || start < 0 || stop > a[1].n || stop > a[2].n ||
        stop > a[3].n || stop > a[4].n || cap <= 0) {
        arr_release(a, 5);
        PyErr_SetString(PyExc_ValueError, "insert_entries: arrays shorter than their bounds");
        return NULL;
    }
    uint32_t *table = (uint32_t *)a[0].p;
    int64_t next = stop, status = MAP_OK;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = start; i < stop; i++) {
        if (i + PREFETCH_AHEAD < stop)
            __builtin_prefetch(&table[home(ld_u64(&a[2], i + PREFETCH_AHEAD), cap) * 4], 0, 3);
        if (ld_u16(&a[4], i) & 2)
            continue; /* keyless: never deduplicated, not in the map */
        int64_t delta = ld_i64(&a[1], i) - base;
        if (delta < 0 || delta > MAX_DELTA) {
            next = i;
            status = MAP_FULL;
            break;
        }
        uint64_t lo = ld_u64(&a[2], i), hi = ld_u64(&a[3], i);
        uint32_t k0 = (uint32_t)(hi & 0xFFFFFFFFull), k1 = (uint32_t)(hi >> 32),
                 k2 = (uint32_t)(lo >> 32);
        int64_t h = home(lo, cap);
        for (;;) {
            uint32_t *s = &table[h * 4];
            if (s[3] == EMPTY) {
                if (count >= max_keys) {
                    next = i;
                    status = MAP_FULL;
                    goto done;
                }
                s[0] = k0;
                s[1] = k1;
                s[2] = k2;
                s[3] = (uint32_t)delta;
                count++;
                break;
            }
            if (s[0] == k0 && s[1] == k1 && s[2] == k2) {
                s[3] = (uint32_t)delta; /* offsets only grow: the newer one wins */
                break;
            }
            if (++h == cap)
                h = 0;
        }
    }
done:
    Py_END_ALLOW_THREADS
    arr_release(a, 5);
    return Py_BuildValue("(LLL)", (long long)next, (long long)count, (long long)status);
}

static inline int64_t lookup(const uint32_t *table, int64_t cap, int64_t base, uint64_t lo,
                             uint64_t hi)
{
    uint32_t k0 = (uint32_t)(hi & 0xFFFFFFFFull), k1 = (uint32_t)(hi >> 32),
             k2 = (uint32_t)(lo >> 32);
    int64_t h = home(lo, cap);
    for (;;) {
        const uint32_t *s = &table[h * 4];
        if (s[3] == EMPTY)
            return -1;
        if (s[0] == k0 && s[1] == k1 && s[2] == k2)
            return base + (int64_t)s[3];
        if (++h == cap)
            h = 0;
    }
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
    if (a[0].stride != 4 || a[0].n < cap * 4 || cap <= 0 || a[2].n < n || a[3].n < n) {
        arr_release(a, 4);
        PyErr_SetString(PyExc_ValueError, "lookup_many: arrays shorter than their bounds");
        return NULL;
    }
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
    if (a[0].stride != 4 || a[0].n < cap * 4 || cap <= 0 || a[2].n < n || a[3].n < n ||
        a[4].n < n || a[5].n < n || a[6].n < n || a[7].n < n) {
        arr_release(a, 8);
        PyErr_SetString(PyExc_ValueError, "decide: arrays shorter than their bounds");
        return NULL;
    }
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

/* gather_kept(src, positions, sizes, keep, out, out_entries_pos, base_out) -> (bytes, kept):
 * copy the kept records (positions relative to src) into out, back to back; record where each
 * landed (base_out + its position in out) */
static PyObject *gather_kept(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("gather_kept", 7);
    static const int ints[] = {6};
    int64_t base_out;
    if (args_i64(args, ints, 1, &base_out) < 0)
        return NULL;
    Arr a[6] = {0};
    if (arr_get(args[0], &a[0], 1, 0, "src") < 0 || arr_get(args[1], &a[1], 8, 0, "positions") < 0 ||
        arr_get(args[2], &a[2], 8, 0, "sizes") < 0 || arr_get(args[3], &a[3], 1, 0, "keep") < 0 ||
        arr_get(args[4], &a[4], 1, 1, "out") < 0 ||
        arr_get(args[5], &a[5], 8, 1, "out_entries_pos") < 0) {
        arr_release(a, 6);
        return NULL;
    }
    int64_t n = a[1].n;
    if (a[0].stride != 1 || a[4].stride != 1 || a[2].n < n || a[3].n < n) {
        arr_release(a, 6);
        PyErr_SetString(PyExc_ValueError, "gather_kept: bad array shapes");
        return NULL;
    }
    int64_t q = 0, n_out = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        if (!ld_u8(&a[3], i))
            continue;
        int64_t pos = ld_i64(&a[1], i), size = ld_i64(&a[2], i);
        if (pos < 0 || size < 0 || pos + size > a[0].n || q + size > a[4].n || n_out >= a[5].n) {
            bad = 1;
            break;
        }
        memcpy(a[4].p + q, a[0].p + pos, (size_t)size);
        int64_t at = base_out + q;
        memcpy(a[5].p + n_out * a[5].stride, &at, 8);
        n_out++;
        q += size;
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 6);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "gather_kept: a record lies outside its buffer");
        return NULL;
    }
    return Py_BuildValue("(LL)", (long long)q, (long long)n_out);
}

/* lower_bound_strided(words, stride_words, n, target): first i in [0, n) with
 * words[i * stride_words] >= target (int64), else n */
static PyObject *lower_bound_strided(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("lower_bound_strided", 4);
    static const int ints[] = {1, 2};
    int64_t iv[2];
    if (args_i64(args, ints, 2, iv) < 0)
        return NULL;
    int64_t stride = iv[0], n = iv[1];
    int overflow = 0;
    PyObject *t = PyNumber_Index(args[3]);
    if (t == NULL)
        return NULL;
    int64_t target = PyLong_AsLongLongAndOverflow(t, &overflow);
    Py_DECREF(t);
    if (target == -1 && PyErr_Occurred())
        return NULL;
    if (overflow > 0) /* beyond every int64 offset */
        return PyLong_FromLongLong(n < 0 ? 0 : n);
    if (overflow < 0)
        return PyLong_FromLongLong(0);
    Arr a;
    memset(&a, 0, sizeof a);
    if (arr_get(args[0], &a, 8, 0, "words") < 0)
        return NULL;
    if (stride <= 0 || n < 0 || (n > 0 && (n - 1) * stride >= a.n)) {
        PyBuffer_Release(&a.v);
        PyErr_SetString(PyExc_ValueError, "lower_bound_strided: n entries do not fit words");
        return NULL;
    }
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + ((hi - lo) >> 1);
        if (ld_i64(&a, mid * stride) < target)
            lo = mid + 1;
        else
            hi = mid;
    }
    PyBuffer_Release(&a.v);
    return PyLong_FromLongLong(lo);
}

/* message_columns(msgs, partitions, offsets, timestamps) ->
 *     (keys, values, headers, key_buf, key_offs, key_null, val_buf, val_offs, val_null),
 *     or None when a message of the list is an error event (nothing is filled then)
 *
 * One pass over a list of confluent_kafka Message objects (no errors among them), through their
 * public methods: partition(), offset() and timestamp()[1] into the int32/int64/int64 arrays
 * given; key() and value() into lists (bytes or None) and packed as well (bytearray of the
 * bytes back to back, bytearray of n+1 int64 start offsets, bytearray of n null flags: a
 * column the store can encode without touching the objects again); headers() into a list, or
 * None when no message has headers. What the connectors' sink runner and store sink did with
 * six map() passes, np.fromiter and b"".join: about 0.6 us a message in Python. */
/* The Message methods are C functions without arguments (METH_NOARGS): for the type seen last,
 * their function pointers are looked up once and called directly, instead of an attribute
 * lookup and a vectorcall per call. Any other type goes through the generic call. */
enum { M_PARTITION, M_OFFSET, M_TIMESTAMP, M_KEY, M_VALUE, M_HEADERS, M_ERROR, M_TOPIC,
       M_LEADER_EPOCH, M_N };
static const char *const m_name_text[M_N] = {"partition", "offset", "timestamp", "key", "value",
                                             "headers", "error", "topic", "leader_epoch"};
static PyObject *m_names[M_N]; /* interned at module init */
static PyTypeObject *m_type = NULL;
static PyCFunction m_fn[M_N];

static void resolve(PyTypeObject *tp)
{
    PyCFunction fn[M_N];
    for (int i = 0; i < M_N; i++) {
        PyObject *d = PyObject_GetAttr((PyObject *)tp, m_names[i]);
        if (d == NULL) {
            PyErr_Clear();
            return;
        }
        int ok = Py_IS_TYPE(d, &PyMethodDescr_Type) &&
                 (((PyMethodDescrObject *)d)->d_method->ml_flags & METH_NOARGS);
        fn[i] = ok ? ((PyMethodDescrObject *)d)->d_method->ml_meth : NULL;
        Py_DECREF(d);
        if (!ok)
            return;
    }
    memcpy(m_fn, fn, sizeof fn);
    m_type = tp;
}

/* confluent_kafka.Message's C struct, as declared in its confluent_kafka.h (2.x, x86-64 and
 * other LP64 ABIs): reading the fields saves the method calls, the timestamp() tuple and the
 * offset() int of every message. Used only for a type whose instances are at least this large
 * and only for a batch whose first message reads the same through the fields as through the
 * methods (eight fields compared, pointers by identity): any other layout, or a future version
 * that moves a field, takes the method path. */
typedef struct {
    PyObject_HEAD
    PyObject *topic;
    PyObject *value;
    PyObject *key;
    PyObject *headers;   /* NULL until headers() converts c_headers */
    void *c_headers;     /* rd_kafka_headers_t *, NULL when the message has none */
    PyObject *error;     /* NULL or None when no error */
    int32_t partition;
    int64_t offset;
    int32_t leader_epoch;
    int64_t timestamp;
    int tstype;
} cfl_message;

static inline PyObject *call_m(PyObject *obj, int which);

static int same_obj(PyObject *field, PyObject *got)
{
    if (got == NULL) {
        PyErr_Clear();
        return 0;
    }
    int ok = (field == got) || ((field == NULL || field == Py_None) && got == Py_None);
    Py_DECREF(got);
    return ok;
}

static int same_int(long long field, PyObject *got, int item)
{
    if (got == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *x = got;
    if (item >= 0) {
        if (!PyTuple_Check(got) || PyTuple_GET_SIZE(got) <= item) {
            Py_DECREF(got);
            return 0;
        }
        x = PyTuple_GET_ITEM(got, item);
    }
    long long v = PyLong_AsLongLong(x);
    int ok = !(v == -1 && PyErr_Occurred()) && v == field;
    PyErr_Clear();
    Py_DECREF(got);
    return ok;
}

/* leader_epoch(): None for a negative field */
static int same_epoch(int32_t field, PyObject *got)
{
    if (got == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (field < 0) {
        int ok = got == Py_None;
        Py_DECREF(got);
        return ok;
    }
    return same_int(field, got, -1);
}

/* May the messages of this list (all of type m_type) be read through cfl_message? */
static int fields_readable(PyObject *m)
{
    if (m_type == NULL || Py_TYPE(m) != m_type ||
        m_type->tp_basicsize < (Py_ssize_t)sizeof(cfl_message))
        return 0;
    const cfl_message *f = (const cfl_message *)m;
    PyObject *headers_now = f->headers;
    int ok = same_obj(f->topic, call_m(m, M_TOPIC)) &&
             same_obj(f->value, call_m(m, M_VALUE)) && same_obj(f->key, call_m(m, M_KEY)) &&
             same_obj(f->error, call_m(m, M_ERROR)) &&
             same_int(f->partition, call_m(m, M_PARTITION), -1) &&
             same_int(f->offset, call_m(m, M_OFFSET), -1) &&
             same_int(f->timestamp, call_m(m, M_TIMESTAMP), 1) &&
             same_int(f->tstype, call_m(m, M_TIMESTAMP), 0) &&
             same_epoch(f->leader_epoch, call_m(m, M_LEADER_EPOCH));
    /* headers: nothing converted and nothing to convert reads None */
    if (ok && headers_now == NULL && f->c_headers == NULL)
        ok = same_obj(NULL, call_m(m, M_HEADERS));
    return ok;
}

static inline PyObject *call_m(PyObject *obj, int which)
{
    if (Py_TYPE(obj) == m_type)
        return m_fn[which](obj, NULL);
    PyObject *args[1] = {obj};
    return PyObject_VectorcallMethod(m_names[which], args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     NULL);
}

/* obj.which() as an integer; for timestamp(), the second item of its (type, ms) pair */
static int int_of(PyObject *obj, int which, long long *out)
{
    PyObject *o = call_m(obj, which);
    if (o == NULL)
        return -1;
    PyObject *x = o;
    if (which == M_TIMESTAMP) {
        if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 2) {
            Py_DECREF(o);
            PyErr_SetString(PyExc_TypeError, "message_columns: timestamp() is not a pair");
            return -1;
        }
        x = PyTuple_GET_ITEM(o, 1);
    }
    *out = PyLong_AsLongLong(x);
    Py_DECREF(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* obj.which(), a new reference to bytes or None */
static PyObject *bytes_of(PyObject *obj, int which)
{
    PyObject *o = call_m(obj, which);
    if (o != NULL && o != Py_None && !PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "message_columns: %s() is not bytes or None",
                     m_name_text[which]);
        Py_DECREF(o);
        return NULL;
    }
    return o;
}

static int pack(PyObject *list, Py_ssize_t n, PyObject **buf, PyObject **offs, PyObject **nulls)
{
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        if (o != Py_None)
            total += PyBytes_GET_SIZE(o);
    }
    *buf = PyByteArray_FromStringAndSize(NULL, total);
    *offs = PyByteArray_FromStringAndSize(NULL, (n + 1) * 8);
    *nulls = PyByteArray_FromStringAndSize(NULL, n);
    if (*buf == NULL || *offs == NULL || *nulls == NULL)
        return -1;
    char *b = PyByteArray_AS_STRING(*buf), *nl = PyByteArray_AS_STRING(*nulls);
    char *of = PyByteArray_AS_STRING(*offs);
    int64_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        memcpy(of + i * 8, &at, 8);
        if (o == Py_None) {
            nl[i] = 1;
        } else {
            Py_ssize_t len = PyBytes_GET_SIZE(o);
            memcpy(b + at, PyBytes_AS_STRING(o), (size_t)len);
            at += len;
            nl[i] = 0;
        }
    }
    memcpy(of + n * 8, &at, 8);
    return 0;
}

static inline void put_numbers(Arr *a, Py_ssize_t i, long long p, long long off, long long ts)
{
    int32_t p32 = (int32_t)p;
    int64_t off64 = off, ts64 = ts;
    memcpy(a[0].p + i * a[0].stride, &p32, 4);
    memcpy(a[1].p + i * a[1].stride, &off64, 8);
    memcpy(a[2].p + i * a[2].stride, &ts64, 8);
}

/* list[i] = field (bytes; NULL reads None), a new reference */
static inline int direct_column(PyObject *list, Py_ssize_t i, PyObject *field, const char *what)
{
    if (field == NULL)
        field = Py_None;
    if (field != Py_None && !PyBytes_Check(field)) {
        PyErr_Format(PyExc_TypeError, "message_columns: %s() is not bytes or None", what);
        return -1;
    }
    Py_INCREF(field);
    PyList_SET_ITEM(list, i, field);
    return 0;
}

static PyObject *message_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("message_columns", 4);
    PyObject *msgs = args[0];
    if (!PyList_Check(msgs)) {
        PyErr_SetString(PyExc_TypeError, "message_columns: a list of Message objects is required");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(msgs);
    if (n > 0 && Py_TYPE(PyList_GET_ITEM(msgs, 0)) != m_type)
        resolve(Py_TYPE(PyList_GET_ITEM(msgs, 0)));
    int direct = n > 0 && fields_readable(PyList_GET_ITEM(msgs, 0));
    /* an error event among them (end of partition ...): None, the caller takes its event path */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(msgs, i);
        if (direct && Py_TYPE(m) == m_type) {
            PyObject *e = ((const cfl_message *)m)->error;
            if (e != NULL && e != Py_None)
                Py_RETURN_NONE;
            continue;
        }
        direct = 0; /* another type in the list: methods for every message */
        PyObject *e = call_m(m, M_ERROR);
        if (e == NULL)
            return NULL;
        Py_DECREF(e);
        if (e != Py_None)
            Py_RETURN_NONE;
    }
    Arr a[3] = {0};
    if (arr_get(args[1], &a[0], 4, 1, "partitions") < 0 || arr_get(args[2], &a[1], 8, 1, "offsets") < 0 ||
        arr_get(args[3], &a[2], 8, 1, "timestamps") < 0) {
        arr_release(a, 3);
        return NULL;
    }
    if (a[0].n < n || a[1].n < n || a[2].n < n) {
        arr_release(a, 3);
        PyErr_SetString(PyExc_ValueError, "message_columns: output arrays shorter than msgs");
        return NULL;
    }
    PyObject *keys = PyList_New(n), *values = PyList_New(n), *headers = PyList_New(n);
    PyObject *kb = NULL, *ko = NULL, *kn = NULL, *vb = NULL, *vo = NULL, *vn = NULL;
    PyObject *result = NULL;
    int any_headers = 0;
    if (keys == NULL || values == NULL || headers == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(msgs, i), *o;
        long long p, off, ts;
        if (direct) {
            const cfl_message *f = (const cfl_message *)m;
            p = f->partition;
            off = f->offset;
            ts = f->timestamp;
            if (direct_column(keys, i, f->key, "key") < 0 ||
                direct_column(values, i, f->value, "value") < 0)
                goto fail;
            if (f->headers != NULL) {
                Py_INCREF(f->headers);
                o = f->headers;
            } else if (f->c_headers == NULL) {
                Py_INCREF(Py_None);
                o = Py_None;
            } else if ((o = call_m(m, M_HEADERS)) == NULL) {
                goto fail;
            }
            any_headers |= (o != Py_None);
            PyList_SET_ITEM(headers, i, o);
            put_numbers(a, i, p, off, ts);
            continue;
        }
        if (int_of(m, M_PARTITION, &p) < 0 || int_of(m, M_OFFSET, &off) < 0 ||
            int_of(m, M_TIMESTAMP, &ts) < 0)
            goto fail;
        put_numbers(a, i, p, off, ts);
        if ((o = bytes_of(m, M_KEY)) == NULL)
            goto fail;
        PyList_SET_ITEM(keys, i, o);
        if ((o = bytes_of(m, M_VALUE)) == NULL)
            goto fail;
        PyList_SET_ITEM(values, i, o);
        if ((o = call_m(m, M_HEADERS)) == NULL)
            goto fail;
        any_headers |= (o != Py_None);
        PyList_SET_ITEM(headers, i, o);
    }
    if (pack(keys, n, &kb, &ko, &kn) < 0 || pack(values, n, &vb, &vo, &vn) < 0)
        goto fail;
    result = Py_BuildValue("(NNOOOOOOO)", keys, values, any_headers ? headers : Py_None,
                           kb, ko, kn, vb, vo, vn);
    keys = values = NULL; /* references handed to the tuple ("N") */
fail:
    arr_release(a, 3);
    /* PyList_New's slots are NULL until set: Py_XDECREF of a partly filled list is safe */
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(headers);
    Py_XDECREF(kb);
    Py_XDECREF(ko);
    Py_XDECREF(kn);
    Py_XDECREF(vb);
    Py_XDECREF(vo);
    Py_XDECREF(vn);
    return result;
}

/* -- record scanning (reput/_kernels.py count_records, fill_records; docs/formats/record.md) --
 * Header, HEADER_SIZE = 44: 0 size u32 | 4 crc u32 | 8 magic u8 | 9 attributes u8 |
 * 10 topic_len u8 | 11 reserved u8 | 12 partition i32 | 16 offset i64 | 24 timestamp i64 |
 * 32 key_len i32 | 36 value_len i32 | 40 headers_len i32 | 44 topic | key | value | headers */

#define REC_HEADER 44
#define REC_MAGIC 1
#define REC_NULL_VALUE 1
#define REC_NULL_KEY 2
#define REC_ATTR_MASK 3
#define REC_MAX_SIZE (256ll * 1024 * 1024)
#define SCAN_OK 0
#define SCAN_TORN 1
#define SCAN_CORRUPT 2

static inline uint32_t rd32(const uint8_t *b) { uint32_t x; memcpy(&x, b, 4); return x; }
static inline uint64_t rd64(const uint8_t *b) { uint64_t x; memcpy(&x, b, 8); return x; }

static uint32_t crc_table[8][256];
static int crc_hw = 0;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    crc_hw = __builtin_cpu_supports("sse4.2");
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(const uint8_t *p, int64_t n)
{
    uint64_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        c = __builtin_ia32_crc32di(c, rd64(p));
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n-- > 0)
        c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32 ^ 0xFFFFFFFFu;
}
#endif

static uint32_t crc32c_sw(const uint8_t *p, int64_t n)
{
    uint32_t crc = 0xFFFFFFFFu;
    while (n >= 8) {
        uint32_t one = crc ^ rd32(p);
        crc = crc_table[7][one & 0xFF] ^ crc_table[6][(one >> 8) & 0xFF] ^
              crc_table[5][(one >> 16) & 0xFF] ^ crc_table[4][one >> 24] ^ crc_table[3][p[4]] ^
              crc_table[2][p[5]] ^ crc_table[1][p[6]] ^ crc_table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n-- > 0)
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc ^ 0xFFFFFFFFu;
}

static inline uint32_t crc32c(const uint8_t *p, int64_t n)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (crc_hw)
        return crc32c_hw(p, n);
#endif
    return crc32c_sw(p, n);
}

/* the record size at p if its header is self-consistent, 0 if torn, -1 if invalid */
static inline int64_t check_header(const uint8_t *b, int64_t p, int64_t end)
{
    if (end - p < REC_HEADER)
        return 0;
    const uint8_t *h = b + p;
    int64_t size = rd32(h);
    if (size < REC_HEADER || size > REC_MAX_SIZE)
        return -1;
    if (h[8] != REC_MAGIC || (h[9] & ~REC_ATTR_MASK) != 0 || h[11] != 0)
        return -1;
    int64_t tl = h[10], kl = (int32_t)rd32(h + 32), vl = (int32_t)rd32(h + 36),
            hl = (int32_t)rd32(h + 40);
    if (tl < 1 || kl < 0 || vl < 0 || hl < 0)
        return -1;
    if (REC_HEADER + tl + kl + vl + hl != size)
        return -1;
    if (((h[9] & REC_NULL_KEY) && kl != 0) || ((h[9] & REC_NULL_VALUE) && vl != 0))
        return -1;
    if (size > end - p)
        return 0;
    return size;
}

/* count_records(buf, start, end, verify_crc) -> (count, stop, status) */
static PyObject *count_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("count_records", 4);
    long long start = PyLong_AsLongLong(args[1]), end = PyLong_AsLongLong(args[2]);
    int verify = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred() || verify < 0)
        return NULL;
    Arr a = {{0}};
    if (arr_get(args[0], &a, 1, 0, "buf") < 0)
        return NULL;
    if (a.stride != 1 || start < 0 || end < start || end > a.n) {
        arr_release(&a, 1);
        PyErr_SetString(PyExc_ValueError, "count_records: start/end outside the buffer");
        return NULL;
    }
    const uint8_t *b = (const uint8_t *)a.p;
    int64_t p = start, n = 0, status = SCAN_OK;
    Py_BEGIN_ALLOW_THREADS
    while (p < end) {
        int64_t size = check_header(b, p, end);
        if (size <= 0) {
            status = size == 0 ? SCAN_TORN : SCAN_CORRUPT;
            break;
        }
        if (verify && crc32c(b + p + 8, size - 8) != rd32(b + p + 4)) {
            status = SCAN_CORRUPT;
            break;
        }
        p += size;
        n++;
    }
    Py_END_ALLOW_THREADS
    arr_release(&a, 1);
    return Py_BuildValue("(LLL)", (long long)n, (long long)p, (long long)status);
}

static inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

#define SIPROUND                                                                               \
    do {                                                                                       \
        v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);                              \
        v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;                                                 \
        v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;                                                 \
        v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);                              \
    } while (0)

/* SipHash-2-4-128 of p[0:len] under (k0, k1) */
static void siphash128(uint64_t k0, uint64_t k1, const uint8_t *p, int64_t len, uint64_t *lo,
                       uint64_t *hi)
{
    uint64_t v0 = 0x736F6D6570736575ull ^ k0, v1 = 0x646F72616E646F6Dull ^ k1 ^ 0xEE,
             v2 = 0x6C7967656E657261ull ^ k0, v3 = 0x7465646279746573ull ^ k1;
    int64_t i = 0;
    for (; len - i >= 8; i += 8) {
        uint64_t m = rd64(p + i);
        v3 ^= m;
        SIPROUND;
        SIPROUND;
        v0 ^= m;
    }
    uint64_t b = (uint64_t)(len & 0xFF) << 56;
    for (int j = 0; i + j < len; j++)
        b |= (uint64_t)p[i + j] << (8 * j);
    v3 ^= b;
    SIPROUND;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xEE;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    *lo = v0 ^ v1 ^ v2 ^ v3;
    v1 ^= 0xDD;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    *hi = v0 ^ v1 ^ v2 ^ v3;
}

/* fill_records(buf, start, n, k0, k1, positions, sizes, partitions, offsets, timestamps, attrs,
 *              topic_hash, digest_lo, digest_hi, crcs): the columns of the first n records from
 * start, which count_records validated (each header is checked against the buffer again) */
static PyObject *fill_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("fill_records", 15);
    long long start = PyLong_AsLongLong(args[1]), n = PyLong_AsLongLong(args[2]);
    unsigned long long k0 = PyLong_AsUnsignedLongLongMask(args[3]);
    unsigned long long k1 = PyLong_AsUnsignedLongLongMask(args[4]);
    if (PyErr_Occurred())
        return NULL;
    static const int size_of[11] = {1, 8, 8, 4, 8, 8, 1, 8, 8, 8, 4};
    static const char *names[11] = {"buf", "positions", "sizes", "partitions", "offsets",
                                    "timestamps", "attrs", "topic_hash", "digest_lo",
                                    "digest_hi", "crcs"};
    Arr a[11];
    memset(a, 0, sizeof a);
    for (int i = 0; i < 11; i++)
        if (arr_get(args[i == 0 ? 0 : i + 4], &a[i], size_of[i], i > 0, names[i]) < 0) {
            arr_release(a, 11);
            return NULL;
        }
    int bad = a[0].stride != 1 || start < 0 || n < 0;
    for (int i = 1; i < 11; i++)
        bad |= a[i].n < n;
    if (bad) {
        arr_release(a, 11);
        PyErr_SetString(PyExc_ValueError, "fill_records: output arrays shorter than n");
        return NULL;
    }
    const uint8_t *b = (const uint8_t *)a[0].p;
    int64_t blen = a[0].n, p = start, failed = -1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        int64_t size = check_header(b, p, blen);
        if (size <= 0) {
            failed = i;
            break;
        }
        const uint8_t *h = b + p;
        int32_t part = (int32_t)rd32(h + 12);
        int64_t off = (int64_t)rd64(h + 16), ts = (int64_t)rd64(h + 24), sz = size;
        uint32_t crc = rd32(h + 4);
        uint8_t at = h[9];
        int64_t tl = h[10], kl = (int32_t)rd32(h + 32);
        memcpy(a[1].p + i * a[1].stride, &p, 8);
        memcpy(a[2].p + i * a[2].stride, &sz, 8);
        memcpy(a[3].p + i * a[3].stride, &part, 4);
        memcpy(a[4].p + i * a[4].stride, &off, 8);
        memcpy(a[5].p + i * a[5].stride, &ts, 8);
        a[6].p[i * a[6].stride] = (char)at;
        uint64_t th = 0xCBF29CE484222325ull; /* FNV-1a 64 of the topic name */
        for (int64_t j = 0; j < tl; j++) {
            th ^= h[REC_HEADER + j];
            th *= 0x100000001B3ull;
        }
        memcpy(a[7].p + i * a[7].stride, &th, 8);
        uint64_t lo = 0, hi = 0;
        if (!(at & REC_NULL_KEY))
            siphash128(k0, k1, h + REC_HEADER + tl, kl, &lo, &hi);
        memcpy(a[8].p + i * a[8].stride, &lo, 8);
        memcpy(a[9].p + i * a[9].stride, &hi, 8);
        memcpy(a[10].p + i * a[10].stride, &crc, 4);
        p += size;
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 11);
    if (failed >= 0) {
        PyErr_Format(PyExc_ValueError, "fill_records: record %lld is not whole in the buffer "
                     "(count it with count_records first)", (long long)failed);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* -- the key-value map's bulk-build kernels (connectors/apps/kv/kernels.py, same algorithms) */

/* a DigestTable row: five 64-bit words (lo, hi, offset, timestamp, meta) */
#define KV_USED (1ull << 63)
#define KV_TOMBSTONE 1
#define KV_KEYLESS 2

static inline int64_t kv_probe(const uint64_t *rows, int64_t cap, uint64_t lo, uint64_t hi)
{
    uint64_t mask = (uint64_t)cap - 1;
    int64_t s = (int64_t)(lo & mask);
    while (rows[s * 5 + 4] & KV_USED) {
        if (rows[s * 5] == lo && rows[s * 5 + 1] == hi)
            return s;
        s = (int64_t)(((uint64_t)s + 1) & mask);
    }
    return s;
}

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
    long long end = PyLong_AsLongLong(args[6]), part = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
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
    int64_t covered = 0, keyless = 0, added = 0;
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
        uint64_t *r = &rows[kv_probe(rows, cap, lo, hi) * 5];
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
    int64_t added = 0, both = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t j = 0; j < ocap; j++) {
        const uint64_t *x = &other[j * 5];
        if (!(x[4] & KV_USED))
            continue;
        uint64_t *r = &rows[kv_probe(rows, cap, x[0], x[1]) * 5];
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
    Py_BEGIN_ALLOW_THREADS
    for (int64_t j = 0; j < cap; j++)
        if (rows[j * 5 + 4] & KV_USED)
            memcpy(&nw[kv_probe(nw, ncap, rows[j * 5], rows[j * 5 + 1]) * 5], &rows[j * 5], 40);
    Py_END_ALLOW_THREADS
    arr_release(&t, 1);
    arr_release(&o, 1);
    Py_RETURN_NONE;
}

#define KV_HEADER_SIZE 44 /* record header (docs/formats/record.md) */

/* kv_record_spans(buf, positions, kstart, klen, vstart, vlen, attrs): where each record's key
 * and value lie in buf (records already CRC-checked; positions checked against buf here) */
static PyObject *kv_record_spans(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kv_record_spans", 7);
    Arr a[7] = {{0}};
    if (arr_get(args[0], &a[0], 1, 0, "buf") < 0 || arr_get(args[1], &a[1], 8, 0, "positions") < 0 ||
        arr_get(args[2], &a[2], 8, 1, "kstart") < 0 || arr_get(args[3], &a[3], 8, 1, "klen") < 0 ||
        arr_get(args[4], &a[4], 8, 1, "vstart") < 0 || arr_get(args[5], &a[5], 8, 1, "vlen") < 0 ||
        arr_get(args[6], &a[6], 1, 1, "attrs") < 0) {
        arr_release(a, 7);
        return NULL;
    }
    int64_t n = a[1].n, blen = a[0].n;
    int bad = a[0].stride != 1;
    for (int i = 2; i < 7; i++)
        bad |= a[i].n < n;
    if (bad) {
        arr_release(a, 7);
        PyErr_SetString(PyExc_ValueError, "kv_record_spans: arrays shorter than positions");
        return NULL;
    }
    const uint8_t *b = (const uint8_t *)a[0].p;
    int64_t at = -1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        int64_t p = ld_i64(&a[1], i);
        if (p < 0 || p + KV_HEADER_SIZE > blen) {
            at = i;
            break;
        }
        int64_t tl = b[p + 10];
        uint32_t kl, vl;
        memcpy(&kl, b + p + 32, 4);
        memcpy(&vl, b + p + 36, 4);
        int64_t ks = p + KV_HEADER_SIZE + tl;
        memcpy(a[2].p + i * a[2].stride, &ks, 8);
        int64_t k64 = kl, v64 = vl, vs = ks + k64;
        memcpy(a[3].p + i * a[3].stride, &k64, 8);
        memcpy(a[4].p + i * a[4].stride, &vs, 8);
        memcpy(a[5].p + i * a[5].stride, &v64, 8);
        a[6].p[i * a[6].stride] = (char)b[p + 9];
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 7);
    if (at >= 0) {
        PyErr_Format(PyExc_ValueError, "kv_record_spans: position %lld is outside the buffer",
                     (long long)at);
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
    long long prefix = PyLong_AsLongLong(args[3]), pos = PyLong_AsLongLong(args[5]);
    long long first = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    Arr a[5] = {{0}};
    if (arr_get(args[0], &a[0], 1, 0, "src") < 0 || arr_get(args[1], &a[1], 8, 0, "starts") < 0 ||
        arr_get(args[2], &a[2], 8, 0, "lengths") < 0 || arr_get(args[4], &a[3], 1, 1, "out") < 0 ||
        arr_get(args[6], &a[4], 8, 1, "offs") < 0) {
        arr_release(a, 5);
        return NULL;
    }
    int64_t n = a[1].n;
    int bad = a[0].stride != 1 || a[3].stride != 1 || a[2].n < n || first < 0 || pos < 0 ||
              first + n + 1 > a[4].n;
    /* bounds of every copy before any */
    int64_t need = pos;
    for (int64_t i = 0; !bad && i < n; i++) {
        int64_t s = ld_i64(&a[1], i), l = ld_i64(&a[2], i);
        bad |= s < 0 || l < 0 || s + l > a[0].n;
        need += l + (prefix >= 0);
    }
    if (bad || need > a[3].n) {
        arr_release(a, 5);
        PyErr_SetString(PyExc_ValueError, "kv_gather: a range is outside its array");
        return NULL;
    }
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
    long long width = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Arr a[3] = {{0}};
    if (arr_get(args[0], &a[0], 1, 0, "keys") < 0 || arr_get(args[1], &a[1], 8, 0, "koffs") < 0 ||
        arr_get(args[3], &a[2], 1, 1, "out") < 0) {
        arr_release(a, 3);
        return NULL;
    }
    int64_t n = a[1].n - 1;
    int bad = n < 0 || width < 4 || a[0].stride != 1 || a[2].stride != 1 || n * width > a[2].n;
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

/* message_fields_readable(msg) -> bool: would message_columns read this message's type through
 * its struct fields (tests) */
static PyObject *message_fields_readable(PyObject *self, PyObject *msg)
{
    (void)self;
    if (Py_TYPE(msg) != m_type)
        resolve(Py_TYPE(msg));
    return PyBool_FromLong(fields_readable(msg));
}

static PyMethodDef methods[] = {
    {"message_fields_readable", (PyCFunction)message_fields_readable, METH_O, NULL},
    {"insert_entries", (PyCFunction)(void (*)(void))insert_entries, METH_FASTCALL, NULL},
    {"lookup_many", (PyCFunction)(void (*)(void))lookup_many, METH_FASTCALL, NULL},
    {"decide", (PyCFunction)(void (*)(void))decide, METH_FASTCALL, NULL},
    {"gather_kept", (PyCFunction)(void (*)(void))gather_kept, METH_FASTCALL, NULL},
    {"lower_bound_strided", (PyCFunction)(void (*)(void))lower_bound_strided, METH_FASTCALL,
     NULL},
    {"message_columns", (PyCFunction)(void (*)(void))message_columns, METH_FASTCALL, NULL},
    {"count_records", (PyCFunction)(void (*)(void))count_records, METH_FASTCALL, NULL},
    {"fill_records", (PyCFunction)(void (*)(void))fill_records, METH_FASTCALL, NULL},
    {"kv_upsert_latest", (PyCFunction)(void (*)(void))kv_upsert_latest, METH_FASTCALL, NULL},
    {"kv_merge", (PyCFunction)(void (*)(void))kv_merge, METH_FASTCALL, NULL},
    {"kv_rehash", (PyCFunction)(void (*)(void))kv_rehash, METH_FASTCALL, NULL},
    {"kv_record_spans", (PyCFunction)(void (*)(void))kv_record_spans, METH_FASTCALL, NULL},
    {"kv_gather", (PyCFunction)(void (*)(void))kv_gather, METH_FASTCALL, NULL},
    {"kv_sort_rows", (PyCFunction)(void (*)(void))kv_sort_rows, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "reput._native",
    "The compaction kernels in C (see the comment at the top of reput/_native.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    crc_init();
    for (int i = 0; i < M_N; i++)
        if ((m_names[i] = PyUnicode_InternFromString(m_name_text[i])) == NULL)
            return NULL;
    return PyModule_Create(&module);
}
