/* Closing-path searches over llguidance's C API: a step's searches in one call
 * (espalier_llg_close_batch), on native threads, the GIL released throughout.
 *
 * Each search is engine/closing's ClosingPaths.search, choice for choice, on a C-API matcher
 * (a clone of a read-only base at a prefix of the request's history, which first consumes the
 * rest of it and the decided token), with the adapter's rules of backends/common.py
 * (MatcherBase: stop tokens never reach the library, special ids are never accepted) and of
 * backends/llguidance/__init__.py (Matcher: a run of text tokens is accepted as
 * try_consume_tokens does, token by token; validate_tokens checks without consuming). Where
 * the request's matcher is wrapped by the duplicate-key tracker (constrained/keys/), the
 * tracker's functions come in as pointers (EspKeysApi, keys.c) and every grammar call goes
 * through the wrapper's rules of constrained/keys/matcher.py (UniqueKeysMatcher), in the same
 * order. tests/engine/test_closing_native.py compares both on many states.
 *
 * Nothing is rolled back on a matcher (llguidance can answer a stale mask after a rollback):
 * a check of a multi-token candidate is llg_matcher_validate_tokens, a check that needs a fork
 * is made on a clone. This file links against nothing but libc and pthreads.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

/* The llguidance functions a search calls (llguidance's C API, resolved by capi.py). */
typedef struct EspLlgCloseApi {
    int32_t (*consume)(void *matcher, uint32_t token);
    int32_t (*validate)(void *matcher, const uint32_t *tokens, size_t n);
    int32_t (*ff_tokens)(void *matcher, uint32_t *out, size_t cap);
    bool (*is_accepting)(void *matcher);
    int32_t (*mask_into)(void *matcher, uint32_t *dest, size_t byte_len);
    bool (*is_error)(const void *matcher);
    void *(*clone)(const void *matcher);
    void (*free_matcher)(void *matcher);
} EspLlgCloseApi;

/* The duplicate-key tracker's functions (constrained/keys/keys.c). */
typedef struct EspKeysApi {
    void *(*fork)(const void *keys);
    void (*free_keys)(void *keys);
    int32_t (*accept)(void *keys, int64_t token, int32_t strict);
    int64_t (*accept_tokens)(void *keys, const int32_t *tokens, int64_t n);
    void (*rollback)(void *keys, int64_t n);
    int32_t (*filter_row)(void *keys, uint32_t *row, int64_t words);
} EspKeysApi;

/* What every search of a tokenizer shares (engine/closing's ClosingPaths): the candidates in
 * the order tried, the closers among them in that order, the quote (-1: none), bitmaps of the
 * closers, whitespace-only ids, stop ids and excluded (special non-stop) ids (`words` words
 * each), the tokenizer's own vocabulary (ids at or above it are never accepted), the bitmask
 * width in ids, REPEAT_LIMIT and how many of the lowest allowed ids the fallback tries. */
typedef struct EspCloseTables {
    const int64_t *candidates;
    int64_t n_candidates;
    const int64_t *closers_first;
    int64_t n_closers_first;
    int64_t quote;
    const uint32_t *closers, *blank, *stops, *excluded;
    int64_t words, tokenizer_vocab, vocab_size;
    int64_t repeat_limit, lowest;
} EspCloseTables;

/* One search. In: base (a C-API matcher, only cloned), sync[0..n_sync) (what the request's
 * matcher consumed after the base), token (accepted first, as BudgetCloser.decide does; -1:
 * none), limit, stop_depth (the matcher's stop tokens accepted), keys (the matcher's tracker,
 * only forked; NULL: not wrapped), rebase (1: hand back a matcher at the request's state),
 * path (room for path_cap ids). Out: status, path_len, new_base (rebase: the caller owns it). */
typedef struct EspCloseJob {
    void *base;
    const uint32_t *sync;
    int64_t n_sync, token, limit, stop_depth;
    void *keys;
    int64_t rebase;
    int64_t *path;
    int64_t path_cap;
    int64_t status, path_len;
    void *new_base;
} EspCloseJob;

enum {
    CLOSE_FOUND = 0,     /* path[0..path_len) closes the state */
    CLOSE_NONE = 1,      /* no path within the limit (or the repeat rule gave up) */
    CLOSE_REJECTED = 2,  /* the matcher does not accept `token` */
    CLOSE_ERROR = -1,    /* llguidance failed (error state): the caller decides in Python */
    CLOSE_NO_MEMORY = -2,
    CLOSE_OVERFLOW = -3, /* the path outgrew path_cap */
};

/* The layout of EspCloseJob / EspCloseTables / EspTreeJob / EspTreePolicy and the functions:
 * close.py checks it at load. */
#define ESP_CLOSE_ABI 2

int64_t espalier_llg_close_abi(void) { return ESP_CLOSE_ABI; }

enum { MAX_CLOSE_THREADS = 64, MAX_LOWEST = 256 };

static int has(const uint32_t *bits, int64_t t) { return (int)((bits[t >> 5] >> (t & 31)) & 1u); }

/* One probe: a matcher the search owns, its stop depth, its tracker (owned, or NULL). */
typedef struct Probe {
    const EspLlgCloseApi *llg;
    const EspKeysApi *ka;
    const EspCloseTables *t;
    void *m;
    int64_t stop_depth;
    void *keys;
    uint32_t *row; /* scratch: t->words words */
    int failed;    /* CLOSE_ERROR / CLOSE_NO_MEMORY once something failed */
} Probe;

