/* kcompact.connectors.framework._rdkafka: read a confluent_kafka.Consumer's batches straight
 * into columns.
 *
 * confluent_kafka's consume() builds a Message object per record, with the GIL held: its key
 * and value bytes, its topic string, and a timestamp tuple and offset int when read. For the
 * mirror that is two thirds of the task thread's GIL time, and the store's append thread, which
 * overlaps with it, then waits for the GIL (see kafka_columns.py beside this file). Here the same
 * librdkafka call confluent_kafka makes (rd_kafka_consume_batch_queue on the consumer's queue)
 * runs with the GIL released, and the batch is copied into packed columns (key bytes + starts +
 * nulls, the same for values, headers in the store's encoding, partitions, offsets,
 * timestamps) before the GIL is taken back once: no Python object per record.
 *
 * The librdkafka used is the one confluent_kafka loaded (the path comes from the process's
 * mappings, opened with RTLD_NOLOAD), and the rd_kafka_t is read from the Consumer's C struct
 * (confluent_kafka.h "Handle"). attach() checks that layout on the live object: the rd_kafka_t's
 * opaque is the Consumer itself, the error_cb and logger fields are the very objects the caller
 * configured, the client type is a consumer and the thread-local key is created and unset. Any
 * mismatch returns None, and the caller keeps confluent_kafka's consume().
 *
 * Callbacks (error_cb, the logger) run inside rd_kafka_consume_batch_queue, on this thread.
 * confluent_kafka's callback trampolines find the GIL through a thread-local CallState; this
 * module sets one up exactly as Consumer.consume does (CallState_begin/_end), so callbacks run
 * and report their exceptions the same way.
 *
 * Why one file of ~1,100 lines: it is one extension module, and its consumer half (columns from
 * consume) and producer half (ColumnSender's produce) share the librdkafka ABI declarations,
 * the checks of confluent_kafka's Handle layout and the header-section walker; split, each half
 * would repeat them or need a private header of its own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* -- librdkafka's public ABI (rdkafka.h), the parts used here -------------------------------- */

typedef struct rd_kafka_s rd_kafka_t;
typedef struct rd_kafka_topic_s rd_kafka_topic_t;
typedef struct rd_kafka_queue_s rd_kafka_queue_t;
typedef struct rd_kafka_headers_s rd_kafka_headers_t;

typedef struct {
    int err; /* rd_kafka_resp_err_t */
    rd_kafka_topic_t *rkt;
    int32_t partition;
    void *payload;
    size_t len;
    void *key;
    size_t key_len;
    int64_t offset;
    void *_private;
} rdk_message;

#define RDK_PRODUCER 0
#define RDK_CONSUMER 1
#define RDK_ERR_QUEUE_FULL (-184)
#define RDK_MSG_F_COPY 0x2
enum { VT_END, VT_TOPIC, VT_RKT, VT_PARTITION, VT_VALUE, VT_KEY, VT_OPAQUE, VT_MSGFLAGS,
       VT_TIMESTAMP, VT_HEADER, VT_HEADERS };

/* rd_kafka_vu_t: an argument of rd_kafka_produceva */
typedef struct {
    int vtype;
    union {
        rd_kafka_topic_t *rkt;
        int i;
        int32_t i32;
        int64_t i64;
        struct {
            const void *ptr;
            size_t size;
        } mem;
        void *ptr;
        rd_kafka_headers_t *headers;
        char _pad[64];
    } u;
} rdk_vu;
#define RDK_ERR_FATAL (-150)
#define RDK_NO_ERROR 0

static struct {
    ssize_t (*consume_batch_queue)(rd_kafka_queue_t *, int, rdk_message **, size_t);
    void (*message_destroy)(rdk_message *);
    int64_t (*message_timestamp)(const rdk_message *, int *);
    int (*message_headers)(const rdk_message *, rd_kafka_headers_t **);
    int (*header_get_all)(const rd_kafka_headers_t *, size_t, const char **, const void **,
                          size_t *);
    const char *(*topic_name)(const rd_kafka_topic_t *);
    const char *(*err2str)(int);
    rd_kafka_queue_t *(*queue_get_consumer)(rd_kafka_t *);
    void (*queue_destroy)(rd_kafka_queue_t *);
    void *(*opaque)(const rd_kafka_t *);
    int (*fatal_error)(rd_kafka_t *, char *, size_t);
    int (*type)(const rd_kafka_t *);
    void *(*produceva)(rd_kafka_t *, const void *, size_t); /* rd_kafka_error_t * */
    int (*error_code)(const void *);
    const char *(*error_string)(const void *);
    void (*error_destroy)(void *);
    int (*poll)(rd_kafka_t *, int);
    rd_kafka_topic_t *(*topic_new)(rd_kafka_t *, const char *, void *);
    rd_kafka_headers_t *(*headers_new)(size_t);
    void (*headers_destroy)(rd_kafka_headers_t *);
    int (*header_add)(rd_kafka_headers_t *, const char *, ssize_t, const void *, ssize_t);
    void (*topic_destroy)(rd_kafka_topic_t *);
} rdk;
static int bound = 0;

/* -- confluent_kafka's structs (confluent_kafka.h, 2.x on LP64) ------------------------------ */

typedef struct {
    PyObject_HEAD
    rd_kafka_t *rk;
    PyObject *error_cb;
    PyObject *throttle_cb;
    PyObject *stats_cb;
    int initiated;
    Py_tss_t tlskey;
    int type;
    PyObject *logger;
} cfl_handle;

/* 2.13+ has exception_value; before it, the struct ended at crashed, and a callback left its
 * exception set on the thread state instead. Zeroed, this serves both. */
typedef struct {
    PyThreadState *thread_state;
    int crashed;
    PyObject *exception_value;
} cfl_callstate;

