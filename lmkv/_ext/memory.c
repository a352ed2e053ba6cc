/* Optional accelerator for lmkv.memory: a chunk buffer's fields and reference
 * counts (MemoryObjCore, the base of lmkv.memory.MemoryObj) and an arena's free
 * list (ArenaCore). lmkv.memory holds a pure-Python version of both with the same
 * behaviour (tested both ways); this only takes the per-chunk Python frames out
 * of allocate, tensor, ref_up and ref_down.
 *
 * Thread safety: every operation here runs holding the GIL and calls no Python
 * code while it changes a count or the free list, so each is atomic with respect
 * to other threads without a lock of its own. The only calls out are made before
 * a change (an unknown layout: MemoryAllocator._layout) or after it (the
 * prefault thread's high-water mark; the bug report of a bad count). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

static PyObject *refcount_bug = NULL; /* lmkv.memory._refcount_bug */
static int layout_bits = 12;
static PyObject *s_views, *s_view_at, *s_core, *s_layout, *s_prefaulter, *s_reached;

/* Report a reference-count bug through lmkv.memory._refcount_bug (which logs, or
 * raises in strict mode): -1 when it raised. */
static int
report(const char *fmt, Py_ssize_t offset)
{
    if (refcount_bug == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "lmkv._ext._memory: setup() was not called");
        return -1;
    }
    PyObject *msg = PyUnicode_FromFormat(fmt, offset);
    if (msg == NULL)
        return -1;
    PyObject *res = PyObject_CallOneArg(refcount_bug, msg);
    Py_DECREF(msg);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* ------------------------------------------------------------------ arena core */

typedef struct {
    PyObject_HEAD
    PyObject *allocator; /* the MemoryAllocator that owns this core */
    PyObject *obj_type;  /* the MemoryObj class buffers are made of */
    PyObject *layouts;   /* the allocator's dict (dtype, dims) -> Layout */
    Py_ssize_t *starts, *sizes; /* free blocks, sorted by start */
    Py_ssize_t n, cap;
    Py_ssize_t capacity, used_bytes, live_objects, peak_live, high;
} Core;

static PyTypeObject CoreType;

static int
core_reserve(Core *self, Py_ssize_t need)
{
    if (need <= self->cap)
        return 0;
    Py_ssize_t cap = self->cap ? self->cap : 16;
    while (cap < need)
        cap *= 2;
    Py_ssize_t *starts = PyMem_Realloc(self->starts, cap * sizeof(Py_ssize_t));
    if (starts == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->starts = starts;
    Py_ssize_t *sizes = PyMem_Realloc(self->sizes, cap * sizeof(Py_ssize_t));
    if (sizes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->sizes = sizes;
    self->cap = cap;
    return 0;
}

/* First fit: the offset of a block of ``size`` taken from the free list, or -1. */
static Py_ssize_t
core_take(Core *self, Py_ssize_t size)
{
    Py_ssize_t *sizes = self->sizes;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (sizes[i] >= size) {
            Py_ssize_t start = self->starts[i];
            if (sizes[i] == size) {
                memmove(self->starts + i, self->starts + i + 1,
                        (self->n - i - 1) * sizeof(Py_ssize_t));
                memmove(sizes + i, sizes + i + 1, (self->n - i - 1) * sizeof(Py_ssize_t));
                self->n--;
            } else {
                self->starts[i] = start + size;
                sizes[i] -= size;
            }
            return start;
        }
    }
    return -1;
}

/* Give a block back, coalescing: 1, 0 on a double free (an overlap), -1 on error. */
static int
core_insert(Core *self, Py_ssize_t start, Py_ssize_t size)
{
    Py_ssize_t *starts = self->starts, *sizes = self->sizes, n = self->n;
    Py_ssize_t lo = 0, hi = n; /* bisect_left */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (starts[mid] < start)
            lo = mid + 1;
        else
            hi = mid;
    }
    Py_ssize_t i = lo;
    /* (the block checked first: no sum below can overflow past the arena) */
    if (start < 0 || size <= 0 || size > self->capacity - start)
        return 0;
    int overlaps_next = i < n && starts[i] - start < size;
    int overlaps_prev = i > 0 && starts[i - 1] + sizes[i - 1] > start;
    if (overlaps_next || overlaps_prev)
        return 0;
    int merge_prev = i > 0 && starts[i - 1] + sizes[i - 1] == start;
    int merge_next = i < n && start + size == starts[i];
    if (merge_prev && merge_next) {
        sizes[i - 1] += size + sizes[i];
        memmove(starts + i, starts + i + 1, (n - i - 1) * sizeof(Py_ssize_t));
        memmove(sizes + i, sizes + i + 1, (n - i - 1) * sizeof(Py_ssize_t));
        self->n--;
    } else if (merge_prev) {
        sizes[i - 1] += size;
    } else if (merge_next) {
        starts[i] = start;
        sizes[i] += size;
    } else {
        if (core_reserve(self, n + 1) < 0)
            return -1;
        starts = self->starts;
        sizes = self->sizes;
        memmove(starts + i + 1, starts + i, (n - i) * sizeof(Py_ssize_t));
        memmove(sizes + i + 1, sizes + i, (n - i) * sizeof(Py_ssize_t));
        starts[i] = start;
        sizes[i] = size;
        self->n++;
    }
    return 1;
}

