/* Store format 2's span kernels in C (included by reput/_kafka_native.h, whose record walker
 * kwalk and record writer kput_v1 they use, and by way of it by reput/_native.c, which provides
 * crc32c, siphash128 and the .bcq entry layout): the batches of a span read at once
 * (reput/batch.py decode_batches, span_entries: headers and CRC-32Cs, payloads decompressed
 * through the zstd decoder vendored in third_party/zstd, records walked, converted or
 * indexed) and a lean index
 * chunk decoded (reput/bcq2.py). Each one's Python caller keeps a batch-by-batch path that
 * names any failure these report. */
#ifndef KCOMPACT_KAFKA_SPAN_H
#define KCOMPACT_KAFKA_SPAN_H

/* -- many batches at once (reput/batch.py decode_batches): headers, then records ------------ */

static inline uint64_t be64(const uint8_t *b)
{
    uint64_t x;
    memcpy(&x, b, 8);
    return __builtin_bswap64(x);
}
static inline uint32_t be32(const uint8_t *b)
{
    uint32_t x;
    memcpy(&x, b, 4);
    return __builtin_bswap32(x);
}
static inline uint16_t be16(const uint8_t *b) { return (uint16_t)((b[0] << 8) | b[1]); }

#define KB_HEADER 61       /* RecordBatch v2's header: batch.py HEADER_SIZE */
#define KB_OVERHEAD 12     /* baseOffset + batchLength */
#define KB_CRC_START 21
#define KB_ATTR_REFUSED (~0x0F & 0xFFFF)
#define KHEAD_COLS 8       /* position size base_offset last_offset base_ts max_ts count codec */
#define KHEAD_MORE 1       /* kafka_heads: the table is full, resume at stop */
#define KHEAD_INVALID 2    /* kafka_heads: the batch at stop has an invalid header */
#define KHEAD_CRC 3        /* kafka_heads: the batch at stop fails its CRC-32C */

/* spans: n (start, end) pairs of int64 with 0 <= start <= end <= len */
static int kspans_ok(const Arr *spans, int64_t n, int64_t len)
{
    for (int64_t i = 0; i < n; i++) {
        int64_t a = ld_i64(spans, 2 * i), b = ld_i64(spans, 2 * i + 1);
        if (a < 0 || a > b || b > len)
            return 0;
    }
    return 1;
}

/* one 48-byte .bcq entry (bcq.md: offset, timestamp, key digest, position, size, flags,
 * reserved 0, clean time), as a lean index has it in memory */
static inline void kput_entry(uint8_t *e, int64_t off, int64_t ts, uint64_t dlo, uint64_t dhi,
                              uint32_t pos, uint32_t size, uint16_t flags, uint32_t clean)
{
    uint16_t reserved = 0;
    wr64(e + E_OFFSET, (uint64_t)off);
    wr64(e + E_TIMESTAMP, (uint64_t)ts);
    wr64(e + E_DIGEST_LO, dlo);
    wr64(e + E_DIGEST_HI, dhi);
    memcpy(e + E_POSITION, &pos, 4);
    memcpy(e + E_SIZE, &size, 4);
    memcpy(e + E_FLAGS, &flags, 2);
    memcpy(e + E_FLAGS + 2, &reserved, 2);
    memcpy(e + E_FLAGS + 4, &clean, 4);
}

/* kafka_heads(buf, start, pos0, table) -> (n, status, stop): the batches of buf lying back to
 * back from buf[start:], each header checked as batch.parse_head checks it (magic 2, lengths,
 * attributes, count >= 1, offsets) and its CRC-32C, into rows of the int64 table (KHEAD_COLS
 * columns, batch.BatchHead's fields; position = pos0 + its place in buf). status 0: every batch
 * up to the end of buf; KHEAD_MORE: the table is full, the next batch at stop; KHEAD_INVALID /
 * KHEAD_CRC: the batch at stop fails (the caller's general path names it). */