#include "_arr.h" /* reput/_arr.h: 1-d arrays through the buffer protocol */

/* -- Buffer: malloc'd bytes exported through the buffer protocol (np.frombuffer) ------------ */

typedef struct {
    PyObject_HEAD
    char *data;
    Py_ssize_t size;
} Buffer;

static int buffer_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    Buffer *b = (Buffer *)self;
    return PyBuffer_FillInfo(view, self, b->data, b->size, 0, flags);
}

static void buffer_dealloc(PyObject *self)
{
    free(((Buffer *)self)->data);
    Py_TYPE(self)->tp_free(self);
}

static Py_ssize_t buffer_len(PyObject *self) { return ((Buffer *)self)->size; }

static PyBufferProcs buffer_as_buffer = {.bf_getbuffer = buffer_getbuffer};
static PySequenceMethods buffer_as_sequence = {.sq_length = buffer_len};

static PyTypeObject BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "connectors._rdkafka.Buffer",
    .tp_basicsize = sizeof(Buffer),
    .tp_dealloc = buffer_dealloc,
    .tp_as_buffer = &buffer_as_buffer,
    .tp_as_sequence = &buffer_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Bytes of a consumed batch's column (buffer protocol).",
};

/* takes ownership of data (malloc'd) */
static PyObject *buffer_wrap(char *data, Py_ssize_t size)
{
    Buffer *b = PyObject_New(Buffer, &BufferType);
    if (b == NULL) {
        free(data);
        return NULL;
    }
    b->data = data;
    b->size = size;
    return (PyObject *)b;
}

/* -- bind(path): the librdkafka confluent_kafka loaded ---------------------------------------- */

static PyObject *bind(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL)
        return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL) {
        PyErr_Format(PyExc_OSError, "%s is not loaded in this process", path);
        return NULL;
    }
#define SYM(field, name)                                                                       \
    if ((*(void **)&rdk.field = dlsym(h, name)) == NULL) {                                     \
        PyErr_Format(PyExc_OSError, "%s has no %s", path, name);                               \
        dlclose(h);                                                                            \
        return NULL;                                                                           \
    }
    SYM(consume_batch_queue, "rd_kafka_consume_batch_queue")
    SYM(message_destroy, "rd_kafka_message_destroy")
    SYM(message_timestamp, "rd_kafka_message_timestamp")
    SYM(message_headers, "rd_kafka_message_headers")
    SYM(header_get_all, "rd_kafka_header_get_all")
    SYM(topic_name, "rd_kafka_topic_name")
    SYM(err2str, "rd_kafka_err2str")
    SYM(queue_get_consumer, "rd_kafka_queue_get_consumer")
    SYM(queue_destroy, "rd_kafka_queue_destroy")
    SYM(opaque, "rd_kafka_opaque")
    SYM(fatal_error, "rd_kafka_fatal_error")
    SYM(type, "rd_kafka_type")
    SYM(produceva, "rd_kafka_produceva")
    SYM(error_code, "rd_kafka_error_code")
    SYM(error_string, "rd_kafka_error_string")
    SYM(error_destroy, "rd_kafka_error_destroy")
    SYM(poll, "rd_kafka_poll")
    SYM(topic_new, "rd_kafka_topic_new")
    SYM(headers_new, "rd_kafka_headers_new")
    SYM(headers_destroy, "rd_kafka_headers_destroy")
    SYM(header_add, "rd_kafka_header_add")
    SYM(topic_destroy, "rd_kafka_topic_destroy")
#undef SYM
    /* the library stays loaded as long as confluent_kafka's module: keep our reference too */
    bound = 1;
    Py_RETURN_NONE;
}

/* -- confluent_kafka's CallState, as Consumer.consume and Producer.poll set it up ------------- */

/* CallState_begin: release the GIL; callbacks on this thread find it through the key */
static void callstate_begin(cfl_handle *h, cfl_callstate *cs)
{
    memset(cs, 0, sizeof *cs);
    cs->thread_state = PyEval_SaveThread();
    PyThread_tss_set(&h->tlskey, cs);
}

/* CallState_end's checks, after PyEval_RestoreThread(cs->thread_state): -1 with the exception
 * of a callback that raised (as confluent_kafka reports it) or of a signal handler */
static int callstate_failed(cfl_callstate *cs)
{
    if (cs->crashed) {
        if (cs->exception_value != NULL) {
            PyObject *v = cs->exception_value;
            cs->exception_value = NULL;
            if (PyExceptionInstance_Check(v))
                PyErr_SetObject((PyObject *)Py_TYPE(v), v);
            else
                PyErr_SetString(PyExc_RuntimeError, "a librdkafka callback failed");
            Py_DECREF(v);
        } else if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "a librdkafka callback failed");
        }
        return -1;
    }
    return PyErr_CheckSignals();
}

/* -- attach(consumer, error_cb, logger) -> reader capsule or None --------------------------- */

typedef struct {
    PyObject *consumer; /* strong reference */
    rd_kafka_t *rk;
    rd_kafka_queue_t *q; /* our reference to the consumer queue; NULL once closed */
} reader;

static const char *READER = "connectors._rdkafka.reader";

static void reader_free(PyObject *cap)
{
    reader *r = PyCapsule_GetPointer(cap, READER);
    if (r == NULL)
        return;
    if (r->q != NULL && ((cfl_handle *)r->consumer)->rk == r->rk)
        rdk.queue_destroy(r->q);
    Py_XDECREF(r->consumer);
    free(r);
}

