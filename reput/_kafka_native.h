/* Store format 2's record kernels in C (included by reput/_native.c, which provides crc32c, rd32
 * and rd64): format-1 records <-> Kafka RecordBatch v2 records, docs/formats/segment-v2.md. The
 * numba kernels of tests/unit/_oracle_kafka_kernels.py are the same algorithms (the reference
 * tests/unit/test_segment_v2.py compares against), so that sealing, compacting and reading a
 * format-2 store loads no JIT compiler.
 *
 * Varints are Kafka's: zigzag, then 7 bits a byte, low group first. Kafka records from a .log
 * are untrusted: every length is checked against the payload before it is used. Format-1 records
 * given to the encoder were verified by the partition reader. */
#ifndef KCOMPACT_KAFKA_NATIVE_H
#define KCOMPACT_KAFKA_NATIVE_H

#define KDEC_OK 0
#define KDEC_TRUNCATED 1
#define KDEC_INVALID 2
#define KDEC_ORDER 3 /* kafka_find: offset deltas not 0, then rising */

static inline void wr32(uint8_t *b, uint32_t x) { memcpy(b, &x, 4); }
static inline void wr64(uint8_t *b, uint64_t x) { memcpy(b, &x, 8); }

static inline int64_t kvarint_size(int64_t v)
{
    uint64_t z = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    int64_t n = 1;
    while (z >= 0x80) {
        z >>= 7;
        n++;
    }
    return n;
}

static inline int64_t kput_varint(uint8_t *out, int64_t q, int64_t v)
{
    uint64_t z = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    while (z >= 0x80) {
        out[q++] = (uint8_t)((z & 0x7F) | 0x80);
        z >>= 7;
    }
    out[q++] = (uint8_t)z;
    return q;
}

/* the varint at b[*p:end] into *v; 0, or -1 when it runs past end or is longer than 10 bytes */
static inline int kget_varint(const uint8_t *b, int64_t *p, int64_t end, int64_t *v)
{
    uint64_t z = 0;
    for (int shift = 0;; shift += 7) {
        if (*p >= end || shift > 63)
            return -1;
        uint64_t x = b[(*p)++];
        z |= (x & 0x7F) << shift;
        if (x < 0x80)
            break;
    }
    *v = (int64_t)(z >> 1) ^ -(int64_t)(z & 1);
    return 0;
}

/* bytes of the Kafka record body (after its length varint) of the verified format-1 record at p */
static int64_t kbody_size(const uint8_t *b, int64_t p, int64_t base_off, int64_t base_ts)
{
    int64_t tl = b[p + 10], off = (int64_t)rd64(b + p + 16), ts = (int64_t)rd64(b + p + 24);
    int64_t kl = (int32_t)rd32(b + p + 32), vl = (int32_t)rd32(b + p + 36),
            hl = (int32_t)rd32(b + p + 40);
    uint8_t a = b[p + 9];
    int64_t n = 1 + kvarint_size(ts - base_ts) + kvarint_size(off - base_off);
    n += (a & REC_NULL_KEY) ? 1 : kvarint_size(kl) + kl;
    n += (a & REC_NULL_VALUE) ? 1 : kvarint_size(vl) + vl;
    if (hl == 0)
        return n + 1;
    int64_t h = p + REC_HEADER + tl + kl + vl, count = rd32(b + h), q = h + 4;
    n += kvarint_size(count);
    for (int64_t i = 0; i < count; i++) {
        int64_t nl = (int64_t)b[q] | ((int64_t)b[q + 1] << 8);
        q += 2 + nl;
        int64_t hv = (int32_t)rd32(b + q);
        q += 4;
        n += kvarint_size(nl) + nl;
        if (hv < 0) {
            n += 1;
        } else {
            n += kvarint_size(hv) + hv;
            q += hv;
        }
    }
    return n;
}

/* a key or value as a Kafka record holds it: varint length and bytes, or -1 when null */
static inline int64_t kput_field(uint8_t *out, int64_t q, const uint8_t *src, int64_t len,
                                 int null)
{
    if (null)
        return kput_varint(out, q, -1);
    q = kput_varint(out, q, len);
    memcpy(out + q, src, (size_t)len);
    return q + len;
}

