/* Copies between paged KV caches in host memory and chunk buffers, as plain
 * memcpy runs split over threads (lmkv_kernels.host_impl is the Python side).
 *
 * The caches are one per layer; a token's row (``row`` bytes: one head's K and
 * V of one token in the cpu layout) lives in layer ``l``'s cache at
 *   block_ids[t / block_size] * cache_block + head * cache_head + (t % block_size) * cache_token
 * and in the chunk buffer (holding the request's tokens from ``start``) at
 *   l * chunk_layer + head * chunk_head + (t - start) * chunk_token.
 * Tokens ``[first, stop)`` are copied, one memcpy per layer, head and block
 * (a run of tokens in one block), or per token where a side's tokens are not
 * back to back.
 *
 * Every address is checked against the extents the caller gives before any byte
 * moves: a block id out of range, or a run past a cache's or the buffer's end,
 * raises ValueError and copies nothing. The GIL is released while bytes move;
 * the caller keeps the tensors alive for the call. Large copies are split over
 * up to ``threads`` threads (the caller's among them), taking batches of runs
 * as they come; helper threads run on ``cpus`` where given (the engine's CPUs:
 * a thread inherits its creator's affinity, which an engine may have narrowed to
 * one CPU). On the main thread the threads are its OpenMP team instead, as
 * many as it has, where the engine put them (``use_openmp``, below). */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define STREAMING 1
#endif
#ifdef LMKV_XXHASH
#include <xxhash.h>
#ifdef LMKV_XXHASH_DISPATCH /* the library's choice of the CPU's widest vectors */
#include <xxh_x86dispatch.h>
#define HASH_UPDATE XXH3_64bits_update_dispatch
#else
#define HASH_UPDATE XXH3_64bits_update
#endif
#endif

#define MAX_THREADS 16
/* Below this many bytes a copy runs on the calling thread alone (waking a
 * helper costs about what it would save). */
#define SPLIT_BYTES (1 << 20)

typedef struct {
    int64_t block;     /* the cache block */
    Py_ssize_t offset; /* first token's offset in the block */
    Py_ssize_t count;  /* tokens */
    Py_ssize_t t;      /* first token (the request's numbering) */
} piece;

typedef struct {
    char *base;
    Py_ssize_t layer, head, token; /* strides, bytes */
    Py_ssize_t start;              /* the request's token at the buffer's first row */
    piece *pieces;                 /* into the plan's array */
    Py_ssize_t npieces;
    Py_ssize_t items; /* first item of this chunk (items: chunk, layer, head, piece) */
    Py_ssize_t nbytes, first, stop; /* as given: its extent, the tokens to copy */
    Py_ssize_t tokens;              /* checked copies: the tokens the buffer holds */
    uint64_t checksum;              /* checked copies: the xxh3-64 its bytes must have */
    int verdict;                    /* checked copies: 1 matched, 0 not, -1 no memory */
} chunk;

typedef struct {
    int into_caches;
    char **caches;
    Py_ssize_t layers, heads, row;
    Py_ssize_t cache_block, cache_head, cache_token;
    chunk *chunks;
    Py_ssize_t nchunks;
} plan;

/* The threads take the items (chunk, layer, head, piece) in batches of BATCH
 * from a shared counter: a thread that joins late (its CPU busy with another
 * thread) takes what is left, and the copy waits for no thread but those
 * holding a batch. */
#define BATCH 4

typedef struct {
    const plan *plan;
    int checked; /* items are whole chunks, each copied and checked (copy_checked) */
    Py_ssize_t items;
    _Atomic Py_ssize_t next; /* the first item no thread has taken */
    const cpu_set_t *cpus;
    int wanted; /* helpers that may join */
    int joined; /* helpers that joined (under the pool's lock) */
    int active; /* helpers copying (under the pool's lock) */
} job;

/* A copy whose stores bypass the CPU's caches (x86: non-temporal stores): a
 * cached store first reads the destination's line from memory, a third more
 * traffic on a copy that is bound by memory's bandwidth, and the KV copied
 * is far larger than the caches anyway. memcpy does the same for copies
 * larger than about the last-level cache; these are runs of a few KiB each. */
