/* ringwire._wire._cring: the SPSC ring lane's hot path in C, with C11 atomics.

The wire layout is ringwire/_wire/ring.py's, unchanged (the layout is the contract; a
native end and a pure-Python end share one ring): a 512-byte header of native u64
words, each on its own cache line (magic 0, capacity 1, tail 8, head 16,
reader-parked 24, writer-parked 32, writer-closed 40, reader-closed 48), then the data
area of `capacity` bytes holding frames [u32 length][payload] padded to 8 bytes, a
frame never straddling the end (the wrap marker 0xFFFFFFFF sends the reader to
offset 0).

Memory ordering (what each acquire pairs with)
----------------------------------------------
(1) Publish.  The writer copies the length word and the payload into the data area
    with plain stores, then stores the tail with memory_order_release.  The reader
    loads the tail with memory_order_acquire before it reads any frame below it
    (next_frame, read_many, next_pairs, available).  Release/acquire on the tail word:
    every byte of the frames is visible to the reader that saw the new tail.
(2) Hand back.  The reader reads (and decodes: read_many calls `fn`, and `on_error`
    when `fn` raises, before it moves on) every frame below its private head, then
    commit() stores the head with memory_order_release.  The writer loads the head with memory_order_acquire before
    it reuses the space (refresh_head).  So the writer's overwrite of freed space
    happens after the reader's last read of it.  (The pure path relies on a control
    dependency here; an acquire is stronger, and both are correct together: the pure
    reader fences before its head store.)
(3) Eventcount (Dekker).  A parking end stores its parked word, then issues
    atomic_thread_fence(memory_order_seq_cst), then loads the other end's counter
    (park(), then the caller's re-check of available()/fits_now()).  The other end
    stores its counter (the release store of (1) or (2)), issues the same seq_cst fence,
    then loads the parked word (reader_needs_doorbell / writer_needs_doorbell).  Two
    seq_cst fences order the two store->load pairs in one total order, so at least one
    side sees the other's store: either the parker sees the new counter and does not
    sleep, or the publisher sees the parked word and rings.  The pure path's fence (a
    lock round, a full barrier) is the same fence, so a pure end and a native end
    pair up.
(4) Closed flags.  close() is: seq_cst fence, release store of the flag, seq_cst fence;
    the peer loads it with acquire (writer_closed / reader_closed): what was published
    before the close is visible to whoever sees the flag.

On x86-64 the acquire loads and release stores compile to plain moves (TSO) and the
seq_cst fence to one `mfence`; on aarch64 to ldar/stlr and `dmb ish`.

A parser of peer-controlled bytes
---------------------------------
The peer may write anything anywhere in the segment.  Every word read from shared
memory is read once into a local and checked before use, with the pure reader's checks
and exception messages: a tail that runs backwards or past committed + capacity, a
length beyond the largest payload, a frame past the tail or across the end, a
misplaced wrap marker raise RingCorrupted; a head out of range (the writer's view)
raises RingCorrupted.  Every access into the data area is at an offset below
`capacity` by construction (positions are masked; lengths are checked against the
position before any byte is touched), so no peer value moves a pointer out of the
ring.

needs_lift (the codec's lift-pass scan) touches no shared memory: it walks the
caller's own lists and dicts (exact types only, at most 64 levels deep).

Payload views are memoryviews exported by the lane object itself (its buffer
protocol, one export per view), so a lane whose views are alive keeps its own export
of the segment: the mapping cannot be closed under a live view (mmap.close() raises
BufferError, as with the pure path's memoryview slices).
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if ATOMIC_LLONG_LOCK_FREE != 2
#error "ringwire's native ring needs lock-free 8-byte atomics"
#endif

typedef _Atomic uint64_t aword;
_Static_assert(sizeof(aword) == 8, "an atomic u64 must be 8 bytes");

#define HEADER_SIZE 512
#define MIN_CAPACITY 1024ULL
#define MAX_CAPACITY (1ULL << 30)
#define WRAP_MARKER 0xFFFFFFFFU
/* u64 word indices into the header */
#define W_MAGIC 0
#define W_CAPACITY 1
#define W_TAIL 8
#define W_HEAD 16
#define W_RPARKED 24
#define W_WPARKED 32
#define W_WCLOSED 40
#define W_RCLOSED 48

static PyObject *RingCorrupted = NULL; /* set by init_errors() */
static PyObject *FrameTooLarge = NULL;
static uint64_t magic_word = 0;        /* b"RWRING" + u16 version 1, as a native u64 */