static PyObject *kafka_heads(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_heads", 4);
    static const int which[2] = {1, 2};
    int64_t v[2];
    if (args_i64(args, which, 2, v) < 0)
        return NULL;
    int64_t start = v[0], pos0 = v[1];
    Arr a[2] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "buf") < 0 || arr_get(args[3], &a[1], 8, 1, "table") < 0) {
        arr_release(a, 2);
        return NULL;
    }
    if (a[0].stride != 1 || a[1].stride != 8 || start < 0 || start > a[0].n)
        ARG_ERROR(a, 2, "kafka_heads: buf and table must be contiguous, start inside buf");
    const uint8_t *b = (const uint8_t *)a[0].p;
    int64_t cap = a[1].n / KHEAD_COLS, end = a[0].n, p = start, n = 0;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    while (p < end) {
        if (n == cap) {
            status = KHEAD_MORE;
            break;
        }
        if (end - p < KB_HEADER) {
            status = KHEAD_INVALID;
            break;
        }
        const uint8_t *h = b + p;
        int64_t base = (int64_t)be64(h), length = (int32_t)be32(h + 8);
        int64_t size = KB_OVERHEAD + length;
        uint16_t attrs = be16(h + 21);
        int64_t last_delta = (int32_t)be32(h + 23), count = (int32_t)be32(h + 57);
        if (h[16] != 2 || length < KB_HEADER - KB_OVERHEAD || size > end - p ||
            (attrs & KB_ATTR_REFUSED) || count < 1 || last_delta < 0 || base < 0) {
            status = KHEAD_INVALID;
            break;
        }
        if (crc32c(h + KB_CRC_START, size - KB_CRC_START) != be32(h + 17)) {
            status = KHEAD_CRC;
            break;
        }
        int64_t row[KHEAD_COLS] = {pos0 + p, size, base, base + last_delta, (int64_t)be64(h + 27),
                                   (int64_t)be64(h + 35), count, attrs & 0x07};
        memcpy(a[1].p + n * KHEAD_COLS * 8, row, sizeof row);
        n++;
        p += size;
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 2);
    return Py_BuildValue("(LiL)", (long long)n, status, (long long)p);
}

/* kafka_scan_many(pay, spans, heads, tl, lo, hi) -> (status, batch, record, nsel, nbytes): the
 * records of n batches whose payloads lie in pay (batch i's at pay[spans[2i]:spans[2i+1]], all
 * decompressed back to back, or the batches themselves when none is compressed; heads: their
 * kafka_heads rows), each batch walked whole and
 * checked as kafka_find checks one (count records ending at its payload's end, offset deltas 0
 * then rising, the last one the header's); nsel and nbytes: the records with offsets in
 * [lo, hi] and their format-1 size (topic name of tl bytes). A failure gives its status
 * (KDEC_*), batch and record. */
static PyObject *kafka_scan_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_scan_many", 6);
    static const int which[3] = {3, 4, 5};
    int64_t v[3];
    if (args_i64(args, which, 3, v) < 0)
        return NULL;
    int64_t tl = v[0], lo = v[1], hi = v[2];
    Arr a[3] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "pay") < 0 || arr_get(args[1], &a[1], 8, 0, "spans") < 0 ||
        arr_get(args[2], &a[2], 8, 0, "heads") < 0) {
        arr_release(a, 3);
        return NULL;
    }
    int64_t nb = a[1].n / 2;
    if (a[0].stride != 1 || a[1].stride != 8 || a[2].stride != 8 || a[1].n % 2 ||
        a[2].n < nb * KHEAD_COLS || !kspans_ok(&a[1], nb, a[0].n))
        ARG_ERROR(a, 3, "kafka_scan_many: contiguous arrays, spans of n (start, end) pairs "
                  "inside pay, heads of n rows");
    const uint8_t *b = (const uint8_t *)a[0].p;
    int64_t status = KDEC_OK, bad_b = -1, bad_r = -1, nsel = 0, nbytes = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < nb && status == KDEC_OK; i++) {
        int64_t h[KHEAD_COLS];
        memcpy(h, a[2].p + i * KHEAD_COLS * 8, sizeof h);
        int64_t p = ld_i64(&a[1], 2 * i), end = ld_i64(&a[1], 2 * i + 1), count = h[6];
        int64_t prev = -1;
        int64_t base = h[2];
        for (int64_t j = 0; j < count; j++) {
            KRec r;
            int s2 = kwalk_ordered(b, p, end, j, prev, &r);
            if (s2 != KDEC_OK) {
                status = s2;
                bad_b = i;
                bad_r = j;
                break;
            }
            int64_t off = base + r.od;
            if (off >= lo && off <= hi) {
                nsel++;
                nbytes += REC_HEADER + tl + (r.kl > 0 ? r.kl : 0) + (r.vl > 0 ? r.vl : 0) +
                          r.hbytes;
            }
            prev = r.od;
            p = r.next;
        }
        if (status == KDEC_OK && p != end) {
            status = KDEC_INVALID;
            bad_b = i;
            bad_r = count;
        } else if (status == KDEC_OK && prev != h[3] - base) {
            status = KDEC_ORDER;
            bad_b = i;
            bad_r = count - 1;
        }
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 3);
    return Py_BuildValue("(LLLLL)", (long long)status, (long long)bad_b, (long long)bad_r,
                         (long long)nsel, (long long)nbytes);
}

/* kafka_convert_many(pay, spans, heads, topic, partition, lo, hi, out, offsets, timestamps,
 * sizes, positions, batch_of) -> count: the records of the batches kafka_scan_many accepted
 * whose offsets lie in [lo, hi], as format-1 records back to back in out (CRC32C included);
 * per record its offset, timestamp, size, place in out and batch number. */
