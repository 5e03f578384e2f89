// The compiled loops of services/master/block_ids.py: the same table, the same layout, one
// pass per batch instead of a dozen numpy calls. Plain CPython (no torch: the master never
// loads it), arrays passed as buffers and checked here; the Python side keeps the state
// (free ids, counts, when to grow) and calls these with the GIL held.
//
//   table (buckets, 16) uint32: tags in ways 0..7 (0 = empty), ids in 8..15
//   keys  (capacity, 2) uint64: (lo, hi) of the hash with that id
//   w     (n, 4)        uint32: lo low, lo high, hi low, hi high (block_ids.words)
//
// A hash's buckets: an even one from lo's low word, an odd one from hi's; its tag is lo's
// high word with the low bit set.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace {

constexpr int kWays = 8;
constexpr int kRow = 2 * kWays;
// Hashes (or buckets) ahead whose rows are fetched while this one is handled: the table is
// hundreds of MB at ten million blocks, so nearly every bucket is a cache miss, and misses
// overlap only when they are asked for before they are needed.
constexpr Py_ssize_t kAhead = 8;

struct Buf {
    Py_buffer view{};
    bool held = false;
    ~Buf() {
        if (held) PyBuffer_Release(&view);
    }
};

// `obj` as a C-contiguous buffer of `itemsize`-byte items, `cols` to a row; writable if asked.
bool get(PyObject* obj, Buf& b, Py_ssize_t itemsize, Py_ssize_t cols, bool writable,
         const char* name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b.view, flags) != 0) return false;
    b.held = true;
    if (b.view.itemsize != itemsize || b.view.len % (itemsize * cols) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: want %zd-byte items, %zd to a row", name, itemsize,
                     cols);
        return false;
    }
    return true;
}

struct Table {
    uint32_t* rows;
    uint64_t buckets;  // a power of two
    const uint64_t* keys;
    uint64_t capacity;  // ids with a key slot

    uint64_t even(const uint32_t* w) const { return w[0] & (buckets - 1) & ~uint64_t{1}; }
    uint64_t odd(const uint32_t* w) const { return (w[2] & (buckets - 1)) | 1; }

    int64_t find_in(uint64_t b, const uint32_t* w) const {
        const uint32_t tag = w[1] | 1;
        const uint32_t* row = rows + b * kRow;
        uint64_t lo, hi;
        std::memcpy(&lo, w, 8);
        std::memcpy(&hi, w + 2, 8);
        for (int way = 0; way < kWays; ++way) {
            if (row[way] != tag) continue;
            const uint64_t id = row[kWays + way];
            if (id < capacity && keys[2 * id] == lo && keys[2 * id + 1] == hi)
                return static_cast<int64_t>(id);
        }
        return -1;
    }

    int64_t find(const uint32_t* w) const {
        const int64_t id = find_in(even(w), w);
        return id >= 0 ? id : find_in(odd(w), w);
    }

    void prefetch(const uint32_t* w) const {
        __builtin_prefetch(rows + even(w) * kRow, 1);
        __builtin_prefetch(rows + odd(w) * kRow, 1);
    }
};

int free_ways(const uint32_t* row) {
    int n = 0;
    for (int way = 0; way < kWays; ++way) n += row[way] == 0;
    return n;
}

