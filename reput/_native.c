/* kcompact.reput._native: the record and index kernels in C, so that reading a store (scanning
 * records, their CRC32C and SipHash key digests, checking them against the .bcq, the index
 * search) needs no JIT compiler. The numba kernels of tests/unit/_oracle_kernels.py are the same
 * algorithms: the reference tests/unit/test_native_kernels.py compares against. Loading numba means loading LLVM (~120 MiB resident); see reput/jit.py.
 *
 * The other layers' kernels live with their data: compaction/_native.c (the offset map, the
 * cleaner's decision), connectors/apps/kv/_native.c (the KV map's bulk build),
 * connectors/framework/_rdkafka.c (the Kafka I/O, and the consumer path's column pass over
 * Message objects).
 *
 * Arrays come in through the buffer protocol as 1-d views, possibly strided (fields of a .bcq
 * structured array: a stride of 48 bytes). Loads go through memcpy, so unaligned views are fine.
 * Every function releases the GIL while it loops, as the numba kernels do (nogil=True).
 * (About 680 lines: the record, index and write-order kernels share the CRC and SipHash
 * primitives here; store format 2's are in _kafka_native.h and _kafka_span.h.)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_arr.h"

/* lower_bound_strided(words, stride_words, n, target): first i in [0, n) with
 * words[i * stride_words] >= target (int64), else n. The n entries must lie in words. */
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
    Arr a;
    memset(&a, 0, sizeof a);
    if (arr_get(args[0], &a, 8, 0, "words") < 0)
        return NULL;
    /* (n - 1) * stride < a.n, written so that it cannot overflow */
    if (stride <= 0 || n < 0 || (n > 0 && (a.n <= 0 || n - 1 > (a.n - 1) / stride)))
        ARG_ERROR(&a, 1, "lower_bound_strided: %lld entries of stride %lld do not fit %lld "
                  "words", (long long)n, (long long)stride, (long long)a.n);
    if (overflow) { /* beyond every int64 offset: all below it, or none */
        PyBuffer_Release(&a.v);
        return PyLong_FromLongLong(overflow > 0 ? n : 0);
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

/* the CRC32C register after p[0:n], from register c (the caller inverts in and out) */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw_from(uint32_t c32, const uint8_t *p,
                                                                 int64_t n)
{
    uint64_t c = c32;
    while (n >= 8) {
        c = __builtin_ia32_crc32di(c, rd64(p));
        p += 8;
        n -= 8;
    }
    c32 = (uint32_t)c;
    while (n-- > 0)
        c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

static uint32_t crc32c_sw_from(uint32_t crc, const uint8_t *p, int64_t n)
{
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
    return crc;
}

static inline uint32_t crc32c(const uint8_t *p, int64_t n)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (crc_hw)
        return crc32c_hw_from(0xFFFFFFFFu, p, n) ^ 0xFFFFFFFFu;
#endif
    return crc32c_sw_from(0xFFFFFFFFu, p, n) ^ 0xFFFFFFFFu;
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
    static const int ints[] = {1, 2};
    int64_t iv[2];
    if (args_i64(args, ints, 2, iv) < 0)
        return NULL;
    int64_t start = iv[0], end = iv[1];
    int verify = PyObject_IsTrue(args[3]);
    if (verify < 0)
        return NULL;
    Arr a = {{0}};
    if (arr_get(args[0], &a, 1, 0, "buf") < 0)
        return NULL;
    if (a.stride != 1 || start < 0 || end < start || end > a.n)
        ARG_ERROR(&a, 1, "count_records: start %lld / end %lld outside the buffer of %lld "
                  "bytes (or the buffer is not contiguous)", (long long)start, (long long)end,
                  (long long)a.n);
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

/* siphash_ranges(k0, k1, buf, starts, lengths, digest_lo, digest_hi): SipHash-2-4-128 under
 * (k0, k1) of each buf[starts[i]:starts[i] + lengths[i]], into digest_lo/hi[i]; a negative length
 * is a null key, whose digest is (0, 0). kcompact's one SipHash (siphash128, above) serves the
 * record scans, the writer's key digests (siphash_keys, below), a single key (key_digest) and
 * any ranges (hash_ranges). */
static PyObject *siphash_ranges(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("siphash_ranges", 7);
    unsigned long long k0 = PyLong_AsUnsignedLongLongMask(args[0]);
    unsigned long long k1 = PyLong_AsUnsignedLongLongMask(args[1]);
    if (PyErr_Occurred())
        return NULL;
    static const int size_of[5] = {1, 8, 8, 8, 8};
    static const char *names[5] = {"buf", "starts", "lengths", "digest_lo", "digest_hi"};
    Arr a[5];
    memset(a, 0, sizeof a);
    for (int i = 0; i < 5; i++)
        if (arr_get(args[i + 2], &a[i], size_of[i], i >= 3, names[i]) < 0) {
            arr_release(a, 5);
            return NULL;
        }
    int64_t n = a[1].n;
    if (a[0].stride != 1 || a[2].n != n || a[3].n < n || a[4].n < n)
        ARG_ERROR(a, 5, "siphash_ranges: starts and lengths differ in length, or the outputs "
                  "are shorter");
    const uint8_t *b = (const uint8_t *)a[0].p;
    int64_t blen = a[0].n, bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        int64_t st, len;
        memcpy(&st, a[1].p + i * a[1].stride, 8);
        memcpy(&len, a[2].p + i * a[2].stride, 8);
        uint64_t lo = 0, hi = 0;
        if (len >= 0) {
            if (st < 0 || st > blen || len > blen - st) {
                bad = i;
                break;
            }
            siphash128(k0, k1, b + st, len, &lo, &hi);
        }
        memcpy(a[3].p + i * a[3].stride, &lo, 8);
        memcpy(a[4].p + i * a[4].stride, &hi, 8);
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 5);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "siphash_ranges: range %lld is outside the buffer",
                     (long long)bad);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* siphash_keys(k0, k1, buf, offs, null, digest_lo, digest_hi): the key digests of a keys column
 * (record.BytesColumn: key i is buf[offs[i]:offs[i + 1]], none where null[i]): siphash_ranges
 * without building the ranges (the writer's path, reput/record.py encode_scanned). */
static PyObject *siphash_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("siphash_keys", 7);
    unsigned long long k0 = PyLong_AsUnsignedLongLongMask(args[0]);
    unsigned long long k1 = PyLong_AsUnsignedLongLongMask(args[1]);
    if (PyErr_Occurred())
        return NULL;
    static const int size_of[5] = {1, 8, 1, 8, 8};
    static const char *names[5] = {"buf", "offs", "null", "digest_lo", "digest_hi"};
    Arr a[5];
    memset(a, 0, sizeof a);
    for (int i = 0; i < 5; i++)
        if (arr_get(args[i + 2], &a[i], size_of[i], i >= 3, names[i]) < 0) {
            arr_release(a, 5);
            return NULL;
        }
    int64_t n = a[2].n;
    if (a[0].stride != 1 || a[1].n < n + 1 || a[3].n < n || a[4].n < n)
        ARG_ERROR(a, 5, "siphash_keys: offs needs len(null) + 1 entries and the outputs "
                  "len(null)");
    const uint8_t *b = (const uint8_t *)a[0].p;
    int64_t blen = a[0].n, bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        uint64_t lo = 0, hi = 0;
        if (!a[2].p[i * a[2].stride]) {
            int64_t st, end;
            memcpy(&st, a[1].p + i * a[1].stride, 8);
            memcpy(&end, a[1].p + (i + 1) * a[1].stride, 8);
            if (st < 0 || end < st || end > blen) {
                bad = i;
                break;
            }
            siphash128(k0, k1, b + st, end - st, &lo, &hi);
        }
        memcpy(a[3].p + i * a[3].stride, &lo, 8);
        memcpy(a[4].p + i * a[4].stride, &hi, 8);
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 5);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "siphash_keys: key %lld is outside the buffer",
                     (long long)bad);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* fill_records(buf, start, n, k0, k1, positions, sizes, partitions, offsets, timestamps, attrs,
 *              topic_hash, digest_lo, digest_hi, crcs): the columns of the first n records from
 * start, which count_records validated (each header is checked against the buffer again) */