/* the client's Handle when its layout checks out (see the top of this file), else NULL */
static cfl_handle *recognise(PyObject *c, PyObject *error_cb, PyObject *logger, int type)
{
    if (!bound || error_cb == Py_None || logger == Py_None ||
        Py_TYPE(c)->tp_basicsize < (Py_ssize_t)sizeof(cfl_handle))
        return NULL;
    cfl_handle *h = (cfl_handle *)c;
    /* the fields around the thread-local key first (plain loads), then the key itself, then
     * the librdkafka calls on the pointer that the checks vouched for */
    if (h->rk == NULL || h->error_cb != error_cb || h->logger != logger || h->type != type ||
        !PyThread_tss_is_created(&h->tlskey) || PyThread_tss_get(&h->tlskey) != NULL)
        return NULL;
    if (rdk.opaque(h->rk) != (void *)c || rdk.type(h->rk) != type)
        return NULL;
    return h;
}

static PyObject *attach(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "attach(consumer, error_cb, logger)");
        return NULL;
    }
    PyObject *c = args[0], *error_cb = args[1], *logger = args[2];
    cfl_handle *h = recognise(c, error_cb, logger, RDK_CONSUMER);
    if (h == NULL)
        Py_RETURN_NONE;
    reader *r = calloc(1, sizeof *r);
    if (r == NULL)
        return PyErr_NoMemory();
    r->rk = h->rk;
    r->q = rdk.queue_get_consumer(h->rk);
    if (r->q == NULL) {
        free(r);
        Py_RETURN_NONE;
    }
    Py_INCREF(c);
    r->consumer = c;
    PyObject *cap = PyCapsule_New(r, READER, reader_free);
    if (cap == NULL) {
        rdk.queue_destroy(r->q);
        Py_DECREF(c);
        free(r);
    }
    return cap;
}

static reader *get_reader(PyObject *cap)
{
    reader *r = PyCapsule_GetPointer(cap, READER);
    if (r == NULL)
        return NULL;
    if (r->q == NULL || ((cfl_handle *)r->consumer)->rk != r->rk) {
        PyErr_SetString(PyExc_RuntimeError, "the consumer or its column reader is closed");
        return NULL;
    }
    return r;
}

/* detach(reader): drop the queue reference; call before the consumer's close() */
static PyObject *detach(PyObject *self, PyObject *cap)
{
    (void)self;
    reader *r = PyCapsule_GetPointer(cap, READER);
    if (r == NULL)
        return NULL;
    if (r->q != NULL && ((cfl_handle *)r->consumer)->rk == r->rk)
        rdk.queue_destroy(r->q);
    r->q = NULL;
    Py_RETURN_NONE;
}

/* -- consume(reader, want, timeout_ms) ------------------------------------------------------- */

#define MAX_TOPICS 64

typedef struct {
    char *topic; /* strdup'd, or NULL */
    int32_t partition;
    int64_t offset;
    int code;
    int fatal;
    char *reason; /* malloc'd */
} event;

typedef struct {
    /* inputs */
    rdk_message **ms;
    ssize_t n;
    rd_kafka_t *rk;
    /* outputs */
    Py_ssize_t good;
    char *parts, *offs, *ts, *kb, *ko, *kn, *vb, *vo, *vn, *hb, *ho, *ti;
    int64_t kbytes, vbytes, hbytes;
    int any_headers;
    rd_kafka_topic_t *rkts[MAX_TOPICS];
    char *names[MAX_TOPICS];
    int ntopics;
    event *events;
    int nevents;
    const char *failure; /* static text: the batch could not be read */
} work;

static char *dup_n(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d != NULL) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static int topic_index(work *w, rd_kafka_topic_t *rkt)
{
    for (int i = 0; i < w->ntopics; i++)
        if (w->rkts[i] == rkt)
            return i;
    if (w->ntopics == MAX_TOPICS)
        return -1;
    const char *name = rdk.topic_name(rkt);
    if ((w->names[w->ntopics] = dup_n(name, strlen(name))) == NULL)
        return -1;
    w->rkts[w->ntopics] = rkt;
    return w->ntopics++;
}

/* the store's header encoding (docs/formats: u32 count, then per header u16 name length, name,
 * i32 value length or -1 for null, value), little-endian; returns bytes written, or the size
 * needed when out is NULL; -1 when a name is longer than 65535 bytes */
static int64_t encode_headers(const rd_kafka_headers_t *hs, char *out)
{
    const char *name;
    const void *val;
    size_t size;
    int64_t at = 4;
    uint32_t count = 0;
    for (size_t i = 0; rdk.header_get_all(hs, i, &name, &val, &size) == RDK_NO_ERROR; i++) {
        size_t nl = strlen(name);
        if (nl > 0xFFFF)
            return -1;
        if (out != NULL) {
            uint16_t n16 = (uint16_t)nl;
            int32_t v32 = val == NULL ? -1 : (int32_t)size;
            memcpy(out + at, &n16, 2);
            memcpy(out + at + 2, name, nl);
            memcpy(out + at + 2 + nl, &v32, 4);
            if (val != NULL)
                memcpy(out + at + 6 + nl, val, size);
        }
        at += 6 + (int64_t)nl + (val == NULL ? 0 : (int64_t)size);
        count++;
    }
    if (count == 0)
        return 0;
    if (out != NULL)
        memcpy(out, &count, 4);
    return at;
}

static void fail(work *w, const char *why)
{
    if (w->failure == NULL)
        w->failure = why;
}

