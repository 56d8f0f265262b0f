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
 * the rolled-back state, into a scratch row, before the next consume; the walk ends rolled back
 * to the root, with its memo stale (the caller's next walk refreshes it first). The llguidance functions come in as pointers (EspLlgApi), resolved by the caller
 * from the library Python already loaded; this file links against nothing but libc.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
                       uint32_t *scratch, size_t row_bytes, int refresh, char *err,
                       size_t err_len) {
    if (*depth <= target) return 0;
    if (api->rollback(m, (size_t)(*depth - target)) != 0) {
        copy_error(api, m, err, err_len);
        return WALK_ROLLBACK_ERROR;
    }
    *depth = target;
    if (refresh && api->mask_into(m, scratch, row_bytes) != 0) {
        copy_error(api, m, err, err_len);
        return WALK_MASK_ERROR;
    }
    return 0;
}

/* Fill rows[0..n) for the tree from `root` (the request's twin matcher), which ends where it
 * started (after catching up) with a stale memo.
 *
 * First the root catches up with the request: roll back `rollback_n` tokens, consume `sync`
 * (after one mask into `scratch` ([words]) when it was rolled back since its last mask:
 * `memo_stale`, or rollback_n > 0). root_mode: ROOT_COMPUTE computes row 0; ROOT_READY trusts it.
 * budget_s < 0: no limit; else a node starts only if it would end by now + budget_s were it
 * as long as the longest node so far (one node's mask can take milliseconds inside a long
 * string: this keeps the overrun to the rare node slower than all before it).
 * valid/filled/terminated: uint8 [n], zeroed by the caller; filled[i] is set last.
 * Returns WALK_DONE, WALK_BUDGET_HIT, or a negative error (message in `err`); after a
 * WALK_SYNC_ERROR or WALK_ROLLBACK_ERROR the root's state is unknown. */
int64_t espalier_llg_walk(const EspLlgApi *api, void *root, int32_t memo_stale,
                          size_t rollback_n, const uint32_t *sync, size_t n_sync, int64_t n,
                          const int64_t *tokens, const int64_t *first_child,
                          const int64_t *next_sibling, uint32_t *rows, int64_t words,
                          int64_t limit, const uint32_t *excluded, const uint32_t *stops,
                          const uint32_t *stop_row, int32_t root_mode, uint32_t *scratch,
                          double budget_s, uint8_t *valid, uint8_t *filled, uint8_t *terminated,
                          char *err, size_t err_len) {
    const size_t row_bytes = (size_t)words * 4u;
    const double deadline = budget_s < 0 ? 0.0 : now_s() + budget_s;
    if (rollback_n > 0) {
        if (api->rollback(root, rollback_n) != 0) {
            copy_error(api, root, err, err_len);
            return WALK_SYNC_ERROR;
        }
        memo_stale = 1;
    }
    if (memo_stale && n_sync > 0) { /* a consume must not meet a stale memo */
        if (api->mask_into(root, scratch, row_bytes) != 0) {
            copy_error(api, root, err, err_len);
            return WALK_SYNC_ERROR;
        }
        memo_stale = 0;
    }
    if (n_sync > 0 && api->consume_many(root, sync, n_sync) != 0) {
        copy_error(api, root, err, err_len);
        return WALK_SYNC_ERROR;
    }
    if (root_mode == ROOT_COMPUTE) {
        if (api->mask_into(root, rows, row_bytes) != 0) {
            copy_error(api, root, err, err_len);
            return WALK_MASK_ERROR;
        }
        memo_stale = 0;
    }
    valid[0] = 1;
    filled[0] = 1;
    if (n <= 1 || first_child[0] < 0) return WALK_DONE;
    if (memo_stale && api->mask_into(root, scratch, row_bytes) != 0) {
        copy_error(api, root, err, err_len);
        return WALK_MASK_ERROR;
    }

    Walk w = {tokens, first_child, next_sibling, rows, excluded, stops, words, limit,
              NULL, 0, NULL};
    w.stack = malloc(sizeof(Entry) * (size_t)n);
    w.kids = malloc(sizeof(int64_t) * (size_t)n);
    int64_t status = WALK_DONE;
    int64_t depth = 0; /* tokens the root has consumed below the tree's root */
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
        if (e.parent_depth < 0 || bit_set(stops, tokens[node])) {
            /* a stop token, or one after it: never consumed natively */
            memcpy(row, stop_row, row_bytes);
            valid[node] = 1;
            terminated[node] = 1;
            filled[node] = 1;
            push_children(&w, node, -1);
            continue;
        }
        status = back_to(api, root, &depth, e.parent_depth, scratch, row_bytes, 1, err, err_len);
        if (status != 0) break;
        /* the parent's row allows the token, so this fails only on a library inconsistency
         * (the matcher is then in its error state: stop) */
        if (api->consume(root, (uint32_t)tokens[node]) != 0) {
            copy_error(api, root, err, err_len);
            status = WALK_ROLLBACK_ERROR;
            break;
        }
        depth++;
        if (api->mask_into(root, row, row_bytes) != 0) {
            copy_error(api, root, err, err_len);
            status = WALK_MASK_ERROR;
            break;
        }
        valid[node] = 1;
        filled[node] = 1;
        if (budget_s >= 0) {
            double took = now_s() - started;
            if (took > slowest) slowest = took;
        }
        if (first_child[node] >= 0) push_children(&w, node, depth);
    }
out:
    if (depth > 0) {
        /* back to the root; its memo is stale now (no refresh: the caller's next walk does it) */
        int64_t back = back_to(api, root, &depth, 0, scratch, row_bytes, 0, err, err_len);
        if (back != 0 && status >= 0) status = back;
    }
    free(w.stack);
    free(w.kids);
    return status;
}