static void
copy_run(char *dst, const char *src, size_t n)
{
#ifdef STREAMING
    if (n >= 4096) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* Items [begin, end) of the plan. */
static void
copy_items(const plan *p, Py_ssize_t begin, Py_ssize_t end)
{
    Py_ssize_t low = 0, high = p->nchunks - 1; /* the last chunk starting at or before begin */
    while (low < high) {
        Py_ssize_t mid = (low + high + 1) / 2;
        if (p->chunks[mid].items <= begin)
            low = mid;
        else
            high = mid - 1;
    }
    for (Py_ssize_t c = low; c < p->nchunks; c++) {
        const chunk *k = &p->chunks[c];
        Py_ssize_t per_layer = p->heads * k->npieces;
        Py_ssize_t first = k->items, last = k->items + p->layers * per_layer;
        if (first >= end)
            break;
        if (last <= begin)
            continue;
        Py_ssize_t from = begin > first ? begin : first;
        Py_ssize_t to = end < last ? end : last;
        for (Py_ssize_t item = from - first; item < to - first; item++) {
            Py_ssize_t layer = item / per_layer;
            Py_ssize_t rest = item % per_layer;
            Py_ssize_t head = rest / k->npieces;
            const piece *q = &k->pieces[rest % k->npieces];
            char *in_cache = p->caches[layer] + q->block * p->cache_block
                             + head * p->cache_head + q->offset * p->cache_token;
            char *in_chunk = k->base + layer * k->layer + head * k->head
                             + (q->t - k->start) * k->token;
            char *dst = p->into_caches ? in_cache : in_chunk;
            char *src = p->into_caches ? in_chunk : in_cache;
            Py_ssize_t dst_step = p->into_caches ? p->cache_token : k->token;
            Py_ssize_t src_step = p->into_caches ? k->token : p->cache_token;
            if (dst_step == p->row && src_step == p->row) {
                copy_run(dst, src, (size_t)(q->count * p->row));
            } else {
                for (Py_ssize_t i = 0; i < q->count; i++)
                    copy_run(dst + i * dst_step, src + i * src_step, (size_t)p->row);
            }
        }
    }
}

#ifdef LMKV_XXHASH
/* Checked copies: the bytes of a chunk buffer are read once, a few KiB at a
 * time, into a buffer of the thread's own that stays in its first-level cache;
 * there they are folded into the checksum and copied out into the caches. The
 * bytes copied are the bytes checked, whatever happens to the source meanwhile
 * (a file mapped as the source changed under the reader). */
#define BOUNCE (16 << 10)

/* The next ``n`` rows at ``bounce`` into layer ``layer``'s cache, head
 * ``head``, from the request's token ``t`` on, in piece ``q``. */
static void
put_rows(const plan *p, const piece *q, Py_ssize_t layer, Py_ssize_t head, Py_ssize_t t,
         const char *bounce, Py_ssize_t n)
{
    char *dst = p->caches[layer] + q->block * p->cache_block + head * p->cache_head
                + (q->offset + (t - q->t)) * p->cache_token;
    if (p->cache_token == p->row) {
        copy_run(dst, bounce, (size_t)(n * p->row));
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        copy_run(dst + i * p->cache_token, bounce + i * p->row, (size_t)p->row);
}

/* Chunk ``k``'s bytes, in their order, checked against its checksum; its
 * tokens [first, stop) copied into the caches on the way. The buffer is whole
 * and back to back (checked by the caller): layer by layer, head by head, its
 * ``tokens`` rows of ``row`` bytes. */
static void
check_chunk(const plan *p, chunk *k)
{
    _Alignas(64) char bounce[BOUNCE];
    XXH3_state_t *state = XXH3_createState();
    if (state == NULL || XXH3_64bits_reset(state) != XXH_OK) {
        XXH3_freeState(state);
        k->verdict = -1;
        return;
    }
    Py_ssize_t cap = BOUNCE / p->row; /* (>= 1: the caller checked the row's size) */
    Py_ssize_t end = k->start + k->tokens;
    for (Py_ssize_t layer = 0; layer < p->layers; layer++) {
        for (Py_ssize_t head = 0; head < p->heads; head++) {
            const char *rows = k->base + layer * k->layer + head * k->head;
            Py_ssize_t next = 0; /* the first piece that may hold token t */
            for (Py_ssize_t t = k->start; t < end;) {
                const piece *q = NULL;
                Py_ssize_t n;
                if (t < k->first) {
                    n = k->first - t;
                } else if (t >= k->stop) {
                    n = end - t;
                } else {
                    while (k->pieces[next].t + k->pieces[next].count <= t)
                        next++;
                    q = &k->pieces[next];
                    n = q->t + q->count - t;
                }
                if (n > cap)
                    n = cap;
                size_t bytes = (size_t)(n * p->row);
                memcpy(bounce, rows + (t - k->start) * p->row, bytes);
                (void)HASH_UPDATE(state, bounce, bytes);
                if (q != NULL)
                    put_rows(p, q, layer, head, t, bounce, n);
                t += n;
            }
        }
    }
    k->verdict = XXH3_64bits_digest(state) == (XXH64_hash_t)k->checksum;
    XXH3_freeState(state);
}
#endif

static void
run(job *j)
{
    for (;;) {
        Py_ssize_t begin = atomic_fetch_add(&j->next, j->checked ? 1 : BATCH);
        if (begin >= j->items)
            break;
#ifdef LMKV_XXHASH
        if (j->checked) {
            check_chunk(j->plan, &j->plan->chunks[begin]);
            continue;
        }
#endif
        copy_items(j->plan, begin, begin + BATCH < j->items ? begin + BATCH : j->items);
    }
#ifdef STREAMING
    _mm_sfence(); /* this thread's streamed stores visible before the copy returns */
#endif
}

/* The helper threads: started on the first copy that wants them and kept,
 * asleep between copies. A copy publishes its job and wakes them; each helper
 * joins (up to the job's wants) while the job is open, takes batches, and
 * says when it is done. The caller closes the job when it runs out of items
 * and waits only for the helpers that joined: one that wakes after that finds
 * no job and sleeps again. One copy uses the pool at a time; another, in the
 * meantime, copies on its own thread. A forked child starts a pool of its own
 * (the parent's threads are not in it: pool_after_fork_in_child). */
/* The OpenMP runtime torch runs its parallel loops on (its ``GOMP_parallel``,
 * from the process's global scope once torch is loaded: the libgomp torch
 * ships, or an Intel runtime preloaded in its place, which torch's own calls
 * bind to then as well), with that library's ``omp_get_max_threads``, when
 * ``use_openmp`` found both. A copy split over threads on the thread that runs
 * the engine's forward (the main thread) runs on that thread's OpenMP team:
 * the threads torch's own copies and the forward use, already on the engine's
 * cores and still awake after the last parallel loop; lmkv's helpers beside
 * them would wait for those cores while they spin. As many threads as the
 * team has (the thread's OpenMP setting, torch's thread count: a team resized
 * per call would make the runtime start and stop threads). Copies on other
 * threads (lmkv's loaders and savers), where the team has one thread (a
 * forked child as torch's fork-safe children set it), and in any child
 * forked after ``use_openmp`` (an OpenMP team does not survive a fork: the
 * child's first parallel region would wait forever for threads that are not
 * there) use the helpers. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_max_threads_fn)(void);
static gomp_parallel_fn gomp_parallel; /* (atomic loads and stores) */
static omp_max_threads_fn omp_max_threads;
static pthread_t team_thread;

/* How the last copy ran, for tests: alone, on lmkv's helpers, on the team. */
enum { RAN_ALONE = 1, RAN_HELPERS, RAN_TEAM };
static int last_ran;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t pool_user = PTHREAD_MUTEX_INITIALIZER; /* the copy using the pool */
static job *pool_job;                 /* the open job, or NULL */
static unsigned long pool_generation; /* jobs published so far */
static int pool_threads;              /* helpers started */

static void *
helper(void *arg)
{
    (void)arg;
    unsigned long seen = 0;
    cpu_set_t applied;
    int have_applied = 0;
    pthread_mutex_lock(&pool_lock);
    for (;;) {
        while (pool_job == NULL || pool_generation == seen)
            pthread_cond_wait(&pool_wake, &pool_lock);
        seen = pool_generation;
        job *j = pool_job;
        if (j->joined >= j->wanted)
            continue;
        j->joined++;
        j->active++;
        pthread_mutex_unlock(&pool_lock);
        if (j->cpus != NULL && (!have_applied || !CPU_EQUAL(&applied, j->cpus))) {
            applied = *j->cpus;
            have_applied = 1;
            (void)pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &applied);
        }
        run(j);
        pthread_mutex_lock(&pool_lock);
        if (--j->active == 0)
            pthread_cond_broadcast(&pool_done);
    }
    return NULL;
}

/* In a forked child (only the forking thread is there): a pool of its own,
 * with locks no thread of the parent may be holding. */
static void
pool_after_fork_in_child(void)
{
    pthread_mutex_init(&pool_lock, NULL);
    pthread_mutex_init(&pool_user, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pthread_cond_init(&pool_done, NULL);
    pool_job = NULL;
    pool_threads = 0;
    __atomic_store_n(&gomp_parallel, NULL, __ATOMIC_RELEASE); /* the helpers, from now on */
}

/* Copy ``work`` with up to ``helpers`` pool threads beside the calling one
 * (called without the GIL). */
static void
run_pooled(job *work, int helpers)
{
    if (helpers <= 0 || pthread_mutex_trylock(&pool_user) != 0) {
        __atomic_store_n(&last_ran, RAN_ALONE, __ATOMIC_RELAXED);
        run(work); /* another copy has the pool: this one copies alone */
        return;
    }
    __atomic_store_n(&last_ran, RAN_HELPERS, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool_lock);
    while (pool_threads < helpers) {
        pthread_t tid;
        pthread_attr_t attr;
        sigset_t all, before;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* helpers take no asynchronous signal (the process's are the interpreter's
         * to handle); faults stay deliverable: lmkv's SIGBUS guard needs them */
        sigfillset(&all);
        sigdelset(&all, SIGBUS);
        sigdelset(&all, SIGSEGV);
        sigdelset(&all, SIGFPE);
        sigdelset(&all, SIGILL);
        pthread_sigmask(SIG_SETMASK, &all, &before);
        int failed = pthread_create(&tid, &attr, helper, NULL);
        pthread_sigmask(SIG_SETMASK, &before, NULL);
        pthread_attr_destroy(&attr);
        if (failed)
            break; /* fewer helpers, or none: the caller copies what is left */
        pool_threads++;
    }
    work->wanted = helpers;
    pool_job = work;
    pool_generation++;
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);

    run(work);

    pthread_mutex_lock(&pool_lock);
    pool_job = NULL; /* closed: no helper joins it from now on */
    while (work->active > 0)
        pthread_cond_wait(&pool_done, &pool_lock);
    pthread_mutex_unlock(&pool_lock);
    pthread_mutex_unlock(&pool_user);
}

static void
run_team_member(void *work)
{
    run((job *)work);
}

/* Copy ``work`` with ``threads`` threads in all (called without the GIL); on
 * the team, as many as it has. */
static void
run_threads(job *work, int threads)
{
    gomp_parallel_fn parallel = __atomic_load_n(&gomp_parallel, __ATOMIC_ACQUIRE);
    if (threads > 1 && parallel != NULL && pthread_equal(pthread_self(), team_thread)
        && omp_max_threads() > 1) {
        __atomic_store_n(&last_ran, RAN_TEAM, __ATOMIC_RELAXED);
        parallel(run_team_member, work, 0, 0);
        return;
    }
    run_pooled(work, threads - 1);
}

/* use_openmp(on, thread) -> whether the split copies called on ``thread`` (a
 * pthread id, as threading's ident) now run on its OpenMP team */
static PyObject *
use_openmp(PyObject *self, PyObject *args)
{
    int on;
    unsigned long thread;
    if (!PyArg_ParseTuple(args, "pk", &on, &thread))
        return NULL;
    __atomic_store_n(&gomp_parallel, NULL, __ATOMIC_RELEASE);
    if (!on)
        Py_RETURN_FALSE;
    gomp_parallel_fn parallel = (gomp_parallel_fn)dlsym(RTLD_DEFAULT, "GOMP_parallel");
    omp_max_threads_fn max_threads = NULL;
    Dl_info info;
    if (parallel != NULL && dladdr((void *)parallel, &info) && info.dli_fname != NULL) {
        /* the same library's: its team is the one asked about */
        void *lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
        if (lib != NULL) {
            max_threads = (omp_max_threads_fn)dlsym(lib, "omp_get_max_threads");
            dlclose(lib); /* (loaded still: torch holds it) */
        }
    }
    if (max_threads == NULL)
        Py_RETURN_FALSE;
    omp_max_threads = max_threads;
    team_thread = (pthread_t)thread;
    __atomic_store_n(&gomp_parallel, parallel, __ATOMIC_RELEASE);
    Py_RETURN_TRUE;
}

/* last_ran() -> how the last copy split over threads or not ran: "alone",
 * "helpers" or "team" (None before any); for tests */
static PyObject *
last_ran_of(PyObject *self, PyObject *unused)
{
    static const char *names[] = {NULL, "alone", "helpers", "team"};
    int ran = __atomic_load_n(&last_ran, __ATOMIC_RELAXED);
    if (ran < RAN_ALONE || ran > RAN_TEAM)
        Py_RETURN_NONE;
    return PyUnicode_FromString(names[ran]);
}

static int
item_size(PyObject *seq, Py_ssize_t i, Py_ssize_t *out)
{
    *out = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* The call whose input is checked, for its messages: copy_blocks or copy_checked
 * (set under the GIL, which every check runs under). */
static const char *checking = "copy_blocks";

static PyObject *
bad(const char *message)
{
    PyErr_Format(PyExc_ValueError, "%s: %s", checking, message);
    return NULL;
}

/* a * b + c; -1 where any is negative or the result overflows. */
static Py_ssize_t
mul_add(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c)
{
    Py_ssize_t r;
    if (a < 0 || b < 0 || c < 0 || __builtin_mul_overflow(a, b, &r)
        || __builtin_add_overflow(r, c, &r))
        return -1;
    return r;
}

/* Split tokens [k->first, k->stop) of one chunk into runs inside blocks, each
 * checked against the extents; at most ``room`` pieces. -1 with an exception
 * set when wrong. */
static int
plan_chunk(chunk *k, Py_ssize_t room, PyObject *ids, const plan *p, Py_ssize_t num_blocks,
           Py_ssize_t cache_bytes, Py_ssize_t block_size)
{
    Py_ssize_t first = k->first, stop = k->stop;
    Py_ssize_t reach_cache = mul_add(p->heads - 1, p->cache_head, p->row);
    Py_ssize_t reach_chunk = mul_add(p->layers - 1, k->layer,
                                     mul_add(p->heads - 1, k->head, p->row));
    if (reach_cache < 0 || reach_chunk < 0) {
        bad("a run past the end of a tensor");
        return -1;
    }
    if (stop > first && (stop - 1) / block_size >= PySequence_Fast_GET_SIZE(ids)) {
        bad("the block table does not cover the tokens copied");
        return -1;
    }
    k->npieces = 0;
    for (Py_ssize_t t = first; t < stop;) { /* (0 <= start <= first: t, offset >= 0) */
        Py_ssize_t offset = t % block_size;
        Py_ssize_t count = block_size - offset < stop - t ? block_size - offset : stop - t;
        Py_ssize_t block;
        if (item_size(ids, t / block_size, &block) < 0)
            return -1;
        if (block < 0 || block >= num_blocks) {
            PyErr_Format(PyExc_ValueError, "%s: block id %zd out of range 0..%zd", checking,
                         block, num_blocks - 1);
            return -1;
        }
        Py_ssize_t cache_end = mul_add(block, p->cache_block,
                                       mul_add(offset + count - 1, p->cache_token, reach_cache));
        Py_ssize_t chunk_end = mul_add(t - k->start + count - 1, k->token, reach_chunk);
        if (cache_end < 0 || cache_end > cache_bytes || chunk_end < 0 || chunk_end > k->nbytes) {
            bad("a run past the end of a tensor");
            return -1;
        }
        if (k->npieces >= room) { /* (cannot happen: room counts every block touched) */
            bad("internal: more runs than planned");
            return -1;
        }
        k->pieces[k->npieces++] = (piece){block, offset, count, t};
        t += count;
    }
    return 0;
}

/* copy_blocks(into_caches, caches, cache_bytes, (block, head, token) strides,
 *             num_blocks, heads, row, block_size, block_ids,
 *             chunks: [(address, bytes, (layer, head, token) strides, start, first, stop)],
 *             threads, cpus or None)
 * copy_checked(caches, ... as copy_blocks ..., block_ids,
 *              chunks: [(address, bytes, (layer, head, token) strides, start, first, stop,
 *                        tokens, checksum)], threads, cpus or None) -> [verdict]
 *   Into the caches, each buffer whole (its ``tokens`` rows back to back, layer
 *   by layer and head by head) and its bytes checked against ``checksum``
 *   (xxh3-64) as they are copied, one thread a chunk: True where they matched.
 *   A chunk that did not may have been copied in part. */
static PyObject *copy_common(PyObject *args, int checked);

static PyObject *
copy_blocks(PyObject *self, PyObject *args)
{
    return copy_common(args, 0);
}

#ifdef LMKV_XXHASH
static PyObject *
copy_checked(PyObject *self, PyObject *args)
{
    return copy_common(args, 1);
}
#endif

static PyObject *
copy_common(PyObject *args, int checked)
{
    checking = checked ? "copy_checked" : "copy_blocks";
    int into_caches = 1;
    PyObject *caches_obj, *ids_obj, *chunks_obj, *cpus_obj;
    Py_ssize_t cache_bytes, num_blocks, heads, row, block_size, threads;
    Py_ssize_t cs[3];
    if (checked ? !PyArg_ParseTuple(args, "On(nnn)nnnnOOnO", &caches_obj, &cache_bytes,
                                    &cs[0], &cs[1], &cs[2], &num_blocks, &heads, &row,
                                    &block_size, &ids_obj, &chunks_obj, &threads, &cpus_obj)
                : !PyArg_ParseTuple(args, "pOn(nnn)nnnnOOnO", &into_caches, &caches_obj,
                                    &cache_bytes, &cs[0], &cs[1], &cs[2], &num_blocks, &heads,
                                    &row, &block_size, &ids_obj, &chunks_obj, &threads,
                                    &cpus_obj))
        return NULL;
    if (heads <= 0 || row <= 0 || block_size <= 0 || threads <= 0 || cs[0] < 0 || cs[1] < 0
        || cs[2] < 0)
        return bad("bad geometry");
#ifdef LMKV_XXHASH
    if (checked && row > BOUNCE)
        return bad("rows too long for a checked copy");
#endif

    PyObject *caches_seq = NULL, *ids_seq = NULL, *chunks_seq = NULL, *result = NULL;
    char **caches = NULL;
    chunk *chunks = NULL;
    piece *pieces = NULL;
    cpu_set_t cpus;
    int have_cpus = 0;
    plan p;

    /* tuples: copies no callback can change under the checks */
    caches_seq = PySequence_Tuple(caches_obj);
    ids_seq = caches_seq ? PySequence_Tuple(ids_obj) : NULL;
    chunks_seq = ids_seq ? PySequence_Tuple(chunks_obj) : NULL;
    if (chunks_seq == NULL)
        goto done;
    Py_ssize_t layers = PySequence_Fast_GET_SIZE(caches_seq);
    Py_ssize_t nchunks = PySequence_Fast_GET_SIZE(chunks_seq);
    if (layers == 0 || nchunks == 0) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    caches = PyMem_Malloc(sizeof(char *) * (size_t)layers);
    chunks = PyMem_Calloc((size_t)nchunks, sizeof(chunk));
    Py_ssize_t room = 0;
    for (Py_ssize_t c = 0; c < nchunks; c++) {
        PyObject *item = PySequence_Fast_GET_ITEM(chunks_seq, c);
        Py_ssize_t addr, nbytes, ls, hs, ts, start, first, stop, tokens = 0;
        unsigned long long checksum = 0;
        if (checked ? !PyArg_ParseTuple(item, "nn(nnn)nnnnK", &addr, &nbytes, &ls, &hs, &ts,
                                        &start, &first, &stop, &tokens, &checksum)
                    : !PyArg_ParseTuple(item, "nn(nnn)nnn", &addr, &nbytes, &ls, &hs, &ts,
                                        &start, &first, &stop))
            goto done;
        if (chunks == NULL)
            continue;
        if (ls < 0 || hs < 0 || ts < 0 || addr == 0 || nbytes < 0) {
            bad("bad chunk buffer");
            goto done;
        }
        if (start < 0 || first < start || stop < first) {
            bad("tokens before the buffer's first, or a negative range");
            goto done;
        }
        /* a checked buffer is read whole, in order: its rows back to back, its
         * extent exactly its bytes, the tokens copied among its own */
        if (checked && (tokens <= 0 || stop - start > tokens || ts != row
                        || mul_add(tokens, row, 0) != hs || mul_add(heads, hs, 0) != ls
                        || mul_add(layers, ls, 0) != nbytes)) {
            bad("a checked buffer must be whole and back to back");
            goto done;
        }
        chunks[c] = (chunk){(char *)addr, ls, hs, ts, start, NULL, 0, 0, nbytes, first, stop,
                            tokens, (uint64_t)checksum, 0};
        /* a run of n tokens lies in at most n / block_size + 2 blocks */
        Py_ssize_t most = (stop - first) / block_size + 2;
        if (room > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(piece) - most) {
            bad("too many tokens");
            goto done;
        }
        room += most;
    }
    pieces = PyMem_Malloc(sizeof(piece) * (size_t)room);
    if (caches == NULL || chunks == NULL || pieces == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t l = 0; l < layers; l++) {
        Py_ssize_t addr;
        if (item_size(caches_seq, l, &addr) < 0)
            goto done;
        if (addr == 0) {
            bad("bad cache");
            goto done;
        }
        caches[l] = (char *)addr;
    }
    p = (plan){into_caches, caches, layers, heads, row, cs[0], cs[1], cs[2], chunks, nchunks};
    Py_ssize_t used = 0, items = 0, bytes = 0;
    for (Py_ssize_t c = 0; c < nchunks; c++) {
        chunk *k = &chunks[c];
        k->pieces = pieces + used;
        if (plan_chunk(k, room - used, ids_seq, &p, num_blocks, cache_bytes, block_size) < 0)
            goto done;
        used += chunks[c].npieces;
        chunks[c].items = items;
        items += layers * heads * chunks[c].npieces;
        /* (a checked chunk is read whole: all of its bytes count) */
        bytes += checked ? k->nbytes : (k->stop - k->first) * layers * heads * row;
    }
    if (cpus_obj != Py_None) {
        PyObject *cpu_seq = PySequence_Fast(cpus_obj, "cpus: a sequence of CPU numbers");
        if (cpu_seq == NULL)
            goto done;
        CPU_ZERO(&cpus);
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(cpu_seq); i++) {
            Py_ssize_t cpu;
            if (item_size(cpu_seq, i, &cpu) < 0) {
                Py_DECREF(cpu_seq);
                goto done;
            }
            if (cpu >= 0 && cpu < CPU_SETSIZE) {
                CPU_SET((int)cpu, &cpus);
                have_cpus = 1;
            }
        }
        Py_DECREF(cpu_seq);
    }

    if (checked)
        items = nchunks; /* one thread a chunk: its checksum is read in order */
    Py_ssize_t n = threads > MAX_THREADS ? MAX_THREADS : threads;
    if (bytes < SPLIT_BYTES)
        n = 1;
    if (n > items)
        n = items > 0 ? items : 1;
    job work = {&p, checked, items, 0, have_cpus ? &cpus : NULL, 0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    run_threads(&work, (int)n);
    Py_END_ALLOW_THREADS
    if (!checked) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    result = PyList_New(nchunks);
    for (Py_ssize_t c = 0; result != NULL && c < nchunks; c++) {
        if (chunks[c].verdict < 0) {
            Py_CLEAR(result);
            PyErr_NoMemory();
            break;
        }
        PyObject *verdict = chunks[c].verdict ? Py_True : Py_False;
        Py_INCREF(verdict);
        PyList_SET_ITEM(result, c, verdict);
    }
done:
    PyMem_Free(caches);
    PyMem_Free(chunks);
    PyMem_Free(pieces);
    Py_XDECREF(caches_seq);
    Py_XDECREF(ids_seq);
    Py_XDECREF(chunks_seq);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "Copy token rows between per-layer paged caches and a chunk buffer (see host.c)."},
#ifdef LMKV_XXHASH
    {"copy_checked", copy_checked, METH_VARARGS,
     "Copy chunk buffers into per-layer paged caches, checking each one's xxh3-64 (see host.c)."},
#endif
    {"use_openmp", use_openmp, METH_VARARGS,
     "Run the copies called on a thread on its OpenMP team (True) or lmkv's threads."},
    {"last_ran", last_ran_of, METH_NOARGS, "How the last copy ran (for tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_host", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__host(void)
{
    if (pthread_atfork(NULL, NULL, pool_after_fork_in_child) != 0) {
        PyErr_SetString(PyExc_ImportError, "lmkv_kernels._host: pthread_atfork failed");
        return NULL;
    }
    return PyModule_Create(&module);
}