/* the whole batch, without the GIL: columns, events, then every message destroyed */
static void read_batch(work *w)
{
    ssize_t n = w->n;
    w->events = calloc(n > 0 ? (size_t)n : 1, sizeof(event));
    if (w->events == NULL) {
        fail(w, "out of memory");
        goto destroy;
    }
    /* pass 1: sizes */
    for (ssize_t i = 0; i < n; i++) {
        rdk_message *m = w->ms[i];
        if (m->err != RDK_NO_ERROR)
            continue;
        w->good++;
        w->kbytes += m->key != NULL ? (int64_t)m->key_len : 0;
        w->vbytes += m->payload != NULL ? (int64_t)m->len : 0;
        rd_kafka_headers_t *hs;
        if (rdk.message_headers(m, &hs) == RDK_NO_ERROR) {
            int64_t need = encode_headers(hs, NULL);
            if (need < 0) {
                fail(w, "a header name is longer than 65535 bytes");
                goto destroy;
            }
            w->hbytes += need;
            w->any_headers |= need > 0;
        }
    }
    Py_ssize_t g = w->good;
    w->parts = malloc((size_t)g * 4 + 1);
    w->offs = malloc((size_t)g * 8 + 1);
    w->ts = malloc((size_t)g * 8 + 1);
    w->ti = malloc((size_t)g * 4 + 1);
    w->kb = malloc((size_t)w->kbytes + 1);
    w->ko = malloc((size_t)(g + 1) * 8);
    w->kn = malloc((size_t)g + 1);
    w->vb = malloc((size_t)w->vbytes + 1);
    w->vo = malloc((size_t)(g + 1) * 8);
    w->vn = malloc((size_t)g + 1);
    if (w->any_headers) {
        w->hb = malloc((size_t)w->hbytes + 1);
        w->ho = malloc((size_t)(g + 1) * 8);
    }
    if (!w->parts || !w->offs || !w->ts || !w->ti || !w->kb || !w->ko || !w->kn || !w->vb ||
        !w->vo || !w->vn || (w->any_headers && (!w->hb || !w->ho))) {
        fail(w, "out of memory");
        goto destroy;
    }
    /* pass 2: copy */
    int64_t ka = 0, va = 0, ha = 0;
    Py_ssize_t j = 0;
    rd_kafka_topic_t *last_rkt = NULL;
    int last_ti = -1;
    for (ssize_t i = 0; i < n; i++) {
        rdk_message *m = w->ms[i];
        if (m->err != RDK_NO_ERROR) {
            event *e = &w->events[w->nevents++];
            e->partition = m->partition;
            e->offset = m->offset;
            e->code = m->err;
            if (m->rkt != NULL) {
                const char *t = rdk.topic_name(m->rkt);
                e->topic = dup_n(t, strlen(t));
            }
            if (m->err == RDK_ERR_FATAL) {
                char buf[512];
                buf[0] = 0;
                e->code = rdk.fatal_error(w->rk, buf, sizeof buf);
                e->fatal = 1;
                e->reason = dup_n(buf, strlen(buf));
            } else if (m->payload != NULL) {
                e->reason = dup_n(m->payload, strnlen(m->payload, m->len));
            } else {
                const char *s = rdk.err2str(m->err);
                e->reason = dup_n(s, strlen(s));
            }
            continue;
        }
        int t = last_ti;
        if (m->rkt != last_rkt) {
            if ((t = topic_index(w, m->rkt)) < 0) {
                fail(w, "more than 64 topics in one batch");
                goto destroy;
            }
            last_rkt = m->rkt;
            last_ti = t;
        }
        int32_t t32 = t, p32 = m->partition;
        int tstype;
        int64_t ts = rdk.message_timestamp(m, &tstype);
        memcpy(w->ti + j * 4, &t32, 4);
        memcpy(w->parts + j * 4, &p32, 4);
        memcpy(w->offs + j * 8, &m->offset, 8);
        memcpy(w->ts + j * 8, &ts, 8);
        memcpy(w->ko + j * 8, &ka, 8);
        memcpy(w->vo + j * 8, &va, 8);
        w->kn[j] = m->key == NULL;
        if (m->key != NULL) {
            memcpy(w->kb + ka, m->key, m->key_len);
            ka += (int64_t)m->key_len;
        }
        w->vn[j] = m->payload == NULL;
        if (m->payload != NULL) {
            memcpy(w->vb + va, m->payload, m->len);
            va += (int64_t)m->len;
        }
        if (w->any_headers) {
            memcpy(w->ho + j * 8, &ha, 8);
            rd_kafka_headers_t *hs;
            if (rdk.message_headers(m, &hs) == RDK_NO_ERROR)
                ha += encode_headers(hs, w->hb + ha);
        }
        j++;
    }
    memcpy(w->ko + j * 8, &ka, 8);
    memcpy(w->vo + j * 8, &va, 8);
    if (w->any_headers)
        memcpy(w->ho + j * 8, &ha, 8);
destroy:
    for (ssize_t i = 0; i < n; i++)
        rdk.message_destroy(w->ms[i]);
}

static void work_free(work *w)
{
    char **bufs[] = {&w->parts, &w->offs, &w->ts, &w->ti, &w->kb, &w->ko,
                     &w->kn,    &w->vb,   &w->vo, &w->vn, &w->hb, &w->ho};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        free(*bufs[i]);
        *bufs[i] = NULL;
    }
    for (int i = 0; i < w->ntopics; i++)
        free(w->names[i]);
    w->ntopics = 0;
    if (w->events != NULL)
        for (int i = 0; i < w->nevents; i++) {
            free(w->events[i].topic);
            free(w->events[i].reason);
        }
    free(w->events);
    w->events = NULL;
    free(w->ms);
    w->ms = NULL;
}

/* hand a work buffer to a Buffer object (NULL -> the slot stays NULL on failure) */
static PyObject *take(char **p, Py_ssize_t size)
{
    char *d = *p;
    *p = NULL;
    return buffer_wrap(d, size);
}

/* consume(reader, want, timeout_ms) -> (parts, offsets, timestamps, topic_names, topic_index,
 *   kb, ko, kn, vb, vo, vn, hb, ho, events). Buffers as Buffer objects; topic_index is None when
 *   every record is of topic_names[0]; hb/ho None when no record has headers; events a list of
 *   (topic | None, partition, offset, code, reason, fatal) for the error messages (end of
 *   partition ...), in batch order. */