static PyObject *kafka_convert_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_convert_many", 13);
    static const int which[3] = {4, 5, 6};
    int64_t v[3];
    if (args_i64(args, which, 3, v) < 0)
        return NULL;
    int64_t part = v[0], lo = v[1], hi = v[2];
    Arr a[10] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "pay") < 0 || arr_get(args[1], &a[1], 8, 0, "spans") < 0 ||
        arr_get(args[2], &a[2], 8, 0, "heads") < 0 || arr_get(args[3], &a[3], 1, 0, "topic") < 0 ||
        arr_get(args[7], &a[4], 1, 1, "out") < 0 || arr_get(args[8], &a[5], 8, 1, "offsets") < 0 ||
        arr_get(args[9], &a[6], 8, 1, "timestamps") < 0 ||
        arr_get(args[10], &a[7], 8, 1, "sizes") < 0 ||
        arr_get(args[11], &a[8], 8, 1, "positions") < 0 ||
        arr_get(args[12], &a[9], 8, 1, "batch_of") < 0) {
        arr_release(a, 10);
        return NULL;
    }
    int64_t nb = a[1].n / 2, cap = a[5].n;
    int bad = a[0].stride != 1 || a[1].stride != 8 || a[2].stride != 8 || a[3].stride != 1 ||
              a[4].stride != 1 || a[1].n % 2 || a[2].n < nb * KHEAD_COLS || a[3].n < 1 ||
              a[3].n > 255 || a[6].n < cap || a[7].n < cap || a[8].n < cap || a[9].n < cap ||
              !kspans_ok(&a[1], nb, a[0].n);
    if (bad)
        ARG_ERROR(a, 10, "kafka_convert_many: contiguous arrays, spans of n (start, end) pairs "
                  "inside pay, heads of n rows, a topic of 1-255 bytes, outputs as long as "
                  "offsets");
    const uint8_t *b = (const uint8_t *)a[0].p, *topic = (const uint8_t *)a[3].p;
    uint8_t *out = (uint8_t *)a[4].p;
    int64_t tlen = a[3].n, q = 0, k = 0, outn = a[4].n;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < nb && !bad; i++) {
        int64_t h[KHEAD_COLS];
        memcpy(h, a[2].p + i * KHEAD_COLS * 8, sizeof h);
        int64_t p = ld_i64(&a[1], 2 * i), end = ld_i64(&a[1], 2 * i + 1), count = h[6];
        int64_t base = h[2];
        int64_t bts = h[4];
        for (int64_t j = 0; j < count; j++) {
            KRec r;
            if (kwalk(b, p, end, &r) != KDEC_OK) {
                bad = 1;
                break;
            }
            int64_t off = base + r.od;
            if (off >= lo && off <= hi) {
                int64_t size = REC_HEADER + tlen + (r.kl > 0 ? r.kl : 0) +
                               (r.vl > 0 ? r.vl : 0) + r.hbytes;
                if (k >= cap || size > outn - q) {
                    bad = 1;
                    break;
                }
                int64_t ts = bts + r.tsd;
                kput_v1(b, &r, size, off, ts, topic, tlen, part, out + q);
                memcpy(a[5].p + k * a[5].stride, &off, 8);
                memcpy(a[6].p + k * a[6].stride, &ts, 8);
                memcpy(a[7].p + k * a[7].stride, &size, 8);
                memcpy(a[8].p + k * a[8].stride, &q, 8);
                memcpy(a[9].p + k * a[9].stride, &i, 8);
                q += size;
                k++;
            }
            p = r.next;
        }
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 10);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "kafka_convert_many: a record or the output is outside "
                                          "its array (scan the batches with kafka_scan_many "
                                          "first)");
        return NULL;
    }
    return PyLong_FromLongLong(k);
}

/* kafka_entries_many(pay, spans, heads, k0, k1, out) -> count: the lean-index entries (48 bytes
 * each, bcq.md) of every record of the batches kafka_scan_many accepted, straight from their
 * Kafka records: offset, timestamp, key digest (SipHash-2-4-128 under (k0, k1); 0 when the key is
 * null), flags (tombstone: null value, keyless: null key), the batch's position and, on its first
 * record, its size (heads' columns 0 and 1), clean time 0. What a replica indexes a shipped
 * segment with, under its own secret, without writing a record (replication/shipped.py). */
