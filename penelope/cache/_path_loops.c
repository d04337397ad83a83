/* The radix tree's per-node loops, compiled: the walk down a root path, the lock count along a
 * root path, the recency stamp of a path, the gather of a path's slots, the prefix hashes of a
 * run of blocks, and the checks of the slots a tree takes (whole pages, then the pages). Each
 * does exactly what its Python version in path_loops.py does (the reference; tests run both on
 * the same trees), on the same `Node` objects through their attributes and on numpy arrays
 * through the buffer protocol, without interpreting a bytecode per node, block or page.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

static PyObject *s_children, *s_key, *s_lock_ref, *s_n_gpu, *s_n_resident, *s_parent,
    *s_last_access, *s_n_blocks, *s_slots;

/* An int attribute of `node` as a C long; -1 with an exception set on failure. */
static long int_attr(PyObject *node, PyObject *name) {
    PyObject *value = PyObject_GetAttr(node, name);
    if (value == NULL) return -1;
    long out = PyLong_AsLong(value);
    Py_DECREF(value);
    return out;
}

/* walk(root, raw, block_bytes) -> (path, last_blocks), as path_loops.walk; `raw` is any
 * C-contiguous buffer (bytes, or the int64 token array itself, read in place). */
static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *root;
    Py_buffer raw;
    Py_ssize_t bb;
    if (!PyArg_ParseTuple(args, "Oy*n", &root, &raw, &bb)) return NULL;
    PyObject *path = PyList_New(0);
    PyObject *children = path ? PyObject_GetAttr(root, s_children) : NULL;
    PyObject *result = NULL;
    const char *bytes = (const char *)raw.buf;
    Py_ssize_t end = raw.len, pos = 0;
    if (children == NULL || bb <= 0 || bb % 8) {
        if (children != NULL) PyErr_SetString(PyExc_ValueError, "block_bytes must be a positive multiple of 8");
        goto done;
    }
    Py_ssize_t steps = 0;
    while (pos < end) {
        if (++steps % 4096 == 0 && PyErr_CheckSignals() < 0) goto done;
        PyObject *first = PyBytes_FromStringAndSize(bytes + pos, pos + bb <= end ? bb : end - pos);
        if (first == NULL) goto done;
        PyObject *child = PyDict_GetItemWithError(children, first);
        Py_DECREF(first);
        if (child == NULL) {
            if (PyErr_Occurred()) goto done;
            break;
        }
        /* Held while its attributes are read: reading them may run code that drops it. */
        Py_INCREF(child);
        PyObject *key = PyObject_GetAttr(child, s_key);
        int appended = key != NULL ? PyList_Append(path, child) : -1;
        if (key == NULL || appended < 0 || !PyBytes_Check(key)) {
            if (key != NULL && appended == 0) PyErr_SetString(PyExc_TypeError, "a node's key must be bytes");
            Py_XDECREF(key);
            Py_DECREF(child);
            goto done;
        }
        Py_ssize_t klen = PyBytes_GET_SIZE(key);
        const char *kbuf = PyBytes_AS_STRING(key);
        if (klen > 0 && klen <= end - pos && memcmp(bytes + pos, kbuf, (size_t)klen) == 0) {
            /* The whole node matches: the common case. */
            Py_DECREF(key);
            pos += klen;
            Py_DECREF(children);
            children = PyObject_GetAttr(child, s_children);
            Py_DECREF(child);
            if (children == NULL) goto done;
            continue;
        }
        Py_DECREF(child);
        /* The walk stops inside this node: at the first block holding a differing token, or
         * where the tokens end. */
        Py_ssize_t n = klen < end - pos ? klen : end - pos;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (bytes[pos + i] != kbuf[i]) {
                n = i / bb * bb;
                break;
            }
        }
        Py_DECREF(key);
        result = Py_BuildValue("(On)", path, n / bb);
        goto done;
    }
    {
        Py_ssize_t n_path = PyList_GET_SIZE(path);
        long last = 0;
        if (n_path) {
            last = int_attr(PyList_GET_ITEM(path, n_path - 1), s_n_blocks);
            if (last == -1 && PyErr_Occurred()) goto done;
        }
        result = Py_BuildValue("(Ol)", path, last);
    }
done:
    Py_XDECREF(children);
    Py_XDECREF(path);
    PyBuffer_Release(&raw);
    return result;
}