static PyObject *fill_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("fill_records", 15);
    static const int ints[] = {1, 2};
    int64_t iv[2];
    if (args_i64(args, ints, 2, iv) < 0)
        return NULL;
    int64_t start = iv[0], n = iv[1];
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
    int bad = a[0].stride != 1 || start < 0 || start > a[0].n || n < 0;
    for (int i = 1; i < 11; i++)
        bad |= a[i].n < n;
    if (bad)
        ARG_ERROR(a, 11, "fill_records: start %lld outside the buffer of %lld bytes, or output "
                  "arrays shorter than n = %lld", (long long)start, (long long)a[0].n,
                  (long long)n);
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

/* -- reading records against their index entries (reput/reader.py) ------------------------- */

/* verify_records(buf, base, entries, k0, k1, mode) -> index of the first record that fails, or
 * -1. ``entries`` is the bytes of n .bcq entries (docs/formats/bcq.md: 48 bytes each,
 * contiguous); record i is the one entry i points to: at buf[position - base] there must be a
 * record with a valid header and a matching CRC32C whose size, offset, timestamp, attributes
 * (the entry's flags) and key digest (SipHash-2-4-128 under (k0, k1); 0 when keyless) are the
 * entry's. mode 0: a selection of entries. mode 1 (contiguous): the records must also lie back
 * to back from buf[0], in strictly increasing offset order, and end exactly at the end of buf
 * (a range read or shipped as it is); bytes left after the last record make the result n.
 * mode 2 (contiguous, with a guard): as 1, but the first record is the one before those handed
 * out (reput/reader.py): only its header is checked (the entry's size and offset, a valid
 * header), not its CRC or digest, so that damage inside it does not fail reads after it. The
 * mode 3 (decoded): as 0, without the CRC: the records were just written by store format 2's
 * decoder, which computed their CRCs from the bytes it wrote (the batch they came from was
 * accepted by its CRC-32C); checking them again would check the decoder, not the data.
 * The reader's one check (segment_v1.verify_records); the numba twin is
 * tests/unit/_oracle_kernels.py's. */
