/* Draft-tree mask walks over llguidance's C API: every llguidance tree of a speculative step in
 * one call that never touches Python (espalier_llg_walk_batch): trees in parallel on native
 * threads, each tree's walk, wrap-up and duplicate-key filter (a function pointer into
 * constrained/keys/keys.c) on one of them, the GIL released for the whole call.
 *
 * The walk is an iterative DFS, first child first, where a node is tried only when its parent's
 * row allows its token (backends/llguidance/tree_walk.py). Stop tokens are never consumed: their
 * row is the stop row, and below them only stop tokens are valid.
 *
 * Nothing is ever rolled back: llguidance (1.9.1) can answer a mask of a rolled-back branch
 * after a rollback, even after a fresh mask at the rolled-back state
 * (tests/constrained/test_llguidance_stale_rollback.py). The walk computes the root row on the
 * request's own matcher, which it never advances; it goes down a path on a clone of it, and a
 * node off that path gets a fresh clone that consumes the path to its parent (a clone: ~25 us
 * on Gemma for a young matcher, up to ~100 us for a grown one; ~4 us a token to consume). Chains
 * (oracle, forced, n-gram drafts) take one clone; each further branch one more. With two
 * threads, each takes entries from its own deque and steals from the other's bottom.
 *
 * The llguidance functions come in as pointers (EspLlgApi), resolved by the caller from the
 * library Python already loaded; this file links against nothing but libc and pthreads.
 *
 * Also here: a tokenize callback with a cache (espalier_tokenize_cached). llguidance calls its
 * tokenizer from inside mask computations (to tokenize the rest of a forced lexeme); the
 * tokenizer is Python (a ctypes callback), so each call took the GIL in the middle of a walk
 * that had dropped it. The cache answers the repeated texts in C; only misses reach Python.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>

typedef struct EspLlgApi {
    int32_t (*consume)(void *matcher, uint32_t token);
    int32_t (*consume_many)(void *matcher, const uint32_t *tokens, size_t n);
    int32_t (*mask_into)(void *matcher, uint32_t *dest, size_t byte_len);
    const char *(*get_error)(void *matcher);
    void *(*clone)(const void *matcher);
    void (*free_matcher)(void *matcher);
} EspLlgApi;

/* The layout of EspTreeBatch and the exported functions: capi.py checks it at load. */
#define ESP_WALK_ABI 6

int64_t espalier_llg_walk_abi(void) { return ESP_WALK_ABI; }