static PyObject *kafka_entries_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_entries_many", 6);
    unsigned long long k0 = PyLong_AsUnsignedLongLongMask(args[3]);
    unsigned long long k1 = PyLong_AsUnsignedLongLongMask(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Arr a[4] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "pay") < 0 || arr_get(args[1], &a[1], 8, 0, "spans") < 0 ||
        arr_get(args[2], &a[2], 8, 0, "heads") < 0 || arr_get(args[5], &a[3], 1, 1, "out") < 0) {
        arr_release(a, 4);
        return NULL;
    }
    int64_t nb = a[1].n / 2, cap = a[3].n / ENTRY_SIZE;
    int bad = a[0].stride != 1 || a[1].stride != 8 || a[2].stride != 8 || a[3].stride != 1 ||
              a[1].n % 2 || a[2].n < nb * KHEAD_COLS || a[3].n % ENTRY_SIZE ||
              !kspans_ok(&a[1], nb, a[0].n);
    if (bad)
        ARG_ERROR(a, 4, "kafka_entries_many: contiguous arrays, spans of n (start, end) pairs "
                  "inside pay, heads of n rows, out of whole %d-byte entries", ENTRY_SIZE);
    const uint8_t *b = (const uint8_t *)a[0].p;
    uint8_t *out = (uint8_t *)a[3].p;
    int64_t k = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < nb && !bad; i++) {
        int64_t h[KHEAD_COLS];
        memcpy(h, a[2].p + i * KHEAD_COLS * 8, sizeof h);
        int64_t p = ld_i64(&a[1], 2 * i), end = ld_i64(&a[1], 2 * i + 1);
        for (int64_t j = 0; j < h[6]; j++) {
            KRec r;
            if (k >= cap || kwalk(b, p, end, &r) != KDEC_OK) {
                bad = 1;
                break;
            }
            uint64_t lo = 0, hi = 0;
            if (r.kl >= 0)
                siphash128(k0, k1, b + r.ks, r.kl, &lo, &hi);
            kput_entry(out + k * ENTRY_SIZE, h[2] + r.od, h[4] + r.tsd, lo, hi, (uint32_t)h[0],
                       j == 0 ? (uint32_t)h[1] : 0,
                       (uint16_t)((r.vl < 0 ? REC_NULL_VALUE : 0) | (r.kl < 0 ? REC_NULL_KEY : 0)),
                       0);
            k++;
            p = r.next;
        }
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 4);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "kafka_entries_many: a record or the output is outside "
                                          "its array (scan the batches with kafka_scan_many "
                                          "first)");
        return NULL;
    }
    return PyLong_FromLongLong(k);
}

/* kafka_fields_many(pay, spans, heads, entries, k0, k1, kstart, klen, vstart, vlen) -> the first
 * entry that fails, or -1: each of the n index entries (48 bytes each, bcq.md, offsets rising)
 * must be a record of the batches kafka_scan_many accepted, in the batch at the entry's position,
 * with the entry's offset, timestamp, flags (tombstone: null value, keyless: null key) and key
 * digest (SipHash-2-4-128 under (k0, k1); 0 when the key is null): the check a format-1 record
 * gets against its entry, on the Kafka record. Its key and value are given where they lie in pay
 * (length -1: null), no record written: what a reader of keys and values needs (the KV map's
 * build, reput/reader.py read_fields). */
static PyObject *kafka_fields_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_fields_many", 10);
    unsigned long long k0 = PyLong_AsUnsignedLongLongMask(args[4]);
    unsigned long long k1 = PyLong_AsUnsignedLongLongMask(args[5]);
    if (PyErr_Occurred())
        return NULL;
    static const int arg_of[8] = {0, 1, 2, 3, 6, 7, 8, 9};
    static const int size_of[8] = {1, 8, 8, 1, 8, 8, 8, 8};
    static const char *names[8] = {"pay", "spans", "heads", "entries", "kstart", "klen",
                                   "vstart", "vlen"};
    Arr a[8];
    memset(a, 0, sizeof a);
    for (int i = 0; i < 8; i++)
        if (arr_get(args[arg_of[i]], &a[i], size_of[i], i >= 4, names[i]) < 0) {
            arr_release(a, 8);
            return NULL;
        }
    int64_t nb = a[1].n / 2, n = a[3].n / ENTRY_SIZE;
    int bad = a[0].stride != 1 || a[1].stride != 8 || a[2].stride != 8 || a[3].stride != 1 ||
              a[1].n % 2 || a[2].n < nb * KHEAD_COLS || a[3].n % ENTRY_SIZE || a[4].n < n ||
              a[5].n < n || a[6].n < n || a[7].n < n || !kspans_ok(&a[1], nb, a[0].n);
    if (bad)
        ARG_ERROR(a, 8, "kafka_fields_many: contiguous arrays, spans of n (start, end) pairs "
                  "inside pay, heads of n rows, whole %d-byte entries, outputs as long as the "
                  "entries", ENTRY_SIZE);
    const uint8_t *b = (const uint8_t *)a[0].p, *e = (const uint8_t *)a[3].p;
    int64_t c = 0, failed = -1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < nb && c < n && failed < 0; i++) {
        int64_t h[KHEAD_COLS];
        memcpy(h, a[2].p + i * KHEAD_COLS * 8, sizeof h);
        int64_t p = ld_i64(&a[1], 2 * i), end = ld_i64(&a[1], 2 * i + 1);
        for (int64_t j = 0; j < h[6] && c < n; j++) {
            KRec r;
            if (kwalk(b, p, end, &r) != KDEC_OK) {
                failed = c;
                break;
            }
            p = r.next;
            const uint8_t *ec = e + c * ENTRY_SIZE;
            int64_t off = h[2] + r.od, want = (int64_t)rd64(ec + E_OFFSET);
            if (want < off) { /* an entry no record of these batches has */
                failed = c;
                break;
            }
            if (want > off)
                continue; /* a record not asked for */
            uint16_t flags;
            memcpy(&flags, ec + E_FLAGS, 2);
            uint64_t dlo = 0, dhi = 0;
            if (r.kl >= 0)
                siphash128(k0, k1, b + r.ks, r.kl, &dlo, &dhi);
            if ((int64_t)rd32(ec + E_POSITION) != h[0] ||
                (int64_t)rd64(ec + E_TIMESTAMP) != h[4] + r.tsd ||
                flags != ((r.vl < 0 ? REC_NULL_VALUE : 0) | (r.kl < 0 ? REC_NULL_KEY : 0)) ||
                dlo != rd64(ec + E_DIGEST_LO) || dhi != rd64(ec + E_DIGEST_HI)) {
                failed = c;
                break;
            }
            int64_t kl = r.kl < 0 ? -1 : r.kl, vl = r.vl < 0 ? -1 : r.vl;
            memcpy(a[4].p + c * a[4].stride, &r.ks, 8);
            memcpy(a[5].p + c * a[5].stride, &kl, 8);
            memcpy(a[6].p + c * a[6].stride, &r.vs, 8);
            memcpy(a[7].p + c * a[7].stride, &vl, 8);
            c++;
        }
    }
    if (failed < 0 && c < n)
        failed = c; /* entries past the last record */
    Py_END_ALLOW_THREADS
    arr_release(a, 8);
    return PyLong_FromLongLong(failed);
}