static void fail(Probe *p, int status) {
    if (!p->failed) p->failed = status;
}

static int text_token(const Probe *p, int64_t token) {
    const EspCloseTables *t = p->t;
    return token >= 0 && token < t->tokenizer_vocab && !has(t->excluded, token) &&
           !has(t->stops, token);
}

/* -- the adapter (MatcherBase + llguidance's Matcher) ------------------------------------------ */

static int inner_can_terminate(Probe *p) {
    return p->stop_depth > 0 || p->llg->is_accepting(p->m);
}

/* Matcher._native_accept: try_consume_tokens([token]) */
static int native_accept(Probe *p, int64_t token) {
    const uint32_t id = (uint32_t)token;
    const int32_t valid = p->llg->validate(p->m, &id, 1);
    if (valid == 1) {
        if (p->llg->consume(p->m, id) != 0) fail(p, CLOSE_ERROR);
        return !p->failed;
    }
    if (valid < 0 || p->llg->is_error(p->m)) fail(p, CLOSE_ERROR);
    return 0;
}

/* MatcherBase.accept */
static int inner_accept(Probe *p, int64_t token) {
    const EspCloseTables *t = p->t;
    if (token < 0 || token >= t->tokenizer_vocab || has(t->excluded, token)) return 0;
    if (has(t->stops, token)) {
        if (p->stop_depth || p->llg->is_accepting(p->m)) {
            p->stop_depth++;
            return 1;
        }
        return 0;
    }
    if (p->stop_depth) return 0;
    return native_accept(p, token);
}

/* Matcher.accept_tokens: the run of text tokens at the front one by one as
 * try_consume_tokens does, the rest through inner_accept. */
static int64_t inner_accept_tokens(Probe *p, const int64_t *tokens, int64_t n) {
    int64_t i = 0;
    if (!p->stop_depth) {
        while (i < n && text_token(p, tokens[i])) {
            if (!native_accept(p, tokens[i])) return p->failed ? 0 : i;
            i++;
        }
    }
    for (; i < n; i++)
        if (!inner_accept(p, tokens[i])) break;
    return p->failed ? 0 : i;
}

static int probe_fork(Probe *p, Probe *out);
static void probe_free(Probe *p);
static int64_t accept_tokens(Probe *p, const int64_t *tokens, int64_t n);

/* A clone of p's matcher alone (no tracker: the inner Matcher's fork), into out; 0 when out of
 * memory (p failed). */
static int inner_fork(Probe *p, Probe *out) {
    *out = *p;
    out->failed = 0;
    out->keys = NULL;
    out->m = p->llg->clone(p->m);
    if (out->m == NULL) {
        fail(p, CLOSE_NO_MEMORY);
        return 0;
    }
    return 1;
}

/* Matcher.accepted_prefix: validate_tokens for text tokens, else a fork's accept_tokens. */
static int64_t inner_accepted_prefix(Probe *p, const int64_t *tokens, int64_t n) {
    int all_text = n > 0 && !p->stop_depth;
    for (int64_t i = 0; all_text && i < n; i++) all_text = text_token(p, tokens[i]);
    if (all_text) {
        uint32_t ids[8];
        if (n > 8) return 0; /* never: candidates are checked one or two at a time */
        for (int64_t i = 0; i < n; i++) ids[i] = (uint32_t)tokens[i];
        const int32_t valid = p->llg->validate(p->m, ids, (size_t)n);
        if (valid < 0 || p->llg->is_error(p->m)) {
            fail(p, CLOSE_ERROR);
            return 0;
        }
        return valid;
    }
    Probe fork;
    if (!inner_fork(p, &fork)) return 0;
    const int64_t taken = inner_accept_tokens(&fork, tokens, n);
    if (fork.failed) fail(p, fork.failed);
    p->llg->free_matcher(fork.m);
    return taken;
}

/* Matcher.forced_tokens: compute_ff_tokens, at most `limit`. */
static int64_t inner_forced(Probe *p, int64_t limit, uint32_t *out) {
    if (limit <= 0 || p->stop_depth) return 0;
    const int32_t n = p->llg->ff_tokens(p->m, out, (size_t)limit);
    if (n < 0) {
        fail(p, CLOSE_ERROR);
        return 0;
    }
    return n;
}

/* Matcher.fill_bitmask into p->row: the stop row once terminated, else the mask with the bits
 * past V cleared. */
static void inner_fill(Probe *p) {
    const EspCloseTables *t = p->t;
    const size_t bytes = (size_t)t->words * 4u;
    if (p->stop_depth) {
        memcpy(p->row, t->stops, bytes);
        return;
    }
    if (p->llg->mask_into(p->m, p->row, bytes) != 0 || p->llg->is_error(p->m)) {
        fail(p, CLOSE_ERROR);
        return;
    }
    const int64_t rem = t->vocab_size % 32;
    if (rem && t->vocab_size / 32 < t->words) p->row[t->vocab_size / 32] &= (1u << rem) - 1u;
}

/* -- the duplicate-key wrapper (UniqueKeysMatcher) ------------------------------------------- */

static int can_terminate(Probe *p) { return inner_can_terminate(p); }