enum { ROOT_COMPUTE = 0, ROOT_READY = 1 };
enum { WALK_DONE = 0, WALK_BUDGET_HIT = 1, WALK_MASK_ERROR = -2,
       WALK_NO_MEMORY = -3, WALK_ROLLBACK_ERROR = -4 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int bit_set(const uint32_t *words, int64_t token) {
    return (int)((words[token >> 5] >> (token & 31)) & 1u);
}

static void copy_error(const EspLlgApi *api, void *matcher, char *err, size_t err_len) {
    const char *msg = api->get_error(matcher);
    if (err_len == 0) return;
    if (msg == NULL) msg = "llguidance reported an error without a message";
    strncpy(err, msg, err_len - 1);
    err[err_len - 1] = '\0';
}

/* DFS stack entry: a node and its parent, or -1 when the parent is a stop token (or below
 * one): then the node is never consumed natively. */
typedef struct Entry {
    int64_t node;
    int64_t parent;
} Entry;

/* Everything one walk reads and writes (one struct: a ctypes call with two pointer arguments
 * costs a few microseconds, one with 24 typed arguments tens).
 *
 * `root` is the request's own matcher. It is never advanced: it only computes row 0 (root_mode
 * ROOT_COMPUTE; ROOT_READY trusts it); the walk runs on clones of it. budget_s < 0: no limit; else a node
 * starts only if it would end by now + budget_s were it as long as the longest node so far (one
 * node's mask can take milliseconds inside a long string: this keeps the overrun to the rare
 * node slower than all before it). threads: 1, or 2 (a second thread shares the tree).
 * valid/filled/terminated: uint8 [n], zeroed by the caller; filled[i] is set last.
 * Out: n_filled the number of filled rows (both threads), helper_filled the second thread's. */
typedef struct EspWalkArgs {
    void *root;
    int64_t n;
    const int64_t *tokens, *first_child, *next_sibling;
    uint32_t *rows;
    int64_t words, limit;
    const uint32_t *excluded, *stops; /* stops: also the stop row (the stop ids' bitmap) */
    int64_t root_mode;
    double budget_s;
    uint8_t *valid, *filled, *terminated;
    char *err;
    int64_t err_len;
    int64_t threads, n_filled, helper_filled;
} EspWalkArgs;

struct Pool;

/* One thread's share of a walk: its matcher (a clone of the root, or NULL), the nodes that
 * matcher has consumed below the tree's root (path[0..depth)), and its deque of entries
 * (stack[bottom..top): it pops the top, the other worker steals the bottom, the shallowest
 * entry: the largest subtree). */
typedef struct Worker {
    struct Pool *pool;
    int id;
    void *m;
    int64_t depth;
    int64_t *path, *chain, *kids;
    uint32_t *chain_tokens;
    Entry *stack;
    int64_t bottom, top;
    double slowest;
    int64_t n_filled;
    int64_t at; /* the node its matcher stood at when it last pushed children (under the lock) */
    int waiting;
} Worker;

typedef struct Pool {
    const EspLlgApi *api;
    void *root;
    const int64_t *tokens, *first_child, *next_sibling;
    int64_t *parent, *depth_of;
    uint32_t *rows;
    int64_t n, words, limit;
    size_t row_bytes;
    const uint32_t *excluded, *stops;
    uint8_t *valid, *filled, *terminated;
    char *err;
    size_t err_len;
    double deadline;
    int timed, workers;
    Worker w[2];
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int busy; /* workers holding an entry (they may push more) */
    int stop; /* the budget ran out or a worker failed: nobody starts a node */
    int64_t status;
} Pool;

/* Record a failure (the first one's message) and stop the walk. */
static void fail(Worker *w, void *matcher, int64_t status) {
    Pool *p = w->pool;
    pthread_mutex_lock(&p->lock);
    if (p->status >= 0) {
        p->status = status;
        if (p->err_len) {
            if (matcher != NULL)
                copy_error(p->api, matcher, p->err, p->err_len);
            else
                strncpy(p->err, "llguidance could not clone a matcher", p->err_len - 1);
        }
    }
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
}

/* Push the children of `parent` that its row allows, first child on top; `state` is `parent`
 * or -1 (stop mode). Wakes the other worker if it waits for work. */
static void push_children(Worker *w, int64_t parent, int64_t state) {
    Pool *p = w->pool;
    int64_t count = 0;
    const uint32_t *row = p->rows + parent * p->words;
    for (int64_t kid = p->first_child[parent]; kid >= 0; kid = p->next_sibling[kid]) {
        int64_t token = p->tokens[kid];
        if (token < 0 || token >= p->limit || !bit_set(row, token) || bit_set(p->excluded, token))
            continue;
        w->kids[count++] = kid;
    }
    if (count == 0) return;
    pthread_mutex_lock(&p->lock);
    if (state >= 0) w->at = state;
    for (int64_t i = count - 1; i >= 0; i--) {
        w->stack[w->top].node = w->kids[i];
        w->stack[w->top].parent = state;
        w->top++;
    }
    if (p->workers > 1 && p->w[1 - w->id].waiting) pthread_cond_signal(&p->wake);
    pthread_mutex_unlock(&p->lock);
}

/* Take the next entry: own top, else the other worker's bottom, unless that is the only entry
 * there and continues the other's path (a chain: the other takes it for one consume, a thief
 * would need a clone); wait while the other may still push; 0 when the walk is over
 * (everything done, or stop). */
static int take(Worker *w, Entry *e) {
    Pool *p = w->pool;
    Worker *other = p->workers > 1 ? &p->w[1 - w->id] : NULL;
    int got = 0;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        if (p->stop) break;
        if (w->top > w->bottom) {
            *e = w->stack[--w->top];
            if (w->top == w->bottom) w->top = w->bottom = 0;
            got = 1;
            break;
        }
        const int64_t left = other != NULL ? other->top - other->bottom : 0;
        if (left > 1 || (left == 1 && other->stack[other->bottom].parent != other->at)) {
            *e = other->stack[other->bottom++];
            if (other->top == other->bottom) other->top = other->bottom = 0;
            got = 1;
            break;
        }
        if (p->busy == 0) break;
        w->waiting = 1;
        pthread_cond_wait(&p->wake, &p->lock);
        w->waiting = 0;
    }
    if (got) p->busy++;
    pthread_mutex_unlock(&p->lock);
    return got;
}

