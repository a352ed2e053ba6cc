/* Optional accelerator for lmkv.keys.slots: SlotKeys (CacheKey <-> dense slot) in
 * C. The pure-Python SlotKeys in lmkv.keys.slots gives the same slots, keys and
 * names, op for op (tested both ways); this one keeps per key a reference to its
 * chunk hash, its space and a 4-byte table entry, and answers add and slot
 * without a Python frame.
 *
 * Keys are grouped by space, a (meta, layer) pair; a slot is found by its chunk
 * hash in one open-addressing table of slot numbers, probed by the hash's own
 * hash mixed with its space's number. Like the Python one, it is not thread-safe
 * beyond the GIL: its tier's lock guards it (and no Python code runs while a
 * table is half changed). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY (-1)
#define GONE (-2)

static PyObject *s_meta, *s_layer, *s_chunk_hash, *s_from_bytes, *s_little;

typedef struct {
    PyObject *meta;  /* NULL: a number free for another space */
    long layer;
    Py_ssize_t count;
    uint64_t tag;    /* hash((meta, layer)) & (2**64 - 1) */
} Space;

typedef struct {
    PyObject_HEAD
    PyObject *key_type;  /* CacheKey */
    PyObject *space_ids; /* dict (meta, layer) -> space number */
    Space *spaces;
    Py_ssize_t nspaces, spaces_cap;
    Py_ssize_t *free_spaces;
    Py_ssize_t nfree_spaces, free_spaces_cap;
    PyObject **digest;   /* per slot: its chunk hash (NULL: free) */
    Py_hash_t *hashes;   /* per slot: the table hash it was placed by */
    uint32_t *space_of;  /* per slot: its space */
    Py_ssize_t nslots, slots_cap, aux_cap; /* aux: hashes' and space_of's size */
    Py_ssize_t *free;
    Py_ssize_t nfree, free_cap;
    int32_t *table;
    Py_ssize_t tsize, tfilled; /* slots of the table; entries not EMPTY */
    Py_ssize_t last;     /* the space of the last key seen, or -1 */
    uint64_t version;    /* bumped by every change of the table */
} SlotKeys;

static int
grow(void **array, Py_ssize_t *cap, Py_ssize_t need, size_t item)
{
    if (need <= *cap)
        return 0;
    Py_ssize_t size = *cap ? *cap : 64;
    while (size < need)
        size *= 2;
    void *more = PyMem_Realloc(*array, size * item);
    if (more == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *array = more;
    *cap = size;
    return 0;
}

static inline Py_hash_t
mix(Py_hash_t h, Py_ssize_t space)
{
    uint64_t x = (uint64_t)h ^ ((uint64_t)(space + 1) * 0x9E3779B97F4A7C15ULL);
    x ^= x >> 29;
    return (Py_hash_t)x;
}

/* 1 equal, 0 not, -1 error */
static inline int
same_digest(PyObject *a, PyObject *b)
{
    if (a == b)
        return 1;
    if (PyBytes_CheckExact(a) && PyBytes_CheckExact(b)) {
        Py_ssize_t n = PyBytes_GET_SIZE(a);
        return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), n) == 0;
    }
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

/* The table position holding ``digest`` of ``space`` (>= 0), or -(first free
 * position) - 1 when it is not there; -(tsize) - 2 on error. */