#define E_OFFSET 0
#define E_TIMESTAMP 8
#define E_DIGEST_LO 16
#define E_DIGEST_HI 24
#define E_POSITION 32
#define E_SIZE 36
#define E_FLAGS 40
#define ENTRY_SIZE 48

static PyObject *verify_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("verify_records", 6);
    static const int ints[] = {1};
    int64_t base;
    if (args_i64(args, ints, 1, &base) < 0)
        return NULL;
    unsigned long long k0 = PyLong_AsUnsignedLongLongMask(args[3]);
    unsigned long long k1 = PyLong_AsUnsignedLongLongMask(args[4]);
    if (PyErr_Occurred())
        return NULL;
    long mode = PyLong_AsLong(args[5]);
    if (mode == -1 && PyErr_Occurred())
        return NULL;
    if (mode < 0 || mode > 3) {
        PyErr_Format(PyExc_ValueError, "verify_records: mode %ld is not 0, 1, 2 or 3", mode);
        return NULL;
    }
    int contiguous = mode == 1 || mode == 2, guard = mode == 2, crc = mode != 3;
    Arr a[2] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "buf") < 0 || arr_get(args[2], &a[1], 1, 0, "entries") < 0) {
        arr_release(a, 2);
        return NULL;
    }
    /* a .log position is 32 bits: base (the file position of buf[0]) is one too */
    if (a[0].stride != 1 || a[1].stride != 1 || a[1].n % ENTRY_SIZE != 0 || base < 0 ||
        base > 0xFFFFFFFFll)
        ARG_ERROR(a, 2, "verify_records: buf and entries must be contiguous bytes, entries a "
                  "whole number of %d-byte entries (got %lld bytes), base in [0, 2^32) "
                  "(got %lld)", ENTRY_SIZE, (long long)a[1].n, (long long)base);
    const uint8_t *b = (const uint8_t *)a[0].p, *e = (const uint8_t *)a[1].p;
    int64_t n = a[1].n / ENTRY_SIZE, blen = a[0].n, bad = -1, expect = 0;
    int64_t prev_off = INT64_MIN;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++, e += ENTRY_SIZE) {
        int64_t p = (int64_t)rd32(e + E_POSITION) - base, size = (int64_t)rd32(e + E_SIZE);
        int64_t off = (int64_t)rd64(e + E_OFFSET);
        /* size >= REC_HEADER before anything is read at p (a zeroed entry has size 0) */
        if (size < REC_HEADER || p < 0 || p > blen ||
            (contiguous && (p != expect || (i > 0 && off <= prev_off))) ||
            check_header(b, p, blen) != size) {
            bad = i;
            break;
        }
        const uint8_t *h = b + p;
        prev_off = off;
        if (guard && i == 0) { /* the guard: its header's offset, nothing more */
            if ((int64_t)rd64(h + 16) != off) {
                bad = i;
                break;
            }
            expect = p + size;
            continue;
        }
        uint16_t flags;
        memcpy(&flags, e + E_FLAGS, 2);
        if (rd64(h + 16) != rd64(e + E_OFFSET) || rd64(h + 24) != rd64(e + E_TIMESTAMP) ||
            flags != h[9] || (crc && crc32c(h + 8, size - 8) != rd32(h + 4))) {
            bad = i;
            break;
        }
        uint64_t lo = 0, hi = 0;
        if (!(h[9] & REC_NULL_KEY))
            siphash128(k0, k1, h + REC_HEADER + h[10], (int32_t)rd32(h + 32), &lo, &hi);
        if (lo != rd64(e + E_DIGEST_LO) || hi != rd64(e + E_DIGEST_HI)) {
            bad = i;
            break;
        }
        expect = p + size;
    }
    if (bad < 0 && contiguous && expect != blen)
        bad = n; /* bytes after the last record: none of them may be handed out */
    Py_END_ALLOW_THREADS
    arr_release(a, 2);
    return PyLong_FromLongLong(bad);
}

