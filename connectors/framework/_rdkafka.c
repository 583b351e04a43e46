/* kcompact.connectors.framework._rdkafka: kcompact's own Kafka client on librdkafka's public API
 * (rdkafka.h), with consumed batches read straight into columns and columns produced.
 *
 * Client(kind, conf, logs, stats) creates an rd_kafka_t with rd_kafka_conf_set (librdkafka
 * validates every key; its error text names the key) and rd_kafka_new. Nothing here reads or
 * writes a struct of confluent-kafka: confluent-kafka stays for admin, metadata and the Schema
 * Registry; this is the data path's one client (connectors/framework/native_kafka.py).
 *
 * The library: load(path) dlopens the librdkafka that native_kafka.py found (the one
 * confluent-kafka's wheel ships, through importlib.metadata; or KCOMPACT_LIBRDKAFKA; or the
 * system's), resolves each function used here by name with its type taken from rdkafka.h
 * (__typeof__: the header is compiled against, the library is not linked), and refuses a library
 * older than the header (rd_kafka_version() < RD_KAFKA_VERSION). The header is librdkafka
 * 2.6.0's, vendored in third_party/librdkafka (the librdkafka of the oldest confluent-kafka that
 * pyproject.toml allows; third_party/README.md), so the module builds wherever a C compiler is.
 *
 * Callbacks: librdkafka calls error_cb, log_cb, stats_cb and dr_msg_cb from inside its calls
 * (consume, poll, flush, commit...) or, for the log, from its own threads. None of them touches
 * Python: each appends an event to the client's list under a mutex, and the Python side drains
 * the list (drain()) after each call and calls the application's callables, with the GIL, on
 * its own thread. So every librdkafka call here runs with the GIL released, a callable that
 * raises raises from the call that served its event (the batch of that consume() is dropped, as
 * in confluent-kafka), and no per-message state is allocated: a delivery report carries the
 * message's topic, partition, offset and error, which is all the application reads.
 *
 * Consume: rd_kafka_consume_batch_queue on the consumer queue (rd_kafka_poll_set_consumer
 * forwards the main queue to it, so errors and stats are served there too) with the GIL
 * released, in slices of at most 200 ms with a signal check between slices (Ctrl-C during a long
 * wait raises KeyboardInterrupt; the batch in hand is dropped, a restart resumes from the store),
 * then one pass copies the batch into packed columns (key bytes + starts + nulls, the same for
 * values, headers in the store's encoding, partitions, offsets, timestamps) before the GIL is
 * taken back once: no Python object per record.
 *
 * Produce: rd_kafka_produceva per record of the columns (RD_KAFKA_MSG_F_COPY), the GIL released
 * for the whole block; a full queue is served with rd_kafka_poll and the record retried.
 *
 * One file: one extension module; the client, the column passes and the header-section walker
 * share the librdkafka declarations.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_arr.h" /* reput/_arr.h: 1-d arrays through the buffer protocol */

#include <pthread.h>
#include <librdkafka/rdkafka.h> /* third_party/librdkafka: 2.6.0's, vendored (setup.py) */

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


/* -- librdkafka's functions, resolved by load() ----------------------------------------------- */

#define RDK_FUNCS(X)                                                                           \
    X(version) X(version_str) X(conf_new) X(conf_destroy) X(conf_set) X(conf_set_opaque)      \
    X(conf_set_error_cb) X(conf_set_log_cb) X(conf_set_stats_cb) X(conf_set_dr_msg_cb)        \
    X(new) X(destroy) X(opaque) X(poll_set_consumer) X(queue_get_consumer) X(queue_destroy)   \
    X(consume_batch_queue) X(message_destroy) X(message_timestamp) X(message_headers)         \
    X(header_get_all) X(headers_new) X(headers_destroy) X(header_add)       \
    X(topic_name) X(topic_new) X(topic_destroy) X(err2str) X(err2name) X(fatal_error)          \
    X(produceva) X(error_code) X(error_string) X(error_is_fatal) X(error_is_retriable)         \
    X(error_txn_requires_abort) X(error_destroy) X(poll) X(flush) X(outq_len) X(assign)       \
    X(incremental_assign) X(pause_partitions) X(commit) X(consumer_close) X(get_watermark_offsets)                 \
    X(query_watermark_offsets) X(metadata) X(metadata_destroy) X(clusterid) X(mem_free)       \
    X(topic_partition_list_new) X(topic_partition_list_add) X(topic_partition_list_destroy)   \
    X(init_transactions) X(begin_transaction) X(commit_transaction) X(abort_transaction)

#define RDK_FIELD(f) __typeof__(rd_kafka_##f) *f;
static struct {
    RDK_FUNCS(RDK_FIELD)
} rdk;
#undef RDK_FIELD
static char loaded_version[32] = "";

/* the Python exception of a librdkafka error: KafkaIOError(code, reason, fatal, retriable,
 * txn_requires_abort); native_kafka.py turns it into confluent_kafka's KafkaException */
static PyObject *KafkaIOError;