/* -- decompressing many batches at once (zstd: the decoder vendored in third_party/zstd) ----- */
#include <pthread.h>
#include <zstd.h>

#define KUNPACK_UNKNOWN (-1) /* kafka_payload_sizes: a codec or frame this path does not size */

/* kafka_payload_sizes(buf, heads, pos0, sizes) -> how many are known: each batch's payload size
 * once decompressed (its kafka_heads row; the batch at heads' position - pos0 in buf): an
 * uncompressed payload's length, a zstd frame's declared content size (one frame filling the
 * payload), else KUNPACK_UNKNOWN (other codecs, a frame without its size, several frames). */
static PyObject *kafka_payload_sizes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_payload_sizes", 4);
    static const int which[1] = {2};
    int64_t pos0;
    if (args_i64(args, which, 1, &pos0) < 0)
        return NULL;
    Arr a[3] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "buf") < 0 || arr_get(args[1], &a[1], 8, 0, "heads") < 0 ||
        arr_get(args[3], &a[2], 8, 1, "sizes") < 0) {
        arr_release(a, 3);
        return NULL;
    }
    int64_t n = a[2].n;
    if (a[0].stride != 1 || a[1].stride != 8 || a[2].stride != 8 || a[1].n < n * KHEAD_COLS)
        ARG_ERROR(a, 3, "kafka_payload_sizes: contiguous arrays, heads of as many rows as sizes");
    const uint8_t *b = (const uint8_t *)a[0].p;
    int64_t known = 0, bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        int64_t h[KHEAD_COLS], size = KUNPACK_UNKNOWN;
        memcpy(h, a[1].p + i * KHEAD_COLS * 8, sizeof h);
        int64_t p = h[0] - pos0 + KB_HEADER, len = h[1] - KB_HEADER;
        if (p < KB_HEADER || len < 0 || p + len > a[0].n) {
            bad = 1;
            break;
        }
        if (h[7] == 0) {
            size = len;
        } else if (h[7] == 4) {
            unsigned long long c = ZSTD_getFrameContentSize(b + p, (size_t)len);
            size_t fl = ZSTD_findFrameCompressedSize(b + p, (size_t)len);
            if (c != ZSTD_CONTENTSIZE_UNKNOWN && c != ZSTD_CONTENTSIZE_ERROR &&
                c <= (1ull << 30) && !ZSTD_isError(fl) && (int64_t)fl == len)
                size = (int64_t)c;
        }
        known += size >= 0;
        memcpy(a[2].p + i * 8, &size, 8);
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 3);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "kafka_payload_sizes: a batch of heads lies outside buf");
        return NULL;
    }
    return PyLong_FromLongLong(known);
}

typedef struct {
    const uint8_t *b;
    const char *heads;
    const int64_t *starts;
    uint8_t *out;
    int64_t pos0, lo, hi, bad;
} KUnpack;