typedef struct {
    PyObject_HEAD
    PyObject *allocator, *layout, *tensor;
    Py_ssize_t nbytes, offset, ref_count, pin_count;
} MemObj;

static PyTypeObject MemObjType;

/* A buffer of ``layout`` at ``offset``: one reference (the caller's), no pin. */
static PyObject *
core_make(Core *self, Py_ssize_t offset, PyObject *layout, Py_ssize_t size)
{
    PyTypeObject *type = (PyTypeObject *)self->obj_type;
    MemObj *obj = (MemObj *)type->tp_alloc(type, 0);
    if (obj == NULL)
        return NULL;
    Py_INCREF(self->allocator);
    obj->allocator = self->allocator;
    Py_INCREF(layout);
    obj->layout = layout;
    Py_INCREF(Py_None);
    obj->tensor = Py_None;
    obj->offset = offset;
    obj->nbytes = size;
    obj->ref_count = 1;
    obj->pin_count = 0;
    return (PyObject *)obj;
}

static Py_ssize_t
layout_size(PyObject *layout)
{
    if (!PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) < 5) {
        PyErr_SetString(PyExc_TypeError, "a Layout is a 5-tuple");
        return -1;
    }
    return PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, 4));
}

/* A buffer of ``layout`` (known size), counted; None when the arena has no room. */
static PyObject *
core_allocate_layout(Core *self, PyObject *layout)
{
    Py_ssize_t size = layout_size(layout);
    if (size < 0) {
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear(); /* larger than any arena: no room */
            Py_RETURN_NONE;
        }
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a Layout's size is negative");
        return NULL;
    }
    Py_ssize_t offset = core_take(self, size);
    if (offset < 0)
        Py_RETURN_NONE;
    self->used_bytes += size;
    self->live_objects += 1;
    if (self->live_objects > self->peak_live)
        self->peak_live = self->live_objects;
    int higher = offset + size > self->high;
    if (higher)
        self->high = offset + size;
    PyObject *obj = core_make(self, offset, layout, size);
    if (obj == NULL) {
        if (core_insert(self, offset, size) == 1) {
            self->used_bytes -= size;
            self->live_objects -= 1;
        }
        return NULL;
    }
    if (higher) {
        /* Tell the prefault thread (if any) how far the arena is in use. */
        PyObject *pre = PyObject_GetAttr(self->allocator, s_prefaulter);
        if (pre == NULL) {
            Py_DECREF(obj);
            return NULL;
        }
        if (pre != Py_None) {
            PyObject *end = PyLong_FromSsize_t(offset + size);
            PyObject *res = end ? PyObject_CallMethodOneArg(pre, s_reached, end) : NULL;
            Py_XDECREF(end);
            if (res == NULL) {
                Py_DECREF(pre);
                Py_DECREF(obj); /* (its block stays counted, as a raise in Python leaves it) */
                return NULL;
            }
            Py_DECREF(res);
        }
        Py_DECREF(pre);
    }
    return obj;
}

static int
core_ready(Core *self)
{
    if (self->layouts == NULL || self->allocator == NULL || self->obj_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an ArenaCore that __init__ did not make");
        return -1;
    }
    return 0;
}

static PyObject *
core_allocate(Core *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (core_ready(self) < 0)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "allocate(shape, dtype)");
        return NULL;
    }
    PyObject *shape = args[0], *dtype = args[1];
    PyObject *dims;
    if (PyTuple_CheckExact(shape)) {
        Py_INCREF(shape);
        dims = shape;
    } else {
        dims = PySequence_Tuple(shape);
        if (dims == NULL)
            return NULL;
    }
    PyObject *key = PyTuple_Pack(2, dtype, dims);
    if (key == NULL) {
        Py_DECREF(dims);
        return NULL;
    }
    PyObject *layout = PyDict_GetItemWithError(self->layouts, key); /* borrowed */
    Py_DECREF(key);
    if (layout != NULL) {
        Py_INCREF(layout);
    } else if (PyErr_Occurred()) {
        Py_DECREF(dims);
        return NULL;
    } else { /* a new layout: interned (or refused) by the allocator */
        layout = PyObject_CallMethodObjArgs(self->allocator, s_layout, dims, dtype, NULL);
        if (layout == NULL) {
            Py_DECREF(dims);
            return NULL;
        }
    }
    Py_DECREF(dims);
    PyObject *obj = core_allocate_layout(self, layout);
    Py_DECREF(layout);
    return obj;
}