static PyObject *raise_kafka(int code, const char *reason, int fatal, int retriable, int abort)
{
    PyObject *args = Py_BuildValue("(isiii)", code, reason ? reason : "", fatal, retriable, abort);
    if (args != NULL) {
        PyErr_SetObject(KafkaIOError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static PyObject *raise_err(rd_kafka_resp_err_t err)
{
    return raise_kafka(err, rdk.err2str(err), 0, 0, 0);
}

/* an rd_kafka_error_t (destroyed here) as KafkaIOError */
static PyObject *raise_error_t(rd_kafka_error_t *e)
{
    raise_kafka(rdk.error_code(e), rdk.error_string(e), rdk.error_is_fatal(e),
                rdk.error_is_retriable(e), rdk.error_txn_requires_abort(e));
    rdk.error_destroy(e);
    return NULL;
}

/* load(path) -> librdkafka's version text: dlopen the library and resolve every function, once
 * per process; OSError when it cannot be loaded, lacks a function or is older than rdkafka.h */
static PyObject *load(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL)
        return NULL;
    if (loaded_version[0])
        return PyUnicode_FromString(loaded_version);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        PyErr_Format(PyExc_OSError, "cannot load librdkafka from %s: %s", path, dlerror());
        return NULL;
    }
    __typeof__(rdk) got;
#define RDK_SYM(f)                                                                             \
    if ((*(void **)&got.f = dlsym(h, "rd_kafka_" #f)) == NULL) {                               \
        PyErr_Format(PyExc_OSError, "%s has no rd_kafka_" #f " (not librdkafka, or too old)", \
                     path);                                                                    \
        dlclose(h);                                                                            \
        return NULL;                                                                           \
    }
    RDK_FUNCS(RDK_SYM)
#undef RDK_SYM
    int v = got.version();
    if (v < RD_KAFKA_VERSION) {
        PyErr_Format(PyExc_OSError, "%s is librdkafka %s; kcompact's client needs %d.%d.%d or "
                     "newer (the rdkafka.h it was built with)", path, got.version_str(),
                     (RD_KAFKA_VERSION >> 24) & 0xff, (RD_KAFKA_VERSION >> 16) & 0xff,
                     (RD_KAFKA_VERSION >> 8) & 0xff);
        dlclose(h);
        return NULL;
    }
    rdk = got; /* the library stays loaded for the life of the process */
    snprintf(loaded_version, sizeof loaded_version, "%s", got.version_str());
    return PyUnicode_FromString(loaded_version);
}

/* -- Client: an rd_kafka_t, and the events its callbacks leave for Python ------------------ */

enum { EV_ERROR, EV_LOG, EV_STATS, EV_DR };

typedef struct ev {
    struct ev *next;
    int kind, code, fatal, level;
    int32_t partition;
    int64_t offset;
    char *topic; /* EV_DR: the topic; EV_LOG: the facility */
    char *text;
} ev;

/* log lines kept between two drains; more are counted and reported as dropped */
#define MAX_LOGS 10000

/* acknowledged deliveries of one topic (track_acks): per partition the lowest and highest
 * offset and the count since the last acks() */
typedef struct {
    int64_t lo, hi, n;
} ack_range;

typedef struct ack_topic {
    struct ack_topic *next;
    char *name;
    int32_t cap; /* partitions [0, cap) have a slot */
    ack_range *parts;
} ack_topic;

typedef struct {
    PyObject_HEAD
    rd_kafka_t *rk;      /* NULL once closed */
    rd_kafka_queue_t *q; /* the consumer queue (consumers) */
    int type;            /* RD_KAFKA_PRODUCER or RD_KAFKA_CONSUMER */
    int logs;            /* keep log lines (else dropped in the callback) */
    pthread_mutex_t mu;  /* guards the list and the counts below */
    ev *head, *tail;
    int pending;         /* events in the list; read without the mutex as a hint */
    int nlogs, dropped_logs;
    int busy;            /* calls of this client running without the GIL */
    int track;           /* track_acks(): count acknowledged deliveries (under mu) */
    ack_topic *acks;
} Client;

static char *dup_s(const char *s)
{
    if (s == NULL)
        return NULL;
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d != NULL)
        memcpy(d, s, n + 1);
    return d;
}

/* append an event (any thread); an event that cannot be allocated is lost */
static void push(Client *c, int kind, int code, int fatal, int level, const char *topic,
                 int32_t partition, int64_t offset, const char *text, size_t text_len)
{
    ev *e = calloc(1, sizeof *e);
    if (e == NULL)
        return;
    e->kind = kind, e->code = code, e->fatal = fatal, e->level = level;
    e->partition = partition, e->offset = offset;
    e->topic = dup_s(topic);
    if (text != NULL && (e->text = malloc(text_len + 1)) != NULL) {
        memcpy(e->text, text, text_len);
        e->text[text_len] = 0;
    }
    pthread_mutex_lock(&c->mu);
    if (kind == EV_LOG && c->nlogs >= MAX_LOGS) {
        __atomic_store_n(&c->dropped_logs, c->dropped_logs + 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&c->mu);
        free(e->topic);
        free(e->text);
        free(e);
        return;
    }
    c->nlogs += kind == EV_LOG;
    if (c->tail != NULL)
        c->tail->next = e;
    else
        c->head = e;
    c->tail = e;
    __atomic_store_n(&c->pending, c->pending + 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&c->mu);
}

static void on_error(rd_kafka_t *rk, int err, const char *reason, void *opaque)
{
    char buf[512];
    int fatal = 0;
    if (err == RD_KAFKA_RESP_ERR__FATAL) { /* the underlying error, as confluent-kafka reports */
        buf[0] = 0;
        err = rdk.fatal_error(rk, buf, sizeof buf);
        reason = buf;
        fatal = 1;
    }
    push(opaque, EV_ERROR, err, fatal, 0, NULL, -1, -1, reason, strlen(reason));
}

static void on_log(const rd_kafka_t *rk, int level, const char *fac, const char *buf)
{
    Client *c = rdk.opaque(rk);
    if (c != NULL && c->logs)
        push(c, EV_LOG, 0, 0, level, fac, -1, -1, buf, strlen(buf));
}

static int on_stats(rd_kafka_t *rk, char *json, size_t len, void *opaque)
{
    (void)rk;
    push(opaque, EV_STATS, 0, 0, 0, NULL, -1, -1, json, len);
    return 0; /* librdkafka frees json */
}

/* an acknowledged delivery, counted when tracking (caller holds mu) */
static void ack(Client *c, const char *topic, int32_t partition, int64_t offset)
{
    ack_topic *t = c->acks;
    while (t != NULL && strcmp(t->name, topic) != 0)
        t = t->next;
    if (t == NULL) {
        if ((t = calloc(1, sizeof *t)) == NULL || (t->name = dup_s(topic)) == NULL) {
            free(t);
            return;
        }
        t->next = c->acks;
        c->acks = t;
    }
    if (partition < 0)
        return;
    if (partition >= t->cap) {
        int32_t cap = partition + 1 > 2 * t->cap ? partition + 1 : 2 * t->cap;
        ack_range *p = realloc(t->parts, (size_t)cap * sizeof *p);
        if (p == NULL)
            return;
        for (int32_t i = t->cap; i < cap; i++)
            p[i].lo = INT64_MAX, p[i].hi = -1, p[i].n = 0;
        t->parts = p, t->cap = cap;
    }
    ack_range *r = &t->parts[partition];
    if (offset < r->lo)
        r->lo = offset;
    if (offset > r->hi)
        r->hi = offset;
    r->n++;
}

/* a failed delivery; a successful one only counts toward acks() while tracking (the callers
 * count acks by flush) */
static void on_delivery(rd_kafka_t *rk, const rd_kafka_message_t *m, void *opaque)
{
    (void)rk;
    if (m->err == RD_KAFKA_RESP_ERR_NO_ERROR) {
        Client *c = opaque;
        if (!__atomic_load_n(&c->track, __ATOMIC_RELAXED) || m->rkt == NULL)
            return;
        pthread_mutex_lock(&c->mu);
        ack(c, rdk.topic_name(m->rkt), m->partition, m->offset);
        pthread_mutex_unlock(&c->mu);
        return;
    }
    /* not rd_kafka_message_errstr: for a produced message its payload is the record's value,
     * not an error text (AddressSanitizer found the strlen past it) */
    const char *why = rdk.err2str(m->err);
    push(opaque, EV_DR, m->err, 0, 0, m->rkt != NULL ? rdk.topic_name(m->rkt) : NULL,
         m->partition, m->offset, why, strlen(why));
}

static void free_events(ev *e)
{
    while (e != NULL) {
        ev *next = e->next;
        free(e->topic);
        free(e->text);
        free(e);
        e = next;
    }
}

#define BUSY_BEGIN(c)                                                                          \
    (c)->busy++;                                                                               \
    Py_BEGIN_ALLOW_THREADS
#define BUSY_END(c)                                                                            \
    Py_END_ALLOW_THREADS(c)->busy--;

static rd_kafka_t *live(Client *c)
{
    if (c->rk == NULL)
        PyErr_SetString(PyExc_RuntimeError, "the Kafka client is closed");
    return c->rk;
}

/* Client(kind, conf, logs, stats): kind 0 producer, 1 consumer; conf a dict of str -> str */
static PyObject *client_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    int kind, logs, stats;
    PyObject *conf;
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "Client(kind, conf, logs, stats)");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iO!pp", &kind, &PyDict_Type, &conf, &logs, &stats))
        return NULL;
    if (rdk.new == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "librdkafka is not loaded (call load() first)");
        return NULL;
    }
    if (kind != RD_KAFKA_PRODUCER && kind != RD_KAFKA_CONSUMER) {
        PyErr_SetString(PyExc_ValueError, "Client: kind is 0 (producer) or 1 (consumer)");
        return NULL;
    }
    Client *c = (Client *)tp->tp_alloc(tp, 0);
    if (c == NULL)
        return NULL;
    pthread_mutex_init(&c->mu, NULL);
    c->type = kind;
    c->logs = logs;
    char errstr[512];
    rd_kafka_conf_t *cf = rdk.conf_new();
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(conf, &pos, &k, &v)) {
        const char *ks = PyUnicode_AsUTF8(k), *vs = ks ? PyUnicode_AsUTF8(v) : NULL;
        if (vs == NULL) {
            rdk.conf_destroy(cf);
            Py_DECREF(c);
            return NULL;
        }
        if (rdk.conf_set(cf, ks, vs, errstr, sizeof errstr) != RD_KAFKA_CONF_OK) {
            rdk.conf_destroy(cf);
            Py_DECREF(c);
            return raise_kafka(RD_KAFKA_RESP_ERR__INVALID_ARG, errstr, 0, 0, 0);
        }
    }
    rdk.conf_set_opaque(cf, c);
    rdk.conf_set_error_cb(cf, on_error);
    rdk.conf_set_log_cb(cf, on_log); /* else librdkafka prints to stderr */
    if (stats)
        rdk.conf_set_stats_cb(cf, on_stats);
    if (kind == RD_KAFKA_PRODUCER)
        rdk.conf_set_dr_msg_cb(cf, on_delivery);
    rd_kafka_t *rk;
    Py_BEGIN_ALLOW_THREADS
    rk = rdk.new(kind, cf, errstr, sizeof errstr);
    Py_END_ALLOW_THREADS
    if (rk == NULL) {
        rdk.conf_destroy(cf); /* still ours when rd_kafka_new fails */
        Py_DECREF(c);
        return raise_kafka(RD_KAFKA_RESP_ERR__INVALID_ARG, errstr, 0, 0, 0);
    }
    c->rk = rk;
    if (kind == RD_KAFKA_CONSUMER) {
        rd_kafka_resp_err_t err = rdk.poll_set_consumer(rk);
        if (err != RD_KAFKA_RESP_ERR_NO_ERROR || (c->q = rdk.queue_get_consumer(rk)) == NULL) {
            Py_DECREF(c); /* destroys rk */
            return raise_kafka(RD_KAFKA_RESP_ERR__INVALID_ARG,
                               "a consumer needs group.id (its queue is the group's)", 0, 0, 0);
        }
    }
    return (PyObject *)c;
}