static int64_t keys_accept_tokens(Probe *p, const int64_t *tokens, int64_t n) {
    if (n <= 0) return 0;
    int32_t small[64];
    int32_t *ids = n <= 64 ? small : malloc(sizeof(int32_t) * (size_t)n);
    if (ids == NULL) {
        fail(p, CLOSE_NO_MEMORY);
        return 0;
    }
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)tokens[i];
    const int64_t clean = p->ka->accept_tokens(p->keys, ids, n);
    if (ids != small) free(ids);
    if (clean < 0) {
        fail(p, CLOSE_NO_MEMORY);
        return 0;
    }
    return clean;
}

/* UniqueKeysMatcher.forced_tokens: the grammar's forced tokens (into out, and ids) up to the
 * first duplicate completion. */
static int64_t forced(Probe *p, int64_t limit, uint32_t *out, int64_t *ids) {
    const int64_t n = inner_forced(p, limit, out);
    for (int64_t i = 0; i < n; i++) ids[i] = out[i];
    if (p->keys == NULL || n == 0 || p->failed) return n;
    const int64_t clean = keys_accept_tokens(p, ids, n);
    p->ka->rollback(p->keys, clean);
    return clean;
}

/* UniqueKeysMatcher.fill_bitmask */
static void fill(Probe *p) {
    inner_fill(p);
    if (p->keys != NULL && !p->failed && p->ka->filter_row(p->keys, p->row, p->t->words) < 0)
        fail(p, CLOSE_NO_MEMORY);
}

/* UniqueKeysMatcher.accept (with _accept_keys: the dead-end rule) */
static int accept(Probe *p, int64_t token) {
    if (p->keys == NULL) return inner_accept(p, token);
    int32_t r = p->ka->accept(p->keys, token, 1);
    if (r < 0) {
        fail(p, CLOSE_NO_MEMORY);
        return 0;
    }
    if (r == 0) {
        inner_fill(p);
        if (p->failed) return 0;
        const int32_t cleared = p->ka->filter_row(p->keys, p->row, p->t->words);
        if (cleared < 0) fail(p, CLOSE_NO_MEMORY);
        if (cleared != 0) return 0;
        const int32_t loose = p->ka->accept(p->keys, token, 0);
        if (loose < 0) fail(p, CLOSE_NO_MEMORY);
        if (loose != 1) return 0; /* a duplicate key or item: a dead end, never taken */
    }
    if (inner_accept(p, token)) return 1;
    p->ka->rollback(p->keys, 1);
    return 0;
}

/* UniqueKeysMatcher.accept_tokens */
static int64_t accept_tokens(Probe *p, const int64_t *tokens, int64_t n) {
    if (p->keys == NULL) return inner_accept_tokens(p, tokens, n);
    int64_t done = 0;
    while (done < n) {
        const int64_t clean = keys_accept_tokens(p, tokens + done, n - done);
        if (p->failed) return 0;
        const int64_t taken = clean ? inner_accept_tokens(p, tokens + done, clean) : 0;
        p->ka->rollback(p->keys, clean - taken);
        if (p->failed) return 0;
        done += taken;
        if (taken < clean || done == n || !accept(p, tokens[done])) break;
        done++;
    }
    return p->failed ? 0 : done;
}

/* UniqueKeysMatcher.accepted_prefix */
static int64_t accepted_prefix(Probe *p, const int64_t *tokens, int64_t n) {
    const int64_t taken = inner_accepted_prefix(p, tokens, n);
    if (p->keys == NULL || p->failed) return taken;
    int64_t clean;
    if (taken == 1) {
        const int32_t r = p->ka->accept(p->keys, tokens[0], 1);
        if (r < 0) {
            fail(p, CLOSE_NO_MEMORY);
            return 0;
        }
        clean = r;
    } else {
        clean = keys_accept_tokens(p, tokens, taken);
        if (p->failed) return 0;
    }
    p->ka->rollback(p->keys, clean);
    if (clean < taken) { /* a duplicate completion: the dead-end rule decides, on a fork */
        Probe fork;
        if (!probe_fork(p, &fork)) return 0;
        const int64_t got = accept_tokens(&fork, tokens, n);
        if (fork.failed) fail(p, fork.failed);
        probe_free(&fork);
        return got;
    }
    return taken;
}

static int probe_fork(Probe *p, Probe *out) {
    *out = *p;
    out->failed = 0;
    out->m = p->llg->clone(p->m);
    out->keys = p->keys != NULL ? p->ka->fork(p->keys) : NULL;
    if (out->m == NULL || (p->keys != NULL && out->keys == NULL)) {
        probe_free(out);
        fail(p, CLOSE_NO_MEMORY);
        return 0;
    }
    return 1;
}

static void probe_free(Probe *p) {
    if (p->m != NULL) p->llg->free_matcher(p->m);
    if (p->keys != NULL) p->ka->free_keys(p->keys);
    p->m = p->keys = NULL;
}

/* -- the search (ClosingPaths) ----------------------------------------------------------------- */

