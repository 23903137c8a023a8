/* launcher._diagscan: the native reader behind `llama-launcher diagnose`.
 *
 * The state machine of launcher/diagnose.py's _Scanner, rule for rule (that file is the
 * reference; tests/test_diagnose_native.py holds both readers to the same report on the real
 * server's logs, on damaged logs and across threads), reading a log at memory speed:
 *
 *  - a line a failing server prints most (a cascade's memory-slot and retry lines, a slot
 *    release, a send_error, the decode error) is recognised in its exact b11434 form and
 *    read directly (hot_line);
 *  - any other line is scanned 16 bytes at a time (SSE2) for newlines and a few anchor bytes;
 *    an anchor is checked against the keywords that hold it (serverlog.KEYWORDS), and a line
 *    holding one is parsed by matchers with the Python patterns' semantics (leftmost match,
 *    ASCII classes, numbers of 1..MAX_DIGITS digits);
 *  - reading a line does not depend on the state, so a block is read in parts by one thread
 *    per CPU into events, which are applied in order while the next block is read;
 *  - failures, cascades and startups are kept as plain records; Python turns them into the
 *    report (diagnose._read_native).
 *
 * C with the CPython API and pthreads, for GCC or Clang; no library. Without SSE2 the scan
 * is a byte loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <unistd.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_DIGITS 10

/* ------------------------------------------------------------------------------------------
 * Keywords (serverlog.KEYWORDS) and their anchors */

enum {
    K_MS, K_RET, K_PURGE, K_SEND, K_REL, K_DFAIL, K_CTX, K_TL1, K_TL2, K_TL3,
    K_S1, K_S2, K_S3, K_S4, K_S5, K_S6, K_S7, K_S8, K_S9, K_COUNT
};
static const char *const KW[K_COUNT] = {
    "memory slot", ", ret = ", "purging slot", "send_error", "stop processing",
    "decode() failed", "Context size has been exceeded", "exceeds the available context",
    "larger than the max context", "exceed_context_size_error", "n_slots = ",
    "sizing KV pool", "n_ctx_seq (", "capping per-slot", "exceeds the per-slot pool",
    "llama_context: n_ctx ", " cells, ", "context size reduced", "llama_server: initializing",
};
#define ANCHORS "(xyg_,"
static size_t kw_len[K_COUNT];
static size_t kw_anchor[K_COUNT];   /* where the keyword's anchor byte is */
static uint32_t kw_head[K_COUNT];    /* its first four bytes */

static inline uint32_t load4(const char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
/* A byte pair around an anchor -> the keywords whose anchor it is (a bit each): the byte
 * before the anchor and the anchor (pair_prev), or, for a keyword that starts with its
 * anchor, the anchor and the byte after it (pair_next). */
static unsigned char is_anchor[256]; /* 1 + the anchor's index in ANCHORS, or 0 */
static uint32_t pair_prev[sizeof ANCHORS][256], pair_next[sizeof ANCHORS][256];

static int init_keywords(void) {
    for (const char *a = ANCHORS; *a; a++) is_anchor[(unsigned char)*a] = (unsigned char)(a - ANCHORS + 1);
    for (int k = 0; k < K_COUNT; k++) {
        kw_len[k] = strlen(KW[k]);
        const char *hit = NULL;
        for (const char *a = ANCHORS; *a && !hit; a++) hit = strchr(KW[k], *a);
        if (!hit || kw_len[k] < 2) return -1;
        kw_anchor[k] = (size_t)(hit - KW[k]);
        kw_head[k] = load4(KW[k]);
        const unsigned char *h = (const unsigned char *)hit;
        if (hit > KW[k])
            pair_prev[is_anchor[h[0]]][h[-1]] |= 1u << k;
        else
            pair_next[is_anchor[h[0]]][h[1]] |= 1u << k;
    }
    return 0;
}

/* Add the keywords whose anchor is at buf[p] to *flags; kw_at[k] = where keyword k first
 * starts in the line. A keyword holds no newline, so a match never spans two lines. */
static inline void anchor_hit(const char *buf, size_t n, size_t p, uint32_t *flags,
                              const char **kw_at) {
    const unsigned char *b = (const unsigned char *)buf;
    unsigned a = is_anchor[b[p]];
    uint32_t cand = (p ? pair_prev[a][b[p - 1]] : 0) | (p + 1 < n ? pair_next[a][b[p + 1]] : 0);
    cand &= ~*flags;
    while (cand) {
        int k = __builtin_ctz(cand);
        cand &= cand - 1;
        size_t off = kw_anchor[k];
        if (p < off) continue;
        size_t s = p - off;
        if (s + kw_len[k] <= n && load4(buf + s) == kw_head[k] &&
            memcmp(buf + s + 4, KW[k] + 4, kw_len[k] - 4) == 0) {
            *flags |= 1u << k;
            kw_at[k] = buf + s;
        }
    }
}

/* ------------------------------------------------------------------------------------------
 * Matchers: a pattern is literal text with codes
 *   %d  1..MAX_DIGITS ASCII digits, not followed by a digit       (\d+ of serverlog._compile)
 *   %s  the same with an optional '-'                              (-?\d+)
 *   %z  like %d; its value is 0 when the text is "0", else 1   (truncated != "0")
 *   %+  one or more spaces, %*  zero or more spaces, %w  ASCII \s*
 *   %f  one or more of [0-9.], %b  true|false (value 1/0)
 *   %%  a '%'
 * It must start with literal text; `search` returns the leftmost match, like re.search. */

typedef struct { const char *p; size_t n; } Span;

/* memmem for the short haystacks of one line: no set-up cost per call */
static const char *mem_find(const char *h, size_t hn, const char *nd, size_t nn) {
    if (nn == 0) return h;
    if (hn < nn) return NULL;
    const char *last = h + (hn - nn);
    while (h <= last) {
        h = memchr(h, nd[0], (size_t)(last - h) + 1);
        if (!h) return NULL;
        if (memcmp(h + 1, nd + 1, nn - 1) == 0) return h;
        h++;
    }
    return NULL;
}

static int contains(Span t, const char *kw) {
    return mem_find(t.p, t.n, kw, strlen(kw)) != NULL;
}

static int match_at(const char *s, const char *e, const char *pat, int64_t *vals, const char **end) {
    int nv = 0;
    while (*pat) {
        if (*pat != '%' || pat[1] == '%') {
            char c = *pat == '%' ? '%' : *pat;
            if (s >= e || *s != c) return 0;
            s++;
            pat += *pat == '%' ? 2 : 1;
            continue;
        }
        char code = pat[1];
        pat += 2;
        if (code == 'd' || code == 's' || code == 'z') {
            const char *s0 = s;
            int neg = 0;
            if (code == 's' && s < e && *s == '-') { neg = 1; s++; }
            int64_t v = 0;
            int digits = 0;
            while (s < e && *s >= '0' && *s <= '9' && digits <= MAX_DIGITS) {
                v = v * 10 + (*s - '0');
                s++;
                digits++;
            }
            if (digits == 0 || digits > MAX_DIGITS) return 0;
            if (s < e && *s >= '0' && *s <= '9') return 0;
            /* %z: the text of the number is "0" (false) or anything else (true) */
            if (code == 'z') v = !(digits == 1 && *s0 == '0');
            if (vals) vals[nv] = neg ? -v : v;
            nv++;
        } else if (code == '+' || code == '*') {
            const char *s0 = s;
            while (s < e && *s == ' ') s++;
            if (code == '+' && s == s0) return 0;
        } else if (code == 'w') {
            while (s < e && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r' || *s == '\f' ||
                             *s == '\v'))
                s++;
        } else if (code == 'f') {
            const char *s0 = s;
            while (s < e && ((*s >= '0' && *s <= '9') || *s == '.')) s++;
            if (s == s0) return 0;
        } else if (code == 'b') {
            if (e - s >= 4 && memcmp(s, "true", 4) == 0) {
                if (vals) vals[nv] = 1;
                s += 4;
            } else if (e - s >= 5 && memcmp(s, "false", 5) == 0) {
                if (vals) vals[nv] = 0;
                s += 5;
            } else {
                return 0;
            }
            nv++;
        }
    }
    if (end) *end = s;
    return 1;
}

/* leftmost match of pat in t starting at or after `from`; *at = its start. A caller passes
 * as `from` the earliest place a match can start (see kw_start), or t.p. */
static int search_from(Span t, const char *from, const char *pat, int64_t *vals, const char **at,
                       const char **end) {
    size_t lit = strcspn(pat, "%");
    const char *s = from < t.p ? t.p : from, *e = t.p + t.n;
    while (s < e) {
        const char *h = mem_find(s, (size_t)(e - s), pat, lit);
        if (!h) return 0;
        if (match_at(h + lit, e, pat + lit, vals, end)) {
            if (at) *at = h;
            return 1;
        }
        s = h + 1;
    }
    return 0;
}