static PyObject *consume(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "consume(reader, want, timeout_ms)");
        return NULL;
    }
    reader *r = get_reader(args[0]);
    if (r == NULL)
        return NULL;
    Py_ssize_t want = PyLong_AsSsize_t(args[1]);
    long tmo = PyLong_AsLong(args[2]);
    if ((want == -1 || tmo == -1) && PyErr_Occurred())
        return NULL;
    if (want < 1 || want > 1000000) {
        PyErr_SetString(PyExc_ValueError, "consume: want must be 1..1000000");
        return NULL;
    }
    work w;
    memset(&w, 0, sizeof w);
    w.rk = r->rk;
    if ((w.ms = malloc((size_t)want * sizeof *w.ms)) == NULL)
        return PyErr_NoMemory();
    cfl_handle *h = (cfl_handle *)r->consumer;
    cfl_callstate cs;
    callstate_begin(h, &cs);
    w.n = rdk.consume_batch_queue(r->q, (int)tmo, w.ms, (size_t)want);
    PyThread_tss_set(&h->tlskey, NULL); /* nothing below calls back */
    if (w.n > 0)
        read_batch(&w);
    PyEval_RestoreThread(cs.thread_state);

    PyObject *result = NULL, *names = NULL, *tindex = NULL, *events = NULL;
    PyObject *bufs[11] = {0};
    /* the batch is dropped with a callback's or a signal handler's exception, as in
     * confluent_kafka (a restart resumes from the store) */
    if (callstate_failed(&cs) < 0)
        goto done;
    if (w.n < 0) {
        PyErr_SetString(PyExc_RuntimeError, "rd_kafka_consume_batch_queue failed");
        goto done;
    }
    if (w.failure != NULL) {
        PyErr_Format(PyExc_ValueError, "cannot read a consumed batch: %s", w.failure);
        goto done;
    }
    Py_ssize_t g = w.good;
    if (w.n == 0) {
        /* nothing consumed: empty columns (the buffers were never allocated) */
        w.parts = calloc(1, 1), w.offs = calloc(1, 1), w.ts = calloc(1, 1), w.kb = calloc(1, 1);
        w.ko = calloc(1, 8), w.kn = calloc(1, 1), w.vb = calloc(1, 1), w.vo = calloc(1, 8);
        w.vn = calloc(1, 1);
        if (!w.parts || !w.offs || !w.ts || !w.kb || !w.ko || !w.kn || !w.vb || !w.vo || !w.vn) {
            PyErr_NoMemory();
            goto done;
        }
    }
    if ((names = PyList_New(w.ntopics)) == NULL)
        goto done;
    for (int i = 0; i < w.ntopics; i++) {
        PyObject *s = PyUnicode_DecodeUTF8(w.names[i], (Py_ssize_t)strlen(w.names[i]),
                                           "surrogateescape");
        if (s == NULL)
            goto done;
        PyList_SET_ITEM(names, i, s);
    }
    if (w.ntopics > 1) {
        if ((tindex = take(&w.ti, g * 4)) == NULL)
            goto done;
    } else {
        tindex = Py_NewRef(Py_None);
    }
    if ((events = PyList_New(w.nevents)) == NULL)
        goto done;
    for (int i = 0; i < w.nevents; i++) {
        event *e = &w.events[i];
        PyObject *topic = e->topic == NULL
                              ? Py_NewRef(Py_None)
                              : PyUnicode_DecodeUTF8(e->topic, (Py_ssize_t)strlen(e->topic),
                                                     "surrogateescape");
        PyObject *reason = topic == NULL ? NULL
                                         : PyUnicode_DecodeUTF8(
                                               e->reason ? e->reason : "",
                                               e->reason ? (Py_ssize_t)strlen(e->reason) : 0,
                                               "replace");
        PyObject *t = reason == NULL ? NULL
                                     : Py_BuildValue("(NiLiNO)", topic, (int)e->partition,
                                                     (long long)e->offset, e->code, reason,
                                                     e->fatal ? Py_True : Py_False);
        if (t == NULL) {
            if (reason == NULL)
                Py_XDECREF(topic);
            goto done;
        }
        PyList_SET_ITEM(events, i, t);
    }
    struct { char **p; Py_ssize_t size; } spec[11] = {
        {&w.parts, g * 4}, {&w.offs, g * 8}, {&w.ts, g * 8}, {&w.kb, (Py_ssize_t)w.kbytes},
        {&w.ko, (g + 1) * 8}, {&w.kn, g}, {&w.vb, (Py_ssize_t)w.vbytes}, {&w.vo, (g + 1) * 8},
        {&w.vn, g}, {&w.hb, (Py_ssize_t)w.hbytes}, {&w.ho, (g + 1) * 8}};
    for (int i = 0; i < 11; i++) {
        if (i >= 9 && !w.any_headers) {
            bufs[i] = Py_NewRef(Py_None);
            continue;
        }
        if ((bufs[i] = take(spec[i].p, spec[i].size)) == NULL)
            goto done;
    }
    result = Py_BuildValue("(OOOOOOOOOOOOOO)", bufs[0], bufs[1], bufs[2], names, tindex,
                           bufs[3], bufs[4], bufs[5], bufs[6], bufs[7], bufs[8], bufs[9],
                           bufs[10], events);
done:
    for (int i = 0; i < 11; i++)
        Py_XDECREF(bufs[i]);
    Py_XDECREF(names);
    Py_XDECREF(tindex);
    Py_XDECREF(events);
    work_free(&w);
    return result;
}