static PyObject *
core_allocate_layout_py(Core *self, PyObject *layout)
{
    if (core_ready(self) < 0)
        return NULL;
    return core_allocate_layout(self, layout);
}

static PyObject *
core_make_py(Core *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (core_ready(self) < 0)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "make(offset, layout)");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[0]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t size = layout_size(args[1]);
    if (size < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a Layout's size is negative");
        return NULL;
    }
    return core_make(self, offset, args[1], size);
}

static PyObject *
core_free(Core *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "free(offset, size)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[0]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred())
        return NULL;
    int done = core_insert(self, start, size);
    if (done < 0)
        return NULL;
    if (done) {
        self->used_bytes -= size;
        self->live_objects -= 1;
    }
    return PyBool_FromLong(done);
}

static PyObject *
core_blocks(Core *self, PyObject *unused)
{
    PyObject *out = PyList_New(self->n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        PyObject *item = Py_BuildValue("(nn)", self->starts[i], self->sizes[i]);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *
core_largest(Core *self, void *unused)
{
    Py_ssize_t most = 0;
    for (Py_ssize_t i = 0; i < self->n; i++)
        if (self->sizes[i] > most)
            most = self->sizes[i];
    return PyLong_FromSsize_t(most);
}

static int
core_init(Core *self, PyObject *args, PyObject *kwds)
{
    PyObject *allocator, *obj_type, *layouts;
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "OnOO!", &allocator, &capacity, &obj_type,
                          &PyDict_Type, &layouts))
        return -1;
    if (!PyType_Check(obj_type)
            || !PyType_IsSubtype((PyTypeObject *)obj_type, &MemObjType)) {
        PyErr_SetString(PyExc_TypeError, "obj_type must be a subclass of MemoryObjCore");
        return -1;
    }
    if (capacity <= 0) {
        PyErr_SetString(PyExc_ValueError, "capacity must be positive");
        return -1;
    }
    Py_INCREF(allocator);
    Py_XSETREF(self->allocator, allocator);
    Py_INCREF(obj_type);
    Py_XSETREF(self->obj_type, obj_type);
    Py_INCREF(layouts);
    Py_XSETREF(self->layouts, layouts);
    if (core_reserve(self, 16) < 0)
        return -1;
    self->starts[0] = 0;
    self->sizes[0] = capacity;
    self->n = 1;
    self->capacity = capacity;
    self->used_bytes = self->live_objects = self->peak_live = self->high = 0;
    return 0;
}

static int
core_traverse(Core *self, visitproc visit, void *arg)
{
    Py_VISIT(self->allocator);
    Py_VISIT(self->obj_type);
    Py_VISIT(self->layouts);
    return 0;
}

static int
core_clear(Core *self)
{
    Py_CLEAR(self->allocator);
    Py_CLEAR(self->obj_type);
    Py_CLEAR(self->layouts);
    return 0;
}

static void
core_dealloc(Core *self)
{
    PyObject_GC_UnTrack(self);
    core_clear(self);
    PyMem_Free(self->starts);
    PyMem_Free(self->sizes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef core_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))core_allocate, METH_FASTCALL,
     "allocate(shape, dtype): a buffer, or None when the arena has no room."},
    {"allocate_layout", (PyCFunction)core_allocate_layout_py, METH_O,
     "allocate_layout(layout): a buffer of an interned layout, or None."},
    {"make", (PyCFunction)(void (*)(void))core_make_py, METH_FASTCALL,
     "make(offset, layout): a buffer over a block already counted as used."},
    {"free", (PyCFunction)(void (*)(void))core_free, METH_FASTCALL,
     "free(offset, size): give a block back; False on a double free."},
    {"blocks", (PyCFunction)core_blocks, METH_NOARGS, "(start, size) of every free block."},
    {NULL},
};