/* consumer_close (consumers), then rd_kafka_destroy; the GIL released, callbacks still land in
 * the list, which the next drain() returns */
static void client_shut(Client *c)
{
    rd_kafka_t *rk = c->rk;
    rd_kafka_queue_t *q = c->q;
    int consumer = c->type == RD_KAFKA_CONSUMER;
    if (rk == NULL)
        return;
    c->rk = NULL;
    c->q = NULL;
    Py_BEGIN_ALLOW_THREADS
    if (consumer)
        rdk.consumer_close(rk);
    if (q != NULL)
        rdk.queue_destroy(q);
    rdk.destroy(rk);
    Py_END_ALLOW_THREADS
}

static void free_acks(ack_topic *t)
{
    while (t != NULL) {
        ack_topic *next = t->next;
        free(t->name);
        free(t->parts);
        free(t);
        t = next;
    }
}

static void client_dealloc(PyObject *self)
{
    Client *c = (Client *)self;
    client_shut(c);
    free_events(c->head);
    free_acks(c->acks);
    pthread_mutex_destroy(&c->mu);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *client_close(PyObject *self, PyObject *unused)
{
    (void)unused;
    Client *c = (Client *)self;
    if (c->busy) {
        PyErr_SetString(PyExc_RuntimeError, "close(): another thread is inside this client");
        return NULL;
    }
    client_shut(c);
    Py_RETURN_NONE;
}

/* drain() -> None when nothing happened, else (errors, logs, stats, failures):
 * errors [(code, reason, fatal)], logs [(syslog level, facility, text)], stats [json text],
 * failures [(code, reason, topic, partition, offset)] (failed deliveries), each in order */
static PyObject *client_drain(PyObject *self, PyObject *unused)
{
    (void)unused;
    Client *c = (Client *)self;
    if (__atomic_load_n(&c->pending, __ATOMIC_ACQUIRE) == 0 &&
        __atomic_load_n(&c->dropped_logs, __ATOMIC_RELAXED) == 0)
        Py_RETURN_NONE;
    pthread_mutex_lock(&c->mu);
    ev *e = c->head;
    int dropped = c->dropped_logs;
    c->head = c->tail = NULL;
    c->pending = c->nlogs = c->dropped_logs = 0;
    pthread_mutex_unlock(&c->mu);
    PyObject *out[4] = {PyList_New(0), PyList_New(0), PyList_New(0), PyList_New(0)};
    PyObject *result = NULL;
    if (!out[0] || !out[1] || !out[2] || !out[3])
        goto done;
    for (ev *x = e; x != NULL; x = x->next) {
        const char *text = x->text ? x->text : "";
        PyObject *item = NULL;
        int list = x->kind == EV_ERROR ? 0 : x->kind == EV_LOG ? 1 : x->kind == EV_STATS ? 2 : 3;
        switch (x->kind) {
        case EV_ERROR:
            item = Py_BuildValue("(isO)", x->code, text, x->fatal ? Py_True : Py_False);
            break;
        case EV_LOG:
            item = Py_BuildValue("(iss)", x->level, x->topic ? x->topic : "", text);
            break;
        case EV_STATS:
            item = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
            break;
        default:
            item = Py_BuildValue("(issiL)", x->code, text, x->topic ? x->topic : "",
                                 (int)x->partition, (long long)x->offset);
        }
        if (item == NULL || PyList_Append(out[list], item) < 0) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
    }
    if (dropped) {
        PyObject *item = PyUnicode_FromFormat(
            "%d log lines dropped (more than %d between two calls)", dropped, MAX_LOGS);
        PyObject *t = item ? Py_BuildValue("(isN)", 4, "LOG", item) : NULL;
        if (t == NULL || PyList_Append(out[1], t) < 0) {
            Py_XDECREF(t);
            goto done;
        }
        Py_DECREF(t);
    }
    result = Py_BuildValue("(OOOO)", out[0], out[1], out[2], out[3]);
done:
    for (int i = 0; i < 4; i++)
        Py_XDECREF(out[i]);
    free_events(e);
    return result;
}

/* a list of (topic, partition[, offset]) as an rd_kafka_topic_partition_list_t */
static rd_kafka_topic_partition_list_t *tp_list(PyObject *seq, int with_offset)
{
    PyObject *fast = PySequence_Fast(seq, "a list of (topic, partition[, offset]) is required");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    rd_kafka_topic_partition_list_t *l = rdk.topic_partition_list_new((int)(n > 0 ? n : 1));
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *topic;
        int part;
        long long off = RD_KAFKA_OFFSET_INVALID;
        PyObject *t = PySequence_Fast_GET_ITEM(fast, i);
        int ok = with_offset ? PyArg_ParseTuple(t, "siL", &topic, &part, &off)
                             : PyArg_ParseTuple(t, "si", &topic, &part);
        if (!ok) {
            rdk.topic_partition_list_destroy(l);
            Py_DECREF(fast);
            return NULL;
        }
        rdk.topic_partition_list_add(l, topic, part)->offset = off;
    }
    Py_DECREF(fast);
    return l;
}