static void done_with(Worker *w) {
    Pool *p = w->pool;
    pthread_mutex_lock(&p->lock);
    p->busy--;
    if (p->busy == 0) pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
}

/* Give the worker a matcher at the state after node `parent` (the root: 0). Its own matcher
 * serves when it stands right there; else a fresh clone of the root consumes the path to
 * `parent`. Matchers only ever move forward: llguidance (1.9.1) can answer a stale mask after
 * a rollback (tests/constrained/test_llguidance_stale_rollback.py), so nothing here rolls
 * back. Returns 0 or a negative WALK_ status (after fail()). */
static int64_t move_to(Worker *w, int64_t parent) {
    Pool *p = w->pool;
    const EspLlgApi *api = p->api;
    const int64_t d = p->depth_of[parent];
    if (w->m != NULL && w->depth == d && (d == 0 || w->path[d - 1] == parent)) return 0;
    if (w->m != NULL) api->free_matcher(w->m);
    w->m = api->clone(p->root);
    w->depth = 0;
    if (w->m == NULL) {
        fail(w, NULL, WALK_NO_MEMORY);
        return WALK_NO_MEMORY;
    }
    if (d == 0) return 0;
    for (int64_t k = d, x = parent; k > 0; x = p->parent[x]) w->chain[--k] = x;
    for (int64_t i = 0; i < d; i++) {
        w->chain_tokens[i] = (uint32_t)p->tokens[w->chain[i]];
        w->path[i] = w->chain[i];
    }
    if (api->consume_many(w->m, w->chain_tokens, (size_t)d) != 0) {
        fail(w, w->m, WALK_ROLLBACK_ERROR);
        return WALK_ROLLBACK_ERROR;
    }
    w->depth = d;
    return 0;
}

/* Decide one entry: its row, its flags, its children pushed. */
static void visit(Worker *w, Entry e) {
    Pool *p = w->pool;
    const EspLlgApi *api = p->api;
    const int64_t node = e.node;
    uint32_t *row = p->rows + node * p->words;
    double started = 0.0;
    if (p->timed) {
        started = now_s();
        if (started + w->slowest > p->deadline) {
            pthread_mutex_lock(&p->lock);
            if (p->status == WALK_DONE) p->status = WALK_BUDGET_HIT;
            p->stop = 1;
            pthread_cond_broadcast(&p->wake);
            pthread_mutex_unlock(&p->lock);
            return;
        }
    }
    if (e.parent < 0 || bit_set(p->stops, p->tokens[node])) {
        /* a stop token, or one after it: never consumed natively */
        memcpy(row, p->stops, p->row_bytes);
        p->valid[node] = 1;
        p->terminated[node] = 1;
        p->filled[node] = 1;
        w->n_filled++;
        push_children(w, node, -1);
        return;
    }
    if (move_to(w, e.parent) != 0) return;
    /* the parent's row allows the token, so this fails only on a library inconsistency (the
     * matcher is then in its error state: stop) */
    if (api->consume(w->m, (uint32_t)p->tokens[node]) != 0) {
        fail(w, w->m, WALK_ROLLBACK_ERROR);
        return;
    }
    w->path[w->depth++] = node;
    if (api->mask_into(w->m, row, p->row_bytes) != 0) {
        fail(w, w->m, WALK_MASK_ERROR);
        return;
    }
    p->valid[node] = 1;
    p->filled[node] = 1;
    w->n_filled++;
    if (p->timed) {
        double took = now_s() - started;
        if (took > w->slowest) w->slowest = took;
    }
    if (p->first_child[node] >= 0) push_children(w, node, node);
}

static void work(Worker *w) {
    Entry e;
    while (take(w, &e)) {
        visit(w, e);
        done_with(w);
    }
}

static void *helper_main(void *arg) {
    work((Worker *)arg);
    return NULL;
}

static int alloc_worker(Worker *w, Pool *p, int id, int64_t n) {
    w->pool = p;
    w->id = id;
    w->path = malloc(sizeof(int64_t) * (size_t)n);
    w->chain = malloc(sizeof(int64_t) * (size_t)n);
    w->kids = malloc(sizeof(int64_t) * (size_t)n);
    w->chain_tokens = malloc(sizeof(uint32_t) * (size_t)n);
    w->stack = malloc(sizeof(Entry) * (size_t)n);
    return w->path && w->chain && w->kids && w->chain_tokens && w->stack;
}

