/* The radix tree's per-node loops, compiled: the walk down a root path, the lock count along a
 * root path, and the recency stamp of a path. Each does exactly what its Python version in
 * path_loops.py does (the reference; tests run both on the same trees), on the same `Node`
 * objects through their attributes, without interpreting a bytecode per node.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *s_children, *s_key, *s_end, *s_lock_ref, *s_n_gpu, *s_n_resident, *s_parent,
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
    if (children == NULL || bb <= 0) {
        if (bb <= 0 && children != NULL) PyErr_SetString(PyExc_ValueError, "block_bytes must be positive");
        goto done;
    }
    while (pos < end) {
        PyObject *first = PyBytes_FromStringAndSize(bytes + pos, pos + bb <= end ? bb : end - pos);
        if (first == NULL) goto done;
        PyObject *child = PyDict_GetItemWithError(children, first); /* borrowed */
        Py_DECREF(first);
        if (child == NULL) {
            if (PyErr_Occurred()) goto done;
            break;
        }
        PyObject *key = PyObject_GetAttr(child, s_key);
        if (key == NULL) goto done;
        if (!PyBytes_Check(key)) {
            Py_DECREF(key);
            PyErr_SetString(PyExc_TypeError, "a node's key must be bytes");
            goto done;
        }
        Py_ssize_t klen = PyBytes_GET_SIZE(key);
        const char *kbuf = PyBytes_AS_STRING(key);
        if (PyList_Append(path, child) < 0) {
            Py_DECREF(key);
            goto done;
        }
        if (klen <= end - pos && memcmp(bytes + pos, kbuf, (size_t)klen) == 0) {
            /* The whole node matches: the common case. Positions are absolute. */
            Py_DECREF(key);
            long node_end = int_attr(child, s_end);
            if (node_end == -1 && PyErr_Occurred()) goto done;
            pos = (Py_ssize_t)node_end * 8;
            Py_DECREF(children);
            children = PyObject_GetAttr(child, s_children);
            if (children == NULL) goto done;
            continue;
        }
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
    Py_INCREF(node);
    while (node != root) {
        if (node == Py_None) {
            Py_DECREF(node);
            PyErr_SetString(PyExc_ValueError, "the node is not under this root");
            return NULL;
        }
        long count = int_attr(node, s_lock_ref);
        if (count == -1 && PyErr_Occurred()) goto fail;
        count += delta;
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
            gpu += g;
            resident += r;
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
    Py_ssize_t n = PyList_GET_SIZE(path);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_SetAttr(PyList_GET_ITEM(path, i), s_last_access, clock) < 0) return NULL;
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

PyMODINIT_FUNC PyInit__path_loops(void) {
    s_children = PyUnicode_InternFromString("children");
    s_key = PyUnicode_InternFromString("key");
    s_end = PyUnicode_InternFromString("end");
    s_lock_ref = PyUnicode_InternFromString("lock_ref");
    s_n_gpu = PyUnicode_InternFromString("n_gpu");
    s_n_resident = PyUnicode_InternFromString("n_resident");
    s_parent = PyUnicode_InternFromString("parent");
    s_last_access = PyUnicode_InternFromString("last_access");
    s_n_blocks = PyUnicode_InternFromString("n_blocks");
    if (!s_children || !s_key || !s_end || !s_lock_ref || !s_n_gpu || !s_n_resident || !s_parent || !s_last_access ||
        !s_n_blocks)
        return NULL;
    return PyModule_Create(&module);
}