typedef struct {
    PyObject_HEAD
    Py_buffer buf;         /* the segment's buffer, held while this lane or a view lives */
    int have_buf;
    int released;          /* release() was called */
    int reader;            /* 1: a RingReader, 0: a RingWriter */
    Py_ssize_t exports;    /* live payload views */
    aword *hdr;            /* NULL once released */
    unsigned char *data;
    uint64_t capacity, mask, max_payload;
    uint64_t tail, head_cache;             /* writer: private tail, last head seen */
    uint64_t head, committed, tail_seen;   /* reader: private head, published head */
    uint64_t park_seq, rung;
    unsigned char *exp_ptr; /* the view being made (see make_view) */
    Py_ssize_t exp_len;
} Lane;

static PyTypeObject WriterType;
static PyTypeObject ReaderType;

/* -- small helpers ----------------------------------------------------------------- */

static inline uint64_t load_acq(Lane *s, int w) {
    return atomic_load_explicit(&s->hdr[w], memory_order_acquire);
}
static inline void store_rel(Lane *s, int w, uint64_t v) {
    atomic_store_explicit(&s->hdr[w], v, memory_order_release);
}
static inline uint32_t load_len(const unsigned char *data, uint64_t pos) {
    uint32_t n;
    /* the u32 that holds byte `pos` (pos is 8-aligned on every honest ring; an odd
       head still reads inside the data area, as the pure reader's d32[pos >> 2]) */
    memcpy(&n, data + (pos & ~(uint64_t)3), 4);
    return n;
}
static inline void store_len(unsigned char *data, uint64_t pos, uint32_t n) {
    memcpy(data + (pos & ~(uint64_t)3), &n, 4);
}

static int check_live(Lane *s) {
    if (s->hdr == NULL) {
        PyErr_SetString(PyExc_ValueError,
                        s->released ? "operation forbidden on a released ring lane"
                                    : "ring lane not initialised");
        return -1;
    }
    return 0;
}
#define LIVE_OR_NULL(s) \
    if (check_live(s)) return NULL

static PyObject *make_view(Lane *s, uint64_t pos, uint64_t n) {
    s->exp_ptr = s->data + pos;
    s->exp_len = (Py_ssize_t)n;
    PyObject *mv = PyMemoryView_FromObject((PyObject *)s);
    s->exp_ptr = NULL;
    return mv;
}

/* the exception being raised, as one object (cleared) */
static PyObject *get_raised(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    if (tb != NULL) PyException_SetTraceback(ev, tb);
    Py_XDECREF(et);
    Py_XDECREF(tb);
    return ev;
#endif
}

/* release a payload view: drop it, releasing it first if something kept a reference
   (an exception already set, by the call that had the view, is kept) */
static int drop_view(PyObject *view) {
    if (Py_REFCNT(view) > 1) {
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *exc = PyErr_GetRaisedException();
#else
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
#endif
        PyObject *r = PyObject_CallMethod(view, "release", NULL);
        int failed = r == NULL;
        Py_XDECREF(r);
#if PY_VERSION_HEX >= 0x030C0000
        if (exc != NULL) {
            if (failed) PyErr_Clear();
            PyErr_SetRaisedException(exc);
        }
#else
        if (et != NULL) {
            if (failed) PyErr_Clear();
            PyErr_Restore(et, ev, tb);
        }
#endif
        Py_DECREF(view);
#if PY_VERSION_HEX >= 0x030C0000
        return failed && exc == NULL ? -1 : 0;
#else
        return failed && et == NULL ? -1 : 0;
#endif
    }
    Py_DECREF(view);
    return 0;
}

/* borrow the bytes of a payload: bytes objects directly, anything else by the buffer
   protocol (held in *pb, released by release_payload) */
static int get_payload(PyObject *o, Py_buffer *pb, const char **p, Py_ssize_t *n) {
    if (PyBytes_CheckExact(o)) {
        pb->obj = NULL;
        *p = PyBytes_AS_STRING(o);
        *n = PyBytes_GET_SIZE(o);
        return 0;
    }
    if (PyObject_GetBuffer(o, pb, PyBUF_SIMPLE) < 0) return -1;
    *p = (const char *)pb->buf;
    *n = pb->len;
    return 0;
}
static inline void release_payload(Py_buffer *pb) {
    if (pb->obj != NULL) PyBuffer_Release(pb);
}

/* -- the lane object: init, buffer export, release ------------------------------------ */