static void free_worker(Worker *w) {
    if (w->m != NULL) w->pool->api->free_matcher(w->m);
    free(w->path);
    free(w->chain);
    free(w->kids);
    free(w->chain_tokens);
    free(w->stack);
}

/* Returns WALK_DONE, WALK_BUDGET_HIT, or a negative error (message in `err`). */
static int64_t walk_tree(const EspLlgApi *api, EspWalkArgs *a) {
    const int64_t n = a->n;
    Pool pool;
    memset(&pool, 0, sizeof(pool));
    Pool *p = &pool;
    p->api = api;
    p->root = a->root;
    p->tokens = a->tokens;
    p->first_child = a->first_child;
    p->next_sibling = a->next_sibling;
    p->rows = a->rows;
    p->n = n;
    p->words = a->words;
    p->limit = a->limit;
    p->row_bytes = (size_t)a->words * 4u;
    p->excluded = a->excluded;
    p->stops = a->stops;
    p->valid = a->valid;
    p->filled = a->filled;
    p->terminated = a->terminated;
    p->err = a->err;
    p->err_len = (size_t)a->err_len;
    p->timed = a->budget_s >= 0;
    p->deadline = p->timed ? now_s() + a->budget_s : 0.0;
    p->status = WALK_DONE;
    a->n_filled = 0;
    a->helper_filled = 0;
    const int split = a->threads > 1 && n > 2 && a->first_child[0] >= 0;
    p->workers = split ? 2 : 1;
    p->parent = malloc(sizeof(int64_t) * (size_t)n);
    p->depth_of = malloc(sizeof(int64_t) * (size_t)n);
    int ok = p->parent && p->depth_of && alloc_worker(&p->w[0], p, 0, n);
    if (split) ok = ok && alloc_worker(&p->w[1], p, 1, n);
    if (!ok) {
        p->status = WALK_NO_MEMORY;
        goto out;
    }
    /* parents and depths, root first (a valid tree: every node below the root, no cycle) */
    p->parent[0] = -1;
    p->depth_of[0] = 0;
    {
        int64_t *order = p->w[0].kids, head = 0, tail = 0;
        order[tail++] = 0;
        while (head < tail) {
            int64_t x = order[head++];
            for (int64_t k = a->first_child[x]; k >= 0; k = a->next_sibling[k]) {
                p->parent[k] = x;
                p->depth_of[k] = p->depth_of[x] + 1;
                order[tail++] = k;
            }
        }
    }
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    Worker *w0 = &p->w[0];
    p->busy = 1; /* the root phase below: it pushes the root's children */
    pthread_t thread;
    int started = 0;
    if (split) {
        started = pthread_create(&thread, NULL, helper_main, &p->w[1]) == 0;
        if (!started) p->workers = 1;
    }
    /* the root row on the request's matcher itself (a mask at its current state, as in plain
     * decoding): its lexer's lazily built automaton then grows with the request, and the clones
     * start warm */
    if (a->root_mode == ROOT_COMPUTE && api->mask_into(a->root, a->rows, p->row_bytes) != 0) {
        fail(w0, a->root, WALK_MASK_ERROR);
    } else {
        a->valid[0] = 1;
        a->filled[0] = 1;
        w0->n_filled = 1;
        if (n > 1 && a->first_child[0] >= 0) push_children(w0, 0, 0);
    }
    done_with(w0);
    work(w0);
    if (started) pthread_join(thread, NULL);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->lock);
    a->n_filled = w0->n_filled + (started ? p->w[1].n_filled : 0);
    a->helper_filled = started ? p->w[1].n_filled : 0;
out:
    free(p->parent);
    free(p->depth_of);
    free_worker(&p->w[0]);
    if (split) free_worker(&p->w[1]);
    return p->status;
}

/* -- a step's trees in one call --------------------------------------------------------------- */

/* A filter applied to a tree's rows after its walk, in the same call (the duplicate-key
 * tracker's espalier_keys_filter_tree, constrained/keys/keys.c): state, the tree (n nodes,
 * first_child / next_sibling links), its rows and the walk's flags, updated in place; 0, or -1
 * out of memory. */