/* field_spans(buf, positions, kstart, klen, vstart, vlen, hstart, hlen, attrs): where each
 * record's key, value and headers lie in buf (records verified already; each position is
 * checked against buf here) */
static PyObject *field_spans(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("field_spans", 9);
    static const int size_of[9] = {1, 8, 8, 8, 8, 8, 8, 8, 1};
    static const char *names[9] = {"buf", "positions", "kstart", "klen", "vstart", "vlen",
                                   "hstart", "hlen", "attrs"};
    Arr a[9];
    memset(a, 0, sizeof a);
    for (int i = 0; i < 9; i++)
        if (arr_get(args[i], &a[i], size_of[i], i >= 2, names[i]) < 0) {
            arr_release(a, 9);
            return NULL;
        }
    int64_t n = a[1].n, blen = a[0].n;
    int bad = a[0].stride != 1;
    for (int i = 2; i < 9; i++)
        bad |= a[i].n < n;
    if (bad)
        ARG_ERROR(a, 9, "field_spans: buf is not contiguous or an output array is shorter than "
                  "the %lld positions", (long long)n);
    const uint8_t *b = (const uint8_t *)a[0].p;
    int64_t at = -1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        int64_t p = ld_i64(&a[1], i);
        if (p < 0 || check_header(b, p, blen) <= 0) {
            at = i;
            break;
        }
        int64_t tl = b[p + 10], kl = (int32_t)rd32(b + p + 32), vl = (int32_t)rd32(b + p + 36),
                hl = (int32_t)rd32(b + p + 40);
        int64_t ks = p + REC_HEADER + tl, vs = ks + kl, hs = vs + vl;
        memcpy(a[2].p + i * a[2].stride, &ks, 8);
        memcpy(a[3].p + i * a[3].stride, &kl, 8);
        memcpy(a[4].p + i * a[4].stride, &vs, 8);
        memcpy(a[5].p + i * a[5].stride, &vl, 8);
        memcpy(a[6].p + i * a[6].stride, &hs, 8);
        memcpy(a[7].p + i * a[7].stride, &hl, 8);
        a[8].p[i * a[8].stride] = (char)b[p + 9];
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 9);
    if (at >= 0) {
        PyErr_Format(PyExc_ValueError, "field_spans: no valid record at position %lld",
                     (long long)at);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* gather_ranges(src, starts, lengths, out) -> bytes written: src[starts[i]:+lengths[i]] back to
 * back into out (every range checked against its array before any copy) */
static PyObject *gather_ranges(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("gather_ranges", 4);
    Arr a[4] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "src") < 0 || arr_get(args[1], &a[1], 8, 0, "starts") < 0 ||
        arr_get(args[2], &a[2], 8, 0, "lengths") < 0 || arr_get(args[3], &a[3], 1, 1, "out") < 0) {
        arr_release(a, 4);
        return NULL;
    }
    int64_t n = a[1].n, need = 0;
    int bad = a[0].stride != 1 || a[3].stride != 1 || a[2].n < n;
    for (int64_t i = 0; !bad && i < n; i++) {
        int64_t s = ld_i64(&a[1], i), l = ld_i64(&a[2], i);
        /* written so that no sum can overflow */
        bad |= s < 0 || l < 0 || s > a[0].n || l > a[0].n - s || l > a[3].n - need;
        if (!bad)
            need += l;
    }
    if (bad)
        ARG_ERROR(a, 4, "gather_ranges: a range is outside its source array, or the ranges "
                  "do not fit the output of %lld bytes", (long long)a[3].n);
    int64_t q = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        int64_t l = ld_i64(&a[2], i);
        memcpy(a[3].p + q, a[0].p + ld_i64(&a[1], i), (size_t)l);
        q += l;
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 4);
    return PyLong_FromLongLong(q);
}

/* crc32c(buf, crc) -> the CRC32C of buf's bytes continuing from crc (0 to start): the
 * checksum of a .bcq in a partition's segment list (docs/formats/segment-list.md) */