static int lane_init(Lane *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buf", "offset", NULL};
    PyObject *obj;
    Py_ssize_t offset = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|n", kwlist, &obj, &offset)) return -1;
    if (RingCorrupted == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ringwire._wire._cring.init_errors() not called");
        return -1;
    }
    if (s->have_buf || s->released) {
        PyErr_SetString(PyExc_TypeError, "a ring lane is initialised once");
        return -1;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_SIMPLE) < 0) return -1;
    if (b.readonly) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_TypeError, "a ring needs a writable buffer");
        return -1;
    }
    if (offset < 0 || offset > b.len || b.len - offset < HEADER_SIZE) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "buffer too small for a ring header");
        return -1;
    }
    unsigned char *base = (unsigned char *)b.buf + offset;
    if ((uintptr_t)base % 8) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "a ring must start at an 8-byte aligned address");
        return -1;
    }
    aword *hdr = (aword *)base;
    if (atomic_load_explicit(&hdr[W_MAGIC], memory_order_acquire) != magic_word) {
        PyBuffer_Release(&b);
        PyErr_SetString(RingCorrupted, "no ring header here (bad magic)");
        return -1;
    }
    uint64_t cap = atomic_load_explicit(&hdr[W_CAPACITY], memory_order_relaxed);
    if (cap < MIN_CAPACITY || cap > MAX_CAPACITY || (cap & (cap - 1))) {
        PyBuffer_Release(&b);
        PyErr_Format(RingCorrupted,
                     "ring capacity must be a power of two between %llu and %llu bytes, not %llu",
                     MIN_CAPACITY, MAX_CAPACITY, (unsigned long long)cap);
        return -1;
    }
    if ((uint64_t)(b.len - offset - HEADER_SIZE) < cap) {
        PyBuffer_Release(&b);
        PyErr_SetString(RingCorrupted, "buffer too small for the ring's capacity");
        return -1;
    }
    s->buf = b;
    s->have_buf = 1;
    s->hdr = hdr;
    s->data = base + HEADER_SIZE;
    s->capacity = cap;
    s->mask = cap - 1;
    s->max_payload = cap / 2 - 4;
    s->reader = PyObject_TypeCheck((PyObject *)s, &ReaderType);
    s->park_seq = s->rung = 0;
    if (s->reader) {
        s->head = s->committed = load_acq(s, W_HEAD);
        s->tail_seen = load_acq(s, W_TAIL);
    } else {
        s->tail = load_acq(s, W_TAIL);
        s->head_cache = load_acq(s, W_HEAD);
    }
    return 0;
}

static int lane_getbuffer(Lane *s, Py_buffer *view, int flags) {
    if (s->exp_ptr == NULL) {
        PyErr_SetString(PyExc_BufferError, "a ring lane exports only its payload views");
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)s, s->exp_ptr, s->exp_len, 0, flags) < 0)
        return -1;
    s->exports++;
    return 0;
}

static void lane_releasebuffer(Lane *s, Py_buffer *view) {
    (void)view;
    if (--s->exports == 0 && s->released && s->have_buf) {
        s->have_buf = 0;
        PyBuffer_Release(&s->buf);
    }
}

static PyBufferProcs lane_as_buffer = {
    (getbufferproc)lane_getbuffer,
    (releasebufferproc)lane_releasebuffer,
};

static PyObject *lane_release(Lane *s, PyObject *Py_UNUSED(ignored)) {
    s->released = 1;
    s->hdr = NULL;
    s->data = NULL;
    if (s->exports == 0 && s->have_buf) {
        s->have_buf = 0;
        PyBuffer_Release(&s->buf);
    }
    Py_RETURN_NONE;
}