static PyMemberDef core_members[] = {
    {"used_bytes", T_PYSSIZET, offsetof(Core, used_bytes), READONLY, NULL},
    {"live_objects", T_PYSSIZET, offsetof(Core, live_objects), READONLY, NULL},
    {"peak_live", T_PYSSIZET, offsetof(Core, peak_live), READONLY, NULL},
    {"high", T_PYSSIZET, offsetof(Core, high), READONLY, NULL},
    {"capacity", T_PYSSIZET, offsetof(Core, capacity), READONLY, NULL},
    {NULL},
};

static PyGetSetDef core_getset[] = {
    {"largest", (getter)core_largest, NULL, "the largest free block", NULL},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lmkv._ext._memory.ArenaCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An arena's free list (first fit, coalescing) and its counts.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
    .tp_members = core_members,
    .tp_getset = core_getset,
};

/* ----------------------------------------------------------- MemoryObjCore */

/* The last reference went: the buffer's block back to its arena. */
static int
memobj_free(MemObj *self)
{
    PyObject *core = PyObject_GetAttr(self->allocator, s_core);
    if (core == NULL)
        return -1;
    int done;
    if (Py_IS_TYPE(core, &CoreType)) {
        done = core_insert((Core *)core, self->offset, self->nbytes);
        if (done == 1) {
            ((Core *)core)->used_bytes -= self->nbytes;
            ((Core *)core)->live_objects -= 1;
        }
    } else { /* a core of another kind: its own free */
        PyObject *res = PyObject_CallMethod(core, "free", "nn", self->offset, self->nbytes);
        done = res == NULL ? -1 : PyObject_IsTrue(res);
        Py_XDECREF(res);
    }
    Py_DECREF(core);
    if (done < 0)
        return -1;
    if (!done)
        return report("double free of arena block at offset %zd", self->offset);
    return 0;
}

static PyObject *
memobj_ref_up(MemObj *self, PyObject *unused)
{
    if (self->ref_count <= 0) {
        if (report("ref_up on a released buffer at offset %zd", self->offset) < 0)
            return NULL;
        Py_RETURN_FALSE;
    }
    self->ref_count++;
    Py_RETURN_TRUE;
}

static int
memobj_down(MemObj *self)
{
    if (self->ref_count <= 0)
        return report("ref_down below zero at offset %zd", self->offset);
    self->ref_count--;
    if (self->ref_count == 0 && self->allocator != NULL && self->allocator != Py_None) {
        if (self->pin_count
                && report("buffer at offset %zd freed while pinned", self->offset) < 0)
            return -1;
        return memobj_free(self);
    }
    return 0;
}