/* the store's header encoding (u32 count, then per header u16 name length, name, i32 value
 * length or -1 for null, value; little-endian): 1 when it fills exactly p[0:len], adding each
 * header to h on the way when h is not NULL */
static int walk_headers(const uint8_t *p, int64_t len, rd_kafka_headers_t *h)
{
    if (len < 4)
        return 0;
    uint32_t count;
    memcpy(&count, p, 4);
    int64_t at = 4;
    for (uint32_t i = 0; i < count; i++) {
        uint16_t nl;
        int32_t vl;
        if (at + 2 > len)
            return 0;
        memcpy(&nl, p + at, 2);
        if (at + 2 + nl + 4 > len)
            return 0;
        memcpy(&vl, p + at + 2 + nl, 4);
        const char *name = (const char *)p + at + 2;
        at += 6 + nl;
        if (vl < -1 || (vl > 0 && at + vl > len))
            return 0;
        if (h != NULL)
            rdk.header_add(h, name, nl, vl < 0 ? NULL : p + at, vl < 0 ? 0 : vl);
        at += vl > 0 ? vl : 0;
    }
    return at == len;
}

/* librdkafka headers from a section p[0:len] that walk_headers accepted */
static rd_kafka_headers_t *make_headers(const uint8_t *p, int64_t len)
{
    uint32_t count;
    memcpy(&count, p, 4);
    rd_kafka_headers_t *h = rdk.headers_new(count);
    walk_headers(p, len, h);
    return h;
}

/* -- producer_attach(producer, error_cb, logger) -> capsule or None ------------------------- */

/* confluent_kafka's per-message state (Producer.c, the same in 2.x): its delivery-report
 * trampoline calls dr_cb(err, msg) (only for failures under delivery.report.only.error), then
 * drops the reference and free()s the struct */
typedef struct {
    cfl_handle *self;
    PyObject *dr_cb;
} cfl_msgstate;

typedef struct {
    PyObject *producer; /* strong reference */
    rd_kafka_t *rk;
} sender;

static const char *SENDER = "connectors._rdkafka.sender";

static void sender_free(PyObject *cap)
{
    sender *s = PyCapsule_GetPointer(cap, SENDER);
    if (s == NULL)
        return;
    Py_XDECREF(s->producer);
    free(s);
}

static PyObject *producer_attach(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "producer_attach(producer, error_cb, logger)");
        return NULL;
    }
    cfl_handle *h = recognise(args[0], args[1], args[2], RDK_PRODUCER);
    if (h == NULL)
        Py_RETURN_NONE;
    sender *sd = calloc(1, sizeof *sd);
    if (sd == NULL)
        return PyErr_NoMemory();
    sd->rk = h->rk;
    sd->producer = Py_NewRef(args[0]);
    PyObject *cap = PyCapsule_New(sd, SENDER, sender_free);
    if (cap == NULL) {
        Py_DECREF(sd->producer);
        free(sd);
    }
    return cap;
}

/* -- produce(sender, topic, partition, partitions, kbuf, kstarts, kends, knulls, vbuf, vstarts,
 *            vends, vnulls, timestamps, dr_cb, headers) -> (produced, error code, error text) -
 * headers: None, or (buf, starts, ends) of each record's header section in the store's
 * encoding (reput.record.encode_headers; empty: no headers), made into librdkafka headers.
 * Every record of the columns to ``topic``: at ``partition``, or partitions[i] when that is not
 * None (int32). Keys and values are buf[starts[i]:ends[i]] (int64), null where nulls[i]; copied
 * by librdkafka (RD_KAFKA_MSG_F_COPY), so the buffers may go once this returns.
 * dr_cb None: no delivery report reaches Python for these records, so the caller must produce
 * them inside a transaction, whose commit fails when any of them failed delivery (librdkafka
 * counts them whatever the application's callbacks). dr_cb a callable: each record carries
 * confluent_kafka's per-message state with it, so its delivery report reaches dr_cb exactly as
 * for produce(..., on_delivery=dr_cb). A full queue is served with rd_kafka_poll (callbacks run, as in
 * Producer.poll) and the record retried; another error stops at that record and is returned. */