static int search(Span t, const char *pat, int64_t *vals, const char **at, const char **end) {
    return search_from(t, t.p, pat, vals, at, end);
}

/* ------------------------------------------------------------------------------------------
 * Records */

typedef struct { int64_t slot, task, n_tokens; int truncated; } SlotRec;

typedef struct {
    int64_t off, size, next, pslot, ptok;
    int has_size, has_next, has_purge;
} StepRec;

typedef struct {
    int has_sizing; int64_t sz_np, sz_per, sz_nctx;
    int has_nctx; int64_t nctx;
    int has_kvcells; int64_t kvcells;
    int has_over; int64_t over_seq, over_train;
    int has_capped; int64_t cap_from, cap_to;
    int has_fit; int64_t fit_from, fit_to;
} Boot;

typedef struct {
    int present;
    int64_t line, n_slots, n_ctx_slot;
    int unified;
    Boot boot;
    int has_cells; int64_t cells;
} ConfigRec;

typedef struct { StepRec *v; size_t n, cap; } Steps;
typedef struct { SlotRec *v; size_t n, cap; } Slots;

typedef struct {
    int64_t number, line, off, n_steps, offsets, first_view, purges, requests_failed, total;
    int has_first_view;
    int error;                        /* 0 Context size..., 1 Invalid input batch., 2 Compute error. */
    int64_t pool_cells; int has_cells;
    int64_t overflow; int has_overflow;
    int overflow_source;              /* 0 log, 1 inferred (sum - pool), 2 unknown */
    int adds_up;                      /* -1 None, 0, 1 */
    int cls;                          /* diagnose.FailureClass, in _CLASSES order */
    ConfigRec config;
    Steps steps;
    Slots slots;
} FailRec;

enum { C_SHARED, C_TOO_LONG, C_FIT, C_UNKNOWN, C_COUNT };

/* Most threads a block is read with, and the smallest block worth splitting. */
#define MAX_PARTS 8
#define PART_MIN (1 << 20)
#define PART_MAX ((size_t)1 << 30)

typedef struct Event Event;
typedef struct {
    Event *v;
    size_t n, cap;
    int64_t lines;     /* lines read */
    int oom;
    /* the text of the first drift lines (a drift sample may be taken from them after the
     * block they were read from is gone) */
    char *txt;
    size_t txt_n, txt_cap;
    Py_ssize_t kept_texts, max_texts;
} Tok;

typedef struct {
    Tok tok;
    const char *buf;   /* in memory: buf[0:n], whole lines */
    size_t n;
    int64_t max_slots;
    int done;          /* read already (one part, read in place) */
    int started;       /* read by its own thread */
    pthread_t th;
    /* from a file (fd >= 0): the lines that start in [a, b), read with pread in chunks of
     * `chunk` bytes; the file's reading began at `first` and it had `end` bytes then */
    int fd;
    int64_t a, b, first, end;
    size_t chunk;
    char *rbuf;
    size_t rcap;
    size_t tail_at, tail_n; /* an unterminated last line of the file, in rbuf */
    int err;           /* errno of a failed read; -1: the file ended at err_at, early */
    int64_t err_at;
} Part;

/* The parts of one block, read together; their events wait to be applied until the next
 * block's parts are being read (or the input ends). */
typedef struct {
    Part part[MAX_PARTS];
    int n;
} Set;

typedef struct {
    PyObject_HEAD
    /* settings */
    int64_t pool_hint; int has_hint;
    Py_ssize_t keep, max_steps, max_samples;
    int64_t max_slots, cell_pad;
    int threads;
    int64_t part_min;  /* the smallest block (or file round) split over threads */
    Set sets[2];
    int pend;          /* the set whose events are not applied yet, or -1 */
    int running;       /* the set whose threads may still be reading, or -1 */
    Py_buffer held;    /* the block they read (holding: 1) */
    int holding;
    int busy;          /* a call is in progress (it lets the GIL go while threads read) */
    Tok one;           /* the line carried across blocks */
    /* reading */
    char *carry; size_t carry_n, carry_cap;
    int64_t lines;
    /* counters */
    int64_t exceeded_lines, requests_failed, rejections_total, max_rejected, recovered, startups;
    int has_max_rejected;
    int64_t failures_total, adds_up, checked, drift;
    int64_t by_class[C_COUNT];
    int class_order[C_COUNT]; int n_classes;
    ConfigRec class_config[C_COUNT];
    ConfigRec rejection_config;
    ConfigRec config;
    Boot boot;
    /* rejections (ring of keep) */
    int64_t *rej; Py_ssize_t rej_n, rej_head;
    /* drift samples */
    PyObject *samples;
    /* kept failures (ring of keep) */
    FailRec *kept; Py_ssize_t kept_n, kept_head;
    /* cascade */
    Steps steps;
    int cs_has_last; int64_t cs_last;
    int late_purge;
    int64_t n_steps, n_offsets, purges;
    int has_last_off; int64_t last_off;
    int has_first_view; int64_t first_view;
    int has_view_at_off; int64_t view_at_off;
    int view_capped;
    int has_last_size; int64_t last_size;
    int has_expect; int64_t expect;
    /* pending failure */
    int has_pending;
    FailRec pending;
    int pending_has_final_view; int64_t pending_final_view;
    int oom;
} Scanner;

static int grow(void **v, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap * 2 : 8;
    while (c < need) c *= 2;
    void *n = realloc(*v, c * item);
    if (!n) return -1;
    *v = n;
    *cap = c;
    return 0;
}

static void steps_push(Scanner *s, Steps *st, StepRec r) {
    if (grow((void **)&st->v, &st->cap, st->n + 1, sizeof(StepRec))) { s->oom = 1; return; }
    st->v[st->n++] = r;
}

static void slots_push(Scanner *s, Slots *sl, SlotRec r) {
    if (grow((void **)&sl->v, &sl->cap, sl->n + 1, sizeof(SlotRec))) { s->oom = 1; return; }
    sl->v[sl->n++] = r;
}

/* ------------------------------------------------------------------------------------------
 * The state machine (diagnose._Scanner) */

static int64_t pad(int64_t x, int64_t n) { return (x + n - 1) / n * n; }

static void cascade_reset(Scanner *s) {
    s->steps.n = 0;
    s->cs_has_last = 0;
    s->late_purge = 0;
    s->n_steps = s->n_offsets = s->purges = 0;
    s->has_last_off = s->has_first_view = s->has_view_at_off = 0;
    s->view_capped = 0;
    s->has_last_size = s->has_expect = 0;
}

static void pool_cells(Scanner *s, ConfigRec *c) {
    const Boot *b = &c->boot;
    c->has_cells = 1;
    if (b->has_sizing) {
        int64_t p = pad(b->sz_nctx, s->cell_pad);
        c->cells = c->unified ? p : pad(p / c->n_slots, s->cell_pad) * c->n_slots;
    } else if (b->has_nctx) {
        c->cells = b->nctx;
    } else if (b->has_kvcells) {
        c->cells = b->kvcells;
    } else if (c->unified) {
        c->cells = b->has_over ? b->over_seq : (b->has_capped ? b->cap_from : c->n_ctx_slot);
    } else if (!s->has_hint) {
        c->cells = c->n_slots * c->n_ctx_slot;
    } else {
        c->cells = s->pool_hint;
    }
}

static inline void view(Scanner *s, int64_t size) {
    if (s->has_expect && size != s->expect) s->has_last_off = 0;
    s->has_expect = 0;
    s->has_last_size = 1;
    s->last_size = size;
    if (!s->has_first_view) { s->has_first_view = 1; s->first_view = size; }
}

static inline void try_(Scanner *s, int64_t off, int64_t n_batch) {
    if (!s->has_last_off || s->last_off != off) {
        s->n_offsets++;
        s->has_last_off = 1;
        s->last_off = off;
        s->has_view_at_off = s->has_last_size;
        s->view_at_off = s->last_size;
        s->view_capped = s->has_last_size && (s->last_size == n_batch || s->last_size == 2 * n_batch);
    }
    if (s->has_view_at_off) {
        s->has_expect = 1;
        s->expect = n_batch < s->view_at_off ? n_batch : s->view_at_off;
    }
    s->n_steps++;
    s->has_last_size = 0;
}

static inline void memory_slot(Scanner *s, int64_t size) {
    view(s, size);
    if (s->n_steps < s->max_steps) { s->cs_has_last = 1; s->cs_last = size; }
}

static inline void retry(Scanner *s, int64_t off, int64_t n_batch) {
    if (s->n_steps < s->max_steps) {
        StepRec r = {0};
        r.off = off;
        r.has_size = s->cs_has_last;
        r.size = s->cs_last;
        r.has_next = 1;
        r.next = n_batch;
        steps_push(s, &s->steps, r);
        s->cs_has_last = 0;
    }
    try_(s, off, n_batch);
}