typedef int32_t (*EspTreeFilterFn)(void *state, int64_t n, const int64_t *tokens,
                                   const int64_t *first_child, const int64_t *next_sibling,
                                   uint32_t *rows, int64_t words, uint8_t *valid, uint8_t *filled,
                                   uint8_t *terminated);

/* Every llguidance tree of a step (see espalier_llg_walk_batch). Tree b: its root matcher
 * roots[b] (the request's own); its nodes node_at[b] ..
 * node_at[b + 1] of tokens / parents (parents[0] = -1, each other one a node index of the same
 * tree; siblings in index order); its rows from rows + row_at[b] * words; its flags from offset
 * flag_at[b] of the three planes of `flags` (valid, filled, terminated; `plane` bytes apart,
 * zeroed by the caller); root_mode: ROOT_COMPUTE (row 0 from the root matcher) or ROOT_READY (row 0
 * given, flags set by the walk); filter_states[b]: the state `filter` is called with, NULL for none. Out
 * per tree: status (WALK_*, or WALK_FILTER_ERROR / WALK_BAD_TREE), filled rows (helper: by a
 * second thread), seconds, the error text (err_len bytes each), and where want_snapshot[b] is
 * set, snapshots[b]: a clone of the root once its row is computed (its lexer warm with the
 * request's states; NULL when the walk failed or no clone could be made), which the caller owns
 * and frees. */
typedef struct EspTreeBatch {
    int64_t n_trees;
    void *const *roots;
    void *const *filter_states;
    EspTreeFilterFn filter;
    const int64_t *node_at, *row_at, *flag_at;
    const int64_t *tokens, *parents;
    uint32_t *rows;
    uint8_t *flags;
    int64_t plane, words, limit, vocab_size;
    const uint32_t *excluded, *stops;
    double budget_s;
    int64_t root_mode, threads, tree_threads;
    int64_t *status, *n_filled, *helper_filled;
    double *seconds;
    char *errors;
    int64_t err_len;
    const uint8_t *want_snapshot; /* NULL: none; else per tree, 1: snapshot its root */
    void **snapshots;             /* per tree: a clone of the root after the walk, or NULL */
} EspTreeBatch;

enum { WALK_FILTER_ERROR = -5, WALK_BAD_TREE = -6 };

enum { MAX_BATCH_THREADS = 64, SPLIT_MIN_NODES = 8 };

typedef struct BatchShared {
    const EspLlgApi *api;
    EspTreeBatch *b;
    int64_t next; /* the next tree to take (atomic) */
} BatchShared;

static void set_error(EspTreeBatch *b, int64_t t, const char *message) {
    char *err = b->errors + t * b->err_len;
    strncpy(err, message, (size_t)b->err_len - 1);
    err[b->err_len - 1] = '\0';
}

/* The rows a walk left unfilled get the stop bits (never an all-zero row); the bits past V
 * are cleared in every row (the library may leave them set). */
static void wrap_up(const EspTreeBatch *b, uint32_t *rows, int64_t n, const uint8_t *filled,
                    int64_t n_filled) {
    if (n_filled < n) {
        for (int64_t i = 0; i < n; i++) {
            if (filled[i]) continue;
            uint32_t *row = rows + i * b->words;
            for (int64_t w = 0; w < b->words; w++) row[w] |= b->stops[w];
        }
    }
    const int64_t rem = b->vocab_size % 32;
    if (rem && b->vocab_size / 32 < b->words) {
        const uint32_t keep = (1u << rem) - 1u;
        for (int64_t i = 0; i < n; i++) rows[i * b->words + b->vocab_size / 32] &= keep;
    }
}

