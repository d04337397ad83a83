/* The radix tree's per-node loops, compiled: the walk down a root path, the lock count along a
 * root path, and the recency stamp of a path. Each does exactly what its Python version in
 * path_loops.py does (the reference; tests run both on the same trees), on the same `Node`
 * objects through their attributes, without interpreting a bytecode per node.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *s_children, *s_key, *s_lock_ref, *s_n_gpu, *s_n_resident, *s_parent,
    *s_last_access, *s_n_blocks;

/* An int attribute of `node` as a C long; -1 with an exception set on failure. */
static long int_attr(PyObject *node, PyObject *name) {
    PyObject *value = PyObject_GetAttr(node, name);
    if (value == NULL) return -1;
    long out = PyLong_AsLong(value);
    Py_DECREF(value);
    return out;
}

/* walk(root, raw, block_bytes) -> (path, last_blocks), as path_loops.walk. */
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

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "walk(root, raw, block_bytes) -> (path, last_blocks)"},
    {"lock_path", lock_path, METH_VARARGS, "lock_path(node, root, delta) -> (gpu_blocks, resident_blocks)"},
    {"stamp", stamp, METH_VARARGS, "stamp(path, clock)"},
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
    if (!s_children || !s_key || !s_lock_ref || !s_n_gpu || !s_n_resident || !s_parent || !s_last_access ||
        !s_n_blocks)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_SHA256", PATH_LOOPS_SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