static PyObject *produce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "produce(sender, topic, partition, partitions, kbuf, "
                        "kstarts, kends, knulls, vbuf, vstarts, vends, vnulls, timestamps, "
                        "dr_cb, headers)");
        return NULL;
    }
    sender *sd = PyCapsule_GetPointer(args[0], SENDER);
    if (sd == NULL)
        return NULL;
    cfl_handle *h = (cfl_handle *)sd->producer;
    if (h->rk != sd->rk) {
        PyErr_SetString(PyExc_RuntimeError, "the producer is closed");
        return NULL;
    }
    PyObject *dr_cb = args[13] == Py_None ? NULL : args[13];
    if (dr_cb != NULL && !PyCallable_Check(dr_cb)) {
        PyErr_SetString(PyExc_TypeError, "produce: dr_cb must be callable or None");
        return NULL;
    }
    const char *topic = PyUnicode_AsUTF8(args[1]);
    long part = PyLong_AsLong(args[2]);
    if (topic == NULL || (part == -1 && PyErr_Occurred()))
        return NULL;
    Py_buffer kb = {0}, vb = {0}, hb = {0};
    Arr ha[2];
    memset(ha, 0, sizeof ha);
    int have_headers = args[14] != Py_None;
    Arr a[7] = {0}; /* partitions, kstarts, kends, knulls, vstarts, vends, vnulls; ts last */
    Arr ts = {0};
    PyObject *result = NULL;
    int have_parts = args[3] != Py_None;
    if (PyObject_GetBuffer(args[4], &kb, PyBUF_SIMPLE) < 0)
        goto out;
    if (PyObject_GetBuffer(args[8], &vb, PyBUF_SIMPLE) < 0)
        goto out;
    if ((have_parts && arr_get(args[3], &a[0], 4, 0, "partitions") < 0) ||
        arr_get(args[5], &a[1], 8, 0, "kstarts") < 0 || arr_get(args[6], &a[2], 8, 0, "kends") < 0 ||
        arr_get(args[7], &a[3], 1, 0, "knulls") < 0 || arr_get(args[9], &a[4], 8, 0, "vstarts") < 0 ||
        arr_get(args[10], &a[5], 8, 0, "vends") < 0 || arr_get(args[11], &a[6], 1, 0, "vnulls") < 0 ||
        arr_get(args[12], &ts, 8, 0, "timestamps") < 0)
        goto out;
    Py_ssize_t n = ts.n;
    if (have_headers) {
        if (!PyTuple_Check(args[14]) || PyTuple_GET_SIZE(args[14]) != 3) {
            PyErr_SetString(PyExc_TypeError, "produce: headers must be (buf, starts, ends)");
            goto out;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args[14], 0), &hb, PyBUF_SIMPLE) < 0 ||
            arr_get(PyTuple_GET_ITEM(args[14], 1), &ha[0], 8, 0, "hstarts") < 0 ||
            arr_get(PyTuple_GET_ITEM(args[14], 2), &ha[1], 8, 0, "hends") < 0)
            goto out;
        if (ha[0].n != n || ha[1].n != n) {
            PyErr_SetString(PyExc_ValueError, "produce: columns of different lengths");
            goto out;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t h0 = ld_i64(&ha[0], i), h1 = ld_i64(&ha[1], i);
            if (h0 < 0 || h1 < h0 || h1 > hb.len || (h1 > h0 && !walk_headers(
                    (const uint8_t *)hb.buf + h0, h1 - h0, NULL))) {
                PyErr_SetString(PyExc_ValueError, "produce: a header section is out of bounds "
                                "or malformed");
                goto out;
            }
        }
    }
    for (int i = have_parts ? 0 : 1; i < 7; i++)
        if (a[i].n != n) {
            PyErr_SetString(PyExc_ValueError, "produce: columns of different lengths");
            goto out;
        }
    /* every range inside its buffer, before any record goes */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k0 = ld_i64(&a[1], i), k1 = ld_i64(&a[2], i);
        int64_t v0 = ld_i64(&a[4], i), v1 = ld_i64(&a[5], i);
        if ((!ld_u8(&a[3], i) && (k0 < 0 || k1 < k0 || k1 > kb.len)) ||
            (!ld_u8(&a[6], i) && (v0 < 0 || v1 < v0 || v1 > vb.len))) {
            PyErr_SetString(PyExc_ValueError, "produce: a key or value range is out of bounds");
            goto out;
        }
    }
    static const char empty[1] = {0};
    Py_ssize_t done = 0;
    int code = 0;
    char reason[512];
    reason[0] = 0;
    rd_kafka_topic_t *rkt = rdk.topic_new(sd->rk, topic, NULL);
    if (rkt == NULL) {
        PyErr_Format(PyExc_ValueError, "produce: cannot use topic %s", topic);
        goto out;
    }
    /* one reference per record for its msgstate, taken now with the GIL; the delivery reports
     * (with the GIL) drop them one by one, and those of records never queued go back below */
    if (dr_cb != NULL)
        Py_SET_REFCNT(dr_cb, Py_REFCNT(dr_cb) + n);
    cfl_callstate cs;
    callstate_begin(h, &cs);
    rdk_vu vu[8];
    memset(vu, 0, sizeof vu);
    vu[0].vtype = VT_RKT;
    vu[0].u.rkt = rkt;
    vu[1].vtype = VT_PARTITION;
    vu[1].u.i32 = (int32_t)part;
    vu[2].vtype = VT_KEY;
    vu[3].vtype = VT_VALUE;
    vu[4].vtype = VT_TIMESTAMP;
    vu[5].vtype = VT_MSGFLAGS;
    vu[5].u.i = RDK_MSG_F_COPY;
    vu[6].vtype = VT_OPAQUE;
    int nvu0 = dr_cb != NULL ? 7 : 6;
    int nomem = 0;
    const char *kp = kb.buf, *vp = vb.buf;
    for (; done < n && !cs.crashed; done++) {
        Py_ssize_t i = done;
        if (have_parts)
            vu[1].u.i32 = (int32_t)ld_u32(&a[0], i);
        if (ld_u8(&a[3], i)) {
            vu[2].u.mem.ptr = NULL;
            vu[2].u.mem.size = 0;
        } else {
            int64_t k0 = ld_i64(&a[1], i), k1 = ld_i64(&a[2], i);
            vu[2].u.mem.ptr = k1 > k0 ? kp + k0 : empty; /* empty, not null */
            vu[2].u.mem.size = (size_t)(k1 - k0);
        }
        if (ld_u8(&a[6], i)) {
            vu[3].u.mem.ptr = NULL;
            vu[3].u.mem.size = 0;
        } else {
            int64_t v0 = ld_i64(&a[4], i), v1 = ld_i64(&a[5], i);
            vu[3].u.mem.ptr = v1 > v0 ? vp + v0 : empty;
            vu[3].u.mem.size = (size_t)(v1 - v0);
        }
        vu[4].u.i64 = ld_i64(&ts, i);
        cfl_msgstate *ms = NULL;
        if (dr_cb != NULL) {
            if ((ms = malloc(sizeof *ms)) == NULL) {
                nomem = 1;
                break;
            }
            ms->self = h;
            ms->dr_cb = dr_cb;
            vu[6].u.ptr = ms;
        }
        rd_kafka_headers_t *hdrs = NULL;
        int nvu = nvu0;
        if (have_headers) {
            int64_t h0 = ld_i64(&ha[0], i), h1 = ld_i64(&ha[1], i);
            if (h1 > h0) {
                hdrs = make_headers((const uint8_t *)hb.buf + h0, h1 - h0);
                vu[nvu].vtype = VT_HEADERS;
                vu[nvu].u.headers = hdrs;
                nvu++;
            }
        }
        void *err;
        while ((err = rdk.produceva(sd->rk, vu, nvu)) != NULL) {
            int c = rdk.error_code(err);
            if (c != RDK_ERR_QUEUE_FULL) {
                code = c;
                const char *t = rdk.error_string(err);
                snprintf(reason, sizeof reason, "%s", t ? t : "");
                rdk.error_destroy(err);
                break;
            }
            rdk.error_destroy(err);
            rdk.poll(sd->rk, 10);
            if (cs.crashed)
                break;
        }
        if (code != 0 || cs.crashed) {
            free(ms); /* never handed to librdkafka, nor the headers */
            if (hdrs != NULL)
                rdk.headers_destroy(hdrs);
            break;
        }
    }
    PyThread_tss_set(&h->tlskey, NULL);
    rdk.topic_destroy(rkt);
    PyEval_RestoreThread(cs.thread_state);
    if (dr_cb != NULL)
        Py_SET_REFCNT(dr_cb, Py_REFCNT(dr_cb) - (n - done)); /* records never queued */
    if (callstate_failed(&cs) < 0)
        goto out;
    if (nomem) {
        PyErr_NoMemory();
        goto out;
    }
    result = Py_BuildValue("(nis)", done, code, reason);