/* ClosingPaths._empty_closer: the closer accepted, or -1 (nothing changed). */
static int64_t empty_closer(Probe *p, int64_t avoid) {
    const EspCloseTables *t = p->t;
    for (int64_t i = 0; i < t->n_closers_first; i++) {
        const int64_t closer = t->closers_first[i];
        if (closer == avoid) continue;
        const int64_t pair[2] = {closer, t->quote};
        const int64_t taken = accepted_prefix(p, pair, 2);
        if (p->failed) return -1;
        if (taken == 0) continue;
        if (taken == 2) return -1; /* content of a string: so is any other closer */
        if (!accept(p, closer)) fail(p, CLOSE_ERROR); /* accepted_prefix took it */
        return p->failed ? -1 : closer;
    }
    return -1;
}

/* ClosingPaths._first_accepted: the token accepted on p, or -1. */
static int64_t first_accepted(Probe *p, int64_t avoid) {
    const EspCloseTables *t = p->t;
    for (int64_t i = 0; i < t->n_candidates; i++) {
        const int64_t token = t->candidates[i];
        if (token == avoid) continue;
        if (token == t->quote) {
            const int64_t closer = empty_closer(p, avoid);
            if (p->failed) return -1;
            if (closer >= 0) return closer;
        }
        const int64_t one[1] = {token};
        if (accepted_prefix(p, one, 1) && !p->failed && accept(p, token)) return token;
        if (p->failed) return -1;
    }
    fill(p);
    if (p->failed) return -1;
    /* the `lowest` lowest allowed ids, then without stops and `avoid`; whitespace last */
    int64_t low[MAX_LOWEST];
    int64_t count = 0;
    const int64_t want = t->lowest < MAX_LOWEST ? t->lowest : MAX_LOWEST;
    for (int64_t w = 0; w < t->words && count < want; w++) {
        uint32_t bits = p->row[w];
        while (bits && count < want) {
            const int bit = __builtin_ctz(bits);
            low[count++] = 32 * w + bit;
            bits &= bits - 1u;
        }
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t i = 0; i < count; i++) {
            const int64_t token = low[i];
            if (has(t->stops, token) || token == avoid) continue;
            if (has(t->blank, token) != pass) continue;
            if (accept(p, token)) return token;
            if (p->failed) return -1;
        }
    }
    return -1;
}

/* ClosingPaths.search on p: CLOSE_FOUND (job->path), CLOSE_NONE, or a failure. */
static int64_t search(Probe *p, EspCloseJob *job) {
    const EspCloseTables *t = p->t;
    const int64_t limit = job->limit;
    int64_t *path = job->path, len = 0, repeats = 0;
    int escaped = 0;
    uint32_t *buf = malloc(sizeof(uint32_t) * (size_t)(limit > 0 ? limit : 1));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(limit > 0 ? limit : 1));
    int64_t status = CLOSE_FOUND;
    if (limit < 0) {
        status = CLOSE_NONE;
        goto out;
    }
    if (buf == NULL || ids == NULL) {
        status = CLOSE_NO_MEMORY;
        goto out;
    }
    while (!can_terminate(p)) {
        if (len >= limit) {
            status = CLOSE_NONE;
            goto out;
        }
        const int64_t n = forced(p, limit - len, buf, ids);
        if (p->failed) break;
        const int64_t taken = n ? accept_tokens(p, ids, n) : 0;
        if (p->failed) break;
        if (taken) {
            if (len + taken > job->path_cap) {
                status = CLOSE_OVERFLOW;
                goto out;
            }
            memcpy(path + len, ids, sizeof(int64_t) * (size_t)taken);
            len += taken;
            repeats = 0;
            continue;
        }
        int64_t avoid = -1;
        if (repeats >= t->repeat_limit - 1 && !has(t->closers, path[len - 1])) {
            if (escaped) {
                status = CLOSE_NONE;
                goto out;
            }
            avoid = path[len - 1];
            escaped = 1;
        }
        const int64_t chosen = first_accepted(p, avoid);
        if (p->failed) break;
        if (chosen < 0) {
            status = CLOSE_NONE;
            goto out;
        }
        repeats = len && path[len - 1] == chosen ? repeats + 1 : 1;
        if (len + 1 > job->path_cap) {
            status = CLOSE_OVERFLOW;
            goto out;
        }
        path[len++] = chosen;
    }
    if (p->failed) status = p->failed;
out:
    free(buf);
    free(ids);
    job->path_len = status == CLOSE_FOUND ? len : 0;
    return status;
}

/* One job: the probe made from the base (clone, sync, rebase, token), then the search. */
static void run_job(const EspLlgCloseApi *llg, const EspKeysApi *ka, const EspCloseTables *t,
                    EspCloseJob *job, uint32_t *row) {
    Probe p;
    memset(&p, 0, sizeof p);
    p.llg = llg;
    p.ka = ka;
    p.t = t;
    p.row = row;
    p.stop_depth = job->stop_depth;
    job->new_base = NULL;
    job->path_len = 0;
    p.m = llg->clone(job->base);
    if (job->keys != NULL) p.keys = ka->fork(job->keys);
    if (p.m == NULL || (job->keys != NULL && p.keys == NULL)) {
        job->status = CLOSE_NO_MEMORY;
        probe_free(&p);
        return;
    }
    for (int64_t i = 0; i < job->n_sync; i++) {
        if (llg->consume(p.m, job->sync[i]) != 0) {
            job->status = CLOSE_ERROR;
            probe_free(&p);
            return;
        }
    }
    if (job->rebase) {
        job->new_base = p.m;
        p.m = llg->clone(job->new_base);
        if (p.m == NULL) {
            job->status = CLOSE_NO_MEMORY;
            probe_free(&p);
            return;
        }
    }
    if (job->token >= 0 && !accept(&p, job->token)) {
        job->status = p.failed ? p.failed : CLOSE_REJECTED;
        probe_free(&p);
        return;
    }
    job->status = p.failed ? p.failed : search(&p, job);
    probe_free(&p);
}