bool table_of(PyObject* table, PyObject* keys, Buf& tb, Buf& kb, bool writable, Table& t) {
    if (!get(table, tb, 4, kRow, writable, "table") || !get(keys, kb, 8, 2, true, "keys"))
        return false;
    t.rows = static_cast<uint32_t*>(tb.view.buf);
    t.buckets = static_cast<uint64_t>(tb.view.len / (4 * kRow));
    t.keys = static_cast<const uint64_t*>(kb.view.buf);
    t.capacity = static_cast<uint64_t>(kb.view.len / 16);
    if (t.buckets < 2 || (t.buckets & (t.buckets - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "table: buckets must be a power of two, at least 2");
        return false;
    }
    return true;
}

// find(table, keys, w, out): out[i] = the id of hash i, or -1.
PyObject* find(PyObject*, PyObject* args) {
    PyObject *table, *keys, *w, *out;
    if (!PyArg_ParseTuple(args, "OOOO", &table, &keys, &w, &out)) return nullptr;
    Buf tb, kb, wb, ob;
    Table t{};
    if (!table_of(table, keys, tb, kb, false, t) || !get(w, wb, 4, 4, false, "w") ||
        !get(out, ob, 8, 1, true, "out"))
        return nullptr;
    const Py_ssize_t n = wb.view.len / 16;
    if (ob.view.len / 8 != n) return PyErr_Format(PyExc_ValueError, "out: want %zd ids", n);
    const auto* ws = static_cast<const uint32_t*>(wb.view.buf);
    auto* ids = static_cast<int64_t*>(ob.view.buf);
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (i + kAhead < n) t.prefetch(ws + 4 * (i + kAhead));
        ids[i] = t.find(ws + 4 * i);
    }
    Py_RETURN_NONE;
}

// intern(table, keys, w, out, free, nfree, next) -> (done, nfree, next, added)
// out[i] = the id of hash i, a new one (the top of the free stack, else `next`) for a hash
// not here, placed in the emptier of its buckets. Stops before the first hash whose buckets
// are both full (done < n: the caller grows the table and goes on from there). The caller
// makes room in `keys` for every new id beforehand.
PyObject* intern(PyObject*, PyObject* args) {
    PyObject *table, *keys, *w, *out, *free_;
    Py_ssize_t nfree, next;
    if (!PyArg_ParseTuple(args, "OOOOOnn", &table, &keys, &w, &out, &free_, &nfree, &next))
        return nullptr;
    Buf tb, kb, wb, ob, fb;
    Table t{};
    if (!table_of(table, keys, tb, kb, true, t) || !get(w, wb, 4, 4, false, "w") ||
        !get(out, ob, 8, 1, true, "out") || !get(free_, fb, 8, 1, false, "free"))
        return nullptr;
    const Py_ssize_t n = wb.view.len / 16;
    if (ob.view.len / 8 != n) return PyErr_Format(PyExc_ValueError, "out: want %zd ids", n);
    if (nfree < 0 || nfree > fb.view.len / 8 || next < 0)
        return PyErr_Format(PyExc_ValueError, "bad free stack (%zd) or next (%zd)", nfree, next);
    const auto* ws = static_cast<const uint32_t*>(wb.view.buf);
    auto* ids = static_cast<int64_t*>(ob.view.buf);
    const auto* freed = static_cast<const int64_t*>(fb.view.buf);
    auto* keys_out = static_cast<uint64_t*>(kb.view.buf);
    Py_ssize_t i = 0, added = 0;
    for (; i < n; ++i) {
        const uint32_t* h = ws + 4 * i;
        if (i + kAhead < n) t.prefetch(ws + 4 * (i + kAhead));
        int64_t id = t.find(h);
        if (id < 0) {
            const uint64_t b0 = t.even(h), b1 = t.odd(h);
            uint32_t* r0 = t.rows + b0 * kRow;
            uint32_t* r1 = t.rows + b1 * kRow;
            const int f0 = free_ways(r0), f1 = free_ways(r1);
            if (f0 == 0 && f1 == 0) break;
            uint32_t* row = f0 >= f1 ? r0 : r1;
            id = nfree > 0 ? freed[--nfree] : next++;
            if (static_cast<uint64_t>(id) >= t.capacity)
                return PyErr_Format(PyExc_ValueError, "keys: no room for id %zd",
                                    static_cast<Py_ssize_t>(id));
            std::memcpy(keys_out + 2 * id, h, 16);
            int way = 0;
            while (row[way] != 0) ++way;
            row[way] = h[1] | 1;
            row[kWays + way] = static_cast<uint32_t>(id);
            ++added;
        }
        ids[i] = id;
    }
    return Py_BuildValue("nnnn", i, nfree, next, added);
}