static int64_t kencode(const uint8_t *b, const Arr *pos, int64_t lo, int64_t hi, int64_t base_off,
                       int64_t base_ts, uint8_t *out, int64_t q)
{
    for (int64_t i = lo; i < hi; i++) {
        int64_t p = ld_i64(pos, i);
        int64_t tl = b[p + 10], off = (int64_t)rd64(b + p + 16), ts = (int64_t)rd64(b + p + 24);
        int64_t kl = (int32_t)rd32(b + p + 32), vl = (int32_t)rd32(b + p + 36),
                hl = (int32_t)rd32(b + p + 40);
        uint8_t a = b[p + 9];
        int64_t body = kbody_size(b, p, base_off, base_ts);
        if (out == NULL) {
            q += kvarint_size(body) + body;
            continue;
        }
        q = kput_varint(out, q, body);
        out[q++] = 0;
        q = kput_varint(out, q, ts - base_ts);
        q = kput_varint(out, q, off - base_off);
        int64_t s = p + REC_HEADER + tl;
        q = kput_field(out, q, b + s, kl, a & REC_NULL_KEY);
        s += kl;
        q = kput_field(out, q, b + s, vl, a & REC_NULL_VALUE);
        s += vl;
        if (hl == 0) {
            out[q++] = 0;
            continue;
        }
        int64_t count = rd32(b + s);
        q = kput_varint(out, q, count);
        s += 4;
        for (int64_t j = 0; j < count; j++) {
            int64_t nl = (int64_t)b[s] | ((int64_t)b[s + 1] << 8);
            s += 2;
            q = kput_varint(out, q, nl);
            memcpy(out + q, b + s, (size_t)nl);
            q += nl;
            s += nl;
            int64_t hv = (int32_t)rd32(b + s);
            s += 4;
            if (hv < 0) {
                q = kput_varint(out, q, -1);
            } else {
                q = kput_varint(out, q, hv);
                memcpy(out + q, b + s, (size_t)hv);
                q += hv;
                s += hv;
            }
        }
    }
    return q;
}

/* v1_to_kafka(buf, positions, lo, hi, base_offset, base_ts, out, q) -> end: records
 * positions[lo:hi] of buf (verified format-1 records) as Kafka records at out[q:]; with out None,
 * q + their size */
static PyObject *v1_to_kafka(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("v1_to_kafka", 8);
    static const int which[5] = {2, 3, 4, 5, 7};
    int64_t v[5];
    if (args_i64(args, which, 5, v) < 0)
        return NULL;
    int64_t lo = v[0], hi = v[1], base_off = v[2], base_ts = v[3], q = v[4];
    Arr a[3] = {{{0}}};
    int has_out = args[6] != Py_None;
    if (arr_get(args[0], &a[0], 1, 0, "buf") < 0 || arr_get(args[1], &a[1], 8, 0, "positions") < 0
        || (has_out && arr_get(args[6], &a[2], 1, 1, "out") < 0)) {
        arr_release(a, 3);
        return NULL;
    }
    int bad = a[0].stride != 1 || lo < 0 || hi < lo || hi > a[1].n || q < 0;
    const uint8_t *b = (const uint8_t *)a[0].p;
    for (int64_t i = lo; !bad && i < hi; i++) {
        int64_t p = ld_i64(&a[1], i);
        bad = p < 0 || p + REC_HEADER > a[0].n || p + (int64_t)rd32(b + p) > a[0].n;
    }
    int64_t end = bad ? 0 : kencode(b, &a[1], lo, hi, base_off, base_ts, NULL, q);
    if (!bad && has_out && (a[2].stride != 1 || end > a[2].n))
        bad = 1;
    if (bad) {
        arr_release(a, 3);
        PyErr_SetString(PyExc_ValueError, "v1_to_kafka: a record or the output is outside its "
                                          "array");
        return NULL;
    }
    if (has_out) {
        Py_BEGIN_ALLOW_THREADS
        end = kencode(b, &a[1], lo, hi, base_off, base_ts, (uint8_t *)a[2].p, q);
        Py_END_ALLOW_THREADS
    }
    arr_release(a, 3);
    return PyLong_FromLongLong(end);
}