/* -- whole draft trees: BudgetCloser.decision at every node (engine/closing/ahead.py) -------- */

/* The decision's constants (engine/closing: SEARCH_LIMIT, MARGIN, GROWTH_PER_TOKEN,
 * EVERY_TOKEN). */
typedef struct EspTreePolicy {
    int64_t search_limit, margin, growth_per_token, every_token;
} EspTreePolicy;

/* One draft tree's decisions (ahead.tree_decisions). In: base, sync, stop_depth, keys as in
 * EspCloseJob (the probe they make is the tree's root); eos (the id Matcher.completes
 * validates after a try); the tree (tokens, parents[i] < i, filled: NULL or one flag a node);
 * stops (the request's stop ids: never checked); here, max_tokens, room (a check at output
 * length h has budget min(max_tokens - h, room - h)); the memo (known_here -1: none).
 * rebase: hand back a matcher at the root (new_base; the caller owns it).
 * Out: status (TREE_DONE, TREE_FALLBACK: a decision needs the Python fallback search, < 0: a
 * failure); out[n][TREE_FIELDS] (a node not decided has decided = 0); buf: every path the
 * outputs name (offsets into it), the memo's known path first. */
typedef struct EspTreeJob {
    void *base;
    const uint32_t *sync;
    int64_t n_sync, stop_depth;
    void *keys;
    int64_t eos;
    const int64_t *tokens, *parents;
    const uint8_t *filled;
    int64_t n;
    const int64_t *stops;
    int64_t n_stops;
    int64_t here, max_tokens, room;
    int64_t known_here;
    const int64_t *known;
    int64_t known_len, next_check, unclosable;
    int64_t rebase;
    int64_t *out;
    int64_t *buf;
    int64_t buf_cap;
    int64_t status;
    void *new_base;
} EspTreeJob;

enum { TREE_DONE = 0, TREE_FALLBACK = 1 };
/* out fields: decided, close_at, close_len (-1: none), known_here (-1: none), known_at,
 * known_len, next_check, unclosable */
enum { TREE_FIELDS = 8 };

typedef struct Memo {
    int64_t known_here, known_at, known_len, next_check, unclosable;
} Memo;

typedef struct TreeRun {
    const EspTreePolicy *pol;
    EspTreeJob *job;
    int64_t used; /* of job->buf */
    int64_t status;
} TreeRun;

static void tree_fail(TreeRun *r, int64_t status) {
    if (r->status == TREE_DONE) r->status = status;
}

/* _next_check */
static int64_t next_check(const EspTreePolicy *pol, int64_t here, int64_t budget, int64_t slack) {
    const int64_t spaced = here + 1 + (slack > 0 ? slack / (pol->growth_per_token + 1) : 0);
    const int64_t every = here + budget - pol->every_token;
    const int64_t low = every > here + 1 ? every : here + 1;
    return spaced < low ? spaced : low;
}

/* Matcher.completes: validate_tokens of the run and the EOS for text tokens, else a fork's
 * accept_tokens then can_terminate. */
static int inner_completes(Probe *p, const int64_t *tokens, int64_t n, int64_t eos) {
    int all_text = n > 0 && !p->stop_depth;
    for (int64_t i = 0; all_text && i < n; i++) all_text = text_token(p, tokens[i]);
    if (all_text) {
        uint32_t small[128];
        uint32_t *ids = n + 1 <= 128 ? small : malloc(sizeof(uint32_t) * (size_t)(n + 1));
        if (ids == NULL) {
            fail(p, CLOSE_NO_MEMORY);
            return 0;
        }
        for (int64_t i = 0; i < n; i++) ids[i] = (uint32_t)tokens[i];
        ids[n] = (uint32_t)eos;
        const int32_t valid = p->llg->validate(p->m, ids, (size_t)(n + 1));
        if (ids != small) free(ids);
        if (valid < 0 || p->llg->is_error(p->m)) {
            fail(p, CLOSE_ERROR);
            return 0;
        }
        return valid == n + 1;
    }
    Probe fork;
    if (!inner_fork(p, &fork)) return 0;
    const int ok = inner_accept_tokens(&fork, tokens, n) == n && !fork.failed &&
                   inner_can_terminate(&fork);
    if (fork.failed) fail(p, fork.failed);
    p->llg->free_matcher(fork.m);
    return ok && !p->failed;
}

/* UniqueKeysMatcher.completes (or Matcher.completes, unwrapped) */
static int completes(Probe *p, const int64_t *tokens, int64_t n, int64_t eos) {
    if (!inner_completes(p, tokens, n, eos) || p->failed) return 0;
    if (p->keys == NULL) return 1;
    const int64_t clean = keys_accept_tokens(p, tokens, n);
    if (p->failed) return 0;
    if (clean > 0) p->ka->rollback(p->keys, clean);
    if (clean < n) { /* a duplicate completion: the dead-end rule decides, on a fork */
        Probe fork;
        if (!probe_fork(p, &fork)) return 0;
        const int ok = accept_tokens(&fork, tokens, n) == n && !fork.failed && can_terminate(&fork);
        if (fork.failed) fail(p, fork.failed);
        probe_free(&fork);
        return ok && !p->failed;
    }
    return 1;
}