static void lane_dealloc(Lane *s) {
    if (s->have_buf) { /* no views can be alive: each holds a reference to the lane */
        s->have_buf = 0;
        PyBuffer_Release(&s->buf);
    }
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* -- shared: flags and the eventcount ------------------------------------------------ */

static PyObject *lane_writer_closed(Lane *s, void *Py_UNUSED(c)) {
    LIVE_OR_NULL(s);
    return PyBool_FromLong(load_acq(s, W_WCLOSED) != 0);
}

static PyObject *lane_reader_closed(Lane *s, void *Py_UNUSED(c)) {
    LIVE_OR_NULL(s);
    return PyBool_FromLong(load_acq(s, W_RCLOSED) != 0);
}

/* (3): after this end's release store, is the peer parked and not rung for this park? */
static PyObject *lane_peer_needs_doorbell(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    atomic_thread_fence(memory_order_seq_cst);
    uint64_t seq = atomic_load_explicit(&s->hdr[s->reader ? W_WPARKED : W_RPARKED],
                                        memory_order_relaxed);
    if (seq && seq != s->rung) {
        s->rung = seq;
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* (3): store the parked word, then the fence; the caller re-checks the ring after */
static PyObject *lane_park(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    s->park_seq++;
    atomic_store_explicit(&s->hdr[s->reader ? W_RPARKED : W_WPARKED], s->park_seq,
                          memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

static PyObject *lane_unpark(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    atomic_store_explicit(&s->hdr[s->reader ? W_RPARKED : W_WPARKED], 0, memory_order_relaxed);
    Py_RETURN_NONE;
}

/* (4) */
static PyObject *lane_close(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    atomic_thread_fence(memory_order_seq_cst);
    store_rel(s, s->reader ? W_RCLOSED : W_WCLOSED, 1);
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

/* -- the writer --------------------------------------------------------------------- */

static PyObject *too_large(Lane *s, Py_ssize_t n) {
    return PyErr_Format(FrameTooLarge,
                        "a %zd-byte record does not fit a ring of %llu bytes (at most %llu bytes "
                        "per record); send large arrays and tensors through tensor slots, or "
                        "open the channel with a larger capacity",
                        n, (unsigned long long)s->capacity, (unsigned long long)s->max_payload);
}

/* (2): reload the reader's head; 1 if `total` bytes fit now, 0 if not, -1 corrupt */
static int refresh_head(Lane *s, uint64_t tail, uint64_t total) {
    uint64_t head = load_acq(s, W_HEAD);
    if (head < s->head_cache || head > tail) {
        PyErr_Format(RingCorrupted, "head %llu out of range (tail %llu)",
                     (unsigned long long)head, (unsigned long long)tail);
        return -1;
    }
    s->head_cache = head;
    return total <= s->capacity - (tail - head);
}

/* the bytes a `need`-byte frame takes at `tail` (wrap waste included) */
static inline uint64_t total_for(Lane *s, uint64_t tail, uint64_t need) {
    uint64_t to_end = s->capacity - (tail & s->mask);
    return need <= to_end ? need : to_end + need;
}

/* copy one frame at `tail` (room checked); return the new tail */
static inline uint64_t put_frame(Lane *s, uint64_t tail, const char *p, uint64_t n,
                                 uint64_t need) {
    uint64_t pos = tail & s->mask;
    uint64_t to_end = s->capacity - pos;
    if (need > to_end) {
        store_len(s->data, pos, WRAP_MARKER);
        tail += to_end;
        pos = 0;
    }
    store_len(s->data, pos, (uint32_t)n);
    memmove(s->data + pos + 4, p, n);
    return tail + need;
}

/* room for `need` bytes now? 1 yes, 0 no, -1 corrupt (error set) */
static inline int room(Lane *s, uint64_t tail, uint64_t total) {
    if (total <= s->capacity - (tail - s->head_cache)) return 1;
    return refresh_head(s, tail, total);
}

static PyObject *w_try_write(Lane *s, PyObject *payload) {
    LIVE_OR_NULL(s);
    if (atomic_load_explicit(&s->hdr[W_RCLOSED], memory_order_relaxed)) Py_RETURN_NONE;
    Py_buffer pb;
    const char *p;
    Py_ssize_t n;
    if (get_payload(payload, &pb, &p, &n) < 0) return NULL;
    PyObject *res = NULL;
    if ((uint64_t)n > s->max_payload) {
        too_large(s, n);
        goto done;
    }
    uint64_t need = ((uint64_t)n + 11) & ~(uint64_t)7;
    uint64_t tail = s->tail;
    int ok = room(s, tail, total_for(s, tail, need));
    if (ok < 0) goto done;
    if (!ok) {
        res = Py_NewRef(Py_False);
        goto done;
    }
    s->tail = tail = put_frame(s, tail, p, (uint64_t)n, need);
    store_rel(s, W_TAIL, tail); /* (1) */
    res = Py_NewRef(Py_True);
done:
    release_payload(&pb);
    return res;
}

static PyObject *w_write_many(Lane *s, PyObject *const *args, Py_ssize_t nargs) {
    LIVE_OR_NULL(s);
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "write_many(payloads, start=0)");
        return NULL;
    }
    Py_ssize_t start = 0;
    if (nargs == 2) {
        start = PyLong_AsSsize_t(args[1]);
        if (start == -1 && PyErr_Occurred()) return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "write_many needs a sequence of payloads");
    if (seq == NULL) return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (start < 0) start = 0;
    uint64_t tail = s->tail, count = 0, nbytes = 0;
    int failed = 0;
    for (Py_ssize_t i = start; i < len; i++) {
        Py_buffer pb;
        const char *p;
        Py_ssize_t n;
        if (get_payload(items[i], &pb, &p, &n) < 0) {
            Py_DECREF(seq); /* not a payload: nothing of this batch is published (as the */
            return NULL;    /* pure writer, whose len() raises before it publishes) */
        }
        if ((uint64_t)n > s->max_payload) {
            release_payload(&pb);
            if (!count) {
                too_large(s, n);
                failed = 1;
            }
            break;
        }
        uint64_t need = ((uint64_t)n + 11) & ~(uint64_t)7;
        int ok = room(s, tail, total_for(s, tail, need));
        if (ok <= 0) {
            release_payload(&pb);
            if (ok < 0) {
                s->tail = tail;
                Py_DECREF(seq);
                return NULL;
            }
            break;
        }
        tail = put_frame(s, tail, p, (uint64_t)n, need);
        release_payload(&pb);
        count++;
        nbytes += (uint64_t)n;
    }
    Py_DECREF(seq);
    s->tail = tail;
    if (count) store_rel(s, W_TAIL, tail); /* (1), once for the batch */
    if (failed) return NULL;
    return Py_BuildValue("KK", (unsigned long long)count, (unsigned long long)nbytes);
}

static PyObject *w_fits_now(Lane *s, PyObject *arg) {
    LIVE_OR_NULL(s);
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) n = 0;
    uint64_t need = ((uint64_t)n + 11) & ~(uint64_t)7;
    int ok = room(s, s->tail, total_for(s, s->tail, need));
    if (ok < 0) return NULL;
    return PyBool_FromLong(ok);
}

/* the release lane: put one frame (no closed check: the producer reads until the end) */
static PyObject *w_put(Lane *s, PyObject *payload) {
    LIVE_OR_NULL(s);
    Py_buffer pb;
    const char *p;
    Py_ssize_t n;
    if (get_payload(payload, &pb, &p, &n) < 0) return NULL;
    PyObject *res = NULL;
    uint64_t need = ((uint64_t)n + 11) & ~(uint64_t)7;
    uint64_t tail = s->tail;
    int ok = need > s->capacity ? 0 : room(s, tail, total_for(s, tail, need));
    if (ok < 0) goto done;
    if (ok) {
        s->tail = tail = put_frame(s, tail, p, (uint64_t)n, need);
        store_rel(s, W_TAIL, tail); /* (1) */
    }
    res = PyBool_FromLong(ok);
done:
    release_payload(&pb);
    return res;
}

/* the release lane: one frame of native u64 pairs (slot, generation) */
static PyObject *w_put_pairs(Lane *s, PyObject *batch) {
    LIVE_OR_NULL(s);
    PyObject *seq = PySequence_Fast(batch, "put_pairs needs a sequence of (slot, generation)");
    if (seq == NULL) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t n = (uint64_t)k * 16;
    uint64_t need = (n + 11) & ~(uint64_t)7;
    if (need > s->capacity) {
        Py_DECREF(seq);
        Py_RETURN_FALSE;
    }
    uint64_t *words = PyMem_Malloc(k ? (size_t)n : 1);
    if (words == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *pair = items[i];
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "put_pairs needs (slot, generation) tuples");
            goto fail;
        }
        for (int j = 0; j < 2; j++) {
            unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, j));
            if (v == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
            words[2 * i + j] = (uint64_t)v;
        }
    }
    Py_DECREF(seq);
    seq = NULL;
    uint64_t tail = s->tail;
    int ok = room(s, tail, total_for(s, tail, need));
    if (ok > 0) {
        s->tail = tail = put_frame(s, tail, (const char *)words, n, need);
        store_rel(s, W_TAIL, tail); /* (1) */
    }
    PyMem_Free(words);
    if (ok < 0) return NULL;
    return PyBool_FromLong(ok);
fail:
    Py_XDECREF(seq);
    PyMem_Free(words);
    return NULL;
}