typedef struct {
    int64_t next, tsd, od, ks, kl, vs, vl, hs, hc, hbytes;
} KRec;

/* parse the Kafka record at b[p:end], bounds-checked (its numba twin: _walk_record in
 * tests/unit/_oracle_kafka_kernels.py) */
static int kwalk(const uint8_t *b, int64_t p, int64_t end, KRec *r)
{
    int64_t length, q = p;
    if (kget_varint(b, &q, end, &length) < 0)
        return KDEC_TRUNCATED;
    if (length < 1)
        return KDEC_INVALID;
    if (length > end - q)
        return KDEC_TRUNCATED;
    int64_t rend = q + length;
    q++; /* attributes */
    if (kget_varint(b, &q, rend, &r->tsd) < 0 || kget_varint(b, &q, rend, &r->od) < 0 ||
        r->od < 0 || r->od > 0x7FFFFFFF)
        return KDEC_INVALID;
    if (kget_varint(b, &q, rend, &r->kl) < 0 || r->kl < -1 || (r->kl > 0 && r->kl > rend - q))
        return KDEC_INVALID;
    r->ks = q;
    if (r->kl > 0)
        q += r->kl;
    if (kget_varint(b, &q, rend, &r->vl) < 0 || r->vl < -1 || (r->vl > 0 && r->vl > rend - q))
        return KDEC_INVALID;
    r->vs = q;
    if (r->vl > 0)
        q += r->vl;
    if (kget_varint(b, &q, rend, &r->hc) < 0 || r->hc < 0 || r->hc > length)
        return KDEC_INVALID;
    r->hs = q;
    r->hbytes = r->hc > 0 ? 4 : 0;
    for (int64_t i = 0; i < r->hc; i++) {
        int64_t nl, hv;
        if (kget_varint(b, &q, rend, &nl) < 0 || nl < 0 || nl > 0xFFFF || nl > rend - q)
            return KDEC_INVALID;
        q += nl;
        if (kget_varint(b, &q, rend, &hv) < 0 || hv < -1 || (hv > 0 && hv > rend - q))
            return KDEC_INVALID;
        if (hv > 0)
            q += hv;
        r->hbytes += 2 + nl + 4 + (hv > 0 ? hv : 0);
    }
    if (q != rend)
        return KDEC_INVALID;
    r->next = rend;
    return KDEC_OK;
}

/* record i of a batch walked in order: kwalk, then its offset delta must be 0 for the first
 * record and above the previous record's (prev) after it, else KDEC_ORDER */
static inline int kwalk_ordered(const uint8_t *b, int64_t p, int64_t end, int64_t i, int64_t prev,
                                KRec *r)
{
    int st = kwalk(b, p, end, r);
    if (st == KDEC_OK && (i == 0 ? r->od != 0 : r->od <= prev))
        st = KDEC_ORDER;
    return st;
}