static void *kunpack_range(void *arg)
{
    KUnpack *u = (KUnpack *)arg;
    ZSTD_DCtx *dctx = NULL;
    for (int64_t i = u->lo; i < u->hi; i++) {
        int64_t h[KHEAD_COLS];
        memcpy(h, u->heads + i * KHEAD_COLS * 8, sizeof h);
        const uint8_t *src = u->b + h[0] - u->pos0 + KB_HEADER;
        size_t len = (size_t)(h[1] - KB_HEADER), want = (size_t)(u->starts[i + 1] - u->starts[i]);
        uint8_t *dst = u->out + u->starts[i];
        if (h[7] == 0) {
            if (len != want) {
                u->bad = i;
                break;
            }
            memcpy(dst, src, len);
            continue;
        }
        if (dctx == NULL && (dctx = ZSTD_createDCtx()) == NULL) {
            u->bad = i;
            break;
        }
        size_t got = ZSTD_decompressDCtx(dctx, dst, want, src, len);
        if (ZSTD_isError(got) || got != want) {
            u->bad = i;
            break;
        }
    }
    if (dctx != NULL)
        ZSTD_freeDCtx(dctx);
    return NULL;
}

/* kafka_unpack_many(buf, heads, pos0, out, starts, first, threads) -> the first batch that fails,
 * or -1: the payloads of the batches of heads (rows first.. : a caller that has batch 0's
 * payload already passes first = 1) into out[starts[i]:starts[i+1]], each of exactly the size
 * kafka_payload_sizes gave (uncompressed ones copied, zstd ones decompressed), in up to
 * `threads` threads, each with its own decompression context, without the GIL. */
static PyObject *kafka_unpack_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_unpack_many", 7);
    static const int which[3] = {2, 5, 6};
    int64_t v[3];
    if (args_i64(args, which, 3, v) < 0)
        return NULL;
    int64_t pos0 = v[0], first = v[1], threads = v[2];
    Arr a[4] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "buf") < 0 || arr_get(args[1], &a[1], 8, 0, "heads") < 0 ||
        arr_get(args[3], &a[2], 1, 1, "out") < 0 || arr_get(args[4], &a[3], 8, 0, "starts") < 0) {
        arr_release(a, 4);
        return NULL;
    }
    int64_t n = a[3].n - 1;
    int bad = a[0].stride != 1 || a[1].stride != 8 || a[2].stride != 1 || a[3].stride != 8 ||
              n < 0 || a[1].n < n * KHEAD_COLS || first < 0 || first > n || threads < 1 ||
              threads > 64 || ((uintptr_t)a[3].p & 7);
    const int64_t *st = (const int64_t *)a[3].p;
    for (int64_t i = 0; !bad && i <= n; i++)
        bad = st[i] < 0 || st[i] > a[2].n || (i > 0 && st[i] < st[i - 1]);
    for (int64_t i = 0; !bad && i < n; i++) {
        int64_t h[KHEAD_COLS];
        memcpy(h, a[1].p + i * KHEAD_COLS * 8, sizeof h);
        bad = h[0] - pos0 < 0 || h[1] < KB_HEADER || h[0] - pos0 + h[1] > a[0].n ||
              (h[7] != 0 && h[7] != 4);
    }
    if (bad)
        ARG_ERROR(a, 4, "kafka_unpack_many: contiguous arrays, aligned starts rising inside out, "
                  "heads of batches inside buf, uncompressed or zstd, 1-64 threads");
    /* contiguous ranges of about equal output bytes, one a thread */
    int64_t total = st[n] - st[first], nt = threads;
    if (nt > n - first)
        nt = n - first > 0 ? n - first : 1;
    KUnpack u[64];
    pthread_t tid[64];
    int started[64] = {0};
    int64_t at = first;
    for (int64_t t = 0; t < nt; t++) {
        int64_t goal = st[first] + total * (t + 1) / nt, hi = at;
        while (hi < n && (st[hi] < goal || hi == at))
            hi++;
        if (t == nt - 1)
            hi = n;
        u[t] = (KUnpack){(const uint8_t *)a[0].p, a[1].p, st, (uint8_t *)a[2].p, pos0, at, hi, -1};
        at = hi;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t t = 1; t < nt; t++)
        started[t] = pthread_create(&tid[t], NULL, kunpack_range, &u[t]) == 0;
    kunpack_range(&u[0]);
    for (int64_t t = 1; t < nt; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            kunpack_range(&u[t]); /* no thread: this one does its range */
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 4);
    int64_t fail = -1;
    for (int64_t t = 0; t < nt && fail < 0; t++)
        fail = u[t].bad;
    return PyLong_FromLongLong(fail);
}
#define KAFKA_ZSTD_METHODS                                                                     \
    {"kafka_payload_sizes", (PyCFunction)(void (*)(void))kafka_payload_sizes, METH_FASTCALL,   \
     NULL},                                                                                    \
    {"kafka_unpack_many", (PyCFunction)(void (*)(void))kafka_unpack_many, METH_FASTCALL, NULL},