out:
    if (kb.obj != NULL)
        PyBuffer_Release(&kb);
    if (vb.obj != NULL)
        PyBuffer_Release(&vb);
    if (hb.obj != NULL)
        PyBuffer_Release(&hb);
    arr_release(ha, 2);
    arr_release(a, 7);
    arr_release(&ts, 1);
    return result;
}

/* -- unpack(buf, starts, nulls) -> list of bytes | None (a packed column, for sinks that want
 *    objects) --------------------------------------------------------------------------------- */

static PyObject *unpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "unpack(buf, starts, nulls)");
        return NULL;
    }
    Py_buffer b, o, nl;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &o, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &nl, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&b);
        PyBuffer_Release(&o);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t n = nl.len;
    if (o.len != (n + 1) * 8) {
        PyErr_SetString(PyExc_ValueError, "unpack: starts must hold len(nulls) + 1 int64");
        goto done;
    }
    const char *starts = o.buf, *nulls = nl.buf;
    if ((out = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a, z;
        memcpy(&a, starts + i * 8, 8);
        memcpy(&z, starts + (i + 1) * 8, 8);
        PyObject *x;
        if (nulls[i]) {
            x = Py_NewRef(Py_None);
        } else if (a < 0 || z < a || z > b.len) {
            PyErr_SetString(PyExc_ValueError, "unpack: starts out of range");
            Py_CLEAR(out);
            goto done;
        } else if ((x = PyBytes_FromStringAndSize((const char *)b.buf + a, z - a)) == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, x);
    }
done:
    PyBuffer_Release(&b);
    PyBuffer_Release(&o);
    PyBuffer_Release(&nl);
    return out;
}

/* -- message_columns: a batch of Message objects into columns ----------------------------- */

/* message_columns(msgs, partitions, offsets, timestamps) ->
 *     (keys, values, headers, key_buf, key_offs, key_null, val_buf, val_offs, val_null),
 *     or None when a message of the list is an error event (nothing is filled then)
 *
 * One pass over a list of confluent_kafka Message objects (no errors among them), through their
 * public methods: partition(), offset() and timestamp()[1] into the int32/int64/int64 arrays
 * given; key() and value() into lists (bytes or None) and packed as well (bytearray of the
 * bytes back to back, bytearray of n+1 int64 start offsets, bytearray of n null flags: a
 * column the store can encode without touching the objects again); headers() into a list, or
 * None when no message has headers. What connectors/worker.py and store_sink.py did with six
 * map() passes, np.fromiter and b"".join: about 0.6 us a message in Python. The consumer path's
 * Message objects (a batch read with consume(); the column path above needs no objects). */
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

static int pack_column(PyObject *list, Py_ssize_t n, PyObject **buf, PyObject **offs, PyObject **nulls)
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
    if (pack_column(keys, n, &kb, &ko, &kn) < 0 || pack_column(values, n, &vb, &vo, &vn) < 0)
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
    {"bind", (PyCFunction)bind, METH_O, NULL},
    {"attach", (PyCFunction)(void (*)(void))attach, METH_FASTCALL, NULL},
    {"detach", (PyCFunction)detach, METH_O, NULL},
    {"consume", (PyCFunction)(void (*)(void))consume, METH_FASTCALL, NULL},
    {"unpack", (PyCFunction)(void (*)(void))unpack, METH_FASTCALL, NULL},
    {"producer_attach", (PyCFunction)(void (*)(void))producer_attach, METH_FASTCALL, NULL},
    {"produce", (PyCFunction)(void (*)(void))produce, METH_FASTCALL, NULL},
    {"message_columns", (PyCFunction)(void (*)(void))message_columns, METH_FASTCALL, NULL},
    {"message_fields_readable", (PyCFunction)message_fields_readable, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kcompact.connectors.framework._rdkafka",
    "Consumed batches straight into columns (see the comment at the top of "
    "connectors/framework/_rdkafka.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rdkafka(void)
{
    if (PyType_Ready(&BufferType) < 0)
        return NULL;
    for (int i = 0; i < M_N; i++)
        if ((m_names[i] = PyUnicode_InternFromString(m_name_text[i])) == NULL)
            return NULL;
    return PyModule_Create(&module);
}