/* kafka_sizes(buf, start, end, count, tl, sizes, starts, deltas) -> (status, walked, stop) */
static PyObject *kafka_sizes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_sizes", 8);
    static const int which[4] = {1, 2, 3, 4};
    int64_t v[4];
    if (args_i64(args, which, 4, v) < 0)
        return NULL;
    int64_t start = v[0], end = v[1], count = v[2], tl = v[3];
    Arr a[4] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "buf") < 0 || arr_get(args[5], &a[1], 8, 1, "sizes") < 0 ||
        arr_get(args[6], &a[2], 8, 1, "starts") < 0 ||
        arr_get(args[7], &a[3], 8, 1, "deltas") < 0) {
        arr_release(a, 4);
        return NULL;
    }
    if (a[0].stride != 1 || start < 0 || end < start || end > a[0].n || count < 0 ||
        a[1].n < count || a[2].n < count || a[3].n < count) {
        arr_release(a, 4);
        PyErr_SetString(PyExc_ValueError, "kafka_sizes: start/end/count outside the arrays");
        return NULL;
    }
    const uint8_t *b = (const uint8_t *)a[0].p;
    int64_t p = start, i = 0, status = KDEC_OK;
    Py_BEGIN_ALLOW_THREADS
    for (; i < count; i++) {
        KRec r;
        int st = kwalk(b, p, end, &r);
        if (st != KDEC_OK) {
            status = st;
            break;
        }
        int64_t size = REC_HEADER + tl + (r.kl > 0 ? r.kl : 0) + (r.vl > 0 ? r.vl : 0) + r.hbytes;
        memcpy(a[1].p + i * a[1].stride, &size, 8);
        memcpy(a[2].p + i * a[2].stride, &p, 8);
        memcpy(a[3].p + i * a[3].stride, &r.od, 8);
        p = r.next;
    }
    if (status == KDEC_OK && p != end)
        status = KDEC_INVALID;
    Py_END_ALLOW_THREADS
    arr_release(a, 4);
    return Py_BuildValue("(LLL)", (long long)status, (long long)i, (long long)p);
}

/* kafka_find(buf, start, end, count, tl, lo, hi) -> (status, walked, stop, a, z, start_a, nbytes,
 * last_delta): walk the count Kafka records of buf[start:end] as kafka_sizes does, also checking
 * that the offset deltas start at 0 and rise strictly (else status KDEC_ORDER), without writing
 * per-record arrays; a..z are the records whose delta lies in [lo, hi] (a = z = -1 when none),
 * start_a where record a starts, nbytes their format-1 size together (topic name of tl bytes),
 * last_delta the last record's delta. A one-record read of a batch (reput/batch.py decode_run,
 * the path without kafka_read_one). */
static PyObject *kafka_find(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_find", 7);
    static const int which[6] = {1, 2, 3, 4, 5, 6};
    int64_t v[6];
    if (args_i64(args, which, 6, v) < 0)
        return NULL;
    int64_t start = v[0], end = v[1], count = v[2], tl = v[3], lo = v[4], hi = v[5];
    Arr a = {{0}};
    if (arr_get(args[0], &a, 1, 0, "buf") < 0)
        return NULL;
    if (a.stride != 1 || start < 0 || end < start || end > a.n || count < 0) {
        arr_release(&a, 1);
        PyErr_SetString(PyExc_ValueError, "kafka_find: start/end/count outside the buffer");
        return NULL;
    }
    const uint8_t *b = (const uint8_t *)a.p;
    int64_t p = start, i = 0, status = KDEC_OK, first = -1, last = -1, start_a = 0, nbytes = 0;
    int64_t prev = -1;
    Py_BEGIN_ALLOW_THREADS
    for (; i < count; i++) {
        KRec r;
        int st = kwalk_ordered(b, p, end, i, prev, &r);
        if (st != KDEC_OK) {
            status = st;
            break;
        }
        if (r.od >= lo && r.od <= hi) {
            if (first < 0) {
                first = i;
                start_a = p;
            }
            last = i;
            nbytes += REC_HEADER + tl + (r.kl > 0 ? r.kl : 0) + (r.vl > 0 ? r.vl : 0) + r.hbytes;
        }
        prev = r.od;
        p = r.next;
    }
    if (status == KDEC_OK && p != end)
        status = KDEC_INVALID;
    Py_END_ALLOW_THREADS
    arr_release(&a, 1);
    return Py_BuildValue("(LLLLLLLL)", (long long)status, (long long)i, (long long)p,
                         (long long)first, (long long)(first < 0 ? -1 : last + 1),
                         (long long)start_a, (long long)nbytes, (long long)prev);
}

/* write the walked Kafka record r of b (offset off, timestamp ts) as a format-1 record of size
 * bytes at out (topic name of tlen bytes), CRC32C included */