/* -- many uncompressed batches encoded at once (reput/rewrite.py SegmentWriter2) ------------- */

static inline void wbe64(uint8_t *b, uint64_t x) { x = __builtin_bswap64(x); memcpy(b, &x, 8); }
static inline void wbe32(uint8_t *b, uint32_t x) { x = __builtin_bswap32(x); memcpy(b, &x, 4); }
static inline void wbe16(uint8_t *b, uint16_t x) { b[0] = (uint8_t)(x >> 8); b[1] = (uint8_t)x; }

/* first i in [lo, n) with a[i] >= x (ascending a), else n; with right, a[i] > x */
static inline int64_t kbound(const Arr *a, int64_t lo, int64_t n, int64_t x, int right)
{
    int64_t hi = n;
    while (lo < hi) {
        int64_t m = lo + (hi - lo) / 2;
        int64_t v = ld_i64(a, m);
        if (right ? v <= x : v < x)
            lo = m + 1;
        else
            hi = m;
    }
    return lo;
}

/* kafka_encode_plain(buf, positions, ends, offsets, timestamps, lo, n, batch_bytes,
 * max_batches, final, out, bounds) -> (batches, next, bytes): the verified format-1 records
 * positions[lo:n] of buf (ending at ends[]: ascending, as offsets) as uncompressed RecordBatch v2
 * batches back to back in out, cut as reput/rewrite.py SegmentWriter2._emit cuts them (a batch
 * takes records until they hold batch_bytes of format-1 bytes, and spans at most 2^31 - 1
 * offsets; without final, the last batch is written only when full). At most max_batches; it
 * stops early, at a batch boundary, when out has no room for the next batch. bounds gets each
 * batch's (end record, bytes); next is the first record not encoded. */
static PyObject *kafka_encode_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_encode_plain", 12);
    static const int which[5] = {5, 6, 7, 8, 9};
    int64_t v[5];
    if (args_i64(args, which, 5, v) < 0)
        return NULL;
    int64_t lo = v[0], n = v[1], batch_bytes = v[2], max_batches = v[3], final = v[4];
    static const int arg_of[7] = {0, 1, 2, 3, 4, 10, 11};
    static const int size_of[7] = {1, 8, 8, 8, 8, 1, 8};
    static const char *names[7] = {"buf", "positions", "ends", "offsets", "timestamps", "out",
                                   "bounds"};
    Arr a[7];
    memset(a, 0, sizeof a);
    for (int i = 0; i < 7; i++)
        if (arr_get(args[arg_of[i]], &a[i], size_of[i], i >= 5, names[i]) < 0) {
            arr_release(a, 7);
            return NULL;
        }
    int bad = a[0].stride != 1 || a[5].stride != 1 || lo < 0 || n < lo || batch_bytes < 1 ||
              max_batches < 0 || n > a[1].n || n > a[2].n || n > a[3].n || n > a[4].n;
    const uint8_t *b = (const uint8_t *)a[0].p;
    for (int64_t i = lo; !bad && i < n; i++) {
        int64_t p = ld_i64(&a[1], i);
        bad = p < 0 || p > a[0].n || check_header(b, p, a[0].n) <= 0;
    }
    if (bad)
        ARG_ERROR(a, 7, "kafka_encode_plain: a record, a record range or an output is outside its "
                  "array");
    uint8_t *out = (uint8_t *)a[5].p;
    int64_t cap = a[5].n, q = 0, k = 0, maxk = a[6].n / 2;
    if (max_batches < maxk)
        maxk = max_batches;
    Py_BEGIN_ALLOW_THREADS
    while (lo < n && k < maxk) {
        int64_t done = ld_i64(&a[1], lo);
        int64_t hi = kbound(&a[2], lo, n, done + batch_bytes, 0) + 1;
        if (hi > n)
            hi = n;
        if (hi == n && !final && ld_i64(&a[2], n - 1) - done < batch_bytes)
            break; /* not a full batch yet */
        int64_t base_off = ld_i64(&a[3], lo), base_ts = ld_i64(&a[4], lo);
        int64_t lim = kbound(&a[3], lo, n, base_off + 0x7FFFFFFF, 1);
        if (hi > lim)
            hi = lim;
        int64_t total = KB_HEADER + kencode(b, &a[1], lo, hi, base_off, base_ts, NULL, 0);
        if (total > cap - q)
            break; /* no room: the caller comes back with more */
        int64_t max_ts = base_ts;
        for (int64_t i = lo + 1; i < hi; i++) {
            int64_t t = ld_i64(&a[4], i);
            if (t > max_ts)
                max_ts = t;
        }
        uint8_t *h = out + q;
        wbe64(h, (uint64_t)base_off);
        wbe32(h + 8, (uint32_t)(total - KB_OVERHEAD));
        wbe32(h + 12, 0xFFFFFFFFu);               /* partitionLeaderEpoch -1 */
        h[16] = 2;                                /* magic */
        wbe16(h + 21, 0);                         /* attributes: no codec */
        wbe32(h + 23, (uint32_t)(ld_i64(&a[3], hi - 1) - base_off));
        wbe64(h + 27, (uint64_t)base_ts);
        wbe64(h + 35, (uint64_t)max_ts);
        wbe64(h + 43, 0xFFFFFFFFFFFFFFFFull);     /* producerId -1 */
        wbe16(h + 51, 0xFFFF);                    /* producerEpoch -1 */
        wbe32(h + 53, 0xFFFFFFFFu);               /* baseSequence -1 */
        wbe32(h + 57, (uint32_t)(hi - lo));
        kencode(b, &a[1], lo, hi, base_off, base_ts, h, KB_HEADER);
        wbe32(h + 17, crc32c(h + KB_CRC_START, total - KB_CRC_START));
        int64_t bk[2] = {hi, total};
        memcpy(a[6].p + (2 * k) * a[6].stride, &bk[0], 8);
        memcpy(a[6].p + (2 * k + 1) * a[6].stride, &bk[1], 8);
        q += total;
        k++;
        lo = hi;
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 7);
    return Py_BuildValue("(LLL)", (long long)k, (long long)lo, (long long)q);
}