static void purge(Scanner *s, int64_t slot, int64_t tokens) {
    s->purges++;
    if (s->n_steps < s->max_steps || !s->late_purge) {
        s->late_purge = s->n_steps >= s->max_steps;
        if (s->steps.n && !s->steps.v[s->steps.n - 1].has_purge) {
            StepRec *r = &s->steps.v[s->steps.n - 1];
            r->has_purge = 1;
            r->pslot = slot;
            r->ptok = tokens;
        }
    }
}

/* The slot for a new entry of a ring of `keep` (> 0) holding *n from *head; the oldest
 * entry gives way when it is full (Python: deque(maxlen=keep)). */
static Py_ssize_t ring_slot(Py_ssize_t *n, Py_ssize_t *head, Py_ssize_t keep) {
    if (*n < keep) return (*head + (*n)++) % keep;
    Py_ssize_t at = *head;
    *head = (*head + 1) % keep;
    return at;
}

static int classify(const FailRec *p) {
    if (p->error != 0 || p->slots.n == 0) return C_UNKNOWN;
    if (p->config.present && p->config.boot.has_fit) return C_FIT;
    if (p->config.present && !p->config.unified) return C_UNKNOWN;
    size_t busy = 0;
    for (size_t i = 0; i < p->slots.n; i++) busy += p->slots.v[i].n_tokens > 0;
    return busy >= 2 ? C_SHARED : C_TOO_LONG;
}

static void close_failure(Scanner *s) {
    if (!s->has_pending) return;
    s->has_pending = 0;
    FailRec *p = &s->pending;
    s->failures_total++;
    p->number = s->failures_total;
    if (p->config.present) {
        p->has_cells = p->config.has_cells;
        p->pool_cells = p->config.cells;
    } else {
        p->has_cells = s->has_hint;
        p->pool_cells = s->pool_hint;
    }
    int64_t total = 0;
    for (size_t i = 0; i < p->slots.n; i++) total += p->slots.v[i].n_tokens;
    p->total = total;
    p->has_overflow = s->pending_has_final_view;
    p->overflow = s->pending_final_view;
    p->overflow_source = 0;
    if (!p->has_overflow) {
        if (p->has_cells && p->slots.n) {
            p->has_overflow = 1;
            p->overflow = total - p->pool_cells;
            p->overflow_source = 1;
        } else {
            p->overflow_source = 2;
        }
    }
    p->adds_up = -1;
    if (p->has_cells && p->has_overflow && p->slots.n && p->overflow_source == 0) {
        p->adds_up = total == p->pool_cells + p->overflow;
        s->checked++;
        s->adds_up += p->adds_up;
    }
    p->cls = classify(p);
    if (s->by_class[p->cls]++ == 0) s->class_order[s->n_classes++] = p->cls;
    s->class_config[p->cls] = p->config;
    /* into the ring; the slot's old buffers are reused for the next pending failure */
    if (s->keep <= 0) return;
    Py_ssize_t at = ring_slot(&s->kept_n, &s->kept_head, s->keep);
    FailRec old = s->kept[at];
    s->kept[at] = *p;
    p->steps = old.steps;
    p->slots = old.slots;
    p->steps.n = 0;
    p->slots.n = 0;
}

static void decode_error(Scanner *s, int64_t line, int error, int64_t off) {
    close_failure(s);
    if (!s->has_last_off || s->last_off != off) {
        s->n_offsets++;
        s->has_last_off = 1;
        s->last_off = off;
        s->has_view_at_off = s->has_last_size;
        s->view_at_off = s->last_size;
        s->view_capped = 0;
    }
    FailRec *p = &s->pending;
    /* the cascade's steps become the failure's: swap the buffers */
    Steps st = p->steps;
    p->steps = s->steps;
    s->steps = st;
    s->steps.n = 0;
    if (s->n_steps < s->max_steps) {
        StepRec r = {0};
        r.off = off;
        r.has_size = s->has_last_size;
        r.size = s->last_size;
        steps_push(s, &p->steps, r);
    }
    s->n_steps++;
    p->line = line;
    p->error = error;
    p->off = off;
    p->n_steps = s->n_steps;
    p->offsets = s->n_offsets;
    p->has_first_view = s->has_first_view;
    p->first_view = s->first_view;
    p->purges = s->purges;
    p->config = s->config;
    p->slots.n = 0;
    p->requests_failed = 0;
    s->pending_has_final_view = !s->view_capped && s->has_view_at_off;
    s->pending_final_view = s->view_at_off;
    s->has_pending = 1;
    cascade_reset(s);
}

static void release(Scanner *s, int64_t slot, int64_t task, int64_t n_tokens, int truncated) {
    if (s->has_pending) {
        SlotRec r = {slot, task, n_tokens, truncated};
        slots_push(s, &s->pending.slots, r);
    } else if (s->n_steps) {
        s->recovered++;
        cascade_reset(s);
    }
}

/* ------------------------------------------------------------------------------------------
 * Reading a line is separate from acting on it: the lines of a block are read into events by
 * several threads at once (what a line says does not depend on the state), then the events
 * are applied in order by one. */

enum {
    EV_NONE, EV_DRIFT, EV_MS, EV_RT, EV_DERR, EV_REL, EV_SEND_CTX, EV_CLOSE, EV_PURGE, EV_REJECT,
    EV_STARTUP, EV_SIZING, EV_NCTX, EV_KVCELLS, EV_OVER, EV_CAPPED, EV_FIT, EV_INIT,
};

struct Event {
    int64_t v[3];       /* the line's numbers; EV_DRIFT: where the line is and its length */
    uint32_t line;      /* within its part, 1-based (a part is at most PART_MAX bytes) */
    uint8_t type, exceeded, flag; /* flag: EV_REL's truncated */
};

static __attribute__((noinline)) int tok_grow(Tok *t) {
    if (grow((void **)&t->v, &t->cap, t->n + 1, sizeof(Event))) {
        t->oom = 1;
        return -1;
    }
    return 0;
}

static inline __attribute__((always_inline)) void emit(Tok *t, int type, int64_t line,
                                                       int exceeded, int64_t a, int64_t b,
                                                       int64_t c, int flag) {
    if (t->n == t->cap && tok_grow(t)) return;
    Event *e = &t->v[t->n++];
    e->type = (uint8_t)type;
    e->line = (uint32_t)line;
    e->exceeded = (uint8_t)exceeded;
    e->flag = (uint8_t)flag;
    e->v[0] = a;
    e->v[1] = b;
    e->v[2] = c;
}

/* diagnose._Scanner._too_long: 1 when the text is a request-time rejection (or its logged
 * body); a rejection with its numbers is an EV_REJECT */
#define HAS(k) (flags & (1u << (k)))

/* (Each pattern below holds a keyword; when the line does not, the pattern is not tried.) */
static int too_long(Tok *tk, int64_t line, Span t, int exceeded, uint32_t flags) {
    if (HAS(K_TL3) && contains(t, "exceed_context_size_error")) {
        emit(tk, EV_NONE, line, exceeded, 0, 0, 0, 0);
        return 1;
    }
    int64_t v[2];
    if (!(HAS(K_TL1) && search(t, "request (%d tokens) exceeds the available context size "
                                  "(%d tokens)", v, NULL, NULL)) &&
        !(HAS(K_TL2) && search(t, "input (%d tokens) is larger than the max context size "
                                  "(%d tokens)", v, NULL, NULL)))
        return 0;
    emit(tk, EV_REJECT, line, exceeded, v[0], v[1], 0, 0);
    return 1;
}

static int startup_line(Tok *tk, int64_t line, Span t, int64_t max_slots, int x,
                        uint32_t flags) {
    int64_t v[4];
    if (HAS(K_S1) && search(t, "initializing, n_slots = %d, n_ctx_slot = %d, kv_unified = '%b'", v, NULL, NULL)) {
        if (!(1 <= v[0] && v[0] <= max_slots && v[1] >= 1)) return 0;
        emit(tk, EV_STARTUP, line, x, v[0], v[1], v[2], 0);
    } else if (HAS(K_S2) && search(t, "--kv-unified-per-slot: sizing KV pool to n_parallel * kv_unified_per_slot = "
                         "%d * %d = %d", v, NULL, NULL)) {
        emit(tk, EV_SIZING, line, x, v[0], v[1], v[2], 0);
    } else if (HAS(K_S6) && search(t, "llama_context: n_ctx%+=%w%d", v, NULL, NULL)) {
        emit(tk, EV_NCTX, line, x, v[0], 0, 0, 0);
    } else if (HAS(K_S7) && search(t, "llama_kv_cache: size =%+%f MiB (%*%d cells,%+%d layers,%+%d/%d seqs)", v,
                      NULL, NULL)) {
        emit(tk, EV_KVCELLS, line, x, v[0], 0, 0, 0);
    } else if (HAS(K_S3) && search(t, "n_ctx_seq (%d) > n_ctx_train (%d)", v, NULL, NULL)) {
        emit(tk, EV_OVER, line, x, v[0], v[1], 0, 0);
    } else if (HAS(K_S4) && search(t, "capping per-slot context (%d) to --kv-unified-per-slot "
                                      "(%d)", v, NULL, NULL)) {
        emit(tk, EV_CAPPED, line, x, v[0], v[1], 0, 0);
    } else if (HAS(K_S8) && search(t, "context size reduced from %d to %d", v, NULL, NULL)) {
        emit(tk, EV_FIT, line, x, v[0], v[1], 0, 0);
    } else if (HAS(K_S9) && contains(t, "srv  llama_server: initializing ...")) {
        emit(tk, EV_INIT, line, x, 0, 0, 0, 0);
    } else {
        if (contains(t, "n_slots")) return 0;
        if (!(HAS(K_S3) || HAS(K_S5) || contains(t, "initializing") || contains(t, " cells")))
            return 0;
        emit(tk, EV_NONE, line, x, 0, 0, 0, 0);
    }
    return 1;
}