/* Room for len ids in the job's buffer (NULL: it is full, the tree falls back). */
static int64_t *take_buf(TreeRun *r, int64_t len) {
    if (r->used + len > r->job->buf_cap) {
        tree_fail(r, CLOSE_OVERFLOW);
        return NULL;
    }
    int64_t *at = r->job->buf + r->used;
    r->used += len;
    return at;
}

/* ClosingPaths.stitch from the path buf[at..at+len): 1 with *out_at / *out_len set, 0 none
 * (or a failure: p->failed / r->status). */
static int stitch(TreeRun *r, Probe *p, int64_t token, int64_t at, int64_t len, int64_t limit,
                  int64_t *out_at, int64_t *out_len) {
    const EspCloseTables *t = p->t;
    int64_t *tries = malloc(sizeof(int64_t) * (size_t)(len + 2));
    if (tries == NULL) {
        fail(p, CLOSE_NO_MEMORY);
        return 0;
    }
    const int64_t *path = r->job->buf + at;
    int found = 0;
    const int64_t suffixes = len < 3 ? len : 3;
    for (int64_t k = 0; k <= suffixes && !found && !p->failed; k++) {
        if (len - k > limit) continue;
        tries[0] = token;
        memcpy(tries + 1, path + k, sizeof(int64_t) * (size_t)(len - k));
        if (completes(p, tries, len - k + 1, r->job->eos)) {
            *out_at = at + k;
            *out_len = len - k;
            found = 1;
        }
    }
    if (!found && !p->failed && len > 0 && len < limit) {
        const int64_t closers = t->n_candidates < 3 ? t->n_candidates : 3;
        for (int64_t c = 0; c < closers && !found && !p->failed; c++) {
            tries[0] = token;
            tries[1] = t->candidates[c];
            memcpy(tries + 2, path, sizeof(int64_t) * (size_t)len);
            if (completes(p, tries, len + 2, r->job->eos)) {
                int64_t *dst = take_buf(r, len + 1);
                if (dst == NULL) break;
                memcpy(dst, tries + 1, sizeof(int64_t) * (size_t)(len + 1));
                *out_at = dst - r->job->buf;
                *out_len = len + 1;
                found = 1;
            }
        }
    }
    free(tries);
    return found && !p->failed && r->status == TREE_DONE;
}

/* Whether accept(p, token) may take it: 0 only where it surely rejects it (a text token the
 * library refuses, checked with one validate where accept would clone), so a caller skips a
 * clone it would throw away. */
static int takes(Probe *p, int64_t token) {
    if (p->stop_depth || !text_token(p, token)) return 1;
    const uint32_t id = (uint32_t)token;
    const int32_t valid = p->llg->validate(p->m, &id, 1);
    if (valid < 0 || p->llg->is_error(p->m)) {
        fail(p, CLOSE_ERROR);
        return 0;
    }
    return valid == 1;
}

/* A greedy search on a fork of p (after token, or from p's state when token < 0), its path
 * into the job's buffer: CLOSE_FOUND (*out_at, *out_len), CLOSE_NONE, CLOSE_REJECTED or a
 * failure. */
static int64_t search_from(TreeRun *r, Probe *p, int64_t token, int64_t limit, int64_t *out_at,
                           int64_t *out_len) {
    if (token >= 0 && !takes(p, token)) return p->failed ? p->failed : CLOSE_REJECTED;
    Probe probe;
    if (!probe_fork(p, &probe)) return p->failed;
    int64_t status;
    if (token >= 0 && !accept(&probe, token)) {
        status = probe.failed ? probe.failed : CLOSE_REJECTED;
    } else if (probe.failed) {
        status = probe.failed;
    } else {
        EspCloseJob job;
        memset(&job, 0, sizeof job);
        job.limit = limit;
        job.path = r->job->buf + r->used;
        job.path_cap = r->job->buf_cap - r->used;
        status = search(&probe, &job);
        if (status == CLOSE_FOUND) {
            *out_at = r->used;
            *out_len = job.path_len;
            r->used += job.path_len;
        }
    }
    probe_free(&probe);
    return status;
}

/* BudgetCloser.decision for `token` appended at output length `here` with `budget` left, from
 * memo m and probe p (the state before token; not changed): the memo after into *out and the
 * closing path to emit instead (*close_len -1: none). 0, or -1 with r->status set. */
