/* Optional accelerator for lmkv.keys.chunking: a list or tuple of Python ints as
 * little-endian uint32 bytes (the pure-Python fallback, array('I', tokens),
 * produces the same bytes; this only skips CPython's per-item argument
 * parsing), and the chain of SHA-256 prefix hashes of a prompt's chunks and
 * blocks (``block_chain``; the Python ``_block_chain`` gives the same bytes).
 * With the CPU's SHA extensions it is faster than hashlib's calls at any
 * length, and a warm request's hashing runs as one small piece of code where
 * each hashlib call costs microseconds with the CPU's caches holding other
 * data; the portable code is slower than OpenSSL's on long prompts, and lmkv
 * uses it only in tests (``use_sha_ni(False)``). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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


/* SHA-256 (FIPS 180-4), for block_chain. */
typedef struct {
    uint32_t h[8];
    unsigned char buf[64];
    size_t used;    /* bytes in buf */
    uint64_t total; /* bytes hashed */
} sha256_state;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void
sha256_init(sha256_state *s)
{
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, h0, sizeof h0);
    s->used = 0;
    s->total = 0;
}

static void
sha256_compress(uint32_t h[8], const unsigned char *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16
               | (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g))
                      + K256[i] + w[i];
        uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += k;
}

static void
compress_blocks(uint32_t h[8], const unsigned char *p, size_t blocks)
{
    for (; blocks; blocks--, p += 64)
        sha256_compress(h, p);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
/* The same with the CPU's SHA extensions (four rounds an instruction pair):
 * the state is kept as ABEF and CDGH, as sha256rnds2 takes it. */
__attribute__((target("sha,sse4.1,ssse3"))) static void
compress_blocks_ni(uint32_t h[8], const unsigned char *p, size_t blocks)
{
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)&h[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&h[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (; blocks; blocks--, p += 64) {
        __m128i abef0 = abef, cdgh0 = cdgh, w[4];
        for (int r = 0; r < 16; r++) { /* four rounds each */
            __m128i m;
            if (r < 4) {
                m = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * r)), swap);
            } else {
                m = _mm_sha256msg1_epu32(w[r & 3], w[(r + 1) & 3]);
                m = _mm_add_epi32(m, _mm_alignr_epi8(w[(r + 3) & 3], w[(r + 2) & 3], 4));
                m = _mm_sha256msg2_epu32(m, w[(r + 3) & 3]);
            }
            w[r & 3] = m;
            __m128i wk = _mm_add_epi32(m, _mm_loadu_si128((const __m128i *)&K256[4 * r]));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
        }
        abef = _mm_add_epi32(abef, abef0);
        cdgh = _mm_add_epi32(cdgh, cdgh0);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(dchg, feba, 8));
}

static int
has_sha_ni(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSSE3) || !(c & bit_SSE4_1))
        return 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 29)); /* SHA */
}
#endif

static void (*compress)(uint32_t h[8], const unsigned char *p, size_t blocks) = compress_blocks;

static void
sha256_update(sha256_state *s, const unsigned char *p, size_t n)
{
    s->total += n;
    if (s->used) {
        size_t take = 64 - s->used < n ? 64 - s->used : n;
        memcpy(s->buf + s->used, p, take);
        s->used += take;
        p += take;
        n -= take;
        if (s->used < 64)
            return;
        compress(s->h, s->buf, 1);
        s->used = 0;
    }
    if (n >= 64) {
        compress(s->h, p, n / 64);
        p += n / 64 * 64;
        n %= 64;
    }
    memcpy(s->buf, p, n);
    s->used = n;
}