/* the first error of a partition list (destroyed here), raised; 0 when none */
static int tp_list_failed(rd_kafka_topic_partition_list_t *l, rd_kafka_resp_err_t err)
{
    for (int i = 0; err == RD_KAFKA_RESP_ERR_NO_ERROR && i < l->cnt; i++)
        err = l->elems[i].err;
    rdk.topic_partition_list_destroy(l);
    if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
        return 0;
    raise_err(err);
    return -1;
}

/* assign([(topic, partition, offset), ...]), incremental_assign(the same: added to the
 * assignment), pause([(topic, partition), ...]), commit([(topic, partition, offset), ...])
 * (synchronous, the GIL released) */
enum { TP_ASSIGN, TP_ADD, TP_PAUSE, TP_COMMIT };

static PyObject *tp_call(PyObject *self, PyObject *arg, int which)
{
    Client *c = (Client *)self;
    if (live(c) == NULL)
        return NULL;
    rd_kafka_topic_partition_list_t *l = tp_list(arg, which != TP_PAUSE);
    if (l == NULL)
        return NULL;
    rd_kafka_resp_err_t err;
    if (which == TP_ASSIGN) {
        err = rdk.assign(c->rk, l);
    } else if (which == TP_ADD) {
        rd_kafka_error_t *e = rdk.incremental_assign(c->rk, l);
        if (e != NULL) {
            rdk.topic_partition_list_destroy(l);
            return raise_error_t(e);
        }
        err = RD_KAFKA_RESP_ERR_NO_ERROR;
    } else if (which == TP_PAUSE) {
        err = rdk.pause_partitions(c->rk, l);
    } else {
        BUSY_BEGIN(c)
        err = rdk.commit(c->rk, l, 0);
        BUSY_END(c)
    }
    if (tp_list_failed(l, err) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *client_assign(PyObject *s, PyObject *a) { return tp_call(s, a, TP_ASSIGN); }
static PyObject *client_add(PyObject *s, PyObject *a) { return tp_call(s, a, TP_ADD); }
static PyObject *client_pause(PyObject *s, PyObject *a) { return tp_call(s, a, TP_PAUSE); }
static PyObject *client_commit(PyObject *s, PyObject *a) { return tp_call(s, a, TP_COMMIT); }

/* watermarks(topic, partition, timeout_ms, cached) -> (low, high) */
static PyObject *client_watermarks(PyObject *self, PyObject *args)
{
    Client *c = (Client *)self;
    const char *topic;
    int part, tmo, cached;
    if (!PyArg_ParseTuple(args, "siip", &topic, &part, &tmo, &cached) || live(c) == NULL)
        return NULL;
    int64_t lo = RD_KAFKA_OFFSET_INVALID, hi = RD_KAFKA_OFFSET_INVALID;
    rd_kafka_resp_err_t err;
    if (cached) {
        err = rdk.get_watermark_offsets(c->rk, topic, part, &lo, &hi);
    } else {
        BUSY_BEGIN(c)
        err = rdk.query_watermark_offsets(c->rk, topic, part, &lo, &hi, tmo);
        BUSY_END(c)
    }
    if (err)
        return raise_err(err);
    return Py_BuildValue("(LL)", (long long)lo, (long long)hi);
}

/* metadata(topic | None, timeout_ms) -> (cluster id | None, [(topic, error code,
 * [partition ids])]): of one topic (never auto-created), or of all */
static PyObject *client_metadata(PyObject *self, PyObject *args)
{
    Client *c = (Client *)self;
    PyObject *topic_obj;
    int tmo;
    if (!PyArg_ParseTuple(args, "Oi", &topic_obj, &tmo) || live(c) == NULL)
        return NULL;
    rd_kafka_topic_t *rkt = NULL;
    if (topic_obj != Py_None) {
        const char *topic = PyUnicode_AsUTF8(topic_obj);
        if (topic == NULL)
            return NULL;
        if ((rkt = rdk.topic_new(c->rk, topic, NULL)) == NULL)
            return raise_kafka(RD_KAFKA_RESP_ERR__INVALID_ARG, "invalid topic name", 0, 0, 0);
    }
    const struct rd_kafka_metadata *md = NULL;
    rd_kafka_resp_err_t err;
    char *cid = NULL;
    BUSY_BEGIN(c)
    err = rdk.metadata(c->rk, rkt == NULL, rkt, &md, tmo);
    if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
        cid = rdk.clusterid(c->rk, 0);
    if (rkt != NULL)
        rdk.topic_destroy(rkt);
    BUSY_END(c)
    if (err)
        return raise_err(err);
    PyObject *topics = PyList_New(0), *result = NULL;
    if (topics == NULL)
        goto done;
    for (int i = 0; i < md->topic_cnt; i++) {
        const rd_kafka_metadata_topic_t *t = &md->topics[i];
        PyObject *parts = PyList_New(t->partition_cnt);
        if (parts == NULL)
            goto done;
        for (int j = 0; j < t->partition_cnt; j++)
            PyList_SET_ITEM(parts, j, PyLong_FromLong(t->partitions[j].id));
        PyObject *item = Py_BuildValue("(siN)", t->topic, (int)t->err, parts);
        if (item == NULL || PyList_Append(topics, item) < 0) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
    }
    if (cid != NULL)
        result = Py_BuildValue("(sO)", cid, topics);
    else
        result = Py_BuildValue("(OO)", Py_None, topics);
done:
    Py_XDECREF(topics);
    if (cid != NULL)
        rdk.mem_free(c->rk, cid);
    rdk.metadata_destroy(md);
    return result;
}

/* poll(timeout_ms) -> events served */
static PyObject *client_poll(PyObject *self, PyObject *arg)
{
    Client *c = (Client *)self;
    int tmo = PyLong_AsLong(arg), n;
    if ((tmo == -1 && PyErr_Occurred()) || live(c) == NULL)
        return NULL;
    BUSY_BEGIN(c)
    n = rdk.poll(c->rk, tmo);
    BUSY_END(c)
    return PyLong_FromLong(n);
}

/* flush(timeout_ms) -> messages still in the queue */
static PyObject *client_flush(PyObject *self, PyObject *arg)
{
    Client *c = (Client *)self;
    int tmo = PyLong_AsLong(arg), n;
    if ((tmo == -1 && PyErr_Occurred()) || live(c) == NULL)
        return NULL;
    BUSY_BEGIN(c)
    rdk.flush(c->rk, tmo);
    n = rdk.outq_len(c->rk);
    BUSY_END(c)
    return PyLong_FromLong(n);
}

/* track_acks(on): count acknowledged deliveries per partition from now on (a producer whose
 * delivery.report.only.error is false: librdkafka then reports successes too) */
static PyObject *client_track_acks(PyObject *self, PyObject *on)
{
    Client *c = (Client *)self;
    int v = PyObject_IsTrue(on);
    if (v < 0)
        return NULL;
    __atomic_store_n(&c->track, v, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* acks() -> [(topic, partition, lowest offset, highest offset, count)] of the deliveries
 * acknowledged since the last call (call it after flush(): every report is then served) */
static PyObject *client_acks(PyObject *self, PyObject *unused)
{
    (void)unused;
    Client *c = (Client *)self;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    pthread_mutex_lock(&c->mu);
    for (ack_topic *t = c->acks; t != NULL; t = t->next) {
        for (int32_t p = 0; p < t->cap; p++) {
            ack_range *r = &t->parts[p];
            if (r->n == 0)
                continue;
            PyObject *item = Py_BuildValue("(siLLL)", t->name, (int)p, (long long)r->lo,
                                           (long long)r->hi, (long long)r->n);
            r->lo = INT64_MAX, r->hi = -1, r->n = 0;
            if (item == NULL || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                pthread_mutex_unlock(&c->mu);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(item);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return out;
}

static PyObject *client_outq_len(PyObject *self, PyObject *unused)
{
    (void)unused;
    Client *c = (Client *)self;
    if (live(c) == NULL)
        return NULL;
    return PyLong_FromLong(rdk.outq_len(c->rk));
}

/* the transactional calls: init_transactions(ms), begin_transaction(), commit_transaction(ms),
 * abort_transaction(ms); a failure raises KafkaIOError with the error's flags */
enum { TXN_INIT, TXN_BEGIN, TXN_COMMIT, TXN_ABORT };

static PyObject *txn_call(PyObject *self, PyObject *arg, int which)
{
    Client *c = (Client *)self;
    int tmo = 0;
    if (arg != NULL && (tmo = PyLong_AsLong(arg)) == -1 && PyErr_Occurred())
        return NULL;
    if (live(c) == NULL)
        return NULL;
    rd_kafka_error_t *e = NULL;
    BUSY_BEGIN(c)
    switch (which) {
    case TXN_INIT:
        e = rdk.init_transactions(c->rk, tmo);
        break;
    case TXN_BEGIN:
        e = rdk.begin_transaction(c->rk);
        break;
    case TXN_COMMIT:
        e = rdk.commit_transaction(c->rk, tmo);
        break;
    default:
        e = rdk.abort_transaction(c->rk, tmo);
    }
    BUSY_END(c)
    if (e != NULL)
        return raise_error_t(e);
    Py_RETURN_NONE;
}

static PyObject *client_init_txn(PyObject *s, PyObject *a) { return txn_call(s, a, TXN_INIT); }
static PyObject *client_begin_txn(PyObject *s, PyObject *a)
{
    (void)a;
    return txn_call(s, NULL, TXN_BEGIN);
}
static PyObject *client_commit_txn(PyObject *s, PyObject *a) { return txn_call(s, a, TXN_COMMIT); }
static PyObject *client_abort_txn(PyObject *s, PyObject *a) { return txn_call(s, a, TXN_ABORT); }
/* -- consume(want, timeout_ms): a batch into columns ----------------------------------------- */

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
    rd_kafka_message_t **ms;
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
    for (size_t i = 0;
         rdk.header_get_all(hs, i, &name, &val, &size) == RD_KAFKA_RESP_ERR_NO_ERROR; i++) {
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
        rd_kafka_message_t *m = w->ms[i];
        if (m->err != RD_KAFKA_RESP_ERR_NO_ERROR)
            continue;
        w->good++;
        w->kbytes += m->key != NULL ? (int64_t)m->key_len : 0;
        w->vbytes += m->payload != NULL ? (int64_t)m->len : 0;
        rd_kafka_headers_t *hs;
        if (rdk.message_headers(m, &hs) == RD_KAFKA_RESP_ERR_NO_ERROR) {
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
        rd_kafka_message_t *m = w->ms[i];
        if (m->err != RD_KAFKA_RESP_ERR_NO_ERROR) {
            event *e = &w->events[w->nevents++];
            e->partition = m->partition;
            e->offset = m->offset;
            e->code = m->err;
            if (m->rkt != NULL) {
                const char *t = rdk.topic_name(m->rkt);
                e->topic = dup_n(t, strlen(t));
            }
            if (m->err == RD_KAFKA_RESP_ERR__FATAL) {
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
        rd_kafka_timestamp_type_t tstype;
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
            if (rdk.message_headers(m, &hs) == RD_KAFKA_RESP_ERR_NO_ERROR)
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
/* consume(want, timeout_ms) -> (parts, offsets, timestamps, topic_names, topic_index,
 *   kb, ko, kn, vb, vo, vn, hb, ho, events). Buffers as Buffer objects; topic_index is None when
 *   every record is of topic_names[0]; hb/ho None when no record has headers; events a list of
 *   (topic | None, partition, offset, code, reason, fatal) for the error messages (end of
 *   partition ...), in batch order. Waits up to timeout_ms for the first message, in slices of
 *   CONSUME_SLICE_MS with a signal check between them. */
#define CONSUME_SLICE_MS 200

static PyObject *client_consume(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Client *c = (Client *)self;
    CHECK_NARGS("consume", 2);
    Py_ssize_t want = PyLong_AsSsize_t(args[0]);
    long tmo = PyLong_AsLong(args[1]);
    if ((want == -1 || tmo == -1) && PyErr_Occurred())
        return NULL;
    if (want < 1 || want > 1000000) {
        PyErr_SetString(PyExc_ValueError, "consume: want must be 1..1000000");
        return NULL;
    }
    if (live(c) == NULL)
        return NULL;
    if (c->q == NULL) {
        PyErr_SetString(PyExc_TypeError, "consume: not a consumer");
        return NULL;
    }
    work w;
    memset(&w, 0, sizeof w);
    w.rk = c->rk;
    if ((w.ms = malloc((size_t)want * sizeof *w.ms)) == NULL)
        return PyErr_NoMemory();
    long left = tmo < 0 ? 0 : tmo;
    int signalled = 0;
    for (;;) {
        int slice = left > CONSUME_SLICE_MS ? CONSUME_SLICE_MS : (int)left;
        BUSY_BEGIN(c)
        w.n = rdk.consume_batch_queue(c->q, slice, w.ms, (size_t)want);
        if (w.n > 0)
            read_batch(&w);
        BUSY_END(c)
        left -= slice;
        if (w.n != 0 || left <= 0)
            break;
        if ((signalled = PyErr_CheckSignals()) < 0)
            break;
    }

    PyObject *result = NULL, *names = NULL, *tindex = NULL, *events = NULL;
    PyObject *bufs[11] = {0};
    /* the batch is dropped with a signal handler's exception, as in confluent-kafka (a
     * restart resumes from the store) */
    if (signalled < 0 || PyErr_CheckSignals() < 0)
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

/* -- produce_columns(topic, partition, partitions, kbuf, kstarts, kends, knulls, vbuf, vstarts,
 *                    vends, vnulls, timestamps, headers) -> (produced, error code, error text)
 * headers: None, or (buf, starts, ends) of each record's header section in the store's
 * encoding (reput.record.encode_headers; empty: no headers), made into librdkafka headers.
 * Every record of the columns to ``topic``: at ``partition``, or partitions[i] when that is not
 * None (int32). Keys and values are buf[starts[i]:ends[i]] (int64), null where nulls[i]; copied
 * by librdkafka (RD_KAFKA_MSG_F_COPY), so the buffers may go once this returns. The GIL is
 * released for the whole block. A failed delivery is reported later, by drain(), as for any
 * record of this client. A full queue is served with rd_kafka_poll and the record retried (a
 * signal check every PRODUCE_SIGNAL_POLLS polls: Ctrl-C stops at that record); another error
 * stops at that record and is returned. */
#define PRODUCE_SIGNAL_POLLS 20

static PyObject *client_produce_columns(PyObject *self, PyObject *const *argv, Py_ssize_t nargs)
{
    Client *c = (Client *)self;
    CHECK_NARGS("produce_columns", 13);
    if (live(c) == NULL)
        return NULL;
    const char *topic = PyUnicode_AsUTF8(argv[0]);
    long part = PyLong_AsLong(argv[1]);
    if (topic == NULL || (part == -1 && PyErr_Occurred()))
        return NULL;
    Py_buffer kb = {0}, vb = {0}, hb = {0};
    Arr ha[2];
    memset(ha, 0, sizeof ha);
    int have_headers = argv[12] != Py_None;
    Arr a[7] = {0}; /* partitions, kstarts, kends, knulls, vstarts, vends, vnulls; ts last */
    Arr ts = {0};
    PyObject *result = NULL;
    int have_parts = argv[2] != Py_None;
    if (PyObject_GetBuffer(argv[3], &kb, PyBUF_SIMPLE) < 0)
        goto out;
    if (PyObject_GetBuffer(argv[7], &vb, PyBUF_SIMPLE) < 0)
        goto out;
    if ((have_parts && arr_get(argv[2], &a[0], 4, 0, "partitions") < 0) ||
        arr_get(argv[4], &a[1], 8, 0, "kstarts") < 0 ||
        arr_get(argv[5], &a[2], 8, 0, "kends") < 0 || arr_get(argv[6], &a[3], 1, 0, "knulls") < 0 ||
        arr_get(argv[8], &a[4], 8, 0, "vstarts") < 0 ||
        arr_get(argv[9], &a[5], 8, 0, "vends") < 0 ||
        arr_get(argv[10], &a[6], 1, 0, "vnulls") < 0 ||
        arr_get(argv[11], &ts, 8, 0, "timestamps") < 0)
        goto out;
    Py_ssize_t n = ts.n;
    if (have_headers) {
        if (!PyTuple_Check(argv[12]) || PyTuple_GET_SIZE(argv[12]) != 3) {
            PyErr_SetString(PyExc_TypeError, "produce: headers must be (buf, starts, ends)");
            goto out;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(argv[12], 0), &hb, PyBUF_SIMPLE) < 0 ||
            arr_get(PyTuple_GET_ITEM(argv[12], 1), &ha[0], 8, 0, "hstarts") < 0 ||
            arr_get(PyTuple_GET_ITEM(argv[12], 2), &ha[1], 8, 0, "hends") < 0)
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
    rd_kafka_topic_t *rkt = rdk.topic_new(c->rk, topic, NULL);
    if (rkt == NULL) {
        PyErr_Format(PyExc_ValueError, "produce: cannot use topic %s", topic);
        goto out;
    }
    int signalled = 0, polls = 0;
    BUSY_BEGIN(c)
    rd_kafka_vu_t vu[8];
    memset(vu, 0, sizeof vu);
    vu[0].vtype = RD_KAFKA_VTYPE_RKT;
    vu[0].u.rkt = rkt;
    vu[1].vtype = RD_KAFKA_VTYPE_PARTITION;
    vu[1].u.i32 = (int32_t)part;
    vu[2].vtype = RD_KAFKA_VTYPE_KEY;
    vu[3].vtype = RD_KAFKA_VTYPE_VALUE;
    vu[4].vtype = RD_KAFKA_VTYPE_TIMESTAMP;
    vu[5].vtype = RD_KAFKA_VTYPE_MSGFLAGS;
    vu[5].u.i = RD_KAFKA_MSG_F_COPY;
    int nvu0 = 6;
    const char *kp = kb.buf, *vp = vb.buf;
    for (; done < n && !signalled; done++) {
        Py_ssize_t i = done;
        if (have_parts)
            vu[1].u.i32 = (int32_t)ld_u32(&a[0], i);
        if (ld_u8(&a[3], i)) {
            vu[2].u.mem.ptr = NULL;
            vu[2].u.mem.size = 0;
        } else {
            int64_t k0 = ld_i64(&a[1], i), k1 = ld_i64(&a[2], i);
            vu[2].u.mem.ptr = (void *)(k1 > k0 ? kp + k0 : empty); /* empty, not null */
            vu[2].u.mem.size = (size_t)(k1 - k0);
        }
        if (ld_u8(&a[6], i)) {
            vu[3].u.mem.ptr = NULL;
            vu[3].u.mem.size = 0;
        } else {
            int64_t v0 = ld_i64(&a[4], i), v1 = ld_i64(&a[5], i);
            vu[3].u.mem.ptr = (void *)(v1 > v0 ? vp + v0 : empty);
            vu[3].u.mem.size = (size_t)(v1 - v0);
        }
        vu[4].u.i64 = ld_i64(&ts, i);
        rd_kafka_headers_t *hdrs = NULL;
        int nvu = nvu0;
        if (have_headers) {
            int64_t h0 = ld_i64(&ha[0], i), h1 = ld_i64(&ha[1], i);
            if (h1 > h0) {
                hdrs = make_headers((const uint8_t *)hb.buf + h0, h1 - h0);
                vu[nvu].vtype = RD_KAFKA_VTYPE_HEADERS;
                vu[nvu].u.headers = hdrs;
                nvu++;
            }
        }
        rd_kafka_error_t *err;
        while ((err = rdk.produceva(c->rk, vu, (size_t)nvu)) != NULL) {
            int ec = rdk.error_code(err);
            if (ec != RD_KAFKA_RESP_ERR__QUEUE_FULL) {
                code = ec;
                const char *t = rdk.error_string(err);
                snprintf(reason, sizeof reason, "%s", t ? t : "");
                rdk.error_destroy(err);
                break;
            }
            rdk.error_destroy(err);
            rdk.poll(c->rk, 10);
            if (++polls % PRODUCE_SIGNAL_POLLS == 0) {
                Py_BLOCK_THREADS
                signalled = PyErr_CheckSignals() < 0;
                Py_UNBLOCK_THREADS
                if (signalled)
                    break;
            }
        }
        if (code != 0 || signalled) {
            if (hdrs != NULL) /* never handed to librdkafka */
                rdk.headers_destroy(hdrs);
            break;
        }
    }
    rdk.topic_destroy(rkt);
    BUSY_END(c)
    if (signalled)
        goto out;
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

/* produce(topic, value, key, partition, timestamp, headers): one record, the GIL held (it only
 * queues). value/key bytes-like or None; headers None or a sequence of (name, bytes | str |
 * None). A full queue raises BufferError, as confluent-kafka's produce() does. */
static PyObject *client_produce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Client *c = (Client *)self;
    CHECK_NARGS("produce", 6);
    if (live(c) == NULL)
        return NULL;
    const char *topic = PyUnicode_AsUTF8(args[0]);
    long part = PyLong_AsLong(args[3]);
    long long ts = PyLong_AsLongLong(args[4]);
    if (topic == NULL || ((part == -1 || ts == -1) && PyErr_Occurred()))
        return NULL;
    Py_buffer vb = {0}, kb = {0};
    PyObject *result = NULL, *fast = NULL;
    rd_kafka_headers_t *hdrs = NULL;
    if ((args[1] != Py_None && PyObject_GetBuffer(args[1], &vb, PyBUF_SIMPLE) < 0) ||
        (args[2] != Py_None && PyObject_GetBuffer(args[2], &kb, PyBUF_SIMPLE) < 0))
        goto out;
    if (args[5] != Py_None) {
        if ((fast = PySequence_Fast(args[5], "produce: headers must be a list of (name, "
                                                 "value) pairs")) == NULL)
            goto out;
        Py_ssize_t nh = PySequence_Fast_GET_SIZE(fast);
        hdrs = rdk.headers_new((size_t)nh);
        for (Py_ssize_t i = 0; i < nh; i++) {
            PyObject *name, *val;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "UO", &name, &val))
                goto out;
            Py_ssize_t nl, vl = 0;
            const char *ns = PyUnicode_AsUTF8AndSize(name, &nl), *vs = NULL;
            if (ns == NULL)
                goto out;
            if (PyUnicode_Check(val)) {
                if ((vs = PyUnicode_AsUTF8AndSize(val, &vl)) == NULL)
                    goto out;
            } else if (PyBytes_Check(val)) {
                vs = PyBytes_AS_STRING(val);
                vl = PyBytes_GET_SIZE(val);
            } else if (val != Py_None) {
                PyErr_SetString(PyExc_TypeError, "produce: a header value must be bytes, str "
                                "or None");
                goto out;
            }
            rdk.header_add(hdrs, ns, nl, vs, vl);
        }
    }
    static const char empty[1] = {0};
    rd_kafka_vu_t vu[7];
    memset(vu, 0, sizeof vu);
    vu[0].vtype = RD_KAFKA_VTYPE_TOPIC;
    vu[0].u.cstr = topic;
    vu[1].vtype = RD_KAFKA_VTYPE_PARTITION;
    vu[1].u.i32 = (int32_t)part;
    vu[2].vtype = RD_KAFKA_VTYPE_VALUE;
    vu[2].u.mem.ptr = vb.obj == NULL ? NULL : vb.len ? vb.buf : (void *)empty;
    vu[2].u.mem.size = (size_t)vb.len;
    vu[3].vtype = RD_KAFKA_VTYPE_KEY;
    vu[3].u.mem.ptr = kb.obj == NULL ? NULL : kb.len ? kb.buf : (void *)empty;
    vu[3].u.mem.size = (size_t)kb.len;
    vu[4].vtype = RD_KAFKA_VTYPE_TIMESTAMP;
    vu[4].u.i64 = ts;
    vu[5].vtype = RD_KAFKA_VTYPE_MSGFLAGS;
    vu[5].u.i = RD_KAFKA_MSG_F_COPY;
    size_t nvu = 6;
    if (hdrs != NULL) {
        vu[6].vtype = RD_KAFKA_VTYPE_HEADERS;
        vu[6].u.headers = hdrs;
        nvu = 7;
    }
    rd_kafka_error_t *err = rdk.produceva(c->rk, vu, nvu);
    if (err != NULL) {
        if (rdk.error_code(err) == RD_KAFKA_RESP_ERR__QUEUE_FULL) {
            PyErr_SetString(PyExc_BufferError, rdk.error_string(err));
            rdk.error_destroy(err);
        } else {
            raise_error_t(err);
        }
        goto out;
    }
    hdrs = NULL; /* librdkafka's now */
    result = Py_NewRef(Py_None);
out:
    if (hdrs != NULL)
        rdk.headers_destroy(hdrs);
    Py_XDECREF(fast);
    if (vb.obj != NULL)
        PyBuffer_Release(&vb);
    if (kb.obj != NULL)
        PyBuffer_Release(&kb);
    return result;
}

static PyMethodDef client_methods[] = {
    {"consume", (PyCFunction)(void (*)(void))client_consume, METH_FASTCALL, NULL},
    {"produce_columns", (PyCFunction)(void (*)(void))client_produce_columns, METH_FASTCALL, NULL},
    {"produce", (PyCFunction)(void (*)(void))client_produce, METH_FASTCALL, NULL},
    {"drain", client_drain, METH_NOARGS, NULL},
    {"close", client_close, METH_NOARGS, NULL},
    {"assign", client_assign, METH_O, NULL},
    {"incremental_assign", client_add, METH_O, NULL},
    {"pause", client_pause, METH_O, NULL},
    {"commit", client_commit, METH_O, NULL},
    {"watermarks", client_watermarks, METH_VARARGS, NULL},
    {"metadata", client_metadata, METH_VARARGS, NULL},
    {"poll", client_poll, METH_O, NULL},
    {"flush", client_flush, METH_O, NULL},
    {"outq_len", client_outq_len, METH_NOARGS, NULL},
    {"track_acks", client_track_acks, METH_O, NULL},
    {"acks", client_acks, METH_NOARGS, NULL},
    {"init_transactions", client_init_txn, METH_O, NULL},
    {"begin_transaction", client_begin_txn, METH_NOARGS, NULL},
    {"commit_transaction", client_commit_txn, METH_O, NULL},
    {"abort_transaction", client_abort_txn, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ClientType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kcompact.connectors.framework._rdkafka.Client",
    .tp_basicsize = sizeof(Client),
    .tp_dealloc = client_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = client_new,
    .tp_methods = client_methods,
    .tp_doc = "Client(kind, conf, logs, stats): an rd_kafka_t of kcompact's own (see the top of "
              "connectors/framework/_rdkafka.c); native_kafka.py wraps it.",
};
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

static PyMethodDef methods[] = {
    {"load", (PyCFunction)load, METH_O, NULL},
    {"unpack", (PyCFunction)(void (*)(void))unpack, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kcompact.connectors.framework._rdkafka",
    "kcompact's Kafka client on librdkafka's public API, and the column passes (see the "
    "comment at the top of connectors/framework/_rdkafka.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rdkafka(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyType_Ready(&BufferType) < 0 || PyType_Ready(&ClientType) < 0 ||
        (KafkaIOError = PyErr_NewException("kcompact.connectors.framework._rdkafka.KafkaIOError",
                                           NULL, NULL)) == NULL ||
        PyModule_AddObjectRef(m, "Client", (PyObject *)&ClientType) < 0 ||
        PyModule_AddObjectRef(m, "KafkaIOError", KafkaIOError) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_VERSION", RD_KAFKA_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