static PyObject *w_reader_wants_doorbell_for_close(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    atomic_thread_fence(memory_order_seq_cst);
    return PyBool_FromLong(atomic_load_explicit(&s->hdr[W_RPARKED], memory_order_relaxed) != 0);
}

static PyObject *w_unpark_writer(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    if (atomic_load_explicit(&s->hdr[W_WPARKED], memory_order_relaxed))
        atomic_store_explicit(&s->hdr[W_WPARKED], 0, memory_order_relaxed);
    Py_RETURN_NONE;
}

/* -- the reader --------------------------------------------------------------------- */

/* (1): an acquire load of the tail, checked; 0 ok (s->tail_seen updated), -1 corrupt */
static int load_tail(Lane *s, uint64_t tail) {
    if (tail < s->tail_seen || tail - s->committed > s->capacity) {
        PyErr_Format(RingCorrupted, "tail %llu out of range (head %llu, capacity %llu)",
                     (unsigned long long)tail, (unsigned long long)s->committed,
                     (unsigned long long)s->capacity);
        return -1;
    }
    s->tail_seen = tail;
    return 0;
}

/* Locate the next frame: 1 found (*start: where its frame begins, *pos, *n), 0 none
   published, -1 a corrupt frame, -2 a tail out of range (error set).  `strict`: next_frame's messages; otherwise
   read_many's (a misplaced marker named as one). */
