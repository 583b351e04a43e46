/* 1-d arrays through the buffer protocol, shared by the C modules (reput/_native.c,
 * connectors/framework/_rdkafka.c): views possibly strided, loads through memcpy (unaligned is
 * fine). */
#ifndef KCOMPACT_ARR_H
#define KCOMPACT_ARR_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_buffer v;
    char *p;
    Py_ssize_t stride;
    Py_ssize_t n;
} Arr;

static int arr_get(PyObject *o, Arr *a, Py_ssize_t itemsize, int writable, const char *name)
{
    if (PyObject_GetBuffer(o, &a->v, PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (a->v.ndim != 1 || a->v.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: a 1-d array of %zd-byte items is required "
                     "(got %d-d, %zd-byte items)", name, itemsize, a->v.ndim, a->v.itemsize);
        PyBuffer_Release(&a->v);
        a->v.obj = NULL;
        return -1;
    }
    a->p = (char *)a->v.buf;
    a->stride = a->v.strides ? a->v.strides[0] : itemsize;
    a->n = a->v.shape ? a->v.shape[0] : a->v.len / itemsize;
    return 0;
}

static void arr_release(Arr *a, int n)
{
    for (int i = 0; i < n; i++)
        if (a[i].v.obj != NULL)
            PyBuffer_Release(&a[i].v);
}

static inline int64_t ld_i64(const Arr *a, int64_t i) { int64_t x; memcpy(&x, a->p + i * a->stride, 8); return x; }
static inline uint64_t ld_u64(const Arr *a, int64_t i) { uint64_t x; memcpy(&x, a->p + i * a->stride, 8); return x; }
static inline uint32_t ld_u32(const Arr *a, int64_t i) { uint32_t x; memcpy(&x, a->p + i * a->stride, 4); return x; }
static inline uint16_t ld_u16(const Arr *a, int64_t i) { uint16_t x; memcpy(&x, a->p + i * a->stride, 2); return x; }
static inline uint8_t ld_u8(const Arr *a, int64_t i) { return (uint8_t)a->p[i * a->stride]; }

/* Python ints args[which[i]] as int64 into out[i]; -1 with an exception set on failure (a
 * value outside int64 is a ValueError naming the argument, not an OverflowError) */
static inline int args_i64(PyObject *const *args, const int *which, int n, int64_t *out)
{
    for (int i = 0; i < n; i++) {
        int overflow = 0;
        out[i] = PyLong_AsLongLongAndOverflow(args[which[i]], &overflow);
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
        if (overflow) {
            PyErr_Format(PyExc_ValueError, "argument %d is outside the 64-bit integer range",
                         which[i]);
            return -1;
        }
    }
    return 0;
}

/* a ValueError naming the function, then return NULL after releasing the arrays */
#define ARG_ERROR(arrs, count, ...)                                                          \
    do {                                                                                     \
        arr_release((arrs), (count));                                                        \
        PyErr_Format(PyExc_ValueError, __VA_ARGS__);                                         \
        return NULL;                                                                         \
    } while (0)

#define CHECK_NARGS(name, want)                                                              \
    if (nargs != (want)) {                                                                   \
        PyErr_Format(PyExc_TypeError, name "() takes %d arguments (%zd given)", (want), nargs); \
        return NULL;                                                                         \
    }

#endif