static int decide(TreeRun *r, Probe *p, const Memo *m, int64_t token, int64_t here,
                  int64_t budget, int exempt, Memo *out, int64_t *close_at, int64_t *close_len) {
    const EspTreePolicy *pol = r->pol;
    *out = *m;
    *close_at = 0;
    *close_len = -1;
    if (exempt || m->unclosable) return 0; /* _without_check */
    const int has_path = m->known_here == here;
    if (has_path && m->known_len > 0 && r->job->buf[m->known_at] == token) {
        out->known_here = here + 1;
        out->known_at = m->known_at + 1;
        out->known_len = m->known_len - 1;
        return 0;
    }
    if (here < m->next_check) return 0;
    const int64_t limit = budget - 2;
    int64_t after_at = 0, after_len = -1;
    if (m->known_here >= 0) {
        int64_t at, len;
        if (stitch(r, p, token, m->known_at, m->known_len, limit, &at, &len)) {
            after_at = at;
            after_len = len;
        }
        if (p->failed) tree_fail(r, p->failed);
        if (r->status != TREE_DONE) return -1;
    }
    if (after_len < 0) {
        int64_t at, len;
        const int64_t lim = limit < pol->search_limit ? limit : pol->search_limit;
        const int64_t status = search_from(r, p, token, lim, &at, &len);
        if (status == CLOSE_REJECTED) return 0; /* not for this policy to decide */
        if (status == CLOSE_FOUND) {
            after_at = at;
            after_len = len;
        } else if (status != CLOSE_NONE) {
            tree_fail(r, status);
            return -1;
        }
    }
    if (after_len < 0 && limit > pol->search_limit) { /* not found that short: look again later */
        out->next_check = next_check(pol, here, budget, limit - pol->search_limit);
        return 0;
    }
    if (after_len >= 0) {
        out->known_here = here + 1;
        out->known_at = after_at;
        out->known_len = after_len;
        out->next_check = next_check(pol, here, budget, limit - after_len - pol->margin);
        out->unclosable = 0;
        return 0;
    }
    int64_t path_at = m->known_at, path_len = has_path ? m->known_len : -1;
    if (path_len < 0 && budget - 1 >= 0) { /* ``find``: the current state's own path */
        const int64_t status = search_from(r, p, -1, budget - 1, &path_at, &path_len);
        if (status == CLOSE_NONE) { /* ClosingPaths.or_fallback: Python's backtracking search */
            tree_fail(r, TREE_FALLBACK);
            return -1;
        }
        if (status != CLOSE_FOUND) {
            tree_fail(r, status < 0 ? status : CLOSE_ERROR);
            return -1;
        }
    }
    if (path_len < 0) {
        out->unclosable = 1;
        return 0;
    }
    *close_at = path_at;
    *close_len = path_len;
    return 0;
}

typedef struct Frame {
    int64_t node, depth;
    Probe probe;
    Memo memo;
} Frame;

static int is_stop(const EspTreeJob *job, int64_t token) {
    for (int64_t i = 0; i < job->n_stops; i++)
        if (job->stops[i] == token) return 1;
    return 0;
}

/* ahead.tree_decisions, depth first from the root. */
static void run_tree(const EspLlgCloseApi *llg, const EspKeysApi *ka, const EspCloseTables *t,
                     const EspTreePolicy *pol, EspTreeJob *job, uint32_t *row) {
    const int64_t n = job->n;
    TreeRun r = {pol, job, 0, TREE_DONE};
    memset(job->out, 0, sizeof(int64_t) * (size_t)(n * TREE_FIELDS));
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(2 * n));
    Frame *stack = malloc(sizeof(Frame) * (size_t)n);
    int64_t depth_of_stack = 0;
    if (first == NULL || stack == NULL || n < 1) {
        job->status = n < 1 ? TREE_DONE : CLOSE_NO_MEMORY;
        free(first);
        free(stack);
        return;
    }
    int64_t *next = first + n; /* children in order: first[i], then next[child] */
    for (int64_t i = 0; i < n; i++) first[i] = next[i] = -1;
    for (int64_t i = n - 1; i >= 1; i--) {
        next[i] = first[job->parents[i]];
        first[job->parents[i]] = i;
    }
    Memo memo = {job->known_here, 0, job->known_len, job->next_check, job->unclosable};
    int64_t *known = take_buf(&r, job->known_len);
    if (known != NULL && job->known_len) memcpy(known, job->known, sizeof(int64_t) * (size_t)job->known_len);
    Frame *root = &stack[0];
    memset(root, 0, sizeof *root);
    root->probe.llg = llg;
    root->probe.ka = ka;
    root->probe.t = t;
    root->probe.row = row;
    root->probe.stop_depth = job->stop_depth;
    root->memo = memo;
    root->probe.m = known != NULL ? llg->clone(job->base) : NULL;
    if (job->keys != NULL && root->probe.m != NULL) root->probe.keys = ka->fork(job->keys);
    if (known != NULL && (root->probe.m == NULL || (job->keys != NULL && root->probe.keys == NULL)))
        tree_fail(&r, CLOSE_NO_MEMORY);
    for (int64_t i = 0; r.status == TREE_DONE && i < job->n_sync; i++)
        if (llg->consume(root->probe.m, job->sync[i]) != 0) tree_fail(&r, CLOSE_ERROR);
    job->new_base = NULL;
    if (r.status == TREE_DONE && job->rebase) {
        void *copy = llg->clone(root->probe.m);
        if (copy == NULL) {
            tree_fail(&r, CLOSE_NO_MEMORY);
        } else {
            job->new_base = root->probe.m;
            root->probe.m = copy;
        }
    }
    depth_of_stack = 1;
    while (depth_of_stack > 0 && r.status == TREE_DONE) {
        Frame f = stack[--depth_of_stack];
        const int64_t check = job->here + f.depth; /* the children's tokens are checked here */
        const int64_t a = job->max_tokens - check, b = job->room - check;
        const int64_t budget = a < b ? a : b;
        for (int64_t child = first[f.node]; child >= 0 && r.status == TREE_DONE; child = next[child]) {
            if (job->filled != NULL && !job->filled[child]) continue;
            const int64_t token = job->tokens[child];
            const int exempt = is_stop(job, token);
            Memo after;
            int64_t close_at, close_len;
            if (decide(&r, &f.probe, &f.memo, token, check, budget, exempt, &after, &close_at,
                       &close_len) != 0)
                break;
            int64_t *o = job->out + child * TREE_FIELDS;
            o[0] = 1;
            o[1] = close_at;
            o[2] = close_len;
            o[3] = after.known_here;
            o[4] = after.known_at;
            o[5] = after.known_len;
            o[6] = after.next_check;
            o[7] = after.unclosable;
            if (close_len >= 0 || exempt || first[child] < 0 || budget <= 1) continue;
            if (!takes(&f.probe, token)) {
                if (f.probe.failed) tree_fail(&r, f.probe.failed);
                continue;
            }
            /* the last child advances the node's own probe (no one needs it after) */
            Frame below;
            below.node = child;
            below.depth = f.depth + 1;
            below.memo = after;
            if (next[child] < 0) {
                below.probe = f.probe;
                f.probe.m = NULL;
                f.probe.keys = NULL;
            } else if (!probe_fork(&f.probe, &below.probe)) {
                tree_fail(&r, f.probe.failed ? f.probe.failed : CLOSE_NO_MEMORY);
                break;
            }
            if (accept(&below.probe, token) && !below.probe.stop_depth && !below.probe.failed) {
                stack[depth_of_stack++] = below;
            } else {
                if (below.probe.failed) tree_fail(&r, below.probe.failed);
                probe_free(&below.probe);
            }
        }
        probe_free(&f.probe);
    }
    while (depth_of_stack > 0) probe_free(&stack[--depth_of_stack].probe);
    job->status = r.status;
    free(first);
    free(stack);
}