/* where the keyword stands in the literal head of three patterns (set at import) */
static const char PAT_MS[] = "decode: failed to find a memory slot for batch of size %d";
static const char PAT_SEND[] = "send_error: task id = %s, error: ";
static const char PAT_PURGE[] = "purging slot %d with %d tokens";
static size_t off_ms, off_send, off_purge;

static void init_offsets(void) {
    off_ms = (size_t)(strstr(PAT_MS, KW[K_MS]) - PAT_MS);
    off_send = (size_t)(strstr(PAT_SEND, KW[K_SEND]) - PAT_SEND);
    off_purge = (size_t)(strstr(PAT_PURGE, KW[K_PURGE]) - PAT_PURGE);
}

/* the earliest start of a match whose head holds keyword k at `off`: a match starting before
 * would hold an earlier occurrence of the keyword than the first one */
static inline const char *kw_start(Span t, const char **kw_at, int k, size_t off) {
    return (size_t)(kw_at[k] - t.p) > off ? kw_at[k] - off : t.p;
}

/* one keyword line: diagnose._Scanner._dispatch; 0 = format drift */
static int dispatch(Tok *tk, int64_t line, Span t, uint32_t flags, const char **kw_at,
                    int64_t max_slots) {
    int64_t v[4];
    const char *at, *end;
    int x = (flags >> K_CTX) & 1;
    if (flags & (1u << K_MS)) {
        if (!search_from(t, kw_start(t, kw_at, K_MS, off_ms), PAT_MS, v, NULL, NULL)) return 0;
        emit(tk, EV_MS, line, x, v[0], 0, 0, 0);
        return 1;
    }
    if (flags & (1u << K_RET)) {
        if (search(t, "failed to find free space in the KV cache, retrying with smaller batch size, "
                      "off = %d, n_batch = %d, ret = %s", v, NULL, NULL)) {
            emit(tk, EV_RT, line, x, v[0], v[1], 0, 0);
            return 1;
        }
        static const char *const errors[3] = {
            "Context size has been exceeded. off = %d, n_batch = %d, ret = %s",
            "Invalid input batch. off = %d, n_batch = %d, ret = %s",
            "Compute error. off = %d, n_batch = %d, ret = %s",
        };
        int best = -1;
        const char *best_at = NULL;
        int64_t best_off = 0;
        for (int i = 0; i < 3; i++) {
            if (search(t, errors[i], v, &at, NULL) && (best < 0 || at < best_at)) {
                best = i;
                best_at = at;
                best_off = v[0];
            }
        }
        if (best < 0) return 0;
        emit(tk, EV_DERR, line, x, best, best_off, 0, 0);
        return 1;
    }
    if (flags & (1u << K_REL)) {
        if (!search(t, "release: id%+%d | task %s | stop processing: n_tokens = %d, truncated = %z",
                    v, NULL, NULL))
            return 0;
        emit(tk, EV_REL, line, x, v[0], v[1], v[2], (int)v[3]);
        return 1;
    }
    if (flags & (1u << K_SEND)) {
        if (!search_from(t, kw_start(t, kw_at, K_SEND, off_send), PAT_SEND, v, NULL, &end)) return 0;
        Span error = {end, (size_t)(t.p + t.n - end)};
        static const char ctx[] = "Context size has been exceeded";
        if (error.n >= sizeof ctx - 1 && memcmp(error.p, ctx, sizeof ctx - 1) == 0)
            emit(tk, EV_SEND_CTX, line, x, 0, 0, 0, 0);
        else if (!too_long(tk, line, error, x, flags))
            emit(tk, EV_NONE, line, x, 0, 0, 0, 0);
        return 1;
    }
    if (flags & (1u << K_PURGE)) {
        if (!search_from(t, kw_start(t, kw_at, K_PURGE, off_purge), PAT_PURGE, v, NULL, NULL))
            return 0;
        emit(tk, EV_PURGE, line, x, v[0], v[1], 0, 0);
        return 1;
    }
    if (flags & (1u << K_DFAIL)) {
        if (contains(t, "update_slots: decode() failed: ")) {
            emit(tk, EV_CLOSE, line, x, 0, 0, 0, 0);
            return 1;
        }
        if (!(contains(t, "update_slots: pre_decode() failed: ") ||
              contains(t, "update_slots: post_decode() failed: ")))
            return 0;
        emit(tk, EV_NONE, line, x, 0, 0, 0, 0);
        return 1;
    }
    if (x && contains(t, "\"message\":\"Context size has been exceeded")) {
        emit(tk, EV_NONE, line, x, 0, 0, 0, 0);
        return 1;
    }
    if (too_long(tk, line, t, x, flags)) return 1;
    return startup_line(tk, line, t, max_slots, x, flags);
}

static void read_line(Tok *tk, int64_t line, Span t, uint32_t flags, const char **kw_at,
                      int64_t max_slots) {
    if (!dispatch(tk, line, t, flags, kw_at, max_slots)) {
        int64_t at = -1;
        if (tk->kept_texts < tk->max_texts &&
            !grow((void **)&tk->txt, &tk->txt_cap, tk->txt_n + t.n + 1, 1)) {
            memcpy(tk->txt + tk->txt_n, t.p, t.n);
            at = (int64_t)tk->txt_n;
            tk->txt_n += t.n;
            tk->kept_texts++;
        }
        emit(tk, EV_DRIFT, line, (flags >> K_CTX) & 1, at, (int64_t)t.n, 0, 0);
    }
}

/* every keyword in one line, found without the SIMD pass (the line carried between blocks) */
static uint32_t line_flags(const char *p, size_t n, const char **kw_at) {
    uint32_t f = 0;
    for (size_t i = 0; i < n; i++)
        if (is_anchor[(unsigned char)p[i]]) anchor_hit(p, n, i, &f, kw_at);
    return f;
}

static int add_sample(Scanner *s, int64_t line, const char *text, size_t len) {
    if (PyList_GET_SIZE(s->samples) >= s->max_samples) return 0;
    PyObject *item = Py_BuildValue("(Ly#)", (long long)line, text, (Py_ssize_t)len);
    if (!item) return -1;
    int r = PyList_Append(s->samples, item);
    Py_DECREF(item);
    return r;
}

static void reject(Scanner *s, int64_t line, int64_t n_prompt, int64_t n_ctx) {
    s->rejections_total++;
    s->rejection_config = s->config;
    if (s->keep > 0) {
        Py_ssize_t at = ring_slot(&s->rej_n, &s->rej_head, s->keep);
        s->rej[at * 3] = line;
        s->rej[at * 3 + 1] = n_prompt;
        s->rej[at * 3 + 2] = n_ctx;
    }
    if (!s->has_max_rejected || n_prompt > s->max_rejected) s->max_rejected = n_prompt;
    s->has_max_rejected = 1;
}

static void startup(Scanner *s, int64_t line, int64_t n_slots, int64_t n_ctx_slot, int unified) {
    s->startups++;
    ConfigRec c;
    memset(&c, 0, sizeof c);
    c.present = 1;
    c.line = line;
    c.n_slots = n_slots;
    c.n_ctx_slot = n_ctx_slot;
    c.unified = unified;
    c.boot = s->boot;
    pool_cells(s, &c);
    s->config = c;
    cascade_reset(s);
}

