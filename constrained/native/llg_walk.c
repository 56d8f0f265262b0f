/* Draft-tree mask walk over llguidance's C API, in one call that never touches Python.
 *
 * Semantics mirror constrained/traverse_llguidance.py (the Python walk): an iterative DFS, first
 * child first, where a node is tried only when its parent's row allows its token. Stop tokens are
 * never consumed: their row is the stop row, and below them only stop tokens are valid.
 *
 * Unlike the Python walk, siblings do not start from copies: the C API's llg_clone_matcher is a
 * deep clone (10-60 us on Gemma, the lexer included, against ~2 us for the Python deep_copy,
 * which shares it), so the walk moves one matcher down and rolls it back. llguidance's mask memo
 * survives a rollback (backends/llguidance.py), so after each rollback one mask is computed at
 * the rolled-back state, into a scratch row, before the next consume. The walk leaves the
 * matcher where it ended (the last node it consumed) and reports that path: the next walk rolls
 * back only what the request did not accept of it. A chain draft accepted in full (an oracle,
 * a forced chain) then costs no rollback and no memo refresh at all.
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
    int32_t (*rollback)(void *matcher, size_t n);
    int32_t (*mask_into)(void *matcher, uint32_t *dest, size_t byte_len);
    const char *(*get_error)(void *matcher);
} EspLlgApi;

enum { ROOT_COMPUTE = 0, ROOT_READY = 1 };
enum { WALK_DONE = 0, WALK_BUDGET_HIT = 1, WALK_SYNC_ERROR = -1, WALK_MASK_ERROR = -2,
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
 * First the root catches up with the request: roll back `rollback_n` tokens, consume `sync`
 * (after one mask into `scratch` ([words]) when its memo is stale: `memo_stale`, or
 * rollback_n > 0). root_mode: ROOT_COMPUTE computes row 0; ROOT_READY trusts it.
 * budget_s < 0: no limit; else a node starts only if it would end by now + budget_s were it
 * as long as the longest node so far (one node's mask can take milliseconds inside a long
 * string: this keeps the overrun to the rare node slower than all before it).
 * valid/filled/terminated: uint8 [n], zeroed by the caller; filled[i] is set last.
 * Out: end_path[0..end_depth) the tokens the root has consumed below the tree's root when the
 * walk ends (end_path: uint32 [n]); memo_stale_out whether its memo may be stale then;
 * n_filled the number of filled rows (by both workers). */
typedef struct EspWalkArgs {
    void *root;
    int64_t memo_stale, rollback_n;
    const uint32_t *sync;
    int64_t n_sync, n;
    const int64_t *tokens, *first_child, *next_sibling;
    uint32_t *rows;
    int64_t words, limit;
    const uint32_t *excluded, *stops; /* stops: also the stop row (the stop ids' bitmap) */
    int64_t root_mode;
    uint32_t *scratch;
    double budget_s;
    uint8_t *valid, *filled, *terminated;
    char *err;
    int64_t err_len;
    uint32_t *end_path;
    int64_t end_depth, memo_stale_out, n_filled;
} EspWalkArgs;

/* A second matcher of the same request (its own twin) that walks part of the tree on a thread
 * of its own: it catches up the same way (rollback_n, sync, memo_stale) and reports where it
 * ended in the same way. ran: 0 when its thread could not be started (its state unchanged);
 * n_filled: the rows it filled. */
typedef struct EspHelperArgs {
    void *matcher;
    int64_t memo_stale, rollback_n;
    const uint32_t *sync;
    int64_t n_sync;
    uint32_t *scratch;
    char *err;
    int64_t err_len;
    uint32_t *end_path;
    int64_t end_depth, memo_stale_out, ran, n_filled;
} EspHelperArgs;

struct Pool;

/* One thread's share of a walk: its matcher, the nodes it has consumed below the tree's root
 * (path[0..depth)), and its deque of entries (stack[bottom..top): it pops the top, the other
 * worker steals the bottom, the shallowest entry: the largest subtree). */
typedef struct Worker {
    struct Pool *pool;
    int id;
    void *m;
    int memo_stale;
    int64_t rollback_n, n_sync;
    const uint32_t *sync;
    uint32_t *scratch;
    char *err;
    size_t err_len;
    int64_t depth;
    int64_t *path, *chain, *kids;
    uint32_t *chain_tokens;
    Entry *stack;
    int64_t bottom, top;
    double slowest;
    int64_t n_filled, status;
    int waiting;
} Worker;