static Py_ssize_t
probe(SlotKeys *self, PyObject *digest, Py_ssize_t space, Py_hash_t h)
{
restart:;
    size_t mask = (size_t)self->tsize - 1, i = (size_t)h & mask;
    Py_ssize_t first_gone = -1;
    for (Py_ssize_t n = 0; n < self->tsize; n++) {
        int32_t slot = self->table[i];
        if (slot == EMPTY)
            return first_gone >= 0 ? -first_gone - 1 : -(Py_ssize_t)i - 1;
        if (slot == GONE) {
            if (first_gone < 0)
                first_gone = (Py_ssize_t)i;
        } else if (self->hashes[slot] == h && self->space_of[slot] == (uint32_t)space) {
            PyObject *held = self->digest[slot];
            int eq;
            if (held == digest) {
                eq = 1;
            } else if (PyBytes_CheckExact(held) && PyBytes_CheckExact(digest)) {
                eq = same_digest(held, digest);
            } else {
                /* A comparison that may run Python code (an __eq__), which may
                 * change this table: the probe starts again if it did. */
                uint64_t version = self->version;
                Py_INCREF(held);
                eq = same_digest(held, digest);
                Py_DECREF(held);
                if (eq < 0)
                    return -self->tsize - 2;
                if (self->version != version)
                    goto restart;
            }
            if (eq)
                return (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
    return first_gone >= 0 ? -first_gone - 1 : -self->tsize - 2; /* (never full) */
}

static int
rebuild(SlotKeys *self, Py_ssize_t size)
{
    int32_t *table = PyMem_Malloc(size * sizeof(int32_t));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++)
        table[i] = EMPTY;
    size_t mask = (size_t)size - 1;
    Py_ssize_t filled = 0;
    for (Py_ssize_t slot = 0; slot < self->nslots; slot++) {
        if (self->digest[slot] == NULL)
            continue;
        size_t i = (size_t)self->hashes[slot] & mask;
        while (table[i] != EMPTY)
            i = (i + 1) & mask;
        table[i] = (int32_t)slot;
        filled++;
    }
    PyMem_Free(self->table);
    self->table = table;
    self->tsize = size;
    self->tfilled = filled;
    self->version++;
    return 0;
}

/* The space of ``meta``/``layer`` (-1: none). */
static Py_ssize_t
find_space(SlotKeys *self, PyObject *meta, long layer)
{
    Py_ssize_t last = self->last;
    if (last >= 0) {
        Space *sp = &self->spaces[last];
        if (sp->layer == layer && sp->meta == meta)
            return last; /* a tier sees one meta almost always */
        if (sp->layer == layer) {
            int eq = PyObject_RichCompareBool(sp->meta, meta, Py_EQ);
            if (eq < 0)
                return -2;
            if (eq)
                return last;
        }
    }
    PyObject *id = Py_BuildValue("(Ol)", meta, layer);
    if (id == NULL)
        return -2;
    PyObject *number = PyDict_GetItemWithError(self->space_ids, id);
    Py_DECREF(id);
    if (number == NULL)
        return PyErr_Occurred() ? -2 : -1;
    Py_ssize_t found = PyLong_AsSsize_t(number);
    if (found < 0)
        return -2;
    self->last = found;
    return found;
}

/* A key's meta, layer and chunk hash (new references for meta and digest). */
static int
unpack(PyObject *key, PyObject **meta, long *layer, PyObject **digest)
{
    *meta = PyObject_GetAttr(key, s_meta);
    if (*meta == NULL)
        return -1;
    PyObject *lay = PyObject_GetAttr(key, s_layer);
    if (lay == NULL) {
        Py_DECREF(*meta);
        return -1;
    }
    *layer = PyLong_AsLong(lay);
    Py_DECREF(lay);
    if (*layer == -1 && PyErr_Occurred()) {
        Py_DECREF(*meta);
        return -1;
    }
    *digest = PyObject_GetAttr(key, s_chunk_hash);
    if (*digest == NULL) {
        Py_DECREF(*meta);
        return -1;
    }
    return 0;
}

/* ``key``'s slot (>= 0), -1 when it has none, -2 on error. */
static Py_ssize_t
lookup(SlotKeys *self, PyObject *key)
{
    PyObject *meta, *digest;
    long layer;
    if (unpack(key, &meta, &layer, &digest) < 0)
        return -2;
    Py_ssize_t out = -1;
    Py_ssize_t space = find_space(self, meta, layer);
    if (space >= 0) {
        Py_hash_t h = PyObject_Hash(digest);
        if (h == -1 && PyErr_Occurred()) {
            out = -2;
        } else {
            Py_ssize_t at = probe(self, digest, space, mix(h, space));
            out = at >= 0 ? self->table[at] : (at == -self->tsize - 2 ? -2 : -1);
        }
    } else if (space == -2) {
        out = -2;
    }
    Py_DECREF(meta);
    Py_DECREF(digest);
    return out;
}

static Py_ssize_t
new_space(SlotKeys *self, PyObject *meta, long layer)
{
    PyObject *id = Py_BuildValue("(Ol)", meta, layer);
    if (id == NULL)
        return -2;
    Py_hash_t tag = PyObject_Hash(id);
    if (tag == -1 && PyErr_Occurred()) {
        Py_DECREF(id);
        return -2;
    }
    Py_ssize_t number;
    if (self->nfree_spaces) {
        number = self->free_spaces[--self->nfree_spaces];
    } else {
        if (grow((void **)&self->spaces, &self->spaces_cap, self->nspaces + 1, sizeof(Space)) < 0) {
            Py_DECREF(id);
            return -2;
        }
        number = self->nspaces++;
        self->spaces[number].meta = NULL;
    }
    PyObject *num = PyLong_FromSsize_t(number);
    if (num == NULL || PyDict_SetItem(self->space_ids, id, num) < 0) {
        Py_XDECREF(num);
        Py_DECREF(id);
        if (grow((void **)&self->free_spaces, &self->free_spaces_cap,
                 self->nfree_spaces + 1, sizeof(Py_ssize_t)) == 0)
            self->free_spaces[self->nfree_spaces++] = number;
        return -2;
    }
    Py_DECREF(num);
    Py_DECREF(id);
    Space *sp = &self->spaces[number];
    Py_INCREF(meta);
    sp->meta = meta;
    sp->layer = layer;
    sp->count = 0;
    sp->tag = (uint64_t)tag;
    self->last = number;
    return number;
}

/* A slot for ``key``: its own, or a new one (-2 on error). */
static Py_ssize_t
add(SlotKeys *self, PyObject *key)
{
    PyObject *meta, *digest;
    long layer;
    if (unpack(key, &meta, &layer, &digest) < 0)
        return -2;
    Py_ssize_t out = -2;
    Py_hash_t h = PyObject_Hash(digest);
    if (h == -1 && PyErr_Occurred())
        goto done;
    Py_ssize_t space = find_space(self, meta, layer);
    if (space == -2)
        goto done;
    if (space == -1 && (space = new_space(self, meta, layer)) < 0)
        goto done;
    h = mix(h, space);
    Py_ssize_t at;
    for (;;) {
        if ((self->tfilled + 1) * 4 > self->tsize * 3) { /* at most 3/4 filled */
            Py_ssize_t live = self->nslots - self->nfree + 1, size = 64;
            while (size * 3 < live * 4 * 2)
                size *= 2;
            if (rebuild(self, size) < 0)
                goto done;
        }
        at = probe(self, digest, space, h);
        if (at == -self->tsize - 2)
            goto done;
        if (at >= 0 || (self->tfilled + 1) * 4 <= self->tsize * 3)
            break; /* (an __eq__ in the probe may have filled the table: again) */
    }
    if (at >= 0) {
        out = self->table[at];
        goto done;
    }
    Py_ssize_t slot;
    if (self->nfree) {
        slot = self->free[--self->nfree];
    } else {
        if (self->nslots >= INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "more than 2**31 - 1 slots");
            goto done;
        }
        if (grow((void **)&self->digest, &self->slots_cap, self->nslots + 1, sizeof(PyObject *)) < 0)
            goto done;
        if (self->aux_cap < self->slots_cap) {
            /* the other per-slot arrays follow the digests' size */
            Py_hash_t *hashes = PyMem_Realloc(self->hashes, self->slots_cap * sizeof(Py_hash_t));
            if (hashes == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            self->hashes = hashes;
            uint32_t *space_of = PyMem_Realloc(self->space_of,
                                               self->slots_cap * sizeof(uint32_t));
            if (space_of == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            self->space_of = space_of;
            self->aux_cap = self->slots_cap;
        }
        slot = self->nslots++;
    }
    Py_INCREF(digest);
    self->digest[slot] = digest;
    self->hashes[slot] = h;
    self->space_of[slot] = (uint32_t)space;
    self->spaces[space].count++;
    Py_ssize_t pos = -at - 1;
    if (self->table[pos] == EMPTY)
        self->tfilled++;
    self->table[pos] = (int32_t)slot;
    self->version++;
    out = slot;
done:
    Py_DECREF(meta);
    Py_DECREF(digest);
    return out;
}

/* ------------------------------------------------------------ Python API */

static int
ready(SlotKeys *self)
{
    if (self->space_ids == NULL || self->table == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a SlotKeys that __init__ did not make");
        return -1;
    }
    return 0;
}

static PyObject *
sk_slot(SlotKeys *self, PyObject *key)
{
    if (ready(self) < 0)
        return NULL;
    Py_ssize_t slot = lookup(self, key);
    if (slot == -2)
        return NULL;
    if (slot < 0)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(slot);
}

static PyObject *
sk_add(SlotKeys *self, PyObject *key)
{
    if (ready(self) < 0)
        return NULL;
    Py_ssize_t slot = add(self, key);
    return slot < 0 ? NULL : PyLong_FromSsize_t(slot);
}

static PyObject *
sk_add_many(SlotKeys *self, PyObject *keys)
{
    if (ready(self) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "add_many takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t slot = add(self, items[i]);
        PyObject *num = slot < 0 ? NULL : PyLong_FromSsize_t(slot);
        if (num == NULL) {
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        PyList_SET_ITEM(out, i, num);
    }
    Py_DECREF(seq);
    return out;
}

static int
check_slot(SlotKeys *self, PyObject *arg, Py_ssize_t *slot)
{
    if (ready(self) < 0)
        return -1;
    *slot = PyLong_AsSsize_t(arg);
    if (*slot == -1 && PyErr_Occurred())
        return -1;
    if (*slot < 0 || *slot >= self->nslots) {
        PyErr_Format(PyExc_IndexError, "slot %zd out of range", *slot);
        return -1;
    }
    return 0;
}

/* check_slot, and KeyError for a slot that holds no key. */
static int
check_used(SlotKeys *self, PyObject *arg, Py_ssize_t *slot)
{
    if (check_slot(self, arg, slot) < 0)
        return -1;
    if (self->digest[*slot] == NULL) {
        PyErr_Format(PyExc_KeyError, "slot %zd is free", *slot);
        return -1;
    }
    return 0;
}

static PyObject *
sk_key(SlotKeys *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (check_used(self, arg, &slot) < 0)
        return NULL;
    Space *sp = &self->spaces[self->space_of[slot]];
    return PyObject_CallFunction(self->key_type, "OOl", sp->meta, self->digest[slot], sp->layer);
}

static PyObject *
sk_name(SlotKeys *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (check_used(self, arg, &slot) < 0)
        return NULL;
    PyObject *digest = self->digest[slot];
    Space *sp = &self->spaces[self->space_of[slot]];
    PyObject *tag = PyLong_FromUnsignedLongLong(sp->tag);
    if (tag == NULL)
        return NULL;
    if (PyBytes_CheckExact(digest) && PyBytes_GET_SIZE(digest) == 32) {
        /* int.from_bytes(digest, "little") ^ (tag << 256), as the Python one */
        PyObject *value = PyObject_CallMethodObjArgs((PyObject *)&PyLong_Type, s_from_bytes,
                                                     digest, s_little, NULL);
        PyObject *shift = PyLong_FromLong(256);
        PyObject *high = value && shift ? PyNumber_Lshift(tag, shift) : NULL;
        PyObject *name = high ? PyNumber_Xor(value, high) : NULL;
        Py_XDECREF(value);
        Py_XDECREF(shift);
        Py_XDECREF(high);
        Py_DECREF(tag);
        return name;
    }
    PyObject *name = PyTuple_Pack(2, tag, digest);
    Py_DECREF(tag);
    return name;
}

static PyObject *
sk_remove(SlotKeys *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (check_slot(self, arg, &slot) < 0)
        return NULL;
    PyObject *digest = self->digest[slot];
    if (digest == NULL)
        Py_RETURN_NONE;
    Py_ssize_t space = self->space_of[slot];
    Py_ssize_t at = probe(self, digest, space, self->hashes[slot]);
    if (at == -self->tsize - 2)
        return NULL;
    if (at < 0 || self->table[at] != slot) {
        PyErr_SetString(PyExc_SystemError, "lmkv SlotKeys: a slot missing from its table");
        return NULL;
    }
    if (grow((void **)&self->free, &self->free_cap, self->nfree + 1, sizeof(Py_ssize_t)) < 0)
        return NULL;
    Space *sp = &self->spaces[space];
    if (sp->count == 1 && grow((void **)&self->free_spaces, &self->free_spaces_cap,
                               self->nfree_spaces + 1, sizeof(Py_ssize_t)) < 0)
        return NULL;
    PyObject *id = NULL;
    if (sp->count == 1 && (id = Py_BuildValue("(Ol)", sp->meta, sp->layer)) == NULL)
        return NULL;
    /* Nothing below fails but the dict's delete, done last. */
    size_t mask = (size_t)self->tsize - 1;
    self->table[at] = self->table[(at + 1) & mask] == EMPTY ? EMPTY : GONE;
    if (self->table[at] == EMPTY)
        self->tfilled--;
    self->digest[slot] = NULL;
    self->free[self->nfree++] = slot;
    self->version++;
    Py_DECREF(digest);
    if (--sp->count == 0) { /* its last key left: models seen once cost nothing after */
        PyObject *meta = sp->meta;
        sp->meta = NULL;
        self->free_spaces[self->nfree_spaces++] = space;
        if (self->last == space)
            self->last = -1;
        int bad = PyDict_DelItem(self->space_ids, id) < 0;
        Py_DECREF(id);
        Py_DECREF(meta);
        if (bad)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
sk_slot_named(SlotKeys *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (ready(self) < 0)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "slot_named(name, by_slot)");
        return NULL;
    }
    PyObject *name = args[0];
    int by_slot = PyObject_IsTrue(args[1]);
    if (by_slot < 0)
        return NULL;
    if (by_slot) {
        if (!PyLong_CheckExact(name))
            return PyLong_FromLong(-1);
        Py_ssize_t slot = PyLong_AsSsize_t(name);
        if (slot == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return PyLong_FromLong(-1);
        }
        return PyLong_FromSsize_t(0 <= slot && slot < self->nslots ? slot : -1);
    }
    int is_key = PyObject_IsInstance(name, self->key_type);
    if (is_key < 0)
        return NULL;
    if (!is_key)
        return PyLong_FromLong(-1);
    Py_ssize_t slot = lookup(self, name);
    if (slot == -2)
        return NULL;
    return PyLong_FromSsize_t(slot);
}

static PyObject *
sk_slots(SlotKeys *self, PyObject *unused)
{
    if (ready(self) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t slot = 0; slot < self->nslots; slot++) {
        if (self->digest[slot] == NULL)
            continue;
        PyObject *num = PyLong_FromSsize_t(slot);
        if (num == NULL || PyList_Append(out, num) < 0) {
            Py_XDECREF(num);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(num);
    }
    return out;
}

static PyObject *
sk_space_number(SlotKeys *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (check_used(self, arg, &slot) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(self->space_of[slot]);
}

static PyObject *
sk_spaces(SlotKeys *self, void *unused)
{
    if (ready(self) < 0)
        return NULL;
    PyObject *out = PyList_New(self->nspaces);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->nspaces; i++) {
        Space *sp = &self->spaces[i];
        PyObject *item = sp->meta ? Py_BuildValue("(Ol)", sp->meta, sp->layer) : Py_NewRef(Py_None);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *
sk_space_ids(SlotKeys *self, void *unused)
{
    if (ready(self) < 0)
        return NULL;
    return PyDict_Copy(self->space_ids);
}

static PyObject *
sk_capacity(SlotKeys *self, void *unused)
{
    return PyLong_FromSsize_t(self->nslots);
}

static Py_ssize_t
sk_len(SlotKeys *self)
{
    return self->nslots - self->nfree;
}

static PyObject *
sk_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    SlotKeys *self = (SlotKeys *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->last = -1;
    return (PyObject *)self;
}

static int
sk_init(SlotKeys *self, PyObject *args, PyObject *kwds)
{
    PyObject *key_type;
    if (!PyArg_ParseTuple(args, "O", &key_type))
        return -1;
    if (self->space_ids != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "SlotKeys is made once");
        return -1;
    }
    Py_INCREF(key_type);
    self->key_type = key_type;
    self->space_ids = PyDict_New();
    if (self->space_ids == NULL)
        return -1;
    self->last = -1;
    return rebuild(self, 64);
}

static int
sk_traverse(SlotKeys *self, visitproc visit, void *arg)
{
    Py_VISIT(self->key_type);
    Py_VISIT(self->space_ids);
    for (Py_ssize_t i = 0; i < self->nspaces; i++)
        Py_VISIT(self->spaces[i].meta);
    return 0;
}

static int
sk_clear(SlotKeys *self)
{
    Py_CLEAR(self->key_type);
    Py_CLEAR(self->space_ids);
    for (Py_ssize_t i = 0; i < self->nspaces; i++)
        Py_CLEAR(self->spaces[i].meta);
    for (Py_ssize_t i = 0; i < self->nslots; i++)
        Py_CLEAR(self->digest[i]);
    return 0;
}

static void
sk_dealloc(SlotKeys *self)
{
    PyObject_GC_UnTrack(self);
    sk_clear(self);
    PyMem_Free(self->spaces);
    PyMem_Free(self->free_spaces);
    PyMem_Free(self->digest);
    PyMem_Free(self->hashes);
    PyMem_Free(self->space_of);
    PyMem_Free(self->free);
    PyMem_Free(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
sk_sizeof(SlotKeys *self, PyObject *unused)
{
    size_t n = sizeof(SlotKeys) + self->spaces_cap * sizeof(Space)
        + self->free_spaces_cap * sizeof(Py_ssize_t)
        + self->slots_cap * (sizeof(PyObject *) + sizeof(Py_hash_t) + sizeof(uint32_t))
        + self->free_cap * sizeof(Py_ssize_t) + self->tsize * sizeof(int32_t);
    return PyLong_FromSize_t(n);
}

static PyMethodDef sk_methods[] = {
    {"slot", (PyCFunction)sk_slot, METH_O, "key's slot, or None when it has none."},
    {"add", (PyCFunction)sk_add, METH_O, "A slot for key: its own if it has one, else a new one."},
    {"add_many", (PyCFunction)sk_add_many, METH_O, "add of each key, in order: their slots."},
    {"key", (PyCFunction)sk_key, METH_O, "The key of a slot in use."},
    {"name", (PyCFunction)sk_name, METH_O, "A name for the key a slot holds now."},
    {"remove", (PyCFunction)sk_remove, METH_O, "Give a slot back."},
    {"slot_named", (PyCFunction)(void (*)(void))sk_slot_named, METH_FASTCALL,
     "The slot an eviction policy's name stands for (-1: none)."},
    {"slots", (PyCFunction)sk_slots, METH_NOARGS, "Every slot in use."},
    {"space_number", (PyCFunction)sk_space_number, METH_O, "The number of a slot's space."},
    {"__sizeof__", (PyCFunction)sk_sizeof, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef sk_getset[] = {
    {"capacity", (getter)sk_capacity, NULL, "One past the highest slot ever given.", NULL},
    {"_spaces", (getter)sk_spaces, NULL, "(meta, layer) per space number (None: free).", NULL},
    {"_space_ids", (getter)sk_space_ids, NULL, "(meta, layer) -> space number (a copy).", NULL},
    {NULL},
};

static PySequenceMethods sk_as_sequence = {
    .sq_length = (lenfunc)sk_len,
};

static PyTypeObject SlotKeysType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lmkv._ext._slots.SlotKeys",
    .tp_basicsize = sizeof(SlotKeys),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "CacheKey <-> dense slot (lmkv.keys.slots.SlotKeys, in C).",
    .tp_new = sk_new,
    .tp_init = (initproc)sk_init,
    .tp_dealloc = (destructor)sk_dealloc,
    .tp_traverse = (traverseproc)sk_traverse,
    .tp_clear = (inquiry)sk_clear,
    .tp_methods = sk_methods,
    .tp_getset = sk_getset,
    .tp_as_sequence = &sk_as_sequence,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "lmkv._ext._slots",
    "Cache keys numbered by dense slots, in C (lmkv.keys.slots).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__slots(void)
{
    if (PyType_Ready(&SlotKeysType) < 0)
        return NULL;
    s_meta = PyUnicode_InternFromString("meta");
    s_layer = PyUnicode_InternFromString("layer");
    s_chunk_hash = PyUnicode_InternFromString("chunk_hash");
    s_from_bytes = PyUnicode_InternFromString("from_bytes");
    s_little = PyUnicode_InternFromString("little");
    if (!s_meta || !s_layer || !s_chunk_hash || !s_from_bytes || !s_little)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SlotKeysType);
    if (PyModule_AddObject(m, "SlotKeys", (PyObject *)&SlotKeysType) < 0) {
        Py_DECREF(&SlotKeysType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