/* act on the events of one part; `base` lines precede it */
static int apply(Scanner *s, const Tok *tk, int64_t base) {
    Boot *b = &s->boot;
    for (size_t i = 0; i < tk->n; i++) {
        const Event *e = &tk->v[i];
        const int64_t *v = e->v;
        int64_t line = base + e->line;
        s->exceeded_lines += e->exceeded;
        switch (e->type) {
        case EV_NONE: break;
        case EV_DRIFT:
            s->drift++;
            if (v[0] >= 0 && add_sample(s, line, tk->txt + v[0], (size_t)v[1]) < 0) return -1;
            break;
        case EV_MS: memory_slot(s, v[0]); break;
        case EV_RT: retry(s, v[0], v[1]); break;
        case EV_DERR: decode_error(s, line, (int)v[0], v[1]); break;
        case EV_REL: release(s, v[0], v[1], v[2], e->flag); break;
        case EV_SEND_CTX:
            s->requests_failed++;
            if (s->has_pending) s->pending.requests_failed++;
            break;
        case EV_CLOSE: close_failure(s); break;
        case EV_PURGE: purge(s, v[0], v[1]); break;
        case EV_REJECT: reject(s, line, v[0], v[1]); break;
        case EV_STARTUP: startup(s, line, v[0], v[1], (int)v[2]); break;
        case EV_SIZING:
            b->has_sizing = 1;
            b->sz_np = v[0];
            b->sz_per = v[1];
            b->sz_nctx = v[2];
            break;
        case EV_NCTX: b->has_nctx = 1; b->nctx = v[0]; break;
        case EV_KVCELLS: b->has_kvcells = 1; b->kvcells = v[0]; break;
        case EV_OVER: b->has_over = 1; b->over_seq = v[0]; b->over_train = v[1]; break;
        case EV_CAPPED: b->has_capped = 1; b->cap_from = v[0]; b->cap_to = v[1]; break;
        case EV_FIT: b->has_fit = 1; b->fit_from = v[0]; b->fit_to = v[1]; break;
        case EV_INIT:
            close_failure(s);
            memset(b, 0, sizeof *b);
            cascade_reset(s);
            break;
        }
    }
    return 0;
}

/* -- the two lines of a cascade, in llama-server's own form -----------------------------------
 * Most of a failing server's log is these two lines. When a line is exactly one of them (the
 * "%d.%02d.%03d.%03d L " prefix, the fixed text, numbers, the newline), it holds no keyword
 * but its own, so it is taken directly: what dispatch would do, without the anchor pass. */

static const char MS_BODY[] = "decode: failed to find a memory slot for batch of size ";
static const char RT_BODY[] = "srv        decode: failed to find free space in the KV cache, "
                              "retrying with smaller batch size, off = ";

/* 1..MAX_DIGITS digits at *p (bounded by e), not followed by a digit */
static inline __attribute__((always_inline)) int number(const char **p, const char *e, int64_t *v) {
    const char *s = *p;
    int64_t x = 0;
    int d = 0;
    while (s < e && (unsigned)(*s - '0') < 10) {
        if (++d > MAX_DIGITS) return 0;
        x = x * 10 + (*s - '0');
        s++;
    }
    if (!d) return 0;
    *p = s;
    *v = x;
    return 1;
}

static inline __attribute__((always_inline)) int digits(const char **p, const char *e, int n) {
    const char *s = *p;
    if (e - s < n) return 0;
    for (int i = 0; i < n; i++)
        if ((unsigned)(s[i] - '0') >= 10) return 0;
    *p = s + n;
    return 1;
}

static const char REL_BODY[] = "slot      release: id";
static const char SEND_BODY[] = "srv    send_error: task id = ";
static const char SEND_TAIL[] = ", error: Context size has been exceeded.\n";
static const char DERR_BODY[] = "srv        decode: Context size has been exceeded. off = ";
static const char DFAIL_BODY[] = "srv  update_slots: decode() failed: Context size has been exceeded.\n";

/* p[0:n] == lit[0:n], eight bytes at a time (the bodies are compared whole, inline) */
static inline int eq(const char *p, const char *lit, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t a, b;
        memcpy(&a, p + i, 8);
        memcpy(&b, lit + i, 8);
        if (a != b) return 0;
    }
    for (; i < n; i++)
        if (p[i] != lit[i]) return 0;
    return 1;
}

#define LIT(p, e, lit) ((size_t)((e) - (p)) >= sizeof lit - 1 && eq(p, lit, sizeof lit - 1))

static inline uint64_t load8(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* the first 16 bytes of each body, to turn most lines away with two compares */
enum { H_MS, H_RT, H_REL, H_SEND, H_DFAIL, H_COUNT };
static const char *const HEADS[H_COUNT] = {MS_BODY, RT_BODY, REL_BODY, SEND_BODY, DFAIL_BODY};
static uint64_t head[H_COUNT][2];

static void init_heads(void) {
    for (int i = 0; i < H_COUNT; i++) {
        head[i][0] = load8(HEADS[i]);
        head[i][1] = load8(HEADS[i] + 8);
    }
}

/* buf[0:n] starts a line; returns the length of the line (to its newline) when it is one of
 * the lines a failing server prints most, exactly as b11434 prints it, and was taken; else 0.
 * Each of these holds only the keywords noted, so taking it here is what dispatch would do. */
static size_t hot_line(Tok *tk, const char *buf, size_t n) {
    int64_t line = tk->lines + 1;
    const char *p = buf, *e = buf + n;
    int64_t v0, v1, v2;
    if (!number(&p, e, &v0) || p >= e || *p++ != '.' || !digits(&p, e, 2) || p >= e ||
        *p++ != '.' || !digits(&p, e, 3) || p >= e || *p++ != '.' || !digits(&p, e, 3) ||
        e - p < 3 || p[0] != ' ' ||
        !(p[1] == 'I' || p[1] == 'W' || p[1] == 'E' || p[1] == 'D') || p[2] != ' ')
        return 0;
    p += 3;
    if (e - p < 17) return 0;
    uint64_t h0 = load8(p), h1 = load8(p + 8);
    int h = -1;
    for (int i = 0; i < H_COUNT; i++)
        if (h0 == head[i][0] && h1 == head[i][1]) { h = i; break; }
    if (h < 0) return 0;
    if (h == H_MS && LIT(p, e, MS_BODY)) { /* "memory slot" */
        p += sizeof MS_BODY - 1;
        if (!number(&p, e, &v0) || p >= e || *p != '\n') return 0;
        emit(tk, EV_MS, line, 0, v0, 0, 0, 0);
        return (size_t)(p - buf);
    }
    if (h == H_RT && LIT(p, e, RT_BODY)) { /* ", ret = " */
        p += sizeof RT_BODY - 1;
        if (!number(&p, e, &v0) || !LIT(p, e, ", n_batch = ")) return 0;
        p += 12;
        if (!number(&p, e, &v1) || !LIT(p, e, ", ret = ")) return 0;
        p += 8;
        if (p < e && *p == '-') p++;
        if (!number(&p, e, &v2) || p >= e || *p != '\n') return 0;
        emit(tk, EV_RT, line, 0, v0, v1, 0, 0);
        return (size_t)(p - buf);
    }
    if (h == H_REL && LIT(p, e, REL_BODY)) { /* "stop processing" */
        p += sizeof REL_BODY - 1;
        const char *sp = p;
        while (p < e && *p == ' ') p++;
        if (p == sp || !number(&p, e, &v0) || !LIT(p, e, " | task ")) return 0;
        p += 8;
        int neg = p < e && *p == '-';
        p += neg;
        if (!number(&p, e, &v1) || !LIT(p, e, " | stop processing: n_tokens = ")) return 0;
        p += 31;
        if (!number(&p, e, &v2) || !LIT(p, e, ", truncated = ")) return 0;
        p += 14;
        const char *t = p;
        int64_t tr;
        if (!number(&p, e, &tr) || p >= e || *p != '\n') return 0;
        emit(tk, EV_REL, line, 0, v0, neg ? -v1 : v1, v2, !(p - t == 1 && *t == '0'));
        return (size_t)(p - buf);
    }
    if (h == H_SEND && LIT(p, e, SEND_BODY)) { /* "send_error", "Context size has been exceeded" */
        p += sizeof SEND_BODY - 1;
        if (p < e && *p == '-') p++;
        if (!number(&p, e, &v0) || !LIT(p, e, SEND_TAIL)) return 0;
        p += sizeof SEND_TAIL - 2;
        emit(tk, EV_SEND_CTX, line, 1, 0, 0, 0, 0);
        return (size_t)(p - buf);
    }
    if (h == H_RT && LIT(p, e, DERR_BODY)) { /* ", ret = ", "Context size has been exceeded" */
        p += sizeof DERR_BODY - 1;
        if (!number(&p, e, &v0) || !LIT(p, e, ", n_batch = ")) return 0;
        p += 12;
        if (!number(&p, e, &v1) || !LIT(p, e, ", ret = ")) return 0;
        p += 8;
        if (p < e && *p == '-') p++;
        if (!number(&p, e, &v2) || p >= e || *p != '\n') return 0;
        emit(tk, EV_DERR, line, 1, 0, v0, 0, 0);
        return (size_t)(p - buf);
    }
    if (h == H_DFAIL && LIT(p, e, DFAIL_BODY)) { /* "decode() failed", "Context size has been exceeded" */
        p += sizeof DFAIL_BODY - 2;
        emit(tk, EV_CLOSE, line, 1, 0, 0, 0, 0);
        return (size_t)(p - buf);
    }
    return 0;
}

/* The lines of buf[0:n], which ends in a newline. */
static void scan_lines(Tok *tk, const char *buf, size_t n, int64_t max_slots) {
    size_t start = 0;
    const char *kw_at[K_COUNT];
#if defined(__SSE2__)
    const __m128i nl = _mm_set1_epi8('\n');
    const __m128i a0 = _mm_set1_epi8(ANCHORS[0]), a1 = _mm_set1_epi8(ANCHORS[1]),
                  a2 = _mm_set1_epi8(ANCHORS[2]), a3 = _mm_set1_epi8(ANCHORS[3]),
                  a4 = _mm_set1_epi8(ANCHORS[4]), a5 = _mm_set1_epi8(ANCHORS[5]);
#endif
    while (start < n) {
        size_t len = hot_line(tk, buf + start, n - start);
        if (len) {
            tk->lines++;
            start += len + 1;
            continue;
        }
        /* one line: its keywords from the anchors, up to its newline */
        uint32_t flags = 0;
        size_t i = start, end = n;
#if defined(__SSE2__)
        for (; i + 16 <= n && end == n; i += 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)(buf + i));
            unsigned nlm = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v, nl));
            __m128i an = _mm_or_si128(
                _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, a0), _mm_cmpeq_epi8(v, a1)),
                             _mm_or_si128(_mm_cmpeq_epi8(v, a2), _mm_cmpeq_epi8(v, a3))),
                _mm_or_si128(_mm_cmpeq_epi8(v, a4), _mm_cmpeq_epi8(v, a5)));
            unsigned bits = (unsigned)_mm_movemask_epi8(an);
            if (nlm) {
                unsigned j = (unsigned)__builtin_ctz(nlm);
                end = i + j;
                bits &= (1u << j) - 1;
            }
            while (bits) {
                unsigned j = (unsigned)__builtin_ctz(bits);
                bits &= bits - 1;
                anchor_hit(buf, n, i + j, &flags, kw_at);
            }
        }