/* lock_path(node, root, delta) -> (gpu_blocks, resident_blocks), as path_loops.lock_path. */
static PyObject *lock_path(PyObject *self, PyObject *args) {
    PyObject *node, *root;
    long delta;
    if (!PyArg_ParseTuple(args, "OOl", &node, &root, &delta)) return NULL;
    long edge = delta > 0 ? 1 : 0, gpu = 0, resident = 0;
    Py_ssize_t steps = 0;
    Py_INCREF(node);
    while (node != root) {
        if (++steps % 4096 == 0 && PyErr_CheckSignals() < 0) goto fail;
        if (node == Py_None) {
            Py_DECREF(node);
            PyErr_SetString(PyExc_ValueError, "the node is not under this root");
            return NULL;
        }
        long count = int_attr(node, s_lock_ref);
        if (count == -1 && PyErr_Occurred()) goto fail;
        if (__builtin_add_overflow(count, delta, &count)) {
            PyErr_SetString(PyExc_OverflowError, "lock count out of range");
            goto fail;
        }
        PyObject *value = PyLong_FromLong(count);
        if (value == NULL) goto fail;
        int failed = PyObject_SetAttr(node, s_lock_ref, value);
        Py_DECREF(value);
        if (failed) goto fail;
        if (count == edge) {
            long g = int_attr(node, s_n_gpu), r;
            if (g == -1 && PyErr_Occurred()) goto fail;
            r = int_attr(node, s_n_resident);
            if (r == -1 && PyErr_Occurred()) goto fail;
            if (__builtin_add_overflow(gpu, g, &gpu) || __builtin_add_overflow(resident, r, &resident)) {
                PyErr_SetString(PyExc_OverflowError, "block count out of range");
                goto fail;
            }
        }
        PyObject *parent = PyObject_GetAttr(node, s_parent);
        if (parent == NULL) goto fail;
        Py_DECREF(node);
        node = parent;
    }
    Py_DECREF(node);
    return Py_BuildValue("(ll)", gpu, resident);
fail:
    Py_DECREF(node);
    return NULL;
}

/* stamp(path, clock): every node's last_access = clock, as path_loops.stamp. */
static PyObject *stamp(PyObject *self, PyObject *args) {
    PyObject *path, *clock;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &path, &clock)) return NULL;
    /* The size is read again at every step: setting an attribute may run code that changes the
     * list; each node is held while its attribute is set. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path); i++) {
        PyObject *node = PyList_GET_ITEM(path, i);
        Py_INCREF(node);
        int failed = PyObject_SetAttr(node, s_last_access, clock);
        Py_DECREF(node);
        if (failed < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* The data and length of `obj`, a 1-D C-contiguous numpy array of `itemsize`-byte integers (or
 * booleans, if `bools`) in native byte order, writable if asked; 0, or -1 with an exception set.
 * The caller keeps a reference to `obj` while it uses the data. */
static int int_array(PyObject *obj, int itemsize, int bools, int writable, const char *what, char **data,
                     Py_ssize_t *n) {
    PyArrayObject *array = (PyArrayObject *)obj;
    if (!PyArray_Check(obj) || PyArray_NDIM(array) != 1 || PyArray_ITEMSIZE(array) != itemsize ||
        !(PyArray_ISINTEGER(array) || (bools && PyArray_ISBOOL(array))) || !PyArray_ISNOTSWAPPED(array) ||
        !PyArray_IS_C_CONTIGUOUS(array) || (writable && !PyArray_ISWRITEABLE(array))) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D contiguous%s numpy array of %d-byte integers", what,
                     writable ? " writable" : "", itemsize);
        return -1;
    }
    *data = PyArray_BYTES(array);
    *n = PyArray_DIM(array, 0);
    return 0;
}

/* gather(path, out): the nodes' int32 slots one after the other into int64 `out`, whose length
 * must be their total; as path_loops.gather. */