/* One tree: links from the parents, the walk, the wrap-up, the filter. */
static void fill_one_tree(const EspLlgApi *api, EspTreeBatch *b, int64_t t) {
    const double started = now_s();
    const int64_t at = b->node_at[t], n = b->node_at[t + 1] - at;
    const int64_t *tokens = b->tokens + at, *parents = b->parents + at;
    uint32_t *rows = b->rows + b->row_at[t] * b->words;
    uint8_t *valid = b->flags + b->flag_at[t], *filled = valid + b->plane, *terminated = filled + b->plane;
    char *err = b->errors + t * b->err_len;
    err[0] = '\0';
    b->n_filled[t] = b->helper_filled[t] = 0;
    int64_t *links = malloc(sizeof(int64_t) * (size_t)(3 * (n > 0 ? n : 1)));
    if (links == NULL) {
        b->status[t] = WALK_NO_MEMORY;
        set_error(b, t, "out of memory");
        return;
    }
    int64_t *first_child = links, *next_sibling = links + n, *last_child = links + 2 * n;
    int64_t branches = 0, status = n > 0 && parents[0] == -1 ? WALK_DONE : WALK_BAD_TREE;
    for (int64_t i = 0; i < n; i++) first_child[i] = next_sibling[i] = last_child[i] = -1;
    for (int64_t i = 1; i < n && status == WALK_DONE; i++) {
        const int64_t p = parents[i];
        if (p < 0 || p >= n || p == i) {
            status = WALK_BAD_TREE;
        } else if (last_child[p] < 0) {
            first_child[p] = i;
        } else {
            next_sibling[last_child[p]] = i;
            branches++;
        }
        if (status == WALK_DONE) last_child[p] = i;
    }
    if (status == WALK_BAD_TREE) {
        set_error(b, t, "malformed draft tree (a parent outside the tree)");
    } else {
        EspWalkArgs a;
        memset(&a, 0, sizeof a);
        a.root = b->roots[t];
        a.n = n;
        a.tokens = tokens;
        a.first_child = first_child;
        a.next_sibling = next_sibling;
        a.rows = rows;
        a.words = b->words;
        a.limit = b->limit;
        a.excluded = b->excluded;
        a.stops = b->stops;
        a.root_mode = b->root_mode;
        a.budget_s = b->budget_s;
        a.valid = valid;
        a.filled = filled;
        a.terminated = terminated;
        a.err = err;
        a.err_len = b->err_len;
        /* a second thread only for a tree with a branch and enough nodes: below, its start
         * (~30-60 us) costs about what it saves, and a chain has no second subtree to give */
        a.threads = b->tree_threads > 1 && n >= SPLIT_MIN_NODES && branches > 0 ? 2 : 1;
        status = walk_tree(api, &a);
        b->n_filled[t] = a.n_filled;
        b->helper_filled[t] = a.helper_filled;
        if (status >= 0 && b->want_snapshot != NULL && b->want_snapshot[t]) {
            b->snapshots[t] = api->clone(b->roots[t]);
        }
        if (status >= 0) {
            wrap_up(b, rows, n, filled, a.n_filled);
            void *state = b->filter_states != NULL ? b->filter_states[t] : NULL;
            if (state != NULL && b->filter != NULL &&
                b->filter(state, n, tokens, first_child, next_sibling, rows, b->words, valid,
                          filled, terminated) != 0) {
                status = WALK_FILTER_ERROR;
                set_error(b, t, "the tree filter ran out of memory");
            }
        }
    }
    free(links);
    b->status[t] = status;
    b->seconds[t] = now_s() - started;
}

static void *batch_worker(void *arg) {
    BatchShared *s = arg;
    for (;;) {
        const int64_t t = __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED);
        if (t >= s->b->n_trees) break;
        fill_one_tree(s->api, s->b, t);
    }
    return NULL;
}

/* Fill every tree of `b` on up to b->threads threads (the caller's among them), each tree
 * taken whole by one of them, in index order. Per tree: the walk
 * (walk_tree: budget_s from the tree's own start, < 0 none), the wrap-up (unfilled rows get
 * the stop bits; bits past vocab_size cleared), then b->filter. Never touches Python; returns
 * how many trees failed (their status < 0, message in errors). */
int64_t espalier_llg_walk_batch(const EspLlgApi *api, EspTreeBatch *b) {
    BatchShared shared = {api, b, 0};
    int64_t threads = b->threads < b->n_trees ? b->threads : b->n_trees;
    if (threads > MAX_BATCH_THREADS) threads = MAX_BATCH_THREADS;
    pthread_t ids[MAX_BATCH_THREADS];
    int64_t started = 0;
    for (int64_t i = 1; i < threads; i++) {
        if (pthread_create(&ids[started], NULL, batch_worker, &shared) != 0) break;
        started++;
    }
    batch_worker(&shared);
    for (int64_t i = 0; i < started; i++) pthread_join(ids[i], NULL);
    int64_t failed = 0;
    for (int64_t t = 0; t < b->n_trees; t++) failed += b->status[t] < 0;
    return failed;
}

/* -- the tokenize callback's cache ----------------------------------------------------------- */