static void kput_v1(const uint8_t *b, const KRec *r, int64_t size, int64_t off, int64_t ts,
                    const uint8_t *topic, int64_t tlen, int64_t part, uint8_t *out)
{
    int64_t kl = r->kl > 0 ? r->kl : 0, vl = r->vl > 0 ? r->vl : 0;
    wr32(out, (uint32_t)size);
    out[8] = REC_MAGIC;
    out[9] = (uint8_t)((r->vl < 0 ? REC_NULL_VALUE : 0) | (r->kl < 0 ? REC_NULL_KEY : 0));
    out[10] = (uint8_t)tlen;
    out[11] = 0;
    wr32(out + 12, (uint32_t)part);
    wr64(out + 16, (uint64_t)off);
    wr64(out + 24, (uint64_t)ts);
    wr32(out + 32, (uint32_t)kl);
    wr32(out + 36, (uint32_t)vl);
    wr32(out + 40, (uint32_t)r->hbytes);
    int64_t w = REC_HEADER;
    memcpy(out + w, topic, (size_t)tlen);
    w += tlen;
    memcpy(out + w, b + r->ks, (size_t)kl);
    w += kl;
    memcpy(out + w, b + r->vs, (size_t)vl);
    w += vl;
    if (r->hc > 0) {
        wr32(out + w, (uint32_t)r->hc);
        w += 4;
        int64_t s = r->hs;
        for (int64_t j = 0; j < r->hc; j++) {
            int64_t nl, hv;
            kget_varint(b, &s, r->next, &nl);
            out[w] = (uint8_t)(nl & 0xFF);
            out[w + 1] = (uint8_t)((nl >> 8) & 0xFF);
            w += 2;
            memcpy(out + w, b + s, (size_t)nl);
            w += nl;
            s += nl;
            kget_varint(b, &s, r->next, &hv);
            wr32(out + w, (uint32_t)hv);
            w += 4;
            if (hv > 0) {
                memcpy(out + w, b + s, (size_t)hv);
                w += hv;
                s += hv;
            }
        }
    }
    wr32(out + 4, crc32c(out + 8, size - 8));
}

/* kafka_to_v1(buf, start, count, base_offset, base_ts, topic, partition, out, q0, offsets,
 * timestamps) -> end: the count Kafka records at buf[start:] (walked by kafka_sizes first) as
 * format-1 records at out[q0:], CRC32C included; offsets[i], timestamps[i] get each record's */
static PyObject *kafka_to_v1(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_to_v1", 11);
    static const int which[6] = {1, 2, 3, 4, 6, 8};
    int64_t v[6];
    if (args_i64(args, which, 6, v) < 0)
        return NULL;
    int64_t start = v[0], count = v[1], base_off = v[2], base_ts = v[3], part = v[4], q = v[5];
    Arr a[5] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "buf") < 0 || arr_get(args[5], &a[1], 1, 0, "topic") < 0 ||
        arr_get(args[7], &a[2], 1, 1, "out") < 0 || arr_get(args[9], &a[3], 8, 1, "offsets") < 0 ||
        arr_get(args[10], &a[4], 8, 1, "timestamps") < 0) {
        arr_release(a, 5);
        return NULL;
    }
    const uint8_t *b = (const uint8_t *)a[0].p, *topic = (const uint8_t *)a[1].p;
    uint8_t *out = (uint8_t *)a[2].p;
    int64_t tlen = a[1].n, end = a[0].n, p = start;
    int bad = a[0].stride != 1 || a[1].stride != 1 || a[2].stride != 1 || start < 0 ||
              start > end || count < 0 || a[3].n < count || a[4].n < count || q < 0 ||
              tlen < 1 || tlen > 255;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; !bad && i < count; i++) {
        KRec r;
        if (kwalk(b, p, end, &r) != KDEC_OK) {
            bad = 1;
            break;
        }
        int64_t kl = r.kl > 0 ? r.kl : 0, vl = r.vl > 0 ? r.vl : 0;
        int64_t size = REC_HEADER + tlen + kl + vl + r.hbytes;
        if (size > a[2].n - q) {
            bad = 1;
            break;
        }
        int64_t off = base_off + r.od, ts = base_ts + r.tsd;
        memcpy(a[3].p + i * a[3].stride, &off, 8);
        memcpy(a[4].p + i * a[4].stride, &ts, 8);
        kput_v1(b, &r, size, off, ts, topic, tlen, part, out + q);
        q += size;
        p = r.next;
    }
    Py_END_ALLOW_THREADS
    arr_release(a, 5);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "kafka_to_v1: a record or the output is outside its "
                                          "array (walk the batch with kafka_sizes first)");
        return NULL;
    }
    return PyLong_FromLongLong(q);
}

