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

/* DFS stack entry: a node and the native depth of its parent's state (tokens consumed below
 * the root), or -1 when the parent is a stop token (or below one). */
typedef struct Entry {
    int64_t node;
    int64_t parent_depth;
} Entry;

typedef struct Walk {
    const int64_t *tokens, *first_child, *next_sibling;
    const uint32_t *rows, *excluded, *stops;
    int64_t words, limit;
    Entry *stack;
    int64_t sp;
    int64_t *kids;
} Walk;

/* Push the children of `parent` that its row allows, first child on top. */
static void push_children(Walk *w, int64_t parent, int64_t parent_depth) {
    int64_t count = 0;
    const uint32_t *row = w->rows + parent * w->words;
    for (int64_t kid = w->first_child[parent]; kid >= 0; kid = w->next_sibling[kid]) {
        int64_t token = w->tokens[kid];
        if (token < 0 || token >= w->limit || !bit_set(row, token) || bit_set(w->excluded, token))
            continue;
        w->kids[count++] = kid;
    }
    for (int64_t i = count - 1; i >= 0; i--) {
        w->stack[w->sp].node = w->kids[i];
        w->stack[w->sp].parent_depth = parent_depth;
        w->sp++;
    }
}

/* Roll `m` back from depth *depth to `target`, then refresh the memo (one mask into scratch). */
static int64_t back_to(const EspLlgApi *api, void *m, int64_t *depth, int64_t target,
                       uint32_t *scratch, size_t row_bytes, char *err, size_t err_len) {
    if (*depth <= target) return 0;
    if (api->rollback(m, (size_t)(*depth - target)) != 0) {
        copy_error(api, m, err, err_len);
        return WALK_ROLLBACK_ERROR;
    }
    *depth = target;
    if (api->mask_into(m, scratch, row_bytes) != 0) {
        copy_error(api, m, err, err_len);
        return WALK_MASK_ERROR;
    }
    return 0;
}

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
 * n_filled the number of filled rows. */
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

/* Returns WALK_DONE, WALK_BUDGET_HIT, or a negative error (message in `err`); after an error
 * the root's state is unknown. */
int64_t espalier_llg_walk(const EspLlgApi *api, EspWalkArgs *a) {
    void *root = a->root;
    const int64_t n = a->n, words = a->words;
    const int64_t *tokens = a->tokens, *first_child = a->first_child;
    uint32_t *rows = a->rows, *scratch = a->scratch, *path = a->end_path;
    uint8_t *valid = a->valid, *filled = a->filled, *terminated = a->terminated;
    char *err = a->err;
    const size_t err_len = (size_t)a->err_len;
    const double budget_s = a->budget_s;
    const size_t row_bytes = (size_t)words * 4u;
    const double deadline = budget_s < 0 ? 0.0 : now_s() + budget_s;
    int memo_stale = a->memo_stale != 0;
    a->end_depth = 0;
    a->memo_stale_out = 1;
    a->n_filled = 0;
    if (a->rollback_n > 0) {
        if (api->rollback(root, (size_t)a->rollback_n) != 0) {
            copy_error(api, root, err, err_len);
            return WALK_SYNC_ERROR;
        }
        memo_stale = 1;
    }
    if (memo_stale && a->n_sync > 0) { /* a consume must not meet a stale memo */
        if (api->mask_into(root, scratch, row_bytes) != 0) {
            copy_error(api, root, err, err_len);
            return WALK_SYNC_ERROR;
        }
        memo_stale = 0;
    }
    if (a->n_sync > 0 && api->consume_many(root, a->sync, (size_t)a->n_sync) != 0) {
        copy_error(api, root, err, err_len);
        return WALK_SYNC_ERROR;
    }
    if (a->root_mode == ROOT_COMPUTE) {
        if (api->mask_into(root, rows, row_bytes) != 0) {
            copy_error(api, root, err, err_len);
            return WALK_MASK_ERROR;
        }
        memo_stale = 0;
    }
    valid[0] = 1;
    filled[0] = 1;
    a->n_filled = 1;
    a->memo_stale_out = memo_stale;
    if (n <= 1 || first_child[0] < 0) return WALK_DONE;
    if (memo_stale) {
        if (api->mask_into(root, scratch, row_bytes) != 0) {
            copy_error(api, root, err, err_len);
            return WALK_MASK_ERROR;
        }
        memo_stale = 0;
    }

    Walk w = {tokens, first_child, a->next_sibling, rows, a->excluded, a->stops, words, a->limit,
              NULL, 0, NULL};
    w.stack = malloc(sizeof(Entry) * (size_t)n);
    w.kids = malloc(sizeof(int64_t) * (size_t)n);
    int64_t status = WALK_DONE;
    int64_t depth = 0; /* tokens the root has consumed below the tree's root: path[0..depth) */
    if (w.stack == NULL || w.kids == NULL) {
        status = WALK_NO_MEMORY;
        goto out;
    }
    push_children(&w, 0, 0);
    double slowest = 0.0; /* longest node so far: a node is started only if one as long fits */
    while (w.sp > 0) {
        Entry e = w.stack[--w.sp];
        double started = 0.0;
        if (budget_s >= 0) {
            started = now_s();
            if (started + slowest > deadline) {
                status = WALK_BUDGET_HIT;
                break;
            }
        }
        int64_t node = e.node;
        uint32_t *row = rows + node * words;
        if (e.parent_depth < 0 || bit_set(a->stops, tokens[node])) {
            /* a stop token, or one after it: never consumed natively */
            memcpy(row, a->stops, row_bytes);
            valid[node] = 1;
            terminated[node] = 1;
            filled[node] = 1;
            a->n_filled++;
            push_children(&w, node, -1);
            continue;
        }
        status = back_to(api, root, &depth, e.parent_depth, scratch, row_bytes, err, err_len);
        if (status != 0) break;
        /* the parent's row allows the token, so this fails only on a library inconsistency
         * (the matcher is then in its error state: stop) */
        if (api->consume(root, (uint32_t)tokens[node]) != 0) {
            copy_error(api, root, err, err_len);
            status = WALK_ROLLBACK_ERROR;
            break;
        }
        path[depth++] = (uint32_t)tokens[node];
        if (api->mask_into(root, row, row_bytes) != 0) {
            copy_error(api, root, err, err_len);
            status = WALK_MASK_ERROR;
            break;
        }
        valid[node] = 1;
        filled[node] = 1;
        a->n_filled++;
        if (budget_s >= 0) {
            double took = now_s() - started;
            if (took > slowest) slowest = took;
        }
        if (first_child[node] >= 0) push_children(&w, node, depth);
    }
out:
    /* the root stays where the walk ended, its memo fresh (the last thing done was a mask at
     * this state, or a rollback followed by one) */
    a->end_depth = depth;
    a->memo_stale_out = 0;
    free(w.stack);
    free(w.kids);
    return status;
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