/* The digest of what ``s`` has hashed (``s`` itself is left as it was). */
static void
sha256_digest(const sha256_state *s, unsigned char out[32])
{
    sha256_state t = *s;
    uint64_t bits = t.total * 8;
    unsigned char pad[72] = {0x80};
    size_t padlen = (t.used < 56 ? 56 : 120) - t.used;
    for (int i = 0; i < 8; i++)
        pad[padlen + i] = (unsigned char)(bits >> (56 - 8 * i));
    sha256_update(&t, pad, padlen + 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(t.h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(t.h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(t.h[i] >> 8);
        out[4 * i + 3] = (unsigned char)t.h[i];
    }
}

/* block_chain(data, chunk_size, block_size, partial_flag, first_flag, tag)
 *   -> (chunk hashes, per chunk its leading blocks' hashes)
 * As chunking._block_chain: ``data`` is block-aligned tokens as uint32 LE
 * bytes; each chunk's hash chains from the one before (b"" for the first), a
 * block's hash inside a chunk is the running hash plus a trailer ("<IBB":
 * tokens so far, flags, tag), a whole chunk's is the running hash, and a
 * shorter last chunk's is its last block's. */
static PyObject *
block_chain(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t chunk_size, block_size;
    int partial_flag, first_flag, tag;
    if (!PyArg_ParseTuple(args, "y*nniii", &view, &chunk_size, &block_size, &partial_flag,
                          &first_flag, &tag))
        return NULL;
    PyObject *hashes = NULL, *partials = NULL, *result = NULL;
    if (chunk_size <= 0 || block_size <= 0 || chunk_size % block_size || view.len % 4
        || (view.len / 4) % block_size) {
        PyErr_SetString(PyExc_ValueError, "block_chain: block-aligned tokens, whole blocks "
                                          "to a chunk");
        goto done;
    }
    hashes = PyList_New(0);
    partials = PyList_New(0);
    if (hashes == NULL || partials == NULL)
        goto done;
    const unsigned char *data = view.buf;
    Py_ssize_t n = view.len / 4;
    unsigned char prev[32];
    int have_prev = 0;
    for (Py_ssize_t start = 0; start < n; start += chunk_size) {
        Py_ssize_t length = chunk_size < n - start ? chunk_size : n - start;
        Py_ssize_t blocks = length / block_size;
        int whole = length == chunk_size;
        unsigned char flags = (unsigned char)(partial_flag | (have_prev ? 0 : first_flag));
        sha256_state running;
        sha256_init(&running);
        if (have_prev)
            sha256_update(&running, prev, 32);
        PyObject *hs = PyList_New(0);
        if (hs == NULL || PyList_Append(partials, hs) < 0) {
            Py_XDECREF(hs);
            goto done;
        }
        Py_DECREF(hs); /* (held by partials) */
        unsigned char last[32];
        for (Py_ssize_t j = 1; j <= blocks; j++) {
            sha256_update(&running, data + (start + (j - 1) * block_size) * 4,
                          (size_t)block_size * 4);
            if (j < blocks || !whole) {
                sha256_state h = running;
                uint32_t done_tokens = (uint32_t)(j * block_size);
                unsigned char trailer[6] = {
                    (unsigned char)done_tokens, (unsigned char)(done_tokens >> 8),
                    (unsigned char)(done_tokens >> 16), (unsigned char)(done_tokens >> 24),
                    flags, (unsigned char)tag};
                sha256_update(&h, trailer, sizeof trailer);
                sha256_digest(&h, last);
                PyObject *digest = PyBytes_FromStringAndSize((const char *)last, 32);
                if (digest == NULL || PyList_Append(hs, digest) < 0) {
                    Py_XDECREF(digest);
                    goto done;
                }
                Py_DECREF(digest);
            }
        }
        if (whole)
            sha256_digest(&running, prev);
        else
            memcpy(prev, last, 32);
        have_prev = 1;
        PyObject *digest = PyBytes_FromStringAndSize((const char *)prev, 32);
        if (digest == NULL || PyList_Append(hashes, digest) < 0) {
            Py_XDECREF(digest);
            goto done;
        }
        Py_DECREF(digest);
    }
    result = PyTuple_Pack(2, hashes, partials);
done:
    Py_XDECREF(hashes);
    Py_XDECREF(partials);
    PyBuffer_Release(&view);
    return result;
}

/* use_sha_ni(on) -> whether block_chain now hashes with the CPU's SHA extensions
 * (on where the CPU has them; off: the portable code), for tests of both */
static PyObject *
use_sha_ni(PyObject *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    compress = compress_blocks;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (on && has_sha_ni())
        compress = compress_blocks_ni;
#endif
    return PyBool_FromLong(compress != compress_blocks);
}

static PyMethodDef methods[] = {
    {"uint32_le", uint32_le, METH_O, "A list or tuple of ints as little-endian uint32 bytes."},
    {"int64_to_uint32_le", int64_to_uint32_le, METH_O,
     "A contiguous buffer of 64-bit ints as little-endian uint32 bytes."},
    {"block_chain", block_chain, METH_VARARGS,
     "Chunk and block prefix hashes of block-aligned tokens (see chunking._block_chain)."},
    {"use_sha_ni", use_sha_ni, METH_O,
     "Hash with the CPU's SHA extensions where it has them (True) or portably (False)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "lmkv._ext._tokens", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__tokens(void)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (has_sha_ni())
        compress = compress_blocks_ni;
#endif
    return PyModule_Create(&module);
}