static int find_frame(Lane *s, uint64_t head, uint64_t *tailp, uint64_t *start, uint64_t *pos,
                      uint64_t *n, int strict) {
    uint64_t tail = *tailp;
    if (head == tail) {
        uint64_t t = load_acq(s, W_TAIL);
        if (t == head) return 0;
        if (load_tail(s, t) < 0) return -2;
        *tailp = tail = t;
    }
    uint64_t cap = s->capacity;
    uint64_t p = head & s->mask;
    uint64_t len = load_len(s->data, p);
    if (len == WRAP_MARKER) {
        if (strict) {
            if (p == 0) {
                PyErr_SetString(RingCorrupted, "wrap marker at the start of the data area");
                return -1;
            }
            head += cap - p;
            if (head >= tail) {
                PyErr_SetString(RingCorrupted, "wrap marker with no frame after it");
                return -1;
            }
        } else {
            if (p == 0 || head + cap - p >= tail) {
                PyErr_Format(RingCorrupted, "misplaced wrap marker at ring offset %llu",
                             (unsigned long long)p);
                return -1;
            }
            head += cap - p;
        }
        p = 0;
        len = load_len(s->data, 0);
    }
    uint64_t need = (len + 11) & ~(uint64_t)7;
    if (len > s->max_payload || head + need > tail || p + need > cap) {
        PyErr_Format(RingCorrupted,
                     "bad frame length %llu at ring offset %llu (%llu bytes published, at most "
                     "%llu per frame, none across the end)",
                     (unsigned long long)len, (unsigned long long)p,
                     (unsigned long long)(tail - head), (unsigned long long)s->max_payload);
        return -1;
    }
    *start = head;
    *pos = p;
    *n = len;
    return 1;
}

static PyObject *r_next_frame(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    uint64_t tail = s->tail_seen, start, pos, n;
    int r = find_frame(s, s->head, &tail, &start, &pos, &n, 1);
    if (r <= 0) {
        if (r < 0) return NULL;
        Py_RETURN_NONE;
    }
    s->head = start + ((n + 11) & ~(uint64_t)7);
    return make_view(s, pos + 4, n);
}

/* the release lane: the next frame as a tuple of native u64 (a multiple of 16 bytes) */
static PyObject *r_next_pairs(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    uint64_t tail = s->tail_seen, start, pos, n;
    int r = find_frame(s, s->head, &tail, &start, &pos, &n, 1);
    if (r <= 0) {
        if (r < 0) return NULL;
        Py_RETURN_NONE;
    }
    s->head = start + ((n + 11) & ~(uint64_t)7);
    if (n % 16) {
        return PyErr_Format(RingCorrupted, "release frame of %llu bytes", (unsigned long long)n);
    }
    Py_ssize_t k = (Py_ssize_t)(n / 8);
    PyObject *out = PyTuple_New(k);
    if (out == NULL) return NULL;
    const unsigned char *p = s->data + pos + 4;
    for (Py_ssize_t i = 0; i < k; i++) {
        uint64_t v;
        memcpy(&v, p + 8 * i, 8);
        PyObject *o = PyLong_FromUnsignedLongLong(v);
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, o);
    }
    return out;
}

static PyObject *r_read_many(Lane *s, PyObject *const *args, Py_ssize_t nargs) {
    LIVE_OR_NULL(s);
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "read_many(fn, max_n, out, on_error=None)");
        return NULL;
    }
    PyObject *fn = args[0], *out = args[2];
    PyObject *on_error = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    Py_ssize_t max_n = PyLong_AsSsize_t(args[1]);
    if (max_n == -1 && PyErr_Occurred()) return NULL;
    int is_list = PyList_CheckExact(out);
    Py_ssize_t k = 0;
    uint64_t nbytes = 0;
    uint64_t head = s->head, tail = s->tail_seen;
    while (k < max_n) {
        uint64_t start, pos, n;
        int r = find_frame(s, head, &tail, &start, &pos, &n, 0);
        if (r == 0) break;
        if (r < 0) {
            /* a tail out of range raises whatever was read; a bad frame ends a batch
               that has records (the next call raises) */
            if (r == -1 && k) {
                PyErr_Clear();
                break;
            }
            return NULL;
        }
        uint64_t need = (n + 11) & ~(uint64_t)7;
        PyObject *view = make_view(s, pos + 4, n);
        if (view == NULL) return NULL;
        PyObject *obj = PyObject_CallOneArg(fn, view);
        if (obj == NULL && on_error != NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
            /* on_error(view, exc), the view still valid: what it raises replaces exc,
               what it returns is taken as the record */
            PyObject *exc = get_raised();
            obj = PyObject_CallFunctionObjArgs(on_error, view, exc, NULL);
            Py_DECREF(exc);
        }
        if (drop_view(view) < 0) {
            Py_XDECREF(obj);
            return NULL;
        }
        if (obj == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
            if (!k) {
                s->head = start + need; /* the bad record is consumed */
                return NULL;
            }
            PyErr_Clear();
            break;
        }
        int rc;
        if (is_list) {
            rc = PyList_Append(out, obj);
        } else {
            PyObject *x = PyObject_CallMethod(out, "append", "O", obj);
            rc = x == NULL ? -1 : 0;
            Py_XDECREF(x);
        }
        Py_DECREF(obj);
        k++;
        nbytes += n;
        head = s->head = start + need;
        if (rc < 0) return NULL;
    }
    return PyLong_FromUnsignedLongLong(nbytes);
}

