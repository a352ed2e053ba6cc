/* Guarded file mappings: a read of a mapped page the file no longer has (the file
 * was truncated under the mapping, or the disk failed to read the page) raises
 * SIGBUS, which kills the process. lmkv maps entry files it reads (the fs tier's
 * direct reads) and registers each mapping here; a SIGBUS inside a registered
 * range replaces the rest of that range with zero pages, marks the range damaged
 * and returns, so the read that faulted goes on (reading zeros) and the caller
 * finds the damage afterwards (``released`` / ``damaged``) and treats the chunk as
 * unreadable. A SIGBUS anywhere else goes to the handler installed before this one
 * (or kills the process, as it would have).
 *
 * The table of ranges is a fixed array read by the handler without locks: a slot
 * is claimed by compare-and-swap, filled, then published ACTIVE; the handler only
 * reads ACTIVE slots. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SLOTS 4096
enum { FREE = 0, CLAIMED = 1, ACTIVE = 2 };

struct range {
    _Atomic int state;
    uintptr_t start;
    uintptr_t end; /* page-aligned: the mapping's last page is whole */
    _Atomic int damaged;
};

static struct range ranges[SLOTS];
static struct sigaction previous;
static uintptr_t page_mask;

static __thread int dispatching; /* this thread is in the handler before ours */

static void
on_sigbus(int sig, siginfo_t *info, void *context)
{
    int saved_errno = errno;
    if (info != NULL && info->si_code > 0) { /* a fault, not kill() or raise() */
        uintptr_t addr = (uintptr_t)info->si_addr;
        for (int i = 0; i < SLOTS; i++) {
            struct range *r = &ranges[i];
            if (atomic_load_explicit(&r->state, memory_order_acquire) != ACTIVE)
                continue;
            if (addr < r->start || addr >= r->end)
                continue;
            uintptr_t page = addr & page_mask;
            /* mmap as a raw system call: async-signal-safe in effect */
            void *got = (void *)syscall(SYS_mmap, (void *)page, r->end - page,
                                        PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (got == (void *)page) {
                atomic_store_explicit(&r->damaged, 1, memory_order_release);
                errno = saved_errno;
                return; /* the faulting read runs again, on zeros */
            }
            break;
        }
    }
    /* Not ours: the handler before ours, once. A handler that hands the signal on
     * by raising it again (faulthandler does, after its report) reaches us
     * nested: that goes to the default, never round the chain again. */
    if (!dispatching) {
        int called = 0;
        dispatching = 1;
        if (previous.sa_flags & SA_SIGINFO) {
            if (previous.sa_sigaction != NULL) {
                previous.sa_sigaction(sig, info, context);
                called = 1;
            }
        } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
            previous.sa_handler(sig);
            called = 1;
        }
        dispatching = 0;
        if (called) {
            errno = saved_errno;
            return;
        }
    }
    /* The default: a fault repeats on return and kills the process as it would
     * have without this handler; a signal sent by kill() or raise() is sent again. */
    signal(SIGBUS, SIG_DFL);
    if (info == NULL || info->si_code <= 0)
        raise(SIGBUS);
}

/* Ours is the SIGBUS handler (installed again, before whatever took its place,
 * when another was installed since: that one is then called for faults outside
 * lmkv's mappings). Called with the GIL held. */
static int
ensure_installed(void)
{
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)
        return 0;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    previous = now;
    return sigaction(SIGBUS, &ours, NULL);
}

static PyObject *
guard(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    uintptr_t start = (uintptr_t)view.buf;
    uintptr_t end = start + (uintptr_t)view.len;
    PyBuffer_Release(&view);
    if (end == start || (start & ~page_mask) != 0) {
        PyErr_SetString(PyExc_ValueError, "a guarded range starts on a page and is not empty");
        return NULL;
    }
    if (ensure_installed() != 0)
        return PyLong_FromLong(-1);
    end = (end + ~page_mask) & page_mask;
    for (int i = 0; i < SLOTS; i++) {
        int expected = FREE;
        if (atomic_compare_exchange_strong(&ranges[i].state, &expected, CLAIMED)) {
            ranges[i].start = start;
            ranges[i].end = end;
            atomic_store(&ranges[i].damaged, 0);
            atomic_store_explicit(&ranges[i].state, ACTIVE, memory_order_release);
            return PyLong_FromLong(i);
        }
    }
    return PyLong_FromLong(-1); /* full: the caller reads without a mapping */
}

static int
slot_of(PyObject *arg)
{
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred())
        return -1;
    if (i < 0 || i >= SLOTS || atomic_load(&ranges[i].state) != ACTIVE) {
        PyErr_Format(PyExc_ValueError, "%ld is not a guarded range", i);
        return -1;
    }
    return (int)i;
}

static PyObject *
damaged(PyObject *self, PyObject *arg)
{
    int i = slot_of(arg);
    if (i < 0)
        return NULL;
    return PyBool_FromLong(atomic_load_explicit(&ranges[i].damaged, memory_order_acquire));
}

static PyObject *
release(PyObject *self, PyObject *arg)
{
    int i = slot_of(arg);
    if (i < 0)
        return NULL;
    int was = atomic_load(&ranges[i].damaged);
    atomic_store_explicit(&ranges[i].state, CLAIMED, memory_order_release);
    ranges[i].start = ranges[i].end = 0;
    atomic_store_explicit(&ranges[i].state, FREE, memory_order_release);
    return PyBool_FromLong(was);
}

static PyMethodDef methods[] = {
    {"guard", guard, METH_O,
     "guard(buffer) -> slot: SIGBUS inside the buffer's pages reads zeros and marks "
     "the slot damaged (-1: not guarded; read some other way)"},
    {"damaged", damaged, METH_O, "damaged(slot) -> whether a read of the range faulted"},
    {"release", release, METH_O,
     "release(slot) -> whether a read faulted; the range is no longer guarded"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_busguard",
    "SIGBUS-safe reads of file mappings (lmkv.contracts.mapped_file).", -1, methods,
};

PyMODINIT_FUNC
PyInit__busguard(void)
{
    long size = sysconf(_SC_PAGESIZE);
    page_mask = ~((uintptr_t)(size > 0 ? size : 4096) - 1);
    return PyModule_Create(&module);
}