/* -- the thread pool of both entry points ---------------------------------------------------- */

typedef struct Pool {
    const EspLlgCloseApi *llg;
    const EspKeysApi *ka;
    const EspCloseTables *t;
    const EspTreePolicy *pol;
    EspCloseJob *jobs; /* searches, or */
    EspTreeJob *trees; /* trees (the other NULL) */
    int64_t n;
    int64_t next; /* the next job to take (atomic) */
} Pool;

static void *pool_worker(void *arg) {
    Pool *s = arg;
    uint32_t *row = malloc(sizeof(uint32_t) * (size_t)s->t->words);
    for (;;) {
        const int64_t j = __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED);
        if (j >= s->n) break;
        if (row == NULL) {
            if (s->trees != NULL) s->trees[j].status = CLOSE_NO_MEMORY;
            else s->jobs[j].status = CLOSE_NO_MEMORY;
        } else if (s->trees != NULL) {
            run_tree(s->llg, s->ka, s->t, s->pol, &s->trees[j], row);
        } else {
            run_job(s->llg, s->ka, s->t, &s->jobs[j], row);
        }
    }
    free(row);
    return NULL;
}

/* The pool's jobs on up to `threads` threads (the caller's among them), each job whole on one. */
static void run_pool(Pool *pool, int64_t threads) {
    int64_t count = threads < pool->n ? threads : pool->n;
    if (count > MAX_CLOSE_THREADS) count = MAX_CLOSE_THREADS;
    pthread_t ids[MAX_CLOSE_THREADS];
    int64_t started = 0;
    for (int64_t i = 1; i < count; i++) {
        if (pthread_create(&ids[started], NULL, pool_worker, pool) != 0) break;
        started++;
    }
    pool_worker(pool);
    for (int64_t i = 0; i < started; i++) pthread_join(ids[i], NULL);
}

/* Run searches jobs[0..n) on up to `threads` threads. ka may be NULL when no job has a
 * tracker. Never touches Python (except through llguidance's tokenize callback on a cache
 * miss); returns how many jobs failed (status < 0). */
int64_t espalier_llg_close_batch(const EspLlgCloseApi *llg, const EspKeysApi *ka,
                                 const EspCloseTables *t, EspCloseJob *jobs, int64_t n,
                                 int64_t threads) {
    Pool pool = {llg, ka, t, NULL, jobs, NULL, n, 0};
    run_pool(&pool, threads);
    int64_t failed = 0;
    for (int64_t j = 0; j < n; j++) failed += jobs[j].status < 0;
    return failed;
}

/* Decide trees jobs[0..n) on up to `threads` threads, as espalier_llg_close_batch runs
 * searches; returns how many did not finish (status != TREE_DONE). */
int64_t espalier_llg_close_trees(const EspLlgCloseApi *llg, const EspKeysApi *ka,
                                 const EspCloseTables *t, const EspTreePolicy *pol,
                                 EspTreeJob *jobs, int64_t n, int64_t threads) {
    Pool pool = {llg, ka, t, pol, NULL, jobs, n, 0};
    run_pool(&pool, threads);
    int64_t unfinished = 0;
    for (int64_t j = 0; j < n; j++) unfinished += jobs[j].status != TREE_DONE;
    return unfinished;
}