static PyObject *r_commit(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    if (s->head != s->committed) {
        s->committed = s->head;
        store_rel(s, W_HEAD, s->head); /* (2) */
    }
    Py_RETURN_NONE;
}

static PyObject *r_available(Lane *s, PyObject *Py_UNUSED(ignored)) {
    LIVE_OR_NULL(s);
    return PyBool_FromLong(s->head != s->tail_seen || load_acq(s, W_TAIL) != s->head);
}

static PyObject *r_pending(Lane *s, void *Py_UNUSED(c)) {
    return PyBool_FromLong(s->head != s->committed);
}

/* -- type objects ------------------------------------------------------------------- */

static PyObject *lane_free(Lane *s, void *Py_UNUSED(c)) {
    LIVE_OR_NULL(s);
    /* a snapshot, as Python ints (a lying head may make it negative or huge) */
    PyObject *t = PyLong_FromUnsignedLongLong(s->tail);
    PyObject *h = PyLong_FromUnsignedLongLong(load_acq(s, W_HEAD));
    PyObject *c = PyLong_FromUnsignedLongLong(s->capacity);
    PyObject *res = NULL, *used = NULL;
    if (t && h && c && (used = PyNumber_Subtract(t, h)) != NULL) res = PyNumber_Subtract(c, used);
    Py_XDECREF(t);
    Py_XDECREF(h);
    Py_XDECREF(c);
    Py_XDECREF(used);
    return res;
}

#define COMMON_METHODS                                                                   \
    {"park", (PyCFunction)lane_park, METH_NOARGS,                                        \
     "Announce that this end is about to wait (the caller re-checks after)."},           \
    {"unpark", (PyCFunction)lane_unpark, METH_NOARGS, NULL},                             \
    {"close", (PyCFunction)lane_close, METH_NOARGS, "Mark this end finished."},          \
    {"release", (PyCFunction)lane_release, METH_NOARGS,                                  \
     "Drop this lane's export of the buffer (deferred while payload views live)."}

static PyMethodDef writer_methods[] = {
    {"try_write", (PyCFunction)w_try_write, METH_O,
     "Write and publish one frame; False if the ring is full, None if the reader closed."},
    {"write_many", (PyCFunction)(void (*)(void))w_write_many, METH_FASTCALL,
     "Write payloads[start:] until the ring is full; publish once: (frames, bytes)."},
    {"fits_now", (PyCFunction)w_fits_now, METH_O, "Would a payload of n bytes fit now?"},
    {"reader_needs_doorbell", (PyCFunction)lane_peer_needs_doorbell, METH_NOARGS,
     "After publishing: is the reader parked and not rung for this park yet?"},
    {"reader_wants_doorbell_for_close", (PyCFunction)w_reader_wants_doorbell_for_close,
     METH_NOARGS, "After close(): is the reader parked at all?"},
    {"put", (PyCFunction)w_put, METH_O, "The release lane: write and publish one frame."},
    {"put_pairs", (PyCFunction)w_put_pairs, METH_O,
     "The release lane: one frame of (slot, generation) u64 pairs; False if full."},
    {"unpark_writer", (PyCFunction)w_unpark_writer, METH_NOARGS, NULL},
    COMMON_METHODS,
    {NULL, NULL, 0, NULL},
};