typedef size_t (*EspTokenizeFn)(const void *user, const uint8_t *bytes, size_t len, uint32_t *out,
                                size_t cap);

typedef struct CacheEntry {
    uint64_t hash;
    uint8_t *key;
    size_t key_len;
    uint32_t *ids;
    size_t n_ids;
} CacheEntry;

typedef struct EspTokenizeCache {
    pthread_mutex_t lock;
    EspTokenizeFn slow;
    const void *slow_user;
    size_t capacity, used; /* capacity: a power of two; cleared when half full */
    CacheEntry *entries;
} EspTokenizeCache;

static uint64_t fnv1a(const uint8_t *bytes, size_t len) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) h = (h ^ bytes[i]) * 1099511628211ull;
    return h | 1u; /* 0 marks an empty slot */
}

/* A cache in front of `slow` (the Python tokenizer); `capacity` is rounded up to a power of
 * two. NULL on allocation failure. */
EspTokenizeCache *espalier_tokenize_cache_new(EspTokenizeFn slow, const void *slow_user,
                                              size_t capacity) {
    size_t cap = 64;
    while (cap < capacity) cap <<= 1;
    EspTokenizeCache *c = calloc(1, sizeof(EspTokenizeCache));
    if (c == NULL) return NULL;
    c->entries = calloc(cap, sizeof(CacheEntry));
    if (c->entries == NULL) {
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->lock, NULL);
    c->slow = slow;
    c->slow_user = slow_user;
    c->capacity = cap;
    return c;
}

static void clear_entries(EspTokenizeCache *c) {
    for (size_t i = 0; i < c->capacity; i++) {
        free(c->entries[i].key);
        free(c->entries[i].ids);
    }
    memset(c->entries, 0, c->capacity * sizeof(CacheEntry));
    c->used = 0;
}