#define KREAD_ABSENT 4   /* kafka_read_one: no record of the batch has the entry's offset */
#define KREAD_MISMATCH 5 /* kafka_read_one: the record's timestamp, flags or key digest differ */

/* kafka_read_one(payload, count, topic, partition, base_offset, base_ts, entry, k0, k1)
 * -> (status, last_delta, record): a one-record read of a format-2 batch in one pass. The count
 * Kafka records of the payload are walked and checked as kafka_find does (status KDEC_* when one
 * fails, KDEC_ORDER when the offset deltas do not start at 0 and rise), the one whose offset is
 * the lean index entry's (48 bytes, docs/formats/bcq.md; KREAD_ABSENT when none) is written as a
 * format-1 record (bytes, CRC32C included) and checked against the entry as
 * verify_records checks a record: timestamp, flags and key digest (SipHash-2-4-128 under
 * (k0, k1), 0 when keyless; else KREAD_MISMATCH). record is None unless status is KDEC_OK;
 * the caller compares last_delta with the batch header's. Any other status: the caller's
 * general path (reput/batch.py decode_run, reader._checked_v2) names what fails. */
static PyObject *kafka_read_one(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("kafka_read_one", 9);
    static const int which[4] = {1, 3, 4, 5};
    int64_t v[4];
    if (args_i64(args, which, 4, v) < 0)
        return NULL;
    int64_t count = v[0], part = v[1], base_off = v[2], base_ts = v[3];
    unsigned long long k0 = PyLong_AsUnsignedLongLongMask(args[7]);
    unsigned long long k1 = PyLong_AsUnsignedLongLongMask(args[8]);
    if (PyErr_Occurred())
        return NULL;
    Arr a[3] = {{{0}}};
    if (arr_get(args[0], &a[0], 1, 0, "payload") < 0 ||
        arr_get(args[2], &a[1], 1, 0, "topic") < 0 ||
        arr_get(args[6], &a[2], 1, 0, "entry") < 0) {
        arr_release(a, 3);
        return NULL;
    }
    if (a[0].stride != 1 || a[1].stride != 1 || a[2].stride != 1 || a[2].n != ENTRY_SIZE ||
        count < 0 || a[1].n < 1 || a[1].n > 255)
        ARG_ERROR(a, 3, "kafka_read_one: payload, topic (1-255 bytes) and entry (%d bytes) "
                  "must be contiguous, count >= 0", ENTRY_SIZE);
    const uint8_t *b = (const uint8_t *)a[0].p, *topic = (const uint8_t *)a[1].p;
    const uint8_t *e = (const uint8_t *)a[2].p;
    int64_t end = a[0].n, tlen = a[1].n, p = 0, prev = -1, status = KDEC_OK, size = 0;
    int64_t target = (int64_t)rd64(e + E_OFFSET) - base_off;
    KRec hit;
    int found = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < count; i++) {
        KRec r;
        int st = kwalk_ordered(b, p, end, i, prev, &r);
        if (st != KDEC_OK) {
            status = st;
            break;
        }
        if (r.od == target) {
            hit = r;
            found = 1;
            size = REC_HEADER + tlen + (r.kl > 0 ? r.kl : 0) + (r.vl > 0 ? r.vl : 0) + r.hbytes;
        }
        prev = r.od;
        p = r.next;
    }
    if (status == KDEC_OK && p != end)
        status = KDEC_INVALID;
    if (status == KDEC_OK && !found)
        status = KREAD_ABSENT;
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (status == KDEC_OK) {
        out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
        if (out == NULL) {
            arr_release(a, 3);
            return NULL;
        }
        uint8_t *o = (uint8_t *)PyBytes_AS_STRING(out);
        kput_v1(b, &hit, size, base_off + target, base_ts + hit.tsd, topic, tlen, part, o);
        uint16_t flags;
        memcpy(&flags, e + E_FLAGS, 2);
        uint64_t lo = 0, hi = 0;
        if (!(o[9] & REC_NULL_KEY))
            siphash128(k0, k1, o + REC_HEADER + tlen, (int32_t)rd32(o + 32), &lo, &hi);
        if (rd64(o + 24) != rd64(e + E_TIMESTAMP) || flags != o[9] ||
            lo != rd64(e + E_DIGEST_LO) || hi != rd64(e + E_DIGEST_HI)) {
            status = KREAD_MISMATCH;
            Py_CLEAR(out);
        }
    }
    arr_release(a, 3);
    if (out == NULL) {
        out = Py_None;
        Py_INCREF(out);
    }
    return Py_BuildValue("(LLN)", (long long)status, (long long)prev, out);
}

