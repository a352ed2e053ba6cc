/* Optional accelerator for lmkv.keys.chunking: a list or tuple of Python ints as
 * little-endian uint32 bytes. The pure-Python fallback (array('I', tokens))
 * produces the same bytes; this only skips CPython's per-item argument parsing. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *
uint32_le(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "tokens must be a list or tuple");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    unsigned char *buf = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_Check(item)) {
            PyErr_Format(PyExc_TypeError, "token %zd is a %.100s, not an int", i,
                         Py_TYPE(item)->tp_name);
            goto fail;
        }
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (value == -1 && PyErr_Occurred())
            goto fail;
        if (overflow != 0 || value < 0 || value > 0xFFFFFFFFLL) {
            PyErr_Format(PyExc_OverflowError, "token %zd is outside [0, 2**32)", i);
            goto fail;
        }
        uint32_t v = (uint32_t)value;
        buf[4 * i] = (unsigned char)(v & 0xFF);
        buf[4 * i + 1] = (unsigned char)((v >> 8) & 0xFF);
        buf[4 * i + 2] = (unsigned char)((v >> 16) & 0xFF);
        buf[4 * i + 3] = (unsigned char)(v >> 24);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* A C-contiguous buffer of 64-bit integers (signed "q"/"l" or unsigned "Q"/"L")
 * as little-endian uint32 bytes, checking the range in the same pass. */
static PyObject *
int64_to_uint32_le(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    const char *fmt = view.format ? view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@')
        fmt++;
    int is_signed = (*fmt == 'q' || *fmt == 'l');
    if (view.itemsize != 8 || !(is_signed || *fmt == 'Q' || *fmt == 'L')) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "expected a buffer of 64-bit integers");
        return NULL;
    }
    Py_ssize_t n = view.len / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned char *buf = (unsigned char *)PyBytes_AS_STRING(out);
    const uint64_t *src = (const uint64_t *)view.buf;
    uint64_t bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = src[i];  /* a negative signed value is >= 2**63 here */
        bad |= v >> 32;
        buf[4 * i] = (unsigned char)(v & 0xFF);
        buf[4 * i + 1] = (unsigned char)((v >> 8) & 0xFF);
        buf[4 * i + 2] = (unsigned char)((v >> 16) & 0xFF);
        buf[4 * i + 3] = (unsigned char)((v >> 24) & 0xFF);
    }
    Py_END_ALLOW_THREADS
    (void)is_signed;
    PyBuffer_Release(&view);
    if (bad) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_OverflowError, "token ids must be in [0, 2**32)");
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"uint32_le", uint32_le, METH_O, "A list or tuple of ints as little-endian uint32 bytes."},
    {"int64_to_uint32_le", int64_to_uint32_le, METH_O,
     "A contiguous buffer of 64-bit ints as little-endian uint32 bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "lmkv._ext._tokens", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__tokens(void)
{
    return PyModule_Create(&module);
}