// discard(table, keys, ids): clear each (live, distinct) id's way.
PyObject* discard(PyObject*, PyObject* args) {
    PyObject *table, *keys, *ids_;
    if (!PyArg_ParseTuple(args, "OOO", &table, &keys, &ids_)) return nullptr;
    Buf tb, kb, ib;
    Table t{};
    if (!table_of(table, keys, tb, kb, true, t) || !get(ids_, ib, 8, 1, false, "ids"))
        return nullptr;
    const auto* ids = static_cast<const int64_t*>(ib.view.buf);
    for (Py_ssize_t i = 0; i < ib.view.len / 8; ++i) {
        const uint64_t id = static_cast<uint64_t>(ids[i]);
        if (id >= t.capacity)
            return PyErr_Format(PyExc_ValueError, "no such id %zd", static_cast<Py_ssize_t>(ids[i]));
        uint32_t h[4];
        std::memcpy(h, t.keys + 2 * id, 16);
        bool gone = false;
        for (const uint64_t b : {t.even(h), t.odd(h)}) {
            uint32_t* row = t.rows + b * kRow;
            for (int way = 0; way < kWays && !gone; ++way) {
                if (row[way] != 0 && row[kWays + way] == id) {
                    row[way] = 0;
                    gone = true;
                }
            }
            if (gone) break;
        }
        if (!gone)
            return PyErr_Format(PyExc_ValueError, "id %zd is not in the table",
                                static_cast<Py_ssize_t>(ids[i]));
    }
    Py_RETURN_NONE;
}

// grow(old, new, keys): `new` (twice the buckets, zeroed) gets old's entries, each in bucket
// i or i + old size by the bit its bucket's word gains, in the same way.
PyObject* grow(PyObject*, PyObject* args) {
    PyObject *old, *new_, *keys;
    if (!PyArg_ParseTuple(args, "OOO", &old, &new_, &keys)) return nullptr;
    Buf ob, nb, kb;
    Table t{};
    if (!table_of(new_, keys, nb, kb, true, t) || !get(old, ob, 4, kRow, false, "old"))
        return nullptr;
    const uint64_t size = static_cast<uint64_t>(ob.view.len / (4 * kRow));
    if (2 * size != t.buckets) return PyErr_Format(PyExc_ValueError, "new: want twice the buckets");
    const auto* rows = static_cast<const uint32_t*>(ob.view.buf);
    for (uint64_t b = 0; b < size; ++b) {
        if (b + kAhead < size) {  // the keys of the entries a few buckets on
            const uint32_t* ahead = rows + (b + kAhead) * kRow;
            for (int way = 0; way < kWays; ++way)
                if (ahead[way] != 0 && ahead[kWays + way] < t.capacity)
                    __builtin_prefetch(t.keys + 2 * ahead[kWays + way]);
        }
        const uint32_t* row = rows + b * kRow;
        for (int way = 0; way < kWays; ++way) {
            if (row[way] == 0) continue;
            const uint64_t id = row[kWays + way];
            if (id >= t.capacity) return PyErr_Format(PyExc_ValueError, "no key for id %zd",
                                                      static_cast<Py_ssize_t>(id));
            const uint64_t word = t.keys[2 * id + (b & 1)];
            uint32_t* to = t.rows + (b + ((word & size) ? size : 0)) * kRow;
            to[way] = row[way];
            to[kWays + way] = row[kWays + way];
        }
    }
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"find", find, METH_VARARGS, "find(table, keys, w, out)"},
    {"intern", intern, METH_VARARGS, "intern(table, keys, w, out, free, nfree, next)"},
    {"discard", discard, METH_VARARGS, "discard(table, keys, ids)"},
    {"grow", grow, METH_VARARGS, "grow(old, new, keys)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_table",
                      "services/master/block_ids.py's table loops, compiled.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__block_table() { return PyModule_Create(&module); }