static PyMethodDef reader_methods[] = {
    {"next_frame", (PyCFunction)r_next_frame, METH_NOARGS,
     "The payload of the next frame (a memoryview valid until commit()), or None."},
    {"next_pairs", (PyCFunction)r_next_pairs, METH_NOARGS,
     "The release lane: the next frame's u64 words, or None."},
    {"read_many", (PyCFunction)(void (*)(void))r_read_many, METH_FASTCALL,
     "Append fn(payload) of up to max_n frames to out; return the payload bytes read.\n"
     "If fn raises, on_error(payload, exc) (when given) is called with the payload still\n"
     "valid: what it raises replaces exc, what it returns is taken as the record."},
    {"commit", (PyCFunction)r_commit, METH_NOARGS,
     "Hand the space of every frame read so far back to the writer."},
    {"available", (PyCFunction)r_available, METH_NOARGS,
     "Is there an unread frame (published, and beyond the private head)?"},
    {"writer_needs_doorbell", (PyCFunction)lane_peer_needs_doorbell, METH_NOARGS,
     "After commit(): is the writer parked for room and not rung for this park yet?"},
    COMMON_METHODS,
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef writer_getset[] = {
    {"writer_closed", (getter)lane_writer_closed, NULL, NULL, NULL},
    {"reader_closed", (getter)lane_reader_closed, NULL, NULL, NULL},
    {"free", (getter)lane_free, NULL, "Free bytes (a snapshot).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyGetSetDef reader_getset[] = {
    {"writer_closed", (getter)lane_writer_closed, NULL, NULL, NULL},
    {"reader_closed", (getter)lane_reader_closed, NULL, NULL, NULL},
    {"pending", (getter)r_pending, NULL, "Frames were read but not committed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define M(name, field, flags) \
    {name, T_ULONGLONG, offsetof(Lane, field), flags, NULL}

static PyMemberDef writer_members[] = {
    M("capacity", capacity, READONLY),
    M("max_payload", max_payload, READONLY),
    M("_mask", mask, READONLY),
    M("_tail", tail, 0),
    M("_head_cache", head_cache, 0),
    M("_park_seq", park_seq, 0),
    M("_rung", rung, 0),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef reader_members[] = {
    M("capacity", capacity, READONLY),
    M("max_payload", max_payload, READONLY),
    M("_mask", mask, READONLY),
    M("head", head, 0),
    M("tail_seen", tail_seen, 0),
    M("_committed", committed, 0),
    M("_park_seq", park_seq, 0),
    M("_rung", rung, 0),
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ringwire._wire._cring.RingWriter",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The writing end of one ring lane (native).  One writer at a time.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_as_buffer = &lane_as_buffer,
    .tp_methods = writer_methods,
    .tp_getset = writer_getset,
    .tp_members = writer_members,
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ringwire._wire._cring.RingReader",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The reading end of one ring lane (native).  One reader at a time.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_as_buffer = &lane_as_buffer,
    .tp_methods = reader_methods,
    .tp_getset = reader_getset,
    .tp_members = reader_members,
};

/* -- the module --------------------------------------------------------------------- */

static PyObject *mod_init_errors(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *rc, *ftl;
    if (!PyArg_ParseTuple(args, "OO", &rc, &ftl)) return NULL;
    if (!PyExceptionClass_Check(rc) || !PyExceptionClass_Check(ftl)) {
        PyErr_SetString(PyExc_TypeError, "init_errors(RingCorrupted, FrameTooLarge)");
        return NULL;
    }
    Py_XSETREF(RingCorrupted, Py_NewRef(rc));
    Py_XSETREF(FrameTooLarge, Py_NewRef(ftl));
    Py_RETURN_NONE;
}

static PyObject *mod_fence(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

/* -- the codec's lift pass: is there anything to lift? ------------------------------ */

/* 0: every value in `o` (through exact lists and dicts' values) has a type in
   `atomic`, so the lift pass would return `o` unchanged; 1: the Python pass must look
   (anything else, or nesting deeper than LIFT_DEPTH); -1: error set */
#define LIFT_DEPTH 64
static int scan_lift(PyObject *o, PyObject *atomic, int depth) {
    PyTypeObject *t = Py_TYPE(o);
    if (t == &PyLong_Type || t == &PyUnicode_Type || t == &PyFloat_Type || t == &PyBool_Type ||
        o == Py_None || t == &PyBytes_Type)
        return 0;
    if (depth > LIFT_DEPTH) return 1;
    if (t == &PyList_Type) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); i++) {
            PyObject *x = PyList_GET_ITEM(o, i);
            Py_INCREF(x); /* a value's lookup below may run code that changes the list */
            int r = scan_lift(x, atomic, depth + 1);
            Py_DECREF(x);
            if (r) return r;
        }
        return 0;
    }
    if (t == &PyDict_Type) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(o, &pos, &k, &v)) {
            Py_INCREF(v);
            int r = scan_lift(v, atomic, depth + 1);
            Py_DECREF(v);
            if (r) return r;
        }
        return 0;
    }
    int in = PySet_Contains(atomic, (PyObject *)t);
    if (in < 0) return -1;
    return !in;
}

static PyObject *mod_needs_lift(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyAnySet_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "needs_lift(obj, atomic_types: set)");
        return NULL;
    }
    int r = scan_lift(args[0], args[1], 0);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static PyMethodDef module_methods[] = {
    {"needs_lift", (PyCFunction)(void (*)(void))mod_needs_lift, METH_FASTCALL,
     "Might the codec's lift pass change obj?  False: every value in it (through lists\n"
     "and dict values) is of a type in atomic_types."},
    {"init_errors", mod_init_errors, METH_VARARGS,
     "Set the exception classes the lanes raise (RingCorrupted, FrameTooLarge)."},
    {"fence", mod_fence, METH_NOARGS, "A full memory barrier (a seq_cst fence)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cring_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ringwire._wire._cring",
    .m_doc = "The ring lane's hot path in C (see ringwire/_wire/_cring.c's header).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__cring(void) {
    static const unsigned char magic[8] = {'R', 'W', 'R', 'I', 'N', 'G', 1, 0};
    memcpy(&magic_word, magic, 8);
    if (PyType_Ready(&WriterType) < 0 || PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&cring_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "RingWriter", (PyObject *)&WriterType) < 0 ||
        PyModule_AddObjectRef(m, "RingReader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