/* lean_decode(body, n, first_offset, last_offset, first_position, next_position, out) -> ok:
 * one decompressed chunk of a lean index (docs/formats/bcq-v2.md: n b batch_count[b]
 * batch_size[b] offset_delta[n] timestamp_delta[n] flags[n] clean_time[n] digest_lo[n]
 * digest_hi[n]) into n 48-byte format-1 entries at out (bcq.md; position: the record's batch's,
 * size: the batch's on its first record, else 0), in one pass. False when the chunk is not what
 * its directory entry says: n records, whole batches of at least one record filling
 * [first_position, next_position), offsets rising from first_offset to last_offset
 * (bcq2.LeanIndex._decode, the numpy twin, checks the same). */
static PyObject *lean_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("lean_decode", 7);
    static const int which[5] = {1, 2, 3, 4, 5};
    int64_t v[5];
    if (args_i64(args, which, 5, v) < 0)
        return NULL;
    int64_t n = v[0], first_off = v[1], last_off = v[2], first_pos = v[3], next_pos = v[4];
    Arr a[2] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "body") < 0 || arr_get(args[6], &a[1], 1, 1, "out") < 0) {
        arr_release(a, 2);
        return NULL;
    }
    if (a[0].stride != 1 || a[1].stride != 1 || n < 0 || a[1].n != n * ENTRY_SIZE)
        ARG_ERROR(a, 2, "lean_decode: contiguous body and out, out of n entries");
    const uint8_t *b = (const uint8_t *)a[0].p;
    uint8_t *out = (uint8_t *)a[1].p;
    int64_t len = a[0].n;
    int ok = len >= 8;
    int64_t nr = 0, nb = 0;
    if (ok) {
        nr = rd32(b);
        nb = rd32(b + 4);
        ok = nr == n && n > 0 && nb > 0 && len == 8 + 8 * nb + n * (4 + 8 + 1 + 4 + 8 + 8);
    }
    Py_BEGIN_ALLOW_THREADS
    if (ok) {
        const uint8_t *counts = b + 8, *sizes = counts + 4 * nb, *od = sizes + 4 * nb;
        const uint8_t *td = od + 4 * n, *fl = td + 8 * n, *ct = fl + n, *dlo = ct + 4 * n;
        const uint8_t *dhi = dlo + 8 * n;
        int64_t i = 0, pos = first_pos, off = first_off, ts = 0;
        for (int64_t k = 0; ok && k < nb; k++) {
            int64_t c = rd32(counts + 4 * k), size = rd32(sizes + 4 * k);
            if (c < 1 || c > n - i || pos > 0xFFFFFFFFll) {
                ok = 0;
                break;
            }
            for (int64_t j = 0; j < c; j++, i++) {
                int64_t d = rd32(od + 4 * i);
                if (i > 0 && d == 0) {
                    ok = 0;
                    break;
                }
                off += d;
                ts += (int64_t)rd64(td + 8 * i);
                kput_entry(out + i * ENTRY_SIZE, off, ts, rd64(dlo + 8 * i), rd64(dhi + 8 * i),
                           (uint32_t)pos, j == 0 ? (uint32_t)size : 0, fl[i], rd32(ct + 4 * i));
            }
            pos += size;
        }
        ok = ok && i == n && pos == next_pos && off == last_off;
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 2);
    return PyBool_FromLong(ok);
}

#endif