#endif
        for (; end == n && i < n; i++) {
            unsigned char c = (unsigned char)buf[i];
            if (c == '\n')
                end = i;
            else if (is_anchor[c])
                anchor_hit(buf, n, i, &flags, kw_at);
        }
        tk->lines++;
        if (flags) {
            Span t = {buf + start, end - start};
            read_line(tk, tk->lines, t, flags, kw_at, max_slots);
        }
        start = end + 1;
    }
}

/* ------------------------------------------------------------------------------------------
 * The Python type */

static int settle(Scanner *s);

static PyObject *Scanner_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args;
    (void)kw;
    Scanner *s = (Scanner *)type->tp_alloc(type, 0);
    if (s) {
        s->threads = 1;
        s->part_min = PART_MIN;
        s->pend = s->running = -1;
    }
    return (PyObject *)s;
}

static int Scanner_init(Scanner *s, PyObject *args, PyObject *kw) {
    if (s->samples) {
        PyErr_SetString(PyExc_RuntimeError, "a Scanner is set up once; make a new one");
        return -1;
    }
    static char *names[] = {"pool_hint", "keep", "max_steps", "max_samples", "max_slots",
                            "cell_pad", "threads", "part_min", NULL};
    PyObject *hint;
    long long max_slots, cell_pad;
    s->threads = 1;
    long long part_min = PART_MIN;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OnnnLL|iL", names, &hint, &s->keep, &s->max_steps,
                                     &s->max_samples, &max_slots, &cell_pad, &s->threads,
                                     &part_min))
        return -1;
    s->part_min = part_min > 1 ? part_min : 1;
    s->pend = -1;
    s->running = -1;
    if (s->threads < 1) s->threads = 1;
    if (s->threads > MAX_PARTS) s->threads = MAX_PARTS;
    if (hint != Py_None) {
        s->pool_hint = PyLong_AsLongLong(hint);
        if (s->pool_hint == -1 && PyErr_Occurred()) return -1;
        s->has_hint = 1;
    }
    if (s->keep < 0 || s->max_steps < 0 || s->max_samples < 0 || cell_pad <= 0) {
        PyErr_SetString(PyExc_ValueError, "keep, max_steps, max_samples >= 0; cell_pad > 0");
        return -1;
    }
    s->max_slots = max_slots;
    s->cell_pad = cell_pad;
    s->samples = PyList_New(0);
    if (!s->samples) return -1;
    if (s->keep > 0) {
        s->kept = calloc((size_t)s->keep, sizeof(FailRec));
        s->rej = calloc((size_t)s->keep * 3, sizeof(int64_t));
        if (!s->kept || !s->rej) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

static void Scanner_dealloc(Scanner *s) {
    settle(s); /* threads still reading a block: wait for them, let the block go */
    for (int j = 0; j < 2; j++)
        for (int i = 0; i < MAX_PARTS; i++) {
            free(s->sets[j].part[i].tok.v);
            free(s->sets[j].part[i].tok.txt);
            free(s->sets[j].part[i].rbuf);
        }
    free(s->one.v);
    free(s->one.txt);
    free(s->carry);
    free(s->steps.v);
    free(s->pending.steps.v);
    free(s->pending.slots.v);
    if (s->kept) {
        for (Py_ssize_t i = 0; i < s->keep; i++) {
            free(s->kept[i].steps.v);
            free(s->kept[i].slots.v);
        }
        free(s->kept);
    }
    free(s->rej);
    Py_XDECREF(s->samples);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static void tok_reset(Tok *tk, Py_ssize_t max_texts) {
    tk->n = 0;
    tk->lines = 0;
    tk->txt_n = 0;
    tk->kept_texts = 0;
    tk->max_texts = max_texts;
}

/* The lines of a file that start in [a, b): a line running into a belongs to the part
 * before, which reads on past b to finish its own last line. */
static void file_part(Part *p) {
    Tok *tk = &p->tok;
    int skipping = p->a > p->first;
    int64_t pos = skipping ? p->a - 1 : p->a; /* from the byte before a: is a a line start? */
    size_t keep = 0;                          /* an unfinished line at rbuf[0] */
    p->tail_n = 0;
    for (;;) {
        if (grow((void **)&p->rbuf, &p->rcap, keep + p->chunk, 1)) {
            tk->oom = 1;
            return;
        }
        int64_t want = p->end - pos < (int64_t)p->chunk ? p->end - pos : (int64_t)p->chunk;
        if (want <= 0) {
            /* the file's end: what is left is its last line, without a newline */
            if (!skipping && keep) {
                p->tail_at = 0;
                p->tail_n = keep;
            }
            return;
        }
        ssize_t got = pread(p->fd, p->rbuf + keep, (size_t)want, pos);
        if (got < 0) {
            if (errno == EINTR) continue;
            p->err = errno;
            return;
        }
        if (got == 0) {
            p->err = -1;
            p->err_at = pos;
            return;
        }
        int64_t base = pos - (int64_t)keep; /* the file offset of rbuf[0] */
        pos += got;
        char *d = p->rbuf;
        size_t len = keep + (size_t)got, from = 0;
        keep = 0;
        if (skipping) {
            char *nl = memchr(d, '\n', len);
            if (!nl) continue; /* still inside the line before a */
            skipping = 0;
            from = (size_t)(nl - d) + 1;
        }
        if (base + (int64_t)from >= p->b) return; /* no (more) lines start before b */
        /* the part ends with the line holding byte b - 1: read through it when it is here */
        if (p->b - base <= (int64_t)len) {
            size_t last = (size_t)(p->b - base) - 1;
            char *nl = memchr(d + last, '\n', len - last);
            if (nl) {
                scan_lines(tk, d + from, (size_t)(nl - d) + 1 - from, p->max_slots);
                return;
            }
        }
        /* else the whole lines here, and the unfinished one kept for the next chunk */
        char *nl = memrchr(d + from, '\n', len - from);
        size_t whole = nl ? (size_t)(nl - d) + 1 : from;
        if (whole > from) scan_lines(tk, d + from, whole - from, p->max_slots);
        keep = len - whole;
        memmove(d, d + whole, keep);
    }
}

static void *part_run(void *arg) {
    Part *part = arg;
    if (part->fd >= 0)
        file_part(part);
    else if (part->n)
        scan_lines(&part->tok, part->buf, part->n, part->max_slots);
    part->done = 1;
    return NULL;
}

/* Start reading buf[0:n] (whole lines, at most PART_MAX bytes) into `set`: in `threads`
 * parts, each on its own thread, when the block is large enough; else here and now. */
static void set_start(Scanner *s, Set *set, const char *buf, size_t n) {
    int parts = (int64_t)n >= s->part_min ? s->threads : 1;
    size_t at = 0;
    for (int i = 0; i < parts; i++) {
        size_t cut = n;
        if (i < parts - 1) {
            size_t target = n / (size_t)parts * (size_t)(i + 1);
            if (target < at) target = at;
            const char *nl = memchr(buf + target, '\n', n - target);
            cut = nl ? (size_t)(nl - buf) + 1 : n;
        }
        Part *part = &set->part[i];
        tok_reset(&part->tok, s->max_samples);
        part->buf = buf + at;
        part->n = cut - at;
        part->max_slots = s->max_slots;
        part->done = part->started = 0;
        part->fd = -1;
        at = cut;
    }
    set->n = parts;
    if (parts == 1) {
        part_run(&set->part[0]);
        return;
    }
    for (int i = 0; i < parts; i++)
        set->part[i].started =
            pthread_create(&set->part[i].th, NULL, part_run, &set->part[i]) == 0;
}

/* Wait for the set's threads (a part no thread could be had for is read here). */
static int set_join(Scanner *s, Set *set) {
    (void)s;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < set->n; i++) {
        Part *part = &set->part[i];
        if (part->started)
            pthread_join(part->th, NULL);
        else if (!part->done)
            part_run(part);
        part->started = 0;
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < set->n; i++)
        if (set->part[i].tok.oom) return -1;
    return 0;
}

/* Act on the events of the set waiting to be applied, in order. */
static int apply_pending(Scanner *s) {
    if (s->pend < 0) return 0;
    Set *set = &s->sets[s->pend];
    s->pend = -1;
    for (int i = 0; i < set->n; i++) {
        Tok *tk = &set->part[i].tok;
        if (apply(s, tk, s->lines) < 0) return -2;
        s->lines += tk->lines;
    }
    set->n = 0;
    return 0;
}

/* the line carried over from the blocks before, now whole: buf[0:n] without its newline */
static int read_one(Scanner *s, const char *buf, size_t n) {
    Tok *tk = &s->one;
    const char *kw_at[K_COUNT];
    tok_reset(tk, s->max_samples);
    uint32_t f = line_flags(buf, n, kw_at);
    if (f) {
        Span t = {buf, n};
        read_line(tk, 1, t, f, kw_at, s->max_slots);
    }
    if (tk->oom) return -1;
    if (apply(s, tk, s->lines) < 0) return -2;
    s->lines++;
    return 0;
}

/* Wait for the set the last feed() left its threads reading, and let its block go: its
 * events become the pending ones. */
static int settle(Scanner *s) {
    if (s->running < 0) return 0;
    int i = s->running;
    s->running = -1;
    int r = set_join(s, &s->sets[i]);
    s->pend = i;
    if (s->holding) {
        PyBuffer_Release(&s->held);
        s->holding = 0;
    }
    return r;
}

/* Read one block of the input: while its whole lines are read (by one thread per CPU when
 * it is large), the events of the block before are applied and the line carried across the
 * two is read. The threads may still be reading when this returns (the caller reads the next
 * block meanwhile): *left_running says so, and the block must stay unchanged until the next
 * feed or finish. */
static int feed_buffer(Scanner *s, const char *p, size_t n, int *left_running) {
    *left_running = 0;
    int r = settle(s);
    if (r < 0) return r;
    const char *first = memchr(p, '\n', n);
    if (!first) {
        if (grow((void **)&s->carry, &s->carry_cap, s->carry_n + n, 1)) return -1;
        memcpy(s->carry + s->carry_n, p, n);
        s->carry_n += n;
        return 0;
    }
    size_t head = (size_t)(first - p) + 1;
    int carried = s->carry_n > 0;
    const char *q = carried ? p + head : p;
    size_t m = carried ? n - head : n;
    const char *last = m ? memrchr(q, '\n', m) : NULL;
    size_t whole = last ? (size_t)(last - q) + 1 : 0;
    size_t done = 0;
    do {
        size_t cut = whole;
        if (whole - done > PART_MAX) {
            const char *nl = memchr(q + done + PART_MAX, '\n', whole - done - PART_MAX);
            cut = nl ? (size_t)(nl - q) + 1 : whole;
        }
        int next = -1;
        if (cut > done) {
            next = s->pend == 0 ? 1 : 0;
            set_start(s, &s->sets[next], q + done, cut - done);
            s->running = next;
        }
        r = apply_pending(s);
        if (r == 0 && carried) {
            carried = 0;
            if (grow((void **)&s->carry, &s->carry_cap, s->carry_n + head, 1)) {
                r = -1;
            } else {
                memcpy(s->carry + s->carry_n, p, head);
                size_t len = s->carry_n + head - 1;
                s->carry_n = 0;
                r = read_one(s, s->carry, len);
            }
        }
        done = cut;
        if (r == 0 && done < whole) r = settle(s); /* a block over PART_MAX: one part at a time */
        if (r < 0) {
            int j = settle(s);
            (void)j;
            return r;
        }
    } while (done < whole);
    if (m > whole) {
        if (grow((void **)&s->carry, &s->carry_cap, m - whole, 1)) {
            settle(s);
            return -1;
        }
        memcpy(s->carry, q + whole, m - whole);
        s->carry_n = m - whole;
    }
    *left_running = s->running >= 0;
    return 0;
}

/* One call at a time: each lets the GIL go while its threads read, and another Python
 * thread must not use the scanner meanwhile. */
static int enter(Scanner *s) {
    if (!s->samples) {
        PyErr_SetString(PyExc_RuntimeError, "the Scanner was not set up");
        return -1;
    }
    if (s->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the Scanner is in use by another thread");
        return -1;
    }
    s->busy = 1;
    return 0;
}

/* The method `name`: `impl` (defined below it) with the scanner held by this call. */
#define ONE_AT_A_TIME(name, impl)                                                              \
    static PyObject *impl(Scanner *s, PyObject *arg);                                          \
    static PyObject *name(Scanner *s, PyObject *arg) {                                         \
        if (enter(s) < 0) return NULL;                                                         \
        PyObject *out = impl(s, arg);                                                          \
        s->busy = 0;                                                                           \
        return out;                                                                            \
    }

ONE_AT_A_TIME(Scanner_feed, Scanner_feed_)

static PyObject *Scanner_feed_(Scanner *s, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    int running;
    int r = feed_buffer(s, view.buf, (size_t)view.len, &running);
    if (running) {
        s->held = view; /* released by settle() */
        s->holding = 1;
    } else {
        PyBuffer_Release(&view);
    }
    if (r == -1 || s->oom) return PyErr_NoMemory();
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

/* feed_file(fd, start, end, part): read the file's bytes [start, end) with pread, `threads`
 * parts of `part` bytes at a time, each part on its own thread reading and scanning its own
 * chunks (the bytes are scanned while they are still in the CPU's cache); a round's events
 * are applied while the next round is read. An unterminated last line waits for finish(). */
ONE_AT_A_TIME(Scanner_feed_file, Scanner_feed_file_)

static PyObject *Scanner_feed_file_(Scanner *s, PyObject *args) {
    int fd;
    long long start, end, part_size;
    if (!PyArg_ParseTuple(args, "iLLL", &fd, &start, &end, &part_size)) return NULL;
    if (fd < 0 || start < 0 || end < start || part_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "feed_file(fd >= 0, 0 <= start <= end, part > 0)");
        return NULL;
    }
    int r = settle(s);
    if (r == 0) r = apply_pending(s);
    if (r < 0) return r == -1 ? PyErr_NoMemory() : NULL;
    if (s->carry_n) {
        PyErr_SetString(PyExc_ValueError, "feed_file after feed left a line unfinished");
        return NULL;
    }
    if (part_size > (long long)PART_MAX) part_size = (long long)PART_MAX; /* 32-bit line numbers */
    size_t chunk = part_size < (1 << 20) ? (size_t)part_size : (size_t)1 << 20;
    int64_t at = start;
    while (at < end) {
        int parts = (end - at) >= s->part_min ? s->threads : 1;
        int64_t round_end = at + part_size * parts < end ? at + part_size * parts : end;
        int next = s->pend == 0 ? 1 : 0;
        Set *set = &s->sets[next];
        for (int i = 0; i < parts; i++) {
            Part *p = &set->part[i];
            tok_reset(&p->tok, s->max_samples);
            p->fd = fd;
            p->a = at + (round_end - at) * i / parts;
            p->b = i == parts - 1 ? round_end : at + (round_end - at) * (i + 1) / parts;
            p->first = start;
            p->end = end;
            p->chunk = chunk;
            p->err = 0;
            p->tail_n = 0;
            p->n = 0;
            p->max_slots = s->max_slots;
            p->done = p->started = 0;
        }
        set->n = parts;
        if (parts > 1)
            for (int i = 0; i < parts; i++)
                set->part[i].started =
                    pthread_create(&set->part[i].th, NULL, part_run, &set->part[i]) == 0;
        s->running = next;
        r = apply_pending(s);   /* the round before, while this one is read */
        int j = settle(s);      /* (reads the parts no thread was had for) */
        if (r == 0) r = j;
        if (r < 0) return r == -1 ? PyErr_NoMemory() : NULL;
        for (int i = 0; i < parts; i++) {
            Part *p = &set->part[i];
            if (p->err > 0) {
                errno = p->err;
                return PyErr_SetFromErrno(PyExc_OSError);
            }
            if (p->err < 0)
                return PyErr_Format(PyExc_EOFError,
                                    "the file ended at byte %lld, before the %lld bytes it had "
                                    "when reading began",
                                    (long long)p->err_at, (long long)end);
            if (p->tail_n) {
                if (grow((void **)&s->carry, &s->carry_cap, p->tail_n, 1)) return PyErr_NoMemory();
                memcpy(s->carry, p->rbuf + p->tail_at, p->tail_n);
                s->carry_n = p->tail_n;
            }
        }
        at = round_end;
    }
    Py_RETURN_NONE;
}

/* -- results -------------------------------------------------------------------------------- */

static PyObject *opt(int has, int64_t v) {
    if (!has) Py_RETURN_NONE;
    return PyLong_FromLongLong(v);
}

static PyObject *pair(int has, int64_t a, int64_t b) {
    if (!has) Py_RETURN_NONE;
    return Py_BuildValue("(LL)", (long long)a, (long long)b);
}

/* (line, n_slots, n_ctx_slot, unified, sizing, n_ctx, kv_cells, over_train, capped, fit) */
static PyObject *config_tuple(const ConfigRec *c) {
    if (!c->present) Py_RETURN_NONE;
    const Boot *b = &c->boot;
    PyObject *sizing;
    if (b->has_sizing)
        sizing = Py_BuildValue("(LLL)", (long long)b->sz_np, (long long)b->sz_per,
                               (long long)b->sz_nctx);
    else
        sizing = Py_NewRef(Py_None);
    return Py_BuildValue("(LLLNNNNNNN)", (long long)c->line, (long long)c->n_slots,
                         (long long)c->n_ctx_slot, PyBool_FromLong(c->unified), sizing,
                         opt(b->has_nctx, b->nctx), opt(b->has_kvcells, b->kvcells),
                         pair(b->has_over, b->over_seq, b->over_train),
                         pair(b->has_capped, b->cap_from, b->cap_to),
                         pair(b->has_fit, b->fit_from, b->fit_to));
}

static PyObject *failure_tuple(const FailRec *f) {
    PyObject *slots = PyList_New((Py_ssize_t)f->slots.n);
    if (!slots) return NULL;
    for (size_t i = 0; i < f->slots.n; i++) {
        const SlotRec *r = &f->slots.v[i];
        PyObject *t = Py_BuildValue("(LLLN)", (long long)r->slot, (long long)r->task,
                                    (long long)r->n_tokens, PyBool_FromLong(r->truncated));
        if (!t) { Py_DECREF(slots); return NULL; }
        PyList_SET_ITEM(slots, (Py_ssize_t)i, t);
    }
    PyObject *steps = PyList_New((Py_ssize_t)f->steps.n);
    if (!steps) { Py_DECREF(slots); return NULL; }
    for (size_t i = 0; i < f->steps.n; i++) {
        const StepRec *r = &f->steps.v[i];
        PyObject *t = Py_BuildValue("(LNNN)", (long long)r->off, opt(r->has_size, r->size),
                                    opt(r->has_next, r->next),
                                    pair(r->has_purge, r->pslot, r->ptok));
        if (!t) { Py_DECREF(slots); Py_DECREF(steps); return NULL; }
        PyList_SET_ITEM(steps, (Py_ssize_t)i, t);
    }
    PyObject *adds = f->adds_up < 0 ? Py_NewRef(Py_None) : PyBool_FromLong(f->adds_up);
    return Py_BuildValue("{s:L,s:L,s:i,s:L,s:L,s:L,s:N,s:L,s:N,s:L,s:L,s:N,s:N,s:i,s:N,s:i,s:N,s:N}",
                         "number", (long long)f->number, "line", (long long)f->line, "error",
                         f->error, "off", (long long)f->off, "n_steps", (long long)f->n_steps,
                         "offsets", (long long)f->offsets, "first_view",
                         opt(f->has_first_view, f->first_view), "purges", (long long)f->purges,
                         "slots", slots, "requests_failed", (long long)f->requests_failed,
                         "total", (long long)f->total, "pool_cells",
                         opt(f->has_cells, f->pool_cells), "overflow",
                         opt(f->has_overflow, f->overflow), "overflow_source",
                         f->overflow_source, "adds_up", adds, "cls", f->cls, "config",
                         config_tuple(&f->config), "steps", steps);
}

ONE_AT_A_TIME(Scanner_finish, Scanner_finish_)

static PyObject *Scanner_finish_(Scanner *s, PyObject *unused) {
    (void)unused;
    int r = settle(s);
    if (r == 0) r = apply_pending(s);
    if (r == 0 && s->carry_n) {
        size_t len = s->carry_n;
        s->carry_n = 0;
        r = read_one(s, s->carry, len);
    }
    if (r == -1) return PyErr_NoMemory();
    if (r < 0) return NULL;
    close_failure(s);
    if (s->n_steps) s->recovered++;
    if (s->oom) return PyErr_NoMemory();
    PyObject *by_class = PyList_New(s->n_classes);
    if (!by_class) return NULL;
    for (int i = 0; i < s->n_classes; i++) {
        int c = s->class_order[i];
        PyList_SET_ITEM(by_class, i,
                        Py_BuildValue("(iLN)", c, (long long)s->by_class[c],
                                      config_tuple(&s->class_config[c])));
    }
    PyObject *rej = PyList_New(s->rej_n);
    for (Py_ssize_t i = 0; rej && i < s->rej_n; i++) {
        int64_t *r = &s->rej[((s->rej_head + i) % s->keep) * 3];
        PyList_SET_ITEM(rej, i, Py_BuildValue("(LLL)", (long long)r[0], (long long)r[1],
                                              (long long)r[2]));
    }
    PyObject *kept = PyList_New(s->kept_n);
    for (Py_ssize_t i = 0; kept && i < s->kept_n; i++) {
        PyObject *f = failure_tuple(&s->kept[(s->kept_head + i) % s->keep]);
        if (!f) { Py_CLEAR(kept); break; }
        PyList_SET_ITEM(kept, i, f);
    }
    if (!rej || !kept) {
        Py_DECREF(by_class);
        Py_XDECREF(rej);
        Py_XDECREF(kept);
        return NULL;
    }
    return Py_BuildValue(
        "{s:L,s:L,s:L,s:L,s:L,s:N,s:L,s:L,s:L,s:L,s:L,s:N,s:N,s:N,s:N,s:N,s:O}",
        "lines", (long long)s->lines, "exceeded_lines", (long long)s->exceeded_lines,
        "failures_total", (long long)s->failures_total, "requests_failed",
        (long long)s->requests_failed, "rejections_total", (long long)s->rejections_total,
        "max_rejected", opt(s->has_max_rejected, s->max_rejected), "recovered",
        (long long)s->recovered, "startups", (long long)s->startups, "adds_up",
        (long long)s->adds_up, "checked", (long long)s->checked, "drift", (long long)s->drift,
        "by_class", by_class, "config", config_tuple(&s->config), "rejection_config",
        config_tuple(&s->rejection_config), "rejections", rej, "failures", kept,
        "drift_samples", s->samples);
}

static PyMethodDef Scanner_methods[] = {
    {"feed", (PyCFunction)Scanner_feed, METH_O,
     "feed(data): read a block of the log (a bytes-like object; lines may span blocks). The "
     "block is read on after feed returns: leave it unchanged until the next feed or finish"},
    {"feed_file", (PyCFunction)Scanner_feed_file, METH_VARARGS,
     "feed_file(fd, start, end, part): read the file's bytes [start, end) (pread; the file "
     "position is not used), in parts of `part` bytes, one thread per part"},
    {"finish", (PyCFunction)Scanner_finish, METH_NOARGS,
     "finish() -> dict: end the input and return the raw results"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "launcher._diagscan.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Scanner(pool_hint, keep, max_steps, max_samples, max_slots, cell_pad, threads=1)",
    .tp_new = Scanner_new,
    .tp_init = (initproc)Scanner_init,
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_methods = Scanner_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "launcher._diagscan",
    .m_doc = "The native reader behind `llama-launcher diagnose` (see launcher/diagnose.py).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__diagscan(void) {
    init_heads();
    init_offsets();
    if (init_keywords() < 0) {
        PyErr_SetString(PyExc_RuntimeError, "a keyword has no anchor byte");
        return NULL;
    }
    if (PyType_Ready(&ScannerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *kws = PyTuple_New(K_COUNT);
    if (!kws) {
        Py_DECREF(m);
        return NULL;
    }
    for (int k = 0; k < K_COUNT; k++) {
        PyObject *b = PyBytes_FromString(KW[k]);
        if (!b) {
            Py_DECREF(kws);
            Py_DECREF(m);
            return NULL;
        }
        PyTuple_SET_ITEM(kws, k, b);
    }
    if (PyModule_AddObject(m, "KEYWORDS", kws) < 0) { /* steals kws on success */
        Py_DECREF(kws);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_DIGITS", MAX_DIGITS) < 0 ||
        PyModule_AddObjectRef(m, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