static PyObject *crc32c_update(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("crc32c", 2);
    unsigned long long crc = PyLong_AsUnsignedLongLongMask(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (crc > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "crc32c: crc must be a 32-bit value");
        return NULL;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    const uint8_t *p = (const uint8_t *)v.buf;
    int64_t n = v.len;
    uint32_t c = (uint32_t)crc ^ 0xFFFFFFFFu;
    Py_BEGIN_ALLOW_THREADS
#if defined(__x86_64__) && defined(__GNUC__)
    if (crc_hw)
        c = crc32c_hw_from(c, p, n);
    else
#endif
        c = crc32c_sw_from(c, p, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(c ^ 0xFFFFFFFFu);
}

/* offset_order(partitions, offsets, max_partition, seen) -> i: one pass over a batch (int32
 * partitions in [0, max_partition], int64 offsets): the first record whose offset is not above
 * the previous one of its partition (-1 when none); seen (uint8, max_partition + 1) marks the
 * partitions present. Store._check_order; the numba twin is tests/unit/_oracle_kernels.py's. */
static PyObject *offset_order(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("offset_order", 4);
    static const int ints[] = {2};
    int64_t maxp;
    if (args_i64(args, ints, 1, &maxp) < 0)
        return NULL;
    Arr a[3] = {{{0}}};
    if (arr_get(args[0], &a[0], 4, 0, "partitions") < 0 ||
        arr_get(args[1], &a[1], 8, 0, "offsets") < 0 || arr_get(args[3], &a[2], 1, 1, "seen") < 0) {
        arr_release(a, 3);
        return NULL;
    }
    if (maxp < 0 || maxp > (1 << 24) || a[1].n < a[0].n || a[2].n < maxp + 1 || a[2].stride != 1)
        ARG_ERROR(a, 3, "offset_order: max_partition in [0, 2^24], offsets as long as "
                  "partitions, seen of max_partition + 1 contiguous bytes");
    int64_t *last = (int64_t *)PyMem_Malloc((size_t)(maxp + 1) * sizeof(int64_t));
    if (last == NULL) {
        arr_release(a, 3);
        return PyErr_NoMemory();
    }
    uint8_t *seen = (uint8_t *)a[2].p;
    int64_t bad = -1, n = a[0].n, range_bad = 0;
    Py_BEGIN_ALLOW_THREADS
    memset(seen, 0, (size_t)(maxp + 1));
    for (int64_t i = 0; i < n; i++) {
        int32_t p;
        int64_t o;
        memcpy(&p, a[0].p + i * a[0].stride, 4);
        memcpy(&o, a[1].p + i * a[1].stride, 8);
        if (p < 0 || p > maxp) {
            range_bad = 1;
            break;
        }
        if (seen[p] && o <= last[p]) {
            bad = i;
            break;
        }
        seen[p] = 1;
        last[p] = o;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(last);
    arr_release(a, 3);
    if (range_bad) {
        PyErr_SetString(PyExc_ValueError, "offset_order: a partition outside [0, max_partition]");
        return NULL;
    }
    return PyLong_FromLongLong(bad);
}

#include "_kafka_native.h"

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))crc32c_update, METH_FASTCALL, NULL},
    KAFKA_METHODS
    {"verify_records", (PyCFunction)(void (*)(void))verify_records, METH_FASTCALL, NULL},
    {"offset_order", (PyCFunction)(void (*)(void))offset_order, METH_FASTCALL, NULL},
    {"field_spans", (PyCFunction)(void (*)(void))field_spans, METH_FASTCALL, NULL},
    {"gather_ranges", (PyCFunction)(void (*)(void))gather_ranges, METH_FASTCALL, NULL},
    {"lower_bound_strided", (PyCFunction)(void (*)(void))lower_bound_strided, METH_FASTCALL,
     NULL},
    {"count_records", (PyCFunction)(void (*)(void))count_records, METH_FASTCALL, NULL},
    {"fill_records", (PyCFunction)(void (*)(void))fill_records, METH_FASTCALL, NULL},
    {"siphash_ranges", (PyCFunction)(void (*)(void))siphash_ranges, METH_FASTCALL, NULL},
    {"siphash_keys", (PyCFunction)(void (*)(void))siphash_keys, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kcompact.reput._native",
    "The record and index kernels in C (see the comment at the top of reput/_native.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    crc_init();
    PyObject *m = PyModule_Create(&module);
    /* the zstd decoder compiled in (third_party/zstd): `kcompact --version` names it */
    if (m != NULL && PyModule_AddStringConstant(m, "ZSTD_VERSION", ZSTD_versionString()) < 0)
        Py_CLEAR(m);
    return m;
}