static PyObject *
memobj_ref_down(MemObj *self, PyObject *unused)
{
    if (memobj_down(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
memobj_pin(MemObj *self, PyObject *unused)
{
    self->pin_count++;
    Py_RETURN_NONE;
}

static PyObject *
memobj_unpin(MemObj *self, PyObject *unused)
{
    if (self->pin_count <= 0) {
        if (report("unpin below zero at offset %zd", self->offset) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    self->pin_count--;
    Py_RETURN_NONE;
}

static PyObject *
memobj_tensor(MemObj *self, void *unused)
{
    if (self->tensor != NULL && self->tensor != Py_None) {
        Py_INCREF(self->tensor);
        return self->tensor;
    }
    if (self->allocator == NULL || self->allocator == Py_None || self->layout == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a MemoryObj without a tensor or an arena");
        return NULL;
    }
    long ident = -1;
    if (PyTuple_Check(self->layout) && PyTuple_GET_SIZE(self->layout) > 0) {
        ident = PyLong_AsLong(PyTuple_GET_ITEM(self->layout, 0));
        if (ident == -1 && PyErr_Occurred())
            return NULL;
    }
    if (ident >= 0) { /* the arena's cached view of this slot */
        PyObject *views = PyObject_GetAttr(self->allocator, s_views);
        if (views == NULL)
            return NULL;
        PyObject *key = PyLong_FromSsize_t((self->offset << layout_bits) | ident);
        if (key == NULL) {
            Py_DECREF(views);
            return NULL;
        }
        PyObject *view = PyDict_Check(views) ? PyDict_GetItemWithError(views, key) : NULL;
        Py_XINCREF(view); /* (borrowed from views: taken before views goes) */
        Py_DECREF(key);
        Py_DECREF(views);
        if (view != NULL)
            return view;
        if (PyErr_Occurred())
            return NULL;
    }
    PyObject *offset = PyLong_FromSsize_t(self->offset);
    if (offset == NULL)
        return NULL;
    PyObject *view = PyObject_CallMethodObjArgs(self->allocator, s_view_at, offset,
                                                self->layout, NULL);
    Py_DECREF(offset);
    return view;
}

static int
memobj_traverse(MemObj *self, visitproc visit, void *arg)
{
    Py_VISIT(self->allocator);
    Py_VISIT(self->layout);
    Py_VISIT(self->tensor);
    return 0; /* (a Python subclass's traverse visits its type, then calls this) */
}

static int
memobj_clear(MemObj *self)
{
    Py_CLEAR(self->allocator);
    Py_CLEAR(self->layout);
    Py_CLEAR(self->tensor);
    return 0;
}

static void
memobj_dealloc(MemObj *self)
{
    /* A Python subclass's dealloc calls this, and drops its type's reference. */
    PyObject_GC_UnTrack(self);
    memobj_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef memobj_methods[] = {
    {"ref_up", (PyCFunction)memobj_ref_up, METH_NOARGS,
     "Take a reference; False (a bug, logged or raised) if the buffer was released."},
    {"ref_down", (PyCFunction)memobj_ref_down, METH_NOARGS,
     "Give a reference back; the buffer returns to its arena at zero."},
    {"pin", (PyCFunction)memobj_pin, METH_NOARGS, "Pin: never evicted while pinned."},
    {"unpin", (PyCFunction)memobj_unpin, METH_NOARGS, "Take a pin back."},
    {NULL},
};

static PyMemberDef memobj_members[] = {
    {"_allocator", T_OBJECT, offsetof(MemObj, allocator), 0, NULL},
    {"_layout", T_OBJECT, offsetof(MemObj, layout), 0, NULL},
    {"_tensor", T_OBJECT, offsetof(MemObj, tensor), 0, NULL},
    {"nbytes", T_PYSSIZET, offsetof(MemObj, nbytes), 0, NULL},
    {"offset", T_PYSSIZET, offsetof(MemObj, offset), 0, NULL},
    {"ref_count", T_PYSSIZET, offsetof(MemObj, ref_count), 0, NULL},
    {"pin_count", T_PYSSIZET, offsetof(MemObj, pin_count), 0, NULL},
    {NULL},
};

static PyGetSetDef memobj_getset[] = {
    {"tensor", (getter)memobj_tensor, NULL, "the buffer as a tensor of its layout", NULL},
    {NULL},
};

static PyTypeObject MemObjType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lmkv._ext._memory.MemoryObjCore",
    .tp_basicsize = sizeof(MemObj),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A chunk buffer's fields and reference counts (lmkv.memory.MemoryObj).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)memobj_dealloc,
    .tp_traverse = (traverseproc)memobj_traverse,
    .tp_clear = (inquiry)memobj_clear,
    .tp_methods = memobj_methods,
    .tp_members = memobj_members,
    .tp_getset = memobj_getset,
};

/* ------------------------------------------------------------- functions */

static PyObject *
add_refs(PyObject *module, PyObject *arg)
{
    /* A private tuple: what a callback (a bug report, a duck-typed ref_down)
     * does to the caller's list cannot move the items under this loop. */
    PyObject *seq = PySequence_Tuple(arg);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject **items = &PyTuple_GET_ITEM(seq, 0);
    for (Py_ssize_t i = 0; i < n; i++) { /* checked first: all or nothing */
        if (!PyObject_TypeCheck(items[i], &MemObjType)) {
            PyErr_Format(PyExc_TypeError, "item %zd is a %.100s, not a MemoryObj", i,
                         Py_TYPE(items[i])->tp_name);
            Py_DECREF(seq);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        MemObj *obj = (MemObj *)items[i];
        if (obj->ref_count <= 0) {
            if (report("ref_up on a released buffer at offset %zd", obj->offset) < 0) {
                Py_DECREF(seq);
                return NULL;
            }
            continue;
        }
        obj->ref_count++;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
release(PyObject *module, PyObject *arg)
{
    /* A private tuple: what a callback (a bug report, a duck-typed ref_down)
     * does to the caller's list cannot move the items under this loop. */
    PyObject *seq = PySequence_Tuple(arg);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject **items = &PyTuple_GET_ITEM(seq, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        int bad;
        if (PyObject_TypeCheck(items[i], &MemObjType)) {
            bad = memobj_down((MemObj *)items[i]) < 0;
        } else {
            PyObject *res = PyObject_CallMethod(items[i], "ref_down", NULL);
            bad = res == NULL;
            Py_XDECREF(res);
        }
        if (bad) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* owned(objs, allocator): whether every one of ``objs`` is a live buffer of
 * ``allocator`` (none released). Changes nothing. */
static PyObject *
owned(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "owned(objs, allocator)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "owned takes a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int all = 1;
    for (Py_ssize_t i = 0; i < n && all; i++) {
        all = PyObject_TypeCheck(items[i], &MemObjType)
            && ((MemObj *)items[i])->allocator == args[1]
            && ((MemObj *)items[i])->ref_count > 0;
    }
    Py_DECREF(seq);
    return PyBool_FromLong(all);
}

static int
pop_last(PyObject *list)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    return PyList_SetSlice(list, n - 1, n, NULL);
}

/* tally[0] += stored (0; -1 with an exception set). */
static int
add_tally(PyObject *tally, Py_ssize_t stored)
{
    PyObject *total = PyLong_FromSsize_t(stored);
    PyObject *sum = total ? PyNumber_Add(PyList_GET_ITEM(tally, 0), total) : NULL;
    Py_XDECREF(total);
    if (sum == NULL)
        return -1;
    return PyList_SetItem(tally, 0, sum);
}

/* record_puts(keys, objs, slots, parents, offsets, idents, odd, live, align, out):
 * a cpu tier's batch of its own buffers (lmkv_backends.tiers.cpu): for each
 * item whose slot holds nothing (``offsets[slot] < 0``) and whose buffer is
 * live, its offset (in units of ``align``) and layout number go to ``offsets``
 * / ``idents`` (array('i' or 'q') and array('h'), sized for every slot), an
 * uninterned layout to ``odd``, the buffer to ``live``, with a reference taken
 * on it (the tier's); ``out`` is [new slots, their parents' slots,
 * [(position in new, item) of parents to resolve], [stored bytes, added to]]. A parent that is the key recorded just before is that key's
 * slot; None stays None; any other is left to the caller (None in its place).
 * On an error, ``out`` holds every item recorded before it, whole. */
static PyObject *
record_puts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "record_puts takes 10 arguments");
        return NULL;
    }
    PyObject *odd = args[6], *live = args[7], *out = args[9];
    Py_ssize_t align = PyLong_AsSsize_t(args[8]);
    if (align == -1 && PyErr_Occurred())
        return NULL;
    if (align <= 0 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1])
            || !PyList_CheckExact(args[2]) || !PyList_CheckExact(args[3])
            || !PyDict_CheckExact(odd) || !PyDict_CheckExact(live)
            || !PyList_CheckExact(out) || PyList_GET_SIZE(out) != 4) {
        PyErr_SetString(PyExc_TypeError, "record_puts: lists, dicts and a positive align");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (PyList_GET_SIZE(args[1]) != n || PyList_GET_SIZE(args[2]) != n
            || PyList_GET_SIZE(args[3]) != n) {
        PyErr_SetString(PyExc_ValueError, "record_puts: keys, objs, slots and parents differ in length");
        return NULL;
    }
    /* Private tuples: a callback (a bug report) cannot move the items under the loop. */
    PyObject *keys = PyList_AsTuple(args[0]), *objs = PyList_AsTuple(args[1]);
    PyObject *slots = PyList_AsTuple(args[2]), *parents = PyList_AsTuple(args[3]);
    PyObject *result = NULL;
    if (keys == NULL || objs == NULL || slots == NULL || parents == NULL)
        goto done;
    PyObject *new = PyList_GET_ITEM(out, 0), *new_parents = PyList_GET_ITEM(out, 1);
    PyObject *unresolved = PyList_GET_ITEM(out, 2), *tally = PyList_GET_ITEM(out, 3);
    if (!PyList_CheckExact(new) || !PyList_CheckExact(new_parents)
            || !PyList_CheckExact(unresolved) || !PyList_CheckExact(tally)
            || PyList_GET_SIZE(tally) != 1) {
        PyErr_SetString(PyExc_TypeError, "record_puts: out is three lists and [bytes]");
        goto done;
    }
    Py_buffer ob, ib;
    Py_ssize_t stored = 0, last = -1;
    if (PyObject_GetBuffer(args[4], &ob, PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        goto done;
    if (PyObject_GetBuffer(args[5], &ib, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&ob);
        goto done;
    }
    int wide = ob.itemsize == 8;
    if (!((ob.itemsize == 4 || ob.itemsize == 8) && ob.format && strchr("ilqn", ob.format[0]))
            || !(ib.itemsize == 2 && ib.format && ib.format[0] == 'h')) {
        PyErr_SetString(PyExc_TypeError, "record_puts: offsets array('i'/'q'), idents array('h')");
        goto fail;
    }
    Py_ssize_t noff = ob.len / ob.itemsize, nid = ib.len / ib.itemsize;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj_o = PyTuple_GET_ITEM(objs, i), *slot_o = PyTuple_GET_ITEM(slots, i);
        if (!PyObject_TypeCheck(obj_o, &MemObjType)) {
            PyErr_Format(PyExc_TypeError, "record_puts: item %zd is no MemoryObj", i);
            goto fail;
        }
        MemObj *obj = (MemObj *)obj_o;
        Py_ssize_t slot = PyLong_AsSsize_t(slot_o);
        if (slot == -1 && PyErr_Occurred())
            goto fail;
        if (slot < 0 || slot >= noff || slot >= nid) {
            PyErr_Format(PyExc_IndexError, "record_puts: slot %zd past the arrays", slot);
            goto fail;
        }
        long long was = wide ? ((int64_t *)ob.buf)[slot] : ((int32_t *)ob.buf)[slot];
        if (was >= 0)
            continue; /* stored already */
        if (obj->ref_count <= 0) { /* a released buffer: never stored */
            if (report("ref_up on a released buffer at offset %zd", obj->offset) < 0)
                goto fail;
            continue;
        }
        PyObject *layout = obj->layout;
        if (layout == NULL || !PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) < 1) {
            PyErr_SetString(PyExc_TypeError, "record_puts: a buffer without a layout");
            goto fail;
        }
        long ident = PyLong_AsLong(PyTuple_GET_ITEM(layout, 0));
        if (ident == -1 && PyErr_Occurred())
            goto fail;
        Py_ssize_t unit = obj->offset / align;
        if (ident < -1 || ident > 32767 || obj->offset % align
                || (!wide && unit > INT32_MAX) || unit < 0) {
            PyErr_SetString(PyExc_ValueError, "record_puts: a buffer's offset or layout out of range");
            goto fail;
        }
        /* The lists and dicts first (each may fail, and is undone if a later one
         * does), the arrays last (they cannot). */
        PyObject *parent = PyTuple_GET_ITEM(parents, i);
        PyObject *parent_slot = NULL;
        int resolve = 0;
        if (parent == Py_None) {
            parent_slot = Py_NewRef(Py_None);
        } else if (last >= 0 && parent == PyTuple_GET_ITEM(keys, last)) {
            parent_slot = Py_NewRef(PyTuple_GET_ITEM(slots, last));
        } else {
            parent_slot = Py_NewRef(Py_None);
            resolve = 1;
        }
        int steps = 0;
        if (PyList_Append(new, slot_o) < 0)
            goto undo;
        steps = 1;
        if (PyList_Append(new_parents, parent_slot) < 0)
            goto undo;
        steps = 2;
        if (resolve) {
            PyObject *pair = Py_BuildValue("(nn)", PyList_GET_SIZE(new) - 1, i);
            if (pair == NULL || PyList_Append(unresolved, pair) < 0) {
                Py_XDECREF(pair);
                goto undo;
            }
            Py_DECREF(pair);
        }
        steps = 3;
        if (PyDict_SetItem(live, slot_o, obj_o) < 0)
            goto undo;
        steps = 4;
        if (ident < 0 && PyDict_SetItem(odd, slot_o, layout) < 0)
            goto undo;
        Py_DECREF(parent_slot);
        if (wide)
            ((int64_t *)ob.buf)[slot] = unit;
        else
            ((int32_t *)ob.buf)[slot] = (int32_t)unit;
        ((int16_t *)ib.buf)[slot] = (int16_t)ident;
        obj->ref_count++; /* the tier's */
        stored += obj->nbytes;
        last = i;
        continue;
    undo:
        Py_DECREF(parent_slot);
        {
            PyObject *exc_type, *exc_value, *exc_tb;
            PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
            if (steps >= 4)
                PyDict_DelItem(live, slot_o);
            if (steps >= 3 && resolve)
                pop_last(unresolved);
            if (steps >= 2)
                pop_last(new_parents);
            if (steps >= 1)
                pop_last(new);
            PyErr_Clear();
            PyErr_Restore(exc_type, exc_value, exc_tb);
        }
        goto fail;
    }
    PyBuffer_Release(&ob);
    PyBuffer_Release(&ib);
    if (add_tally(tally, stored) == 0)
        result = Py_NewRef(Py_None);
    goto done;
fail:
    PyBuffer_Release(&ob);
    PyBuffer_Release(&ib);
    {
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        add_tally(tally, stored);
        PyErr_Clear();
        PyErr_Restore(exc_type, exc_value, exc_tb);
    }
done:
    Py_XDECREF(keys);
    Py_XDECREF(objs);
    Py_XDECREF(slots);
    Py_XDECREF(parents);
    return result;
}

static PyObject *
setup(PyObject *module, PyObject *args)
{
    PyObject *bug;
    int bits;
    if (!PyArg_ParseTuple(args, "Oi", &bug, &bits))
        return NULL;
    if (!PyCallable_Check(bug) || bits < 1 || bits > 30) {
        PyErr_SetString(PyExc_ValueError, "setup(refcount_bug, layout_bits)");
        return NULL;
    }
    Py_INCREF(bug);
    Py_XSETREF(refcount_bug, bug);
    layout_bits = bits;
    Py_RETURN_NONE;
}

/* ``fast(*args)``, and ``slow(*args)`` when that is None: a cpu tier's allocate
 * (the arena's, then making room) in one C call on the common path. */
typedef struct {
    PyObject_HEAD
    PyObject *fast, *slow;
    vectorcallfunc vectorcall;
} OrElseVC;

static PyObject *
orelse_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    OrElseVC *self = (OrElseVC *)callable;
    if (self->fast == NULL || self->slow == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an or_else that __init__ did not make");
        return NULL;
    }
    PyObject *res = PyObject_Vectorcall(self->fast, args, nargsf, kwnames);
    if (res != Py_None)
        return res;
    Py_DECREF(res);
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *
orelse_call_tp(OrElseVC *self, PyObject *args, PyObject *kwargs)
{
    if (self->fast == NULL || self->slow == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an or_else that __init__ did not make");
        return NULL;
    }
    PyObject *res = PyObject_Call(self->fast, args, kwargs);
    if (res != Py_None)
        return res;
    Py_DECREF(res);
    return PyObject_Call(self->slow, args, kwargs);
}

static int
orelse_init(OrElseVC *self, PyObject *args, PyObject *kwds)
{
    PyObject *fast, *slow;
    if (!PyArg_ParseTuple(args, "OO", &fast, &slow))
        return -1;
    if (!PyCallable_Check(fast) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "or_else(fast, slow) takes two callables");
        return -1;
    }
    Py_INCREF(fast);
    Py_XSETREF(self->fast, fast);
    Py_INCREF(slow);
    Py_XSETREF(self->slow, slow);
    self->vectorcall = orelse_call;
    return 0;
}

static int
orelse_traverse(OrElseVC *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fast);
    Py_VISIT(self->slow);
    return 0;
}

static int
orelse_clear(OrElseVC *self)
{
    Py_CLEAR(self->fast);
    Py_CLEAR(self->slow);
    return 0;
}

static void
orelse_dealloc(OrElseVC *self)
{
    PyObject_GC_UnTrack(self);
    orelse_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject OrElseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lmkv._ext._memory.or_else",
    .tp_basicsize = sizeof(OrElseVC),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "or_else(fast, slow)(*args): fast(*args), or slow(*args) when that is None.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)orelse_init,
    .tp_dealloc = (destructor)orelse_dealloc,
    .tp_traverse = (traverseproc)orelse_traverse,
    .tp_clear = (inquiry)orelse_clear,
    .tp_call = (ternaryfunc)orelse_call_tp,
    .tp_vectorcall_offset = offsetof(OrElseVC, vectorcall),
};

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS, "setup(refcount_bug, layout_bits)"},
    {"add_refs", add_refs, METH_O, "Take a reference on each buffer of a list."},
    {"release", release, METH_O, "Give back a reference on each buffer of a list."},
    {"owned", (PyCFunction)(void (*)(void))owned, METH_FASTCALL,
     "owned(objs, allocator): whether all are live buffers of it."},
    {"record_puts", (PyCFunction)(void (*)(void))record_puts, METH_FASTCALL,
     "record_puts(...): a cpu tier's batch of its own buffers, recorded."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "lmkv._ext._memory",
    "Chunk buffers and an arena's free list in C (lmkv.memory).", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__memory(void)
{
    if (PyType_Ready(&MemObjType) < 0 || PyType_Ready(&CoreType) < 0
            || PyType_Ready(&OrElseType) < 0)
        return NULL;
    s_views = PyUnicode_InternFromString("_views");
    s_view_at = PyUnicode_InternFromString("view_at");
    s_core = PyUnicode_InternFromString("_core");
    s_layout = PyUnicode_InternFromString("_layout");
    s_prefaulter = PyUnicode_InternFromString("prefaulter");
    s_reached = PyUnicode_InternFromString("reached");
    if (!s_views || !s_view_at || !s_core || !s_layout || !s_prefaulter || !s_reached)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MemObjType);
    Py_INCREF(&CoreType);
    Py_INCREF(&OrElseType);
    if (PyModule_AddObject(m, "MemoryObjCore", (PyObject *)&MemObjType) < 0
            || PyModule_AddObject(m, "ArenaCore", (PyObject *)&CoreType) < 0
            || PyModule_AddObject(m, "or_else", (PyObject *)&OrElseType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