#include "_kafka_span.h"

/* crc32c_range(buf, start, end) -> CRC-32C of buf[start:end] (a batch's, a lean index's) */
static PyObject *crc32c_range(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_NARGS("crc32c_range", 3);
    long long start = PyLong_AsLongLong(args[1]), end = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Arr a = {{0}};
    if (arr_get(args[0], &a, 1, 0, "buf") < 0)
        return NULL;
    if (a.stride != 1 || start < 0 || end < start || end > a.n) {
        arr_release(&a, 1);
        PyErr_SetString(PyExc_ValueError, "crc32c_range: start/end outside the buffer");
        return NULL;
    }
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32c((const uint8_t *)a.p + start, end - start);
    Py_END_ALLOW_THREADS
    arr_release(&a, 1);
    return PyLong_FromUnsignedLong(crc);
}

#define KAFKA_METHODS                                                                          \
    {"v1_to_kafka", (PyCFunction)(void (*)(void))v1_to_kafka, METH_FASTCALL, NULL},            \
    {"kafka_sizes", (PyCFunction)(void (*)(void))kafka_sizes, METH_FASTCALL, NULL},            \
    {"kafka_find", (PyCFunction)(void (*)(void))kafka_find, METH_FASTCALL, NULL},              \
    {"kafka_read_one", (PyCFunction)(void (*)(void))kafka_read_one, METH_FASTCALL, NULL},      \
    {"kafka_heads", (PyCFunction)(void (*)(void))kafka_heads, METH_FASTCALL, NULL},            \
    {"kafka_scan_many", (PyCFunction)(void (*)(void))kafka_scan_many, METH_FASTCALL, NULL},    \
    {"kafka_convert_many", (PyCFunction)(void (*)(void))kafka_convert_many, METH_FASTCALL,     \
     NULL},                                                                                    \
    {"kafka_entries_many", (PyCFunction)(void (*)(void))kafka_entries_many, METH_FASTCALL,     \
     NULL},                                                                                    \
    KAFKA_ZSTD_METHODS                                                                         \
    {"kafka_encode_plain", (PyCFunction)(void (*)(void))kafka_encode_plain, METH_FASTCALL,     \
     NULL},                                                                                    \
    {"kafka_fields_many", (PyCFunction)(void (*)(void))kafka_fields_many, METH_FASTCALL,       \
     NULL},                                                                                    \
    {"lean_decode", (PyCFunction)(void (*)(void))lean_decode, METH_FASTCALL, NULL},            \
    {"kafka_to_v1", (PyCFunction)(void (*)(void))kafka_to_v1, METH_FASTCALL, NULL},            \
    {"crc32c_range", (PyCFunction)(void (*)(void))crc32c_range, METH_FASTCALL, NULL},

#endif
