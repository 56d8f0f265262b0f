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

/* The layout of EspCloseJob / EspCloseTables and the function: capi.py checks it at load. */
#define ESP_CLOSE_ABI 1

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
    memset(&fork, 0, sizeof fork);
    fork.llg = p->llg;
    fork.ka = p->ka;
    fork.t = p->t;
    fork.row = p->row;
    fork.m = p->llg->clone(p->m);
    if (fork.m == NULL) {
        fail(p, CLOSE_NO_MEMORY);
        return 0;
    }
    fork.stop_depth = p->stop_depth;
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
        if (p->ka->accept(p->keys, token, 0) < 0) {
            fail(p, CLOSE_NO_MEMORY);
            return 0;
        }
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

typedef struct CloseShared {
    const EspLlgCloseApi *llg;
    const EspKeysApi *ka;
    const EspCloseTables *t;
    EspCloseJob *jobs;
    int64_t n;
    int64_t next; /* the next job to take (atomic) */
} CloseShared;

static void *close_worker(void *arg) {
    CloseShared *s = arg;
    uint32_t *row = malloc(sizeof(uint32_t) * (size_t)s->t->words);
    for (;;) {
        const int64_t j = __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED);
        if (j >= s->n) break;
        if (row == NULL) {
            s->jobs[j].status = CLOSE_NO_MEMORY;
            continue;
        }
        run_job(s->llg, s->ka, s->t, &s->jobs[j], row);
    }
    free(row);
    return NULL;
}

/* Run jobs[0..n) on up to `threads` threads (the caller's among them), each job whole on one.
 * ka may be NULL when no job has a tracker. Never touches Python (except through llguidance's
 * tokenize callback on a cache miss); returns how many jobs failed (status < 0). */
int64_t espalier_llg_close_batch(const EspLlgCloseApi *llg, const EspKeysApi *ka,
                                 const EspCloseTables *t, EspCloseJob *jobs, int64_t n,
                                 int64_t threads) {
    CloseShared shared = {llg, ka, t, jobs, n, 0};
    int64_t count = threads < n ? threads : n;
    if (count > MAX_CLOSE_THREADS) count = MAX_CLOSE_THREADS;
    pthread_t ids[MAX_CLOSE_THREADS];
    int64_t started = 0;
    for (int64_t i = 1; i < count; i++) {
        if (pthread_create(&ids[started], NULL, close_worker, &shared) != 0) break;
        started++;
    }
    close_worker(&shared);
    for (int64_t i = 0; i < started; i++) pthread_join(ids[i], NULL);
    int64_t failed = 0;
    for (int64_t j = 0; j < n; j++) failed += jobs[j].status < 0;
    return failed;
}