/* Lookup under the lock; copies up to `cap` ids into `out`. Returns the id count, or -1. */
static int64_t lookup(EspTokenizeCache *c, uint64_t h, const uint8_t *bytes, size_t len,
                      uint32_t *out, size_t cap) {
    int64_t found = -1;
    pthread_mutex_lock(&c->lock);
    for (size_t i = h & (c->capacity - 1);; i = (i + 1) & (c->capacity - 1)) {
        CacheEntry *e = &c->entries[i];
        if (e->hash == 0) break;
        if (e->hash == h && e->key_len == len && memcmp(e->key, bytes, len) == 0) {
            memcpy(out, e->ids, sizeof(uint32_t) * (e->n_ids < cap ? e->n_ids : cap));
            found = (int64_t)e->n_ids;
            break;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return found;
}

static void insert(EspTokenizeCache *c, uint64_t h, const uint8_t *bytes, size_t len,
                   const uint32_t *ids, size_t n_ids) {
    uint8_t *key = malloc(len ? len : 1);
    uint32_t *copy = malloc(sizeof(uint32_t) * (n_ids ? n_ids : 1));
    if (key == NULL || copy == NULL) {
        free(key);
        free(copy);
        return;
    }
    memcpy(key, bytes, len);
    memcpy(copy, ids, sizeof(uint32_t) * n_ids);
    pthread_mutex_lock(&c->lock);
    if (2 * (c->used + 1) > c->capacity) clear_entries(c);
    for (size_t i = h & (c->capacity - 1);; i = (i + 1) & (c->capacity - 1)) {
        CacheEntry *e = &c->entries[i];
        if (e->hash == h && e->key_len == len && memcmp(e->key, bytes, len) == 0) {
            free(key); /* another thread inserted it meanwhile */
            free(copy);
            break;
        }
        if (e->hash == 0) {
            *e = (CacheEntry){h, key, len, copy, n_ids};
            c->used++;
            break;
        }
    }
    pthread_mutex_unlock(&c->lock);
}

/* llguidance's tokenize_fn (user_data: an EspTokenizeCache): the ids of `bytes`, at most `cap`
 * of them written to `out`; returns how many there are. */
size_t espalier_tokenize_cached(const void *user, const uint8_t *bytes, size_t len, uint32_t *out,
                                size_t cap) {
    EspTokenizeCache *c = (EspTokenizeCache *)user;
    const uint64_t h = fnv1a(bytes, len);
    int64_t hit = lookup(c, h, bytes, len, out, cap);
    if (hit >= 0) return (size_t)hit;
    size_t room = cap > 64 ? cap : 64;
    uint32_t *ids = malloc(sizeof(uint32_t) * room);
    if (ids == NULL) return c->slow(c->slow_user, bytes, len, out, cap);
    size_t n_ids = c->slow(c->slow_user, bytes, len, ids, room);
    if (n_ids > room) { /* more ids than the buffer: ask again with room for all */
        uint32_t *more = realloc(ids, sizeof(uint32_t) * n_ids);
        if (more == NULL) {
            free(ids);
            return c->slow(c->slow_user, bytes, len, out, cap);
        }
        ids = more;
        n_ids = c->slow(c->slow_user, bytes, len, ids, n_ids);
    }
    memcpy(out, ids, sizeof(uint32_t) * (n_ids < cap ? n_ids : cap));
    insert(c, h, bytes, len, ids, n_ids);
    free(ids);
    return n_ids;
}

/* ---- a step's accepts for a batch of request matchers ------------------------------------- */

typedef int32_t (*EspValidateFn)(void *matcher, const uint32_t *tokens, size_t n);

typedef struct AcceptBatch {
    const EspLlgApi *api;
    EspValidateFn validate;
    void **matchers;
    void *const *sources; /* NULL, or: matchers[b] = a clone of sources[b], made by the job */
    const uint32_t *tokens;
    const int64_t *at;
    int64_t n;
    int64_t *out;
    int64_t next; /* the next matcher to take (under lock) */
    pthread_mutex_t lock;
} AcceptBatch;

/* Matcher b consumes the longest allowed prefix of its run, token by token, each one validated
 * first: what llguidance's Python try_consume_tokens does. (A whole run validated, then
 * consumed, can fail where token-by-token consumes do not, and a disallowed token consumed would
 * put the matcher in its sticky error state.) */
static int64_t accept_one(const AcceptBatch *a, int64_t b) {
    if (a->sources != NULL) {
        a->matchers[b] = a->api->clone(a->sources[b]);
        if (a->matchers[b] == NULL) return -1;
    }
    void *m = a->matchers[b];
    int64_t taken = 0;
    for (int64_t i = a->at[b]; i < a->at[b + 1]; i++) {
        const int32_t valid = a->validate(m, &a->tokens[i], 1);
        if (valid < 0) return -1;
        if (valid == 0) break;
        if (a->api->consume(m, a->tokens[i]) != 0) return -1;
        taken++;
    }
    return taken;
}

static void *accept_worker(void *arg) {
    AcceptBatch *a = (AcceptBatch *)arg;
    for (;;) {
        pthread_mutex_lock(&a->lock);
        const int64_t b = a->next++;
        pthread_mutex_unlock(&a->lock);
        if (b >= a->n) return NULL;
        a->out[b] = accept_one(a, b);
    }
}

/* Matcher b (of n) consumes what it allows of tokens[at[b] .. at[b + 1]) (accept_one); out[b]:
 * how many, or -1 when it failed (its error state then says why; a failed clone leaves
 * matchers[b] NULL). sources NULL: the matchers are advanced in place; else matchers[b] is
 * written first, a clone of sources[b] (its caller owns it), so a batch of forks is made and
 * caught up in one call. Up to `threads` threads over the matchers (each matcher, and each
 * source, on one thread; distinct ones only), the calling one among them. Returns 0. */
int64_t espalier_llg_accept_batch(const EspLlgApi *api, EspValidateFn validate, void **matchers,
                                  void *const *sources, const uint32_t *tokens, const int64_t *at,
                                  int64_t n, int64_t threads, int64_t *out) {
    AcceptBatch a = {api, validate, matchers, sources, tokens, at,
                     n,   out,      0,        PTHREAD_MUTEX_INITIALIZER};
    for (int64_t b = 0; b < n; b++) out[b] = -2;
    int64_t helpers = threads - 1;
    if (helpers > n - 1) helpers = n - 1;
    pthread_t ids[16];
    if (helpers > 16) helpers = 16;
    int64_t started = 0;
    for (; started < helpers; started++) {
        if (pthread_create(&ids[started], NULL, accept_worker, &a) != 0) break;
    }
    accept_worker(&a);
    for (int64_t t = 0; t < started; t++) pthread_join(ids[t], NULL);
    pthread_mutex_destroy(&a.lock);
    return 0;
}