typedef struct Pool {
    const EspLlgApi *api;
    const int64_t *tokens, *first_child, *next_sibling;
    int64_t *parent, *depth_of;
    uint32_t *rows;
    int64_t n, words, limit;
    size_t row_bytes;
    const uint32_t *excluded, *stops;
    uint8_t *valid, *filled, *terminated;
    double deadline;
    int timed, workers;
    Worker w[2];
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int busy; /* workers holding an entry (they may push more) */
    int stop; /* the budget ran out or a worker failed: nobody starts a node */
    int64_t status;
} Pool;

static void fail(Worker *w, int64_t status) {
    Pool *p = w->pool;
    if (w->err_len) copy_error(p->api, w->m, w->err, w->err_len);
    pthread_mutex_lock(&p->lock);
    w->status = status;
    if (p->status >= 0) p->status = status;
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
    for (int64_t i = count - 1; i >= 0; i--) {
        w->stack[w->top].node = w->kids[i];
        w->stack[w->top].parent = state;
        w->top++;
    }
    if (p->workers > 1 && p->w[1 - w->id].waiting) pthread_cond_signal(&p->wake);
    pthread_mutex_unlock(&p->lock);
}

/* Take the next entry: own top, else the other worker's bottom; wait while the other may still
 * push; 0 when the walk is over (everything done, or stop). */
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
        if (other != NULL && other->top > other->bottom) {
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

/* Refresh the memo (one mask into scratch) if a rollback left it stale. */
static int refresh(Worker *w) {
    if (!w->memo_stale) return 0;
    if (w->pool->api->mask_into(w->m, w->scratch, w->pool->row_bytes) != 0) return -1;
    w->memo_stale = 0;
    return 0;
}

/* Bring the worker's matcher to the state after node `parent`: roll back to the longest common
 * prefix of its path and the parent's, then consume the rest (a stolen entry's branch).
 * Returns 0 or a negative WALK_ status. */
static int64_t move_to(Worker *w, int64_t parent) {
    Pool *p = w->pool;
    const EspLlgApi *api = p->api;
    const int64_t d = p->depth_of[parent];
    int64_t target = d, have = d;
    if (d > 0 && !(w->depth >= d && w->path[d - 1] == parent)) {
        for (int64_t k = d, x = parent; k > 0; x = p->parent[x]) w->chain[--k] = x;
        target = 0;
        while (target < w->depth && target < d && w->path[target] == w->chain[target]) target++;
        have = target;
    }
    if (w->depth > target) {
        if (api->rollback(w->m, (size_t)(w->depth - target)) != 0) return WALK_ROLLBACK_ERROR;
        w->depth = target;
        w->memo_stale = 1;
    }
    if (refresh(w) != 0) return WALK_MASK_ERROR; /* a consume must not meet a stale memo */
    if (have < d) {
        for (int64_t i = have; i < d; i++) {
            w->chain_tokens[i - have] = (uint32_t)p->tokens[w->chain[i]];
            w->path[i] = w->chain[i];
        }
        if (api->consume_many(w->m, w->chain_tokens, (size_t)(d - have)) != 0)
            return WALK_ROLLBACK_ERROR;
        w->depth = d;
    }
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
    int64_t status = move_to(w, e.parent);
    if (status != 0) {
        fail(w, status);
        return;
    }
    /* the parent's row allows the token, so this fails only on a library inconsistency (the
     * matcher is then in its error state: stop) */
    if (api->consume(w->m, (uint32_t)p->tokens[node]) != 0) {
        fail(w, WALK_ROLLBACK_ERROR);
        return;
    }
    w->path[w->depth++] = node;
    if (api->mask_into(w->m, row, p->row_bytes) != 0) {
        fail(w, WALK_MASK_ERROR);
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

/* Catch the worker's matcher up with the request. Returns 0 or WALK_SYNC_ERROR. */
static int64_t catch_up(Worker *w) {
    const EspLlgApi *api = w->pool->api;
    if (w->rollback_n > 0) {
        if (api->rollback(w->m, (size_t)w->rollback_n) != 0) return WALK_SYNC_ERROR;
        w->memo_stale = 1;
    }
    if (w->n_sync > 0) {
        if (refresh(w) != 0) return WALK_SYNC_ERROR;
        if (api->consume_many(w->m, w->sync, (size_t)w->n_sync) != 0) return WALK_SYNC_ERROR;
    }
    return 0;
}

static void work(Worker *w) {
    Entry e;
    while (take(w, &e)) {
        visit(w, e);
        done_with(w);
    }
}

static void *helper_main(void *arg) {
    Worker *w = (Worker *)arg;
    int64_t status = catch_up(w);
    if (status != 0) {
        fail(w, status);
        done_with(w); /* its catch-up counted as busy */
        return NULL;
    }
    done_with(w);
    work(w);
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
    free(w->path);
    free(w->chain);
    free(w->kids);
    free(w->chain_tokens);
    free(w->stack);
}

static void end_state(Worker *w, uint32_t *end_path, int64_t *end_depth, int64_t *memo_out) {
    for (int64_t i = 0; i < w->depth; i++) end_path[i] = (uint32_t)w->pool->tokens[w->path[i]];
    *end_depth = w->depth;
    *memo_out = w->memo_stale;
}

/* The walk, on the calling thread, with `helper` (may be NULL) walking part of the tree on a
 * thread of its own. Returns WALK_DONE, WALK_BUDGET_HIT, or a negative error (message in the
 * failing matcher's `err`); after an error the states of both matchers are unknown. */
int64_t espalier_llg_walk2(const EspLlgApi *api, EspWalkArgs *a, EspHelperArgs *helper) {
    const int64_t n = a->n;
    Pool pool;
    memset(&pool, 0, sizeof(pool));
    Pool *p = &pool;
    p->api = api;
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
    p->timed = a->budget_s >= 0;
    p->deadline = p->timed ? now_s() + a->budget_s : 0.0;
    p->status = WALK_DONE;
    a->end_depth = 0;
    a->memo_stale_out = 1;
    a->n_filled = 0;
    if (helper != NULL) helper->ran = 0;
    const int split = helper != NULL && n > 2 && a->first_child[0] >= 0;
    p->workers = split ? 2 : 1;
    p->parent = malloc(sizeof(int64_t) * (size_t)n);
    p->depth_of = malloc(sizeof(int64_t) * (size_t)n);
    int ok = p->parent && p->depth_of && alloc_worker(&p->w[0], p, 0, n);
    if (split) ok = ok && alloc_worker(&p->w[1], p, 1, n);
    int64_t status = WALK_DONE;
    if (!ok) {
        status = WALK_NO_MEMORY;
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
    w0->m = a->root;
    w0->memo_stale = a->memo_stale != 0;
    w0->rollback_n = a->rollback_n;
    w0->sync = a->sync;
    w0->n_sync = a->n_sync;
    w0->scratch = a->scratch;
    w0->err = a->err;
    w0->err_len = (size_t)a->err_len;
    p->busy = 1; /* the root phase below: it pushes the root's children */
    pthread_t thread;
    int started = 0;
    if (split) {
        Worker *w1 = &p->w[1];
        w1->m = helper->matcher;
        w1->memo_stale = helper->memo_stale != 0;
        w1->rollback_n = helper->rollback_n;
        w1->sync = helper->sync;
        w1->n_sync = helper->n_sync;
        w1->scratch = helper->scratch;
        w1->err = helper->err;
        w1->err_len = (size_t)helper->err_len;
        p->busy = 2; /* and the helper's catch-up */
        started = pthread_create(&thread, NULL, helper_main, w1) == 0;
        if (!started) {
            p->busy = 1;
            p->workers = 1;
        }
        helper->ran = started;
    }
    status = catch_up(w0);
    if (status == 0 && a->root_mode == ROOT_COMPUTE) {
        if (api->mask_into(a->root, a->rows, p->row_bytes) != 0)
            status = WALK_MASK_ERROR;
        else
            w0->memo_stale = 0;
    }
    if (status != 0) {
        fail(w0, status);
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
    status = p->status;
    a->n_filled = w0->n_filled + (started ? p->w[1].n_filled : 0);
    end_state(w0, a->end_path, &a->end_depth, &a->memo_stale_out);
    if (started) {
        end_state(&p->w[1], helper->end_path, &helper->end_depth, &helper->memo_stale_out);
        helper->n_filled = p->w[1].n_filled;
    }
out:
    free(p->parent);
    free(p->depth_of);
    free_worker(&p->w[0]);
    free_worker(&p->w[1]);
    return status;
}

/* The walk on the calling thread alone. */
int64_t espalier_llg_walk(const EspLlgApi *api, EspWalkArgs *a) {
    return espalier_llg_walk2(api, a, NULL);
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