static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *path, *out_obj;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &path, &out_obj)) return NULL;
    char *out_data;
    Py_ssize_t room, pos = 0;
    if (int_array(out_obj, 8, 0, 1, "out", &out_data, &room) < 0) return NULL;
    Py_INCREF(out_obj);
    /* The list's size and `out` are read again at every step: reading an attribute may run code
     * that changes the list or resizes `out`; each node is held while it is read. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path); i++) {
        PyObject *node = PyList_GET_ITEM(path, i);
        Py_INCREF(node);
        PyObject *slots = PyObject_GetAttr(node, s_slots);
        Py_DECREF(node);
        char *src_data;
        Py_ssize_t n;
        if (slots == NULL) goto fail;
        if (int_array(slots, 4, 0, 0, "a node's slots", &src_data, &n) < 0 ||
            int_array(out_obj, 8, 0, 1, "out", &out_data, &room) < 0) {
            Py_DECREF(slots);
            goto fail;
        }
        int64_t *dest = (int64_t *)out_data;
        if (n > room - pos) {
            Py_DECREF(slots);
            PyErr_SetString(PyExc_ValueError, "out is shorter than the path's slots");
            goto fail;
        }
        const int32_t *src = (const int32_t *)src_data;
        for (Py_ssize_t j = 0; j < n; j++) dest[pos + j] = src[j];
        pos += n;
        Py_DECREF(slots);
    }
    if (int_array(out_obj, 8, 0, 1, "out", &out_data, &room) < 0) goto fail;
    if (pos != room) {
        PyErr_SetString(PyExc_ValueError, "out is longer than the path's slots");
        goto fail;
    }
    Py_DECREF(out_obj);
    Py_RETURN_NONE;
fail:
    Py_DECREF(out_obj);
    return NULL;
}

/* prefix_hashes(base, tokens, mix, radix, out): out[i] = H_i for the blocks of `tokens` (int64,
 * len(out) * len(mix) of them), H_i = H_{i-1} * radix + d_i + 1 mod 2**64 from H_{-1} = base,
 * d_i = sum_j tokens[i * bs + j] * mix[j] mod 2**64; as path_loops.prefix_hashes. */
static PyObject *prefix_hashes(PyObject *self, PyObject *args) {
    PyObject *base_obj, *radix_obj, *tokens_obj, *mix_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOOOO", &base_obj, &tokens_obj, &mix_obj, &radix_obj, &out_obj)) return NULL;
    uint64_t hash = PyLong_AsUnsignedLongLong(base_obj), radix;
    if (PyErr_Occurred()) return NULL;
    radix = PyLong_AsUnsignedLongLong(radix_obj);
    if (PyErr_Occurred()) return NULL;
    char *t_data, *m_data, *h_data;
    Py_ssize_t n_tokens, bs, k;
    if (int_array(tokens_obj, 8, 0, 0, "tokens", &t_data, &n_tokens) < 0 ||
        int_array(mix_obj, 8, 0, 0, "mix", &m_data, &bs) < 0 || int_array(out_obj, 8, 0, 1, "out", &h_data, &k) < 0)
        return NULL;
    if (bs == 0 || n_tokens != k * bs) {
        PyErr_SetString(PyExc_ValueError, "tokens must hold len(out) blocks of len(mix) tokens");
        return NULL;
    }
    const uint64_t *t = (const uint64_t *)t_data, *m = (const uint64_t *)m_data;
    uint64_t *h = (uint64_t *)h_data;
    for (Py_ssize_t i = 0; i < k; i++) {
        uint64_t digest = 0;
        for (Py_ssize_t j = 0; j < bs; j++) digest += t[i * bs + j] * m[j];
        hash = hash * radix + digest + 1;
        h[i] = hash;
    }
    Py_RETURN_NONE;
}

/* page_problem(pages, end, held, listed, scratch) -> 0, or the first check `pages` (int64 page
 * ids) fail, in this order: 1 a page outside [1, end), 2 a page flagged in `held` (bool, one per
 * page id below `end`), 3 a page passed twice, 4 a page in `listed` (int64 page ids, or None;
 * ids outside `scratch` are ignored); `scratch` (one byte per page id, at least `end`, all 0) is
 * left all 0; as path_loops.page_problem. */
static PyObject *page_problem(PyObject *self, PyObject *args) {
    PyObject *pages_obj, *held_obj, *listed_obj, *scratch_obj;
    Py_ssize_t end;
    if (!PyArg_ParseTuple(args, "OnOOO", &pages_obj, &end, &held_obj, &listed_obj, &scratch_obj)) return NULL;
    char *p_data, *held, *l_data = NULL, *scratch;
    Py_ssize_t n_pages, n_held, n_listed = 0, n_scratch, i;
    if (int_array(pages_obj, 8, 0, 0, "pages", &p_data, &n_pages) < 0 ||
        int_array(held_obj, 1, 1, 0, "held", &held, &n_held) < 0 ||
        (listed_obj != Py_None && int_array(listed_obj, 8, 0, 0, "listed", &l_data, &n_listed) < 0) ||
        int_array(scratch_obj, 1, 1, 1, "scratch", &scratch, &n_scratch) < 0)
        return NULL;
    if (end > n_held || end > n_scratch) {
        PyErr_SetString(PyExc_ValueError, "held and scratch must cover every page id below end");
        return NULL;
    }
    const int64_t *p = (const int64_t *)p_data, *l = (const int64_t *)l_data;
    long problem = 0;
    for (i = 0; i < n_pages; i++)
        if (p[i] < 1 || p[i] >= end) return PyLong_FromLong(1);
    for (i = 0; i < n_pages; i++)
        if (held[p[i]]) return PyLong_FromLong(2);
    /* Every page is marked 1 as it is seen (a page seen marked was passed before), then the
     * listed ones 2 on top; all marks are cleared before returning. */
    for (i = 0; i < n_pages && !problem; i++) {
        if (scratch[p[i]]) problem = 3;
        scratch[p[i]] = 1;
    }
    if (!problem && l != NULL) {
        for (i = 0; i < n_listed; i++)
            if (l[i] >= 0 && l[i] < n_scratch && scratch[l[i]] == 1) problem = 4;
    }
    for (i = 0; i < n_pages; i++) scratch[p[i]] = 0;
    return PyLong_FromLong(problem);
}

/* whole_pages(slots, page, out) -> bool: whether int64 `slots` are whole pages of `page` slots in
 * order, writing the page ids to `out` if so; as path_loops.whole_pages. A page whose slots would
 * pass INT64_MAX is not one, so first + j below never overflows. */
static PyObject *whole_pages(PyObject *self, PyObject *args) {
    PyObject *slots_obj, *out_obj;
    Py_ssize_t page;
    if (!PyArg_ParseTuple(args, "OnO", &slots_obj, &page, &out_obj)) return NULL;
    char *s_data, *o_data;
    Py_ssize_t n, m;
    if (int_array(slots_obj, 8, 0, 0, "slots", &s_data, &n) < 0 || int_array(out_obj, 8, 0, 1, "out", &o_data, &m) < 0)
        return NULL;
    if (page <= 0) {
        PyErr_SetString(PyExc_ValueError, "page must be positive");
        return NULL;
    }
    if (n % page) Py_RETURN_FALSE;
    if (m != n / page) {
        PyErr_SetString(PyExc_ValueError, "out must hold one page id per page");
        return NULL;
    }
    const int64_t *s = (const int64_t *)s_data;
    int64_t *o = (int64_t *)o_data;
    for (Py_ssize_t i = 0; i < m; i++) {
        const int64_t *row = s + i * page;
        int64_t first = row[0];
        if (first % page || first > INT64_MAX - (page - 1)) Py_RETURN_FALSE;
        for (Py_ssize_t j = 1; j < page; j++)
            if (row[j] != first + j) Py_RETURN_FALSE;
        /* Exact: `first` is a multiple of `page`. */
        o[i] = first / page;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "walk(root, raw, block_bytes) -> (path, last_blocks)"},
    {"lock_path", lock_path, METH_VARARGS, "lock_path(node, root, delta) -> (gpu_blocks, resident_blocks)"},
    {"stamp", stamp, METH_VARARGS, "stamp(path, clock)"},
    {"gather", gather, METH_VARARGS, "gather(path, out)"},
    {"prefix_hashes", prefix_hashes, METH_VARARGS, "prefix_hashes(base, tokens, mix, radix, out)"},
    {"page_problem", page_problem, METH_VARARGS, "page_problem(pages, end, held, listed, scratch) -> 0..4"},
    {"whole_pages", whole_pages, METH_VARARGS, "whole_pages(slots, page, out) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_path_loops", NULL, -1, methods};

/* setup.py defines the SHA-256 of this file, so a test can tell a stale build from a current one. */
#ifndef PATH_LOOPS_SOURCE_SHA256
#define PATH_LOOPS_SOURCE_SHA256 "unknown"
#endif

PyMODINIT_FUNC PyInit__path_loops(void) {
    s_children = PyUnicode_InternFromString("children");
    s_key = PyUnicode_InternFromString("key");
    s_lock_ref = PyUnicode_InternFromString("lock_ref");
    s_n_gpu = PyUnicode_InternFromString("n_gpu");
    s_n_resident = PyUnicode_InternFromString("n_resident");
    s_parent = PyUnicode_InternFromString("parent");
    s_last_access = PyUnicode_InternFromString("last_access");
    s_n_blocks = PyUnicode_InternFromString("n_blocks");
    s_slots = PyUnicode_InternFromString("slots");
    if (!s_children || !s_key || !s_lock_ref || !s_n_gpu || !s_n_resident || !s_parent || !s_last_access ||
        !s_n_blocks || !s_slots)
        return NULL;
    import_array();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_SHA256", PATH_LOOPS_SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
