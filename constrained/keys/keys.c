/* The duplicate-key and duplicate-item tracker in C: a JSON lexer over accepted token bytes, and
 * the filter that removes from bitmask rows the tokens that would complete a key already in its
 * object, write an escape a key does not need (needless_escape), or complete an item already in
 * its array where the schema wants unique items (EspPlaces).
 *
 * Semantics are those of the Python twin (tests/fixtures/keys_twin.py: step, KeyState), byte for
 * byte, quirks included; tests/constrained/test_keys_native.py compares states, rows and tree
 * rows on random inputs. Loaded through ctypes (constrained/keys/native.py), which releases the
 * GIL for every call. No Python API: this file links against libc and pthreads only.
 *
 * State (EspKeys): the stack of open containers (Frame), each object's keys as a persistent list
 * in an append-only arena (KeyEntry, bytes), the key string being read (its bytes are the
 * arena's tail), and the string/escape scalars. Every accepted token pushes a Mark (the scalars,
 * depth and arena sizes before it); a stack slot written after the mark is saved first in the
 * undo log. Rollback replays the undo log and restores the mark: O(bytes changed), no copies.
 * The filter simulates candidate tokens the same way (advance, then roll back), so one lexer
 * serves accept, rows and trees. A tracker is driven by one thread at a time (the matcher's).
 *
 * Frames (EspFrames, espalier_keys_set_frames) put JSON values inside other text: a byte
 * automaton (built by constrained/keys/frames.py) scans the text outside the values, from state
 * 0; on reaching a found state (the reasoning end marker, a tag's begin) the lexer reads the
 * JSON value after it. Once that value's root container closes, or its root scalar ends, the
 * scan goes on from the rearm state (a tag list: the next tag's begin), or, with none, every
 * later byte is skipped; rows are filtered only while the lexer reads. frame_at: the scan's
 * state, FRAME_READING, FRAME_DONE, or FRAME_NUMBER / FRAME_WORD inside a root number or
 * literal (it ends at the first byte that cannot go on with it, whitespace included).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ESP_KEYS_ABI 11

enum { ARRAY = 0, OBJECT = 1 };
enum { NO_ITEM = 0, STRING_ITEM = 1, NUMBER_ITEM = 2, LITERAL_ITEM = 3 };
enum { REFUSED_ESCAPE = 0, REFUSED_KEY = 1, REFUSED_ITEM = 2 };
enum { FRAME_READING = -1, FRAME_DONE = -2, FRAME_NUMBER = -3, FRAME_WORD = -4 };

/* keys / items: last KeyEntry (-1 none); loc: this container's place (EspPlaces state, -1 none
 * tracked); index: an array's items before the current one; vloc: an object's value place after
 * its last key */
typedef struct { int32_t kind, expect_key, keys, loc, index, vloc, items; } Frame;
#define EMPTY_FRAME {0, 0, -1, -1, 0, -1, -1}
typedef struct { int32_t prev; uint32_t off, len; } KeyEntry;
typedef struct { int32_t slot; Frame old; } Undo;
typedef struct {
    int32_t in_key, in_value, esc_len, high, depth, n_entries, item, lit_need, expect_value;
    uint32_t key_off, n_bytes, item_off;
    uint8_t esc[4];
    int64_t n_undo;
    int32_t frame_at;
} Mark;

/* bytes -> token ids (CSR), open addressing; keys point into the tables' token bytes */
typedef struct { uint64_t hash; const uint8_t *key; uint32_t len; int32_t start, count; } Slot;
typedef struct { Slot *slots; uint64_t mask; int32_t *ids; } BytesMap;

typedef struct EspKeysTables {
    int64_t n_tokens;
    uint8_t *bytes;
    int64_t *offs;
    BytesMap by_prefix; /* bytes before the first quote (no backslash among them) -> ids */
    BytesMap by_run;    /* simulate tokens: each run between two quotes, and the prefix -> ids */
    int32_t *quote_ids, *simulate_ids, *always_ids, *slash_ids;
    int64_t n_quote, n_simulate, n_always, n_slash; /* slash: no quote, a needless escape */
    /* items: tokens that can complete a scalar item (a quote; a digit before a byte that ends a
     * number; a whole true/false/null), tokens that start with a number byte and hold another
     * (end a number being read), tokens that go on with a literal (by letters read), and one bit per
     * token: its first byte continues a number (or it has no bytes) */
    int32_t *item_ids, *numrun_ids, *lit_ids;
    int64_t n_item, n_numrun, lit_start[3][6], lit_count[3][6];
    /* string items at their longest (EspPlaces.item_chars): a token's whole bytes (no quote, no
     * backslash) -> ids, and the tokens holding a backslash but no quote */
    BytesMap by_text;
    int32_t *escape_ids;
    int64_t n_escape;
    uint32_t *numstart;
    int64_t numstart_words;
} EspKeysTables;

/* Where arrays must hold unique items (constrained/schema/unique_places.py): a deterministic
 * automaton over an instance's places. State s: unique[s] (an array here has unique items),
 * object keys names[key_start[s] .. + key_count[s]) -> key_target, other keys -> key_default[s];
 * array items at index i < prefix_count[s] -> prefix_target[prefix_start[s] + i], later ones ->
 * item_default[s]. -1: no place below is tracked. item_chars[s]: the most characters a string
 * item after the prefix may have there (-1: no bound kept); a token that leaves such an item at
 * that many characters, equal to an item already in the array, is refused like one that
 * completes it (only the closing quote could follow). words[word_start[s] .. + word_count[s]):
 * every string a string item after the prefix may be there (a tag byte 's', then UTF-8,
 * sorted bytewise; none: no list kept); a token after which every listed word that extends the item so far is an item
 * already in the array is refused too (each way on repeats one, or leaves the list). Read-only,
 * shared by trackers and forks. */
typedef struct EspPlaces {
    int32_t n_states;
    uint8_t *unique;
    int32_t *key_start, *key_count, *key_default, *prefix_start, *prefix_count, *item_default;
    int32_t *item_chars, *word_start, *word_count;
    int64_t *word_off;
    int32_t *word_len;
    uint8_t *words;
    int32_t *key_target, *prefix_target;
    int64_t *name_off;
    int32_t *name_len;
    uint8_t *names;
} EspPlaces;

/* The scan between framed values: state s, byte b -> next[s * n_classes + byte_class[b]];
 * found[s]: a value starts after this byte; rearm: the state after a value (-1: none, skip the
 * rest). Read-only, shared by trackers and forks. */
typedef struct EspFrames {
    int32_t n_states, n_classes, rearm;
    uint8_t byte_class[256];
    int32_t *next;
    uint8_t *found;
} EspFrames;

typedef struct EspKeys {
    const EspKeysTables *tables;
    const EspPlaces *places; /* NULL: keys only */
    int32_t in_key, in_value, esc_len, high, item, lit_need;
    int32_t expect_value; /* outside strings, a value may start here (after [ , : or at the root) */
    uint32_t key_off, item_off; /* item_off: the item's bytes (a tag byte first) in the arena */
    uint8_t esc[4];
    Frame *stack; int32_t depth, stack_cap;
    KeyEntry *entries; int32_t n_entries, entries_cap;
    uint8_t *bytes; uint32_t n_bytes, bytes_cap;
    Undo *undo; int64_t n_undo, undo_cap;
    Mark *marks; int64_t n_marks, marks_cap;
    int32_t *found; int64_t found_cap; /* filter scratch */
    int32_t *taken; int64_t taken_cap; /* words_taken_ids' scratch */
    uint32_t *saved; int64_t saved_cap; /* filter scratch: a row before a number's cut */
    int failed;                        /* an allocation failed: sticky */
    int32_t refused; /* what the last refused advance completed (REFUSED_*); not rolled back */
    const EspFrames *frames;           /* NULL: the whole text is one value; see the top */
    int32_t frame_at;
} EspKeys;

/* ---- growth ------------------------------------------------------------------------------ */

static int grow(void **data, int64_t *cap, int64_t need, size_t size) {
    if (need <= *cap) return 1;
    int64_t next = *cap ? *cap : 16;
    while (next < need) next *= 2;
    void *p = realloc(*data, (size_t)next * size);
    if (!p) return 0;
    *data = p;
    *cap = next;
    return 1;
}

static int grow32(void **data, int32_t *cap, int64_t need, size_t size) {
    int64_t c = *cap;
    int ok = grow(data, &c, need, size);
    *cap = (int32_t)c;
    return ok;
}

static int grow_u32(uint8_t **data, uint32_t *cap, int64_t need) {
    int64_t c = *cap;
    int ok = grow((void **)data, &c, need, 1);
    *cap = (uint32_t)c;
    return ok;
}

/* ---- the lexer ------------------------------------------------------------------------------ */

static void put_byte(EspKeys *k, uint8_t b) {
    if (!grow_u32(&k->bytes, &k->bytes_cap, (int64_t)k->n_bytes + 1)) { k->failed = 1; return; }
    k->bytes[k->n_bytes++] = b;
}

static void put_utf8(EspKeys *k, int32_t point) { /* Python: chr(point).encode(surrogatepass) */
    if (point == 0) return;
    if (point < 0x80) {
        put_byte(k, (uint8_t)point);
    } else if (point < 0x800) {
        put_byte(k, (uint8_t)(0xC0 | (point >> 6)));
        put_byte(k, (uint8_t)(0x80 | (point & 0x3F)));
    } else if (point < 0x10000) {
        put_byte(k, (uint8_t)(0xE0 | (point >> 12)));
        put_byte(k, (uint8_t)(0x80 | ((point >> 6) & 0x3F)));
        put_byte(k, (uint8_t)(0x80 | (point & 0x3F)));
    } else {
        put_byte(k, (uint8_t)(0xF0 | (point >> 18)));
        put_byte(k, (uint8_t)(0x80 | ((point >> 12) & 0x3F)));
        put_byte(k, (uint8_t)(0x80 | ((point >> 6) & 0x3F)));
        put_byte(k, (uint8_t)(0x80 | (point & 0x3F)));
    }
}

static void put_point(EspKeys *k, int32_t point) { /* a \\u escape's character, NUL included */
    if (point == 0) put_byte(k, 0);
    else put_utf8(k, point);
}

static void put_char(EspKeys *k, uint8_t c) { /* Python: chr(c).encode() */
    if (c < 0x80) { put_byte(k, c); return; }
    put_byte(k, (uint8_t)(0xC0 | (c >> 6)));
    put_byte(k, (uint8_t)(0x80 | (c & 0x3F)));
}

static void save_slot(EspKeys *k, int32_t slot) {
    if (!grow((void **)&k->undo, &k->undo_cap, k->n_undo + 1, sizeof(Undo))) { k->failed = 1; return; }
    Undo u = {slot, EMPTY_FRAME};
    if (slot < k->stack_cap) u.old = k->stack[slot];
    k->undo[k->n_undo++] = u;
}

/* ---- places ---------------------------------------------------------------------------------- */

static int32_t key_place(const EspPlaces *p, int32_t loc, const uint8_t *key, uint32_t len) {
    if (loc < 0) return -1;
    for (int32_t i = p->key_start[loc], end = i + p->key_count[loc]; i < end; i++)
        if ((uint32_t)p->name_len[i] == len && memcmp(p->names + p->name_off[i], key, len) == 0)
            return p->key_target[i];
    return p->key_default[loc];
}

static int32_t item_place(const EspPlaces *p, int32_t loc, int32_t index) {
    if (loc < 0) return -1;
    if (index < p->prefix_count[loc]) return p->prefix_target[p->prefix_start[loc] + index];
    return p->item_default[loc];
}

/* The place of a value starting here (-1: untracked). */
static int32_t value_place(const EspKeys *k) {
    if (!k->places) return -1;
    if (!k->depth) return 0;
    const Frame *top = &k->stack[k->depth - 1];
    if (top->loc < 0) return -1;
    return top->kind == OBJECT ? top->vloc : item_place(k->places, top->loc, top->index);
}

/* The innermost container is an array whose items must be unique. */
static int in_unique(const EspKeys *k) {
    if (!k->places || !k->depth) return 0;
    const Frame *top = &k->stack[k->depth - 1];
    return top->kind == ARRAY && top->loc >= 0 && k->places->unique[top->loc];
}

static void push(EspKeys *k, int32_t kind) {
    int32_t loc = value_place(k);
    if (!grow32((void **)&k->stack, &k->stack_cap, (int64_t)k->depth + 1, sizeof(Frame))) {
        k->failed = 1;
        return;
    }
    save_slot(k, k->depth);
    Frame f = {kind, kind == OBJECT, -1, loc, 0, -1, -1};
    k->stack[k->depth++] = f;
}

static int key_in(const EspKeys *k, int32_t entry, const uint8_t *key, uint32_t len) {
    for (; entry >= 0; entry = k->entries[entry].prev) {
        const KeyEntry *e = &k->entries[entry];
        if (e->len == len && memcmp(k->bytes + e->off, key, len) == 0) return 1;
    }
    return 0;
}

/* The key string ends: 1 when it repeats a key of its object (the caller rolls the token back;
 * strict or not: no object with a repeated key is ever accepted), else 0. */
static int close_key(EspKeys *k) {
    put_utf8(k, k->high);
    Frame *top = &k->stack[k->depth - 1];
    uint32_t len = k->n_bytes - k->key_off;
    if (key_in(k, top->keys, k->bytes + k->key_off, len)) {
        k->refused = REFUSED_KEY;
        return 1;
    }
    save_slot(k, k->depth - 1);
    if (grow32((void **)&k->entries, &k->entries_cap, (int64_t)k->n_entries + 1,
               sizeof(KeyEntry))) {
        KeyEntry e = {top->keys, k->key_off, len};
        k->entries[k->n_entries] = e;
        top->keys = k->n_entries++;
    } else {
        k->failed = 1;
    }
    top->expect_key = 0;
    if (top->loc >= 0) top->vloc = key_place(k->places, top->loc, k->bytes + k->key_off, len);
    k->in_key = 0;
    k->high = 0;
    return 0;
}

static int hex_value(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Inside a key, whether byte b makes the escape read so far one JSON does not need: \/, or a \u
 * of a character other than a control without a short escape, or with an uppercase digit
 * (Python: _needless). The backends match a key's text against their property names written
 * without such escapes, so {"\u0041": ...} was another key than "A" to them: refused. */
static int needless_escape(const EspKeys *k, uint8_t b) {
    switch (k->esc_len) {
    case 1: return b == '/';
    case 2: case 3: return b != '0';
    case 4: return b != '0' && b != '1';
    case 5: {
        int v = (b >= '0' && b <= '9') ? b - '0' : (b >= 'a' && b <= 'f') ? b - 'a' + 10 : -1;
        if (v < 0) return 1;
        int point = (k->esc[2] - '0') * 16 + v;
        return point == 8 || point == 9 || point == 10 || point == 12 || point == 13;
    }
    default: return 0;
    }
}

/* One byte after a backslash inside a string (Python: _escape). */
static void escape_byte(EspKeys *k, uint8_t b) {
    int put = k->in_key || k->item == STRING_ITEM;
    if (k->esc_len == 1 && b != 'u') {
        static const char simple_from[] = "bfnrt", simple_to[] = "\b\f\n\r\t";
        const char *at = b ? strchr(simple_from, b) : NULL;
        int32_t high = k->high;
        k->high = 0;
        k->esc_len = 0;
        if (put) {
            put_utf8(k, high);
            put_char(k, at ? (uint8_t)simple_to[at - simple_from] : b);
        }
        return;
    }
    if (k->esc_len == 1) { k->esc_len = 2; return; }
    k->esc[k->esc_len - 2] = b;
    if (++k->esc_len < 6) return;
    int32_t point = 0;
    for (int i = 0; i < 4 && point >= 0; i++) {
        int v = hex_value(k->esc[i]);
        point = v < 0 ? -1 : point * 16 + v;
    }
    if (point < 0) point = 0xFFFD;
    k->esc_len = 0;
    int32_t high = k->high;
    if (point >= 0xD800 && point < 0xDC00) {
        k->high = point;
        if (put) put_utf8(k, high);
    } else if (point >= 0xDC00 && point < 0xE000 && high) {
        k->high = 0;
        if (put) put_utf8(k, 0x10000 + ((high - 0xD800) << 10) + (point - 0xDC00));
    } else {
        k->high = 0;
        if (put) { put_utf8(k, high); put_point(k, point); }
    }
}

/* ---- items ----------------------------------------------------------------------------------- */

static const char *const LITERALS[3] = {"true", "false", "null"};

static int literal_index(uint8_t first) { return first == 't' ? 0 : first == 'f' ? 1 : 2; }

static int number_byte(uint8_t b) {
    return (b >= '0' && b <= '9') || b == '-' || b == '+' || b == '.' || b == 'e' || b == 'E';
}

static int json_number(const uint8_t *s, uint32_t n, int *integer) {
    uint32_t i = 0;
    *integer = 1;
    if (i < n && s[i] == '-') i++;
    if (i < n && s[i] == '0') i++;
    else if (i < n && s[i] >= '1' && s[i] <= '9') while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    else return 0;
    if (i < n && s[i] == '.') {
        *integer = 0;
        if (++i >= n || s[i] < '0' || s[i] > '9') return 0;
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        *integer = 0;
        if (++i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= n || s[i] < '0' || s[i] > '9') return 0;
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    }
    return i == n;
}

/* Append the canonical form of the number text [off, n_bytes) (Python's json.loads, compared
 * as jsonschema compares: an integer literal is an exact int, any other a double; equal values
 * give equal forms): 'I' + the exact decimal of an integral value ("-0" is "0"), 'F' + the
 * double's 8 bytes, 'X' + the text when it is not a JSON number. Returns the form's offset. */
static uint32_t put_number(EspKeys *k, uint32_t off) {
    uint32_t n = k->n_bytes - off, start = k->n_bytes;
    int integer;
    if (!json_number(k->bytes + off, n, &integer)) {
        put_byte(k, 'X');
        for (uint32_t i = 0; i < n && !k->failed; i++) put_byte(k, k->bytes[off + i]);
        return start;
    }
    if (integer) {
        uint32_t i = k->bytes[off] == '-';
        int zero = n - i == 1 && k->bytes[off + i] == '0';
        put_byte(k, 'I');
        if (i && !zero) put_byte(k, '-');
        for (; i < n && !k->failed; i++) put_byte(k, k->bytes[off + i]);
        return start;
    }
    char text[1100];
    char *buf = n < sizeof text ? text : malloc((size_t)n + 1);
    if (!buf) { k->failed = 1; return start; }
    memcpy(buf, k->bytes + off, n);
    buf[n] = 0;
    double d = strtod(buf, NULL); /* correctly rounded, as Python's float() */
    if (buf != text) free(buf);
    if (isfinite(d) && d == floor(d)) {
        char digits[400];
        int len = snprintf(digits, sizeof digits, "%.0f", d); /* glibc: exact */
        put_byte(k, 'I');
        const char *at = strcmp(digits, "-0") == 0 ? "0" : digits;
        for (int i = 0; at[i] && i < len; i++) put_byte(k, (uint8_t)at[i]);
        return start;
    }
    uint8_t raw[8];
    memcpy(raw, &d, 8);
    put_byte(k, 'F');
    for (int i = 0; i < 8; i++) put_byte(k, raw[i]);
    return start;
}

/* The item [off, n_bytes) ends: 1 when it repeats an item of its array (the caller rolls the
 * token back; strict or not: no instance with a duplicate item is ever accepted), else 0. */
static int close_item(EspKeys *k, uint32_t off) {
    k->item = NO_ITEM;
    if (k->failed || !k->depth) return 0;
    Frame *top = &k->stack[k->depth - 1];
    uint32_t len = k->n_bytes - off;
    if (key_in(k, top->items, k->bytes + off, len)) {
        k->refused = REFUSED_ITEM;
        return 1;
    }
    save_slot(k, k->depth - 1);
    if (grow32((void **)&k->entries, &k->entries_cap, (int64_t)k->n_entries + 1, sizeof(KeyEntry))) {
        KeyEntry e = {top->items, off, len};
        k->entries[k->n_entries] = e;
        top->items = k->n_entries++;
    } else {
        k->failed = 1;
    }
    return 0;
}

static void start_item(EspKeys *k, int32_t item, uint8_t tag) {
    k->item = item;
    k->item_off = k->n_bytes;
    put_byte(k, tag);
}

/* One byte outside the JSON values (the scan); see the top. */
static void frame_byte(EspKeys *k, uint8_t b) {
    if (k->frame_at == FRAME_DONE) return;
    const EspFrames *f = k->frames;
    int32_t at = f->next[(int64_t)k->frame_at * f->n_classes + f->byte_class[b]];
    k->frame_at = f->found[at] ? FRAME_READING : at;
}

/* A framed value ended: scan on from the rearm state, or skip the rest. */
static void value_ended(EspKeys *k) {
    k->frame_at = k->frames->rearm >= 0 ? k->frames->rearm : FRAME_DONE;
}

/* 1: the byte completes a duplicate key or item, or writes a needless escape in a key (strict);
 * the caller rolls back. */
static int step_byte(EspKeys *k, uint8_t b, int strict) {
    if (k->frame_at == FRAME_NUMBER || k->frame_at == FRAME_WORD) {
        int on = k->frame_at == FRAME_NUMBER ? number_byte(b) : (b >= 'a' && b <= 'z');
        if (on) return 0;
        value_ended(k); /* then the byte is the scan's */
    }
    if (k->frame_at != FRAME_READING) {
        frame_byte(k, b);
        return 0;
    }
    if (k->frames && !k->depth && !k->in_key && !k->in_value && b != '{' && b != '[' &&
        b != '"' && b != ' ' && b != '\t' && b != '\n' && b != '\r') {
        /* a framed value that is a number or a literal: no key in it */
        k->frame_at = (b >= 'a' && b <= 'z') ? FRAME_WORD : FRAME_NUMBER;
        return 0;
    }
    if (k->item == NUMBER_ITEM) {
        if (number_byte(b)) { put_byte(k, b); return 0; }
        uint32_t off = put_number(k, k->item_off + 1);
        if (k->failed || k->bytes[off] == 'X') k->item = NO_ITEM; /* not a number: no item */
        else if (close_item(k, off)) return 1;
    } else if (k->item == LITERAL_ITEM) {
        uint32_t read = k->n_bytes - k->item_off - 1;
        if ((uint8_t)LITERALS[literal_index(k->bytes[k->item_off + 1])][read] == b) {
            put_byte(k, b);
            return read + 1 == (uint32_t)k->lit_need ? close_item(k, k->item_off) : 0;
        }
        k->item = NO_ITEM; /* not a literal after all: no item (the grammar never writes it) */
    }
    if (k->in_key || k->in_value) {
        if (k->esc_len) {
            if (strict && k->in_key && needless_escape(k, b)) {
                k->refused = REFUSED_ESCAPE;
                return 1;
            }
            escape_byte(k, b);
        } else if (b == '\\') {
            k->esc_len = 1;
        } else if (b != '"') {
            if (k->in_key || k->item == STRING_ITEM) {
                put_utf8(k, k->high);
                put_byte(k, b);
                k->high = 0;
            }
        } else if (k->in_value) {
            k->in_value = 0;
            if (k->frames && !k->depth) value_ended(k); /* a framed value that is a string */
            if (k->item == STRING_ITEM) {
                put_utf8(k, k->high);
                k->high = 0;
                return close_item(k, k->item_off);
            }
        } else {
            return close_key(k);
        }
        return 0;
    }
    Frame *top = k->depth ? &k->stack[k->depth - 1] : NULL;
    int value_start = k->expect_value;
    if (b == ' ' || b == '\t' || b == '\n' || b == '\r') return 0;
    k->expect_value = b == '[' || b == ':' || b == ',';
    if (b == '"') {
        if (top && top->kind == OBJECT && top->expect_key) {
            k->in_key = 1;
            k->key_off = k->n_bytes;
            k->high = 0;
        } else {
            k->in_value = 1;
            if (in_unique(k)) { start_item(k, STRING_ITEM, 's'); k->high = 0; }
        }
    } else if (((b >= '0' && b <= '9') || b == '-') && value_start && in_unique(k)) {
        start_item(k, NUMBER_ITEM, 'n');
        put_byte(k, b);
    } else if ((b == 't' || b == 'f' || b == 'n') && value_start && in_unique(k)) {
        start_item(k, LITERAL_ITEM, 'l');
        k->lit_need = (int32_t)strlen(LITERALS[literal_index(b)]);
        put_byte(k, b);
    } else if (b == '{') {
        push(k, OBJECT);
    } else if (b == '[') {
        push(k, ARRAY);
    } else if ((b == '}' || b == ']') && top) {
        k->depth--;
        if (k->frames && !k->depth) value_ended(k);
    } else if (b == ',' && top && top->kind == OBJECT) {
        save_slot(k, k->depth - 1);
        top->expect_key = 1;
    } else if (b == ',' && top && top->loc >= 0) { /* an array's next item */
        save_slot(k, k->depth - 1);
        top->index++;
    }
    return 0;
}

/* Inside a literal already in its array: its first letter names it, so every way on repeats
 * it (a token that ends here is refused like one that completes it). */
static int in_taken_literal(const EspKeys *k) {
    if (k->item != LITERAL_ITEM) return 0;
    uint8_t word[6] = {'l'};
    const char *lit = LITERALS[literal_index(k->bytes[k->item_off + 1])];
    memcpy(word + 1, lit, strlen(lit));
    return key_in(k, k->stack[k->depth - 1].items, word, 1 + (uint32_t)strlen(lit));
}

/* Characters (UTF-8 lead bytes) of [p, p + n). */
static uint32_t chars_of(const uint8_t *p, uint32_t n) {
    uint32_t c = 0;
    for (uint32_t i = 0; i < n; i++) c += (p[i] & 0xC0) != 0x80;
    return c;
}

/* The most characters the string item being read may have (-1: no bound kept, or not inside a
 * string item of a unique array past its prefix). */
static int32_t item_chars(const EspKeys *k) {
    if (k->item != STRING_ITEM || !k->in_value || !in_unique(k)) return -1;
    const Frame *top = &k->stack[k->depth - 1];
    if (top->index < k->places->prefix_count[top->loc]) return -1;
    return k->places->item_chars[top->loc];
}

/* Inside a string item at its most characters (no escape or surrogate half pending) that is
 * already in its array: only the closing quote could follow, a duplicate (EspPlaces). */
static int at_taken_end(const EspKeys *k) {
    int32_t most = item_chars(k);
    if (most < 0 || k->esc_len || k->high) return 0;
    const uint8_t *text = k->bytes + k->item_off + 1;
    uint32_t len = k->n_bytes - k->item_off - 1;
    if (len < (uint32_t)most || len > 4u * (uint32_t)most || chars_of(text, len) != (uint32_t)most)
        return 0;
    return key_in(k, k->stack[k->depth - 1].items, k->bytes + k->item_off, len + 1);
}

/* The word list of the string item being read (EspPlaces.words): its first index, count in
 * *n (0: none, or not inside a string item of a unique array past its prefix). */
static int32_t item_words(const EspKeys *k, int32_t *n) {
    *n = 0;
    if (k->item != STRING_ITEM || !k->in_value || !in_unique(k)) return 0;
    const Frame *top = &k->stack[k->depth - 1];
    if (top->index < k->places->prefix_count[top->loc]) return 0;
    *n = k->places->word_count[top->loc];
    return k->places->word_start[top->loc];
}

/* With a \u escape pending and some of its digits read (no surrogate half): the code points
 * it may still stand for, [*lo, *hi]; 0 when nothing narrows the next character (no escape, a
 * bare backslash or \u, a range that meets surrogates: a pair may follow). */
static int pending_range(const EspKeys *k, int32_t *lo, int32_t *hi) {
    if (k->esc_len < 3 || k->high) return 0;
    int digits = k->esc_len - 2;
    int32_t value = 0;
    for (int i = 0; i < digits; i++) {
        int v = hex_value(k->esc[i]);
        if (v < 0) return 0;
        value = value * 16 + v;
    }
    int shift = 4 * (4 - digits);
    *lo = value << shift;
    *hi = *lo | ((1 << shift) - 1);
    return *hi < 0xD800 || *lo > 0xDFFF;
}

/* The code point UTF-8 starts at p (n bytes left; -1 when cut short). */
static int32_t first_point(const uint8_t *p, uint32_t n) {
    if (!n) return -1;
    uint32_t extra = p[0] < 0x80 ? 0 : p[0] < 0xE0 ? 1 : p[0] < 0xF0 ? 2 : 3;
    if (n <= extra) return -1;
    int32_t point = extra == 0 ? p[0] : p[0] & (0x3F >> extra);
    for (uint32_t i = 1; i <= extra; i++) point = (point << 6) | (p[i] & 0x3F);
    return point;
}

/* Where word i stands against text[0..len): 0 when text is a prefix of it, else the sign of
 * the bytewise order of the word's first bytes and the text (a shorter word equal so far: -1). */
static int prefix_order(const EspPlaces *p, int32_t i, const uint8_t *text, uint32_t len) {
    uint32_t word_len = (uint32_t)p->word_len[i];
    int c = memcmp(p->words + p->word_off[i], text, word_len < len ? word_len : len);
    if (c) return c < 0 ? -1 : 1;
    return word_len < len ? -1 : 0;
}

/* The words of [first, first + n) that text[0..len) is a prefix of: [*lo, *hi). The list is
 * sorted bytewise (native.py), so they are one run, found by two binary searches: a word list
 * costs its logarithm per token, not its length. */
static void word_run(const EspPlaces *p, int32_t first, int32_t n, const uint8_t *text,
                     uint32_t len, int32_t *lo, int32_t *hi) {
    int32_t a = first, b = first + n;
    while (a < b) { /* first word not before the text */
        int32_t mid = a + (b - a) / 2;
        if (prefix_order(p, mid, text, len) < 0) a = mid + 1; else b = mid;
    }
    *lo = a;
    b = first + n;
    while (a < b) { /* first word after every word the text starts */
        int32_t mid = a + (b - a) / 2;
        if (prefix_order(p, mid, text, len) <= 0) a = mid + 1; else b = mid;
    }
    *hi = a;
}

/* Word i of the list against key[0..len): the sign of their bytewise order (a prefix first). */
static int word_order(const EspPlaces *p, int32_t i, const uint8_t *key, uint32_t len) {
    int c = prefix_order(p, i, key, len);
    return c ? c : (uint32_t)p->word_len[i] > len;
}

/* The index in the sorted [from, to) of the word equal to key[0..len), -1 if none. */
static int32_t find_word(const EspPlaces *p, int32_t from, int32_t to, const uint8_t *key,
                         uint32_t len) {
    while (from < to) {
        int32_t mid = from + (to - from) / 2;
        int c = word_order(p, mid, key, len);
        if (!c) return mid;
        if (c < 0) from = mid + 1; else to = mid;
    }
    return -1;
}

/* Whether a listed word's next character may be written by a pending escape: after a bare
 * backslash (escape 1), one the backends write escaped in a listed word (a control, '"', '\\',
 * DEL; every other character they write as itself); after \u (escape 2), one of those every
 * backend writes as a \u escape (the others have a short one). Checked against the backends
 * by tests/constrained/test_unique_items_native.py. */
static int escape_reaches(int escape, int32_t point) {
    if (point < 0) return 0;
    if (point == 0x7F) return 1;
    if (point == '"' || point == '\\') return escape == 1;
    if (point >= 0x20) return 0;
    return escape == 1 || !(point == '\b' || point == '\t' || point == '\n' || point == '\f' ||
                            point == '\r');
}

/* Whether word i may still be what the item's text becomes: with no escape pending (escape
 * 0), every word of the run; with one pending, a word whose next character it may write
 * (escape_reaches) and, where the \u escape's digits allow code points [lo, hi] next
 * (narrow), one within them. */
static int word_ahead(const EspPlaces *p, int32_t i, uint32_t len, int escape, int narrow,
                      int32_t lo, int32_t hi) {
    if (!escape) return 1;
    int32_t next = first_point(p->words + p->word_off[i] + len, (uint32_t)p->word_len[i] - len);
    return escape_reaches(escape, next) && (!narrow || (next >= lo && next <= hi));
}

/* Inside a string item with a word list where some listed word extends the text so far and
 * every such word is an item already in the array: whatever follows repeats one (or leaves
 * the list). The text so far is decoded, and every way on extends it; with an escape pending,
 * only words whose next character it may write count (word_ahead), and an escape none of the
 * words that extend the text is written with is refused too.
 * Counted, not compared word by word: the array's items are distinct, so every such word is
 * taken when as many of its items are such words. Costs the array's length (plus a binary
 * search per item that extends the text), whatever the list's. */
static int words_taken(const EspKeys *k) {
    int32_t n, first = item_words(k, &n);
    if (!n) return 0;
    const EspPlaces *p = k->places;
    const uint8_t *text = k->bytes + k->item_off;
    uint32_t len = k->n_bytes - k->item_off;
    int32_t lo = 0, hi = 0, from, to;
    int narrow = pending_range(k, &lo, &hi), escape = k->esc_len > 1 ? 2 : k->esc_len;
    word_run(p, first, n, text, len, &from, &to);
    int32_t listed = 0;
    for (int32_t i = from; i < to; i++) listed += word_ahead(p, i, len, escape, narrow, lo, hi);
    if (!listed) return escape && from < to; /* an escape no word it extends is written with */
    int32_t taken = 0;
    for (int32_t e = k->stack[k->depth - 1].items; e >= 0; e = k->entries[e].prev) {
        const uint8_t *item = k->bytes + k->entries[e].off;
        uint32_t item_len = k->entries[e].len;
        if (item_len < len || memcmp(item, text, len) != 0) continue;
        int32_t i = find_word(p, from, to, item, item_len);
        taken += i >= 0 && word_ahead(p, i, len, escape, narrow, lo, hi);
    }
    return taken == listed;
}

static void rollback(EspKeys *k, int64_t n) {
    if (n <= 0) return;
    if (n > k->n_marks) n = k->n_marks;
    const Mark *m = &k->marks[k->n_marks - n];
    while (k->n_undo > m->n_undo) {
        const Undo *u = &k->undo[--k->n_undo];
        k->stack[u->slot] = u->old;
    }
    k->in_key = m->in_key;
    k->in_value = m->in_value;
    k->esc_len = m->esc_len;
    k->high = m->high;
    k->depth = m->depth;
    k->n_entries = m->n_entries;
    k->item = m->item;
    k->lit_need = m->lit_need;
    k->expect_value = m->expect_value;
    k->item_off = m->item_off;
    k->key_off = m->key_off;
    k->n_bytes = m->n_bytes;
    k->frame_at = m->frame_at;
    memcpy(k->esc, m->esc, 4);
    k->n_marks -= n;
}

static const uint8_t *token_bytes(const EspKeysTables *t, int64_t token, int64_t *len) {
    if (token < 0 || token >= t->n_tokens) { *len = 0; return NULL; }
    *len = t->offs[token + 1] - t->offs[token];
    return t->bytes + t->offs[token];
}

/* Accept one token: 1 (a mark pushed), 0 it completes a duplicate, or writes a needless escape
 * in a key (strict) (state unchanged),
 * -1 out of memory (state unchanged). */
static int advance(EspKeys *k, int64_t token, int strict) {
    if (!grow((void **)&k->marks, &k->marks_cap, k->n_marks + 1, sizeof(Mark))) return -1;
    Mark m = {k->in_key, k->in_value, k->esc_len,      k->high,    k->depth,
              k->n_entries, k->item, k->lit_need, k->expect_value, k->key_off,
              k->n_bytes, k->item_off, {0}, k->n_undo, k->frame_at};
    memcpy(m.esc, k->esc, 4);
    k->marks[k->n_marks++] = m;
    int64_t len;
    const uint8_t *data = token_bytes(k->tables, token, &len);
    for (int64_t i = 0; i < len && !k->failed; i++) {
        if (step_byte(k, data[i], strict)) { rollback(k, 1); return 0; }
    }
    if (k->failed) { rollback(k, 1); k->failed = 0; return -1; }
    if (in_taken_literal(k) || at_taken_end(k) || words_taken(k)) {
        rollback(k, 1);
        k->refused = REFUSED_ITEM;
        return 0;
    }
    return 1;
}

/* ---- the filter ------------------------------------------------------------------------------ */

static uint64_t hash_bytes(const uint8_t *p, uint32_t n) {
    uint64_t h = 1469598103934665603ull;
    for (uint32_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static const Slot *map_get(const BytesMap *m, const uint8_t *key, uint32_t len) {
    if (!m->slots) return NULL;
    uint64_t h = hash_bytes(key, len);
    for (uint64_t i = h & m->mask;; i = (i + 1) & m->mask) {
        const Slot *s = &m->slots[i];
        if (s->count == 0) return NULL;
        if (s->hash == h && s->len == len && memcmp(s->key, key, len) == 0) return s;
    }
}

static int allowed(const uint32_t *row, int64_t words, int64_t t) {
    return t >= 0 && t < words * 32 && ((row[t >> 5] >> (t & 31)) & 1u);
}

static int note(EspKeys *k, int64_t *n, int32_t token) {
    if (!grow((void **)&k->found, &k->found_cap, *n + 1, sizeof(int32_t))) return 0;
    k->found[(*n)++] = token;
    return 1;
}

/* token completes a duplicate from here (the state is left as it was) */
static int completes_duplicate(EspKeys *k, int32_t token) {
    int r = advance(k, token, 1);
    if (r == 1) rollback(k, 1);
    return r == 0;
}

static int try_ids(EspKeys *k, const int32_t *ids, int64_t n, const uint32_t *row, int64_t words,
                   int64_t *found) {
    for (int64_t i = 0; i < n; i++) {
        if (allowed(row, words, ids[i]) && completes_duplicate(k, ids[i]) &&
            !note(k, found, ids[i]))
            return 0;
    }
    return 1;
}

/* Every allowed token of row that is refused from here. */
static int try_allowed(EspKeys *k, const uint32_t *row, int64_t words, int64_t *found) {
    int64_t n = k->tables->n_tokens;
    for (int64_t w = 0; w < words; w++) {
        for (uint32_t bits = row[w]; bits; bits &= bits - 1) {
            int64_t t = w * 32 + __builtin_ctz(bits);
            if (t < n && completes_duplicate(k, (int32_t)t) && !note(k, found, (int32_t)t))
                return 0;
        }
    }
    return 1;
}

/* The allowed tokens of row that complete a duplicate key (into k->found, maybe repeated);
 * -1 out of memory. Candidates as the index allows (see EspKeysTables). */
static int64_t duplicates(EspKeys *k, const uint32_t *row, int64_t words) {
    const EspKeysTables *t = k->tables;
    int64_t found = 0;
    if (k->in_key && k->esc_len) /* rare: every allowed token (the escape's rest may be needless) */
        return try_allowed(k, row, words, &found) ? found : -1;
    if (k->in_key && !try_ids(k, t->slash_ids, t->n_slash, row, words, &found)) return -1;
    if (k->in_key && k->high) /* rare (a needless escape let through): every token with a quote */
        return try_ids(k, t->quote_ids, t->n_quote, row, words, &found) ? found : -1;
    if (k->in_key) { /* a seen key that extends the key so far, closed at a token's first quote */
        const uint8_t *key = k->bytes + k->key_off;
        uint32_t len = k->n_bytes - k->key_off;
        for (int32_t e = k->stack[k->depth - 1].keys; e >= 0; e = k->entries[e].prev) {
            const KeyEntry *seen = &k->entries[e];
            if (seen->len < len || memcmp(k->bytes + seen->off, key, len) != 0) continue;
            const Slot *s = map_get(&t->by_prefix, k->bytes + seen->off + len, seen->len - len);
            for (int32_t i = 0; s && i < s->count; i++) {
                int32_t id = t->by_prefix.ids[s->start + i];
                if (allowed(row, words, id) && !note(k, &found, id)) return -1;
            }
        }
        return try_ids(k, t->simulate_ids, t->n_simulate, row, words, &found) ? found : -1;
    }
    /* outside a key: a key opened and closed in one token is one of its runs */
    if (!try_ids(k, t->always_ids, t->n_always, row, words, &found)) return -1;
    for (int32_t d = 0; d < k->depth; d++) {
        for (int32_t e = k->stack[d].keys; k->stack[d].kind == OBJECT && e >= 0;
             e = k->entries[e].prev) {
            const Slot *s = map_get(&t->by_run, k->bytes + k->entries[e].off, k->entries[e].len);
            if (s && !try_ids(k, t->by_run.ids + s->start, s->count, row, words, &found))
                return -1;
        }
    }
    return found;
}

/* Some open container (or the root) has a tracked place: an item may complete from here. */
static int items_live(const EspKeys *k) {
    if (!k->places) return 0;
    if (!k->depth) return 1;
    for (int32_t d = 0; d < k->depth; d++)
        if (k->stack[d].loc >= 0) return 1;
    return 0;
}

/* The number being read, ended here, repeats an item of its array. */
static int number_repeats(EspKeys *k) {
    uint32_t saved = k->n_bytes;
    uint32_t off = put_number(k, k->item_off + 1);
    const Frame *top = &k->stack[k->depth - 1];
    int seen = !k->failed && k->bytes[off] != 'X' &&
               key_in(k, top->items, k->bytes + off, k->n_bytes - off);
    k->n_bytes = saved;
    k->failed = 0; /* out of memory: the accept path still refuses the duplicate */
    return seen;
}

/* Inside a string item whose longest is most characters: the allowed tokens that leave it at an
 * item of its array that long (at_taken_end). Candidates: a token spelling the rest of such an
 * item, and the tokens holding a backslash; with an escape or a surrogate half pending, every
 * allowed token. 0 out of memory. */
static int taken_end_ids(EspKeys *k, const uint32_t *row, int64_t words, int32_t most,
                         int64_t *found) {
    const EspKeysTables *t = k->tables;
    uint32_t len = k->n_bytes - k->item_off, ahead = 0;
    for (int32_t e = k->stack[k->depth - 1].items; e >= 0; e = k->entries[e].prev) {
        /* pointers into the arena are taken anew each time: replaying a token may move it */
        uint32_t off = k->entries[e].off, seen_len = k->entries[e].len;
        const uint8_t *text = k->bytes + k->item_off, *item = k->bytes + off;
        if (seen_len < len || memcmp(item, text, len) != 0) continue;
        if (chars_of(item + 1, seen_len - 1) != (uint32_t)most) continue;
        ahead = 1;
        if (k->esc_len || k->high) break;
        const Slot *s = map_get(&t->by_text, item + len, seen_len - len);
        if (s && !try_ids(k, t->by_text.ids + s->start, s->count, row, words, found)) return 0;
    }
    if (!ahead) return 1;
    if (k->esc_len || k->high) return try_allowed(k, row, words, found);
    return try_ids(k, t->escape_ids, t->n_escape, row, words, found);
}

static int compare_int32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Inside a string item with a word list: the allowed tokens after which words_taken holds.
 * Candidates: a token spelling a part of the rest of a listed word that extends the text and
 * is already an item (the text after it must still be a prefix of such a word), and the tokens
 * holding a backslash; with an escape or a surrogate half pending, every allowed token. The
 * taken words are gathered from the array's items and sorted, so that a part two of them
 * share is tried once. 0 out of memory. */
static int words_taken_ids(EspKeys *k, const uint32_t *row, int64_t words, int64_t *found) {
    const EspKeysTables *t = k->tables;
    const EspPlaces *p = k->places;
    int32_t n, first = item_words(k, &n);
    if (!n) return 1;
    uint32_t len = k->n_bytes - k->item_off;
    int32_t from, to;
    int64_t m = 0;
    word_run(p, first, n, k->bytes + k->item_off, len, &from, &to);
    for (int32_t e = k->stack[k->depth - 1].items; e >= 0; e = k->entries[e].prev) {
        const uint8_t *item = k->bytes + k->entries[e].off;
        uint32_t item_len = k->entries[e].len;
        if (item_len <= len || memcmp(item, k->bytes + k->item_off, len) != 0) continue;
        int32_t i = find_word(p, from, to, item, item_len);
        if (i < 0) continue;
        if (!grow((void **)&k->taken, &k->taken_cap, m + 1, sizeof(int32_t))) return 0;
        k->taken[m++] = i;
    }
    if (from == to) return 1;
    if (k->esc_len || k->high) return try_allowed(k, row, words, found);
    qsort(k->taken, (size_t)m, sizeof(int32_t), compare_int32);
    const uint8_t *last = NULL; /* the taken word before, in the list's (sorted) order */
    uint32_t last_len = 0;
    /* replaying a token below may move the arena, never the list: only words are read here */
    for (int64_t j = 0; j < m; j++) {
        const uint8_t *word = p->words + p->word_off[k->taken[j]];
        uint32_t word_len = (uint32_t)p->word_len[k->taken[j]];
        /* a part the word shares with the taken word before was tried with it: the tokens
         * spelling it are the same, and a try leaves the state as it was */
        uint32_t shared = len;
        while (last && shared < word_len && shared < last_len && word[shared] == last[shared])
            shared++;
        last = word, last_len = word_len;
        for (uint32_t end = shared + 1; end <= word_len; end++) {
            const Slot *s = map_get(&t->by_text, word + len, end - len);
            if (s && !try_ids(k, t->by_text.ids + s->start, s->count, row, words, found)) return 0;
        }
    }
    return try_ids(k, t->escape_ids, t->n_escape, row, words, found);
}

/* Append to k->found the allowed tokens of row that complete a duplicate item (candidates: see
 * EspKeysTables); found: how many k->found held. -1 out of memory. */
static int64_t item_duplicates(EspKeys *k, const uint32_t *row, int64_t words, int64_t found) {
    const EspKeysTables *t = k->tables;
    if (!try_ids(k, t->item_ids, t->n_item, row, words, &found)) return -1;
    if (k->item == NUMBER_ITEM && !try_ids(k, t->numrun_ids, t->n_numrun, row, words, &found))
        return -1;
    int32_t most = item_chars(k);
    if (most >= 0 && !taken_end_ids(k, row, words, most, &found)) return -1;
    if (!words_taken_ids(k, row, words, &found)) return -1;
    if (k->item == LITERAL_ITEM) {
        int lit = literal_index(k->bytes[k->item_off + 1]);
        int64_t read = (int64_t)(k->n_bytes - k->item_off - 1);
        if (read >= 1 && read < (int64_t)strlen(LITERALS[lit]) &&
            !try_ids(k, t->lit_ids + t->lit_start[lit][read], t->lit_count[lit][read], row, words,
                     &found))
            return -1;
    }
    return found;
}

/* Clear the duplicate completions from row unless that empties it: 1 cleared (or none
 * allowed), 0 left as it was (the dead-end rule), -1 out of memory. Inside a number that
 * already is an item of its array, every token whose first byte ends the number is one. */
static int filter_row(EspKeys *k, uint32_t *row, int64_t words) {
    if (k->frame_at != FRAME_READING) return 1; /* outside the value: the accept still refuses */
    int64_t n = duplicates(k, row, words);
    if (n < 0) return -1;
    int cut = 0;
    if (items_live(k)) {
        n = item_duplicates(k, row, words, n);
        if (n < 0) return -1;
        cut = k->item == NUMBER_ITEM && number_repeats(k);
    }
    if (n == 0 && !cut) return 1;
    if (cut) {
        if (!grow((void **)&k->saved, &k->saved_cap, words, sizeof(uint32_t))) return -1;
        memcpy(k->saved, row, (size_t)words * 4);
        const EspKeysTables *t = k->tables;
        for (int64_t w = 0; w < words && w < t->numstart_words; w++) row[w] &= t->numstart[w];
    }
    for (int64_t i = 0; i < n; i++) row[k->found[i] >> 5] &= ~(1u << (k->found[i] & 31));
    for (int64_t w = 0; w < words; w++)
        if (row[w]) return 1;
    if (cut) memcpy(row, k->saved, (size_t)words * 4);
    else
        for (int64_t i = 0; i < n; i++) row[k->found[i] >> 5] |= 1u << (k->found[i] & 31);
    return 0;
}

/* ---- tables ---------------------------------------------------------------------------------- */

typedef struct { const uint8_t *key; uint32_t len; int32_t id; } Item;

static int map_build(BytesMap *m, const Item *items, int64_t n) {
    uint64_t cap = 16;
    while (cap < (uint64_t)(2 * n + 1)) cap *= 2;
    m->slots = calloc(cap, sizeof(Slot));
    m->ids = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    int32_t *fill = calloc(cap, sizeof(int32_t));
    if (!m->slots || !m->ids || !fill) { free(fill); return 0; }
    m->mask = cap - 1;
    Slot **at = malloc((size_t)(n ? n : 1) * sizeof(Slot *));
    if (!at) { free(fill); return 0; }
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = hash_bytes(items[i].key, items[i].len);
        uint64_t j = h & m->mask;
        for (;; j = (j + 1) & m->mask) {
            Slot *s = &m->slots[j];
            if (s->count == 0) { s->hash = h; s->key = items[i].key; s->len = items[i].len; break; }
            if (s->hash == h && s->len == items[i].len && memcmp(s->key, items[i].key, s->len) == 0)
                break;
        }
        m->slots[j].count++;
        at[i] = &m->slots[j];
    }
    int32_t start = 0;
    for (uint64_t j = 0; j < cap; j++) { m->slots[j].start = start; start += m->slots[j].count; }
    for (int64_t i = 0; i < n; i++) {
        Slot *s = at[i];
        m->ids[s->start + fill[s - m->slots]++] = items[i].id;
    }
    free(at);
    free(fill);
    return 1;
}

void espalier_keys_tables_free(EspKeysTables *t) {
    if (!t) return;
    free(t->bytes); free(t->offs);
    free(t->by_prefix.slots); free(t->by_prefix.ids);
    free(t->by_run.slots); free(t->by_run.ids);
    free(t->quote_ids); free(t->simulate_ids); free(t->always_ids); free(t->slash_ids);
    free(t->item_ids); free(t->numrun_ids); free(t->lit_ids); free(t->numstart);
    free(t->by_text.slots); free(t->by_text.ids); free(t->escape_ids);
    free(t);
}

static int same(const uint8_t *a, uint32_t na, const uint8_t *b, uint32_t nb) {
    return na == nb && memcmp(a, b, na) == 0;
}

/* The token goes on with the rest of a literal: it agrees with rest on their common length. */
static int starts_with(const uint8_t *data, int64_t len, const char *rest) {
    int64_t n = (int64_t)strlen(rest);
    return len > 0 && memcmp(data, rest, (size_t)(len < n ? len : n)) == 0;
}

static int holds(const uint8_t *data, int64_t len, const char *word) {
    int64_t n = (int64_t)strlen(word);
    for (int64_t i = 0; i + n <= len; i++)
        if (memcmp(data + i, word, (size_t)n) == 0) return 1;
    return 0;
}

/* The token ends with the start of a literal (a proper prefix of one, at the token's start or
 * after a byte that may come before a value). */
static int literal_opened(const uint8_t *data, int64_t len) {
    for (int lit = 0; lit < 3; lit++)
        for (int64_t n = 1; n < (int64_t)strlen(LITERALS[lit]) && n <= len; n++)
            if (memcmp(data + len - n, LITERALS[lit], (size_t)n) == 0 &&
                (n == len || strchr(" \t\n\r,[:", data[len - n - 1])))
                return 1;
    return 0;
}

/* The item candidates of EspKeysTables, from the tokens' bytes. */
static int item_tables(EspKeysTables *t) {
    int64_t n = t->n_tokens, total_lit = 0;
    t->numstart_words = (n + 31) / 32;
    t->item_ids = malloc((size_t)(n + 1) * sizeof(int32_t));
    t->numrun_ids = malloc((size_t)(n + 1) * sizeof(int32_t));
    t->numstart = calloc((size_t)(t->numstart_words + 1), sizeof(uint32_t));
    if (!t->item_ids || !t->numrun_ids || !t->numstart) return 0;
    for (int64_t id = 0; id < n; id++) {
        const uint8_t *data = t->bytes + t->offs[id];
        int64_t len = t->offs[id + 1] - t->offs[id];
        int quote = memchr(data, '"', (size_t)len) != NULL, digit_closed = 0, digit = 0, other = 0;
        for (int64_t i = 0; i < len; i++) {
            if (data[i] >= '0' && data[i] <= '9') digit = 1;
            else if (!number_byte(data[i])) { other = 1; digit_closed |= digit; }
        }
        if (quote || digit_closed || holds(data, len, "true") || holds(data, len, "false") ||
            holds(data, len, "null") || literal_opened(data, len))
            t->item_ids[t->n_item++] = (int32_t)id;
        if (len && number_byte(data[0]) && other) t->numrun_ids[t->n_numrun++] = (int32_t)id;
        if (!len || number_byte(data[0])) t->numstart[id >> 5] |= 1u << (id & 31);
        for (int lit = 0; lit < 3; lit++)
            for (size_t read = 1; read < strlen(LITERALS[lit]); read++)
                if (starts_with(data, len, LITERALS[lit] + read)) t->lit_count[lit][read]++;
    }
    for (int64_t id = n; id < t->numstart_words * 32; id++) /* no bytes: ends nothing */
        t->numstart[id >> 5] |= 1u << (id & 31);
    for (int lit = 0; lit < 3; lit++)
        for (int read = 0; read < 6; read++) {
            t->lit_start[lit][read] = total_lit;
            total_lit += t->lit_count[lit][read];
            t->lit_count[lit][read] = 0;
        }
    t->lit_ids = malloc((size_t)(total_lit + 1) * sizeof(int32_t));
    if (!t->lit_ids) return 0;
    for (int64_t id = 0; id < n; id++) {
        const uint8_t *data = t->bytes + t->offs[id];
        int64_t len = t->offs[id + 1] - t->offs[id];
        for (int lit = 0; lit < 3; lit++)
            for (size_t read = 1; read < strlen(LITERALS[lit]); read++)
                if (starts_with(data, len, LITERALS[lit] + read))
                    t->lit_ids[t->lit_start[lit][read] + t->lit_count[lit][read]++] = (int32_t)id;
    }
    return 1;
}

/* Whether a token without a quote, read inside a key with no escape pending, writes a needless
 * escape within itself (the only such tokens the filter must replay there: one that leaves an
 * escape pending is decided by the next token, with every allowed token replayed). */
static int needless_inside(const uint8_t *data, uint32_t len) {
    EspKeys probe;
    memset(&probe, 0, sizeof probe);
    probe.in_key = 1;
    for (uint32_t i = 0; i < len; i++) {
        uint8_t b = data[i];
        if (!probe.esc_len) {
            if (b == '\\') probe.esc_len = 1;
            continue;
        }
        if (needless_escape(&probe, b)) return 1;
        if (probe.esc_len == 1) probe.esc_len = b == 'u' ? 2 : 0;
        else {
            probe.esc[probe.esc_len - 2] = b;
            probe.esc_len = probe.esc_len == 5 ? 0 : probe.esc_len + 1;
        }
    }
    return 0;
}

/* bytes: every token's bytes back to back; offs: int64[n + 1]. NULL when out of memory. */
EspKeysTables *espalier_keys_tables_new(const uint8_t *bytes, const int64_t *offs, int64_t n) {
    EspKeysTables *t = calloc(1, sizeof(EspKeysTables));
    if (!t) return NULL;
    int64_t total = offs[n], quotes = 0;
    t->n_tokens = n;
    t->bytes = malloc((size_t)(total ? total : 1));
    t->offs = malloc((size_t)(n + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < total; i++) quotes += bytes[i] == '"';
    t->quote_ids = malloc((size_t)(n + 1) * sizeof(int32_t));
    t->simulate_ids = malloc((size_t)(n + 1) * sizeof(int32_t));
    t->always_ids = malloc((size_t)(n + 1) * sizeof(int32_t));
    t->slash_ids = malloc((size_t)(n + 1) * sizeof(int32_t));
    t->escape_ids = malloc((size_t)(n + 1) * sizeof(int32_t));
    Item *texts = malloc((size_t)(n + 1) * sizeof(Item));
    Item *prefixes = malloc((size_t)(n + 1) * sizeof(Item));
    Item *runs = malloc((size_t)(quotes + n + 1) * sizeof(Item));
    const uint8_t **cuts = malloc((size_t)(quotes + 1) * sizeof(uint8_t *));
    int ok = t->bytes && t->offs && t->quote_ids && t->simulate_ids && t->always_ids &&
             t->slash_ids && t->escape_ids && texts && prefixes && runs && cuts;
    int64_t n_prefixes = 0, n_runs = 0, n_texts = 0;
    if (ok) {
        memcpy(t->bytes, bytes, (size_t)total);
        memcpy(t->offs, offs, (size_t)(n + 1) * sizeof(int64_t));
    }
    for (int64_t id = 0; ok && id < n; id++) {
        const uint8_t *data = t->bytes + offs[id];
        uint32_t len = (uint32_t)(offs[id + 1] - offs[id]), nq = 0;
        for (uint32_t i = 0; i < len; i++)
            if (data[i] == '"') cuts[nq++] = data + i;
        if (!nq) {
            if (needless_inside(data, len)) t->slash_ids[t->n_slash++] = (int32_t)id;
            if (memchr(data, '\\', len)) t->escape_ids[t->n_escape++] = (int32_t)id;
            else if (len) texts[n_texts++] = (Item){data, len, (int32_t)id};
            continue;
        }
        t->quote_ids[t->n_quote++] = (int32_t)id;
        uint32_t first = (uint32_t)(cuts[0] - data);
        int slash_before = memchr(data, '\\', first) != NULL;
        if (!slash_before) prefixes[n_prefixes++] = (Item){data, first, (int32_t)id};
        if (!slash_before && nq == 1) continue;
        t->simulate_ids[t->n_simulate++] = (int32_t)id;
        /* runs: between consecutive quotes, and the prefix; always: a backslash anywhere, a run
         * twice, or the prefix among the runs (Python: KeyTables.build, kept as the oracle) */
        int always = memchr(data, '\\', len) != NULL;
        runs[n_runs++] = (Item){data, first, (int32_t)id};
        int64_t token_runs = n_runs;
        for (uint32_t q = 0; q + 1 < nq; q++) {
            const uint8_t *r = cuts[q] + 1;
            uint32_t rl = (uint32_t)(cuts[q + 1] - r);
            for (int64_t j = token_runs; j < n_runs; j++)
                if (same(runs[j].key, runs[j].len, r, rl)) always = 1;
            if (same(data, first, r, rl)) always = 1;
            runs[n_runs++] = (Item){r, rl, (int32_t)id};
        }
        if (always) t->always_ids[t->n_always++] = (int32_t)id;
    }
    ok = ok && map_build(&t->by_prefix, prefixes, n_prefixes) && map_build(&t->by_run, runs, n_runs);
    ok = ok && map_build(&t->by_text, texts, n_texts) && item_tables(t);
    free(texts); free(prefixes); free(runs); free(cuts);
    if (!ok) { espalier_keys_tables_free(t); return NULL; }
    return t;
}

/* ---- the API (ctypes) ------------------------------------------------------------------------ */

int64_t espalier_keys_abi(void) { return ESP_KEYS_ABI; }

EspKeys *espalier_keys_new(const EspKeysTables *tables) {
    EspKeys *k = calloc(1, sizeof(EspKeys));
    if (k) {
        k->tables = tables;
        k->expect_value = 1;
        k->frame_at = FRAME_READING;
    }
    return k;
}

void espalier_keys_frames_free(EspFrames *f) {
    if (!f) return;
    free(f->next); free(f->found); free(f);
}

/* A scan automaton (EspFrames), copied from the caller's arrays: byte_class (256 bytes, each
 * < n_classes), next (n_states * n_classes states), found (n_states), rearm (-1 or a state).
 * NULL when out of memory or inconsistent. */
EspFrames *espalier_keys_frames_new(int32_t n_states, int32_t n_classes,
                                    const uint8_t *byte_class, const int32_t *next,
                                    const uint8_t *found, int32_t rearm) {
    if (n_states < 1 || n_classes < 1 || n_classes > 256 || rearm < -1 || rearm >= n_states)
        return NULL;
    for (int b = 0; b < 256; b++)
        if (byte_class[b] >= n_classes) return NULL;
    int64_t cells = (int64_t)n_states * n_classes;
    for (int64_t i = 0; i < cells; i++)
        if (next[i] < 0 || next[i] >= n_states) return NULL;
    EspFrames *f = calloc(1, sizeof(EspFrames));
    if (!f) return NULL;
    f->n_states = n_states;
    f->n_classes = n_classes;
    f->rearm = rearm;
    memcpy(f->byte_class, byte_class, 256);
    f->next = malloc((size_t)cells * sizeof(int32_t));
    f->found = malloc((size_t)n_states);
    if (!f->next || !f->found) { espalier_keys_frames_free(f); return NULL; }
    memcpy(f->next, next, (size_t)cells * sizeof(int32_t));
    memcpy(f->found, found, (size_t)n_states);
    return f;
}

/* Read only the JSON values that frames finds (see the top); a fresh tracker's setting. */
void espalier_keys_set_frames(EspKeys *k, const EspFrames *frames) {
    k->frames = frames;
    k->frame_at = 0;
}

static void *dup_array(const void *src, int64_t n, size_t size, int64_t *cap) {
    *cap = n;
    if (n == 0) return NULL;
    void *p = malloc((size_t)n * size);
    if (p) memcpy(p, src, (size_t)n * size);
    return p;
}

void espalier_keys_places_free(EspPlaces *p) {
    if (!p) return;
    free(p->unique); free(p->key_start); free(p->key_count); free(p->key_default);
    free(p->prefix_start); free(p->prefix_count); free(p->item_default); free(p->item_chars);
    free(p->word_start); free(p->word_count); free(p->word_off); free(p->word_len); free(p->words);
    free(p->key_target);
    free(p->prefix_target); free(p->name_off); free(p->name_len); free(p->names);
    free(p);
}

/* A places automaton (EspPlaces), copied from the caller's arrays: per state (n) unique, key
 * start/count/default, prefix start/count, item default, item chars, word start/count; per name
 * (m) its offset in names, length and target; per prefix place (q) its target; per word (w)
 * its offset in words and length. NULL when out of memory. */
EspPlaces *espalier_keys_places_new(int32_t n, const uint8_t *unique, const int32_t *per_state,
                                    int32_t m, const int64_t *name_off, const int32_t *name_len,
                                    const int32_t *key_target, const uint8_t *names,
                                    int64_t names_len, int32_t q, const int32_t *prefix_target,
                                    int32_t w, const int64_t *word_off, const int32_t *word_len,
                                    const uint8_t *words, int64_t words_len) {
    EspPlaces *p = calloc(1, sizeof(EspPlaces));
    if (!p) return NULL;
    int64_t cap;
    p->n_states = n;
    p->unique = dup_array(unique, n, 1, &cap);
    int32_t **cols[9] = {&p->key_start,    &p->key_count,    &p->key_default,
                         &p->prefix_start, &p->prefix_count, &p->item_default,
                         &p->item_chars,   &p->word_start,   &p->word_count};
    int ok = p->unique != NULL;
    for (int c = 0; c < 9; c++) {
        *cols[c] = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
        ok = ok && *cols[c];
        for (int32_t s = 0; ok && s < n; s++) (*cols[c])[s] = per_state[(int64_t)s * 9 + c];
    }
    p->name_off = malloc((size_t)(m ? m : 1) * sizeof(int64_t));
    p->name_len = malloc((size_t)(m ? m : 1) * sizeof(int32_t));
    p->key_target = malloc((size_t)(m ? m : 1) * sizeof(int32_t));
    p->names = malloc((size_t)(names_len ? names_len : 1));
    p->prefix_target = malloc((size_t)(q ? q : 1) * sizeof(int32_t));
    p->word_off = malloc((size_t)(w ? w : 1) * sizeof(int64_t));
    p->word_len = malloc((size_t)(w ? w : 1) * sizeof(int32_t));
    p->words = malloc((size_t)(words_len ? words_len : 1));
    ok = ok && p->name_off && p->name_len && p->key_target && p->names && p->prefix_target;
    ok = ok && p->word_off && p->word_len && p->words;
    if (!ok) { espalier_keys_places_free(p); return NULL; }
    if (m) {
        memcpy(p->name_off, name_off, (size_t)m * sizeof(int64_t));
        memcpy(p->name_len, name_len, (size_t)m * sizeof(int32_t));
        memcpy(p->key_target, key_target, (size_t)m * sizeof(int32_t));
    }
    if (names_len) memcpy(p->names, names, (size_t)names_len);
    if (q) memcpy(p->prefix_target, prefix_target, (size_t)q * sizeof(int32_t));
    if (w) {
        memcpy(p->word_off, word_off, (size_t)w * sizeof(int64_t));
        memcpy(p->word_len, word_len, (size_t)w * sizeof(int32_t));
    }
    if (words_len) memcpy(p->words, words, (size_t)words_len);
    return p;
}

/* Follow places (NULL: keys only) from now on; call on a fresh or reset tracker. */
void espalier_keys_set_places(EspKeys *k, const EspPlaces *places) { k->places = places; }

void espalier_keys_free(EspKeys *k) {
    if (!k) return;
    free(k->stack); free(k->entries); free(k->bytes); free(k->undo); free(k->marks); free(k->found);
    free(k->saved); free(k->taken);
    free(k);
}


/* An independent copy (with its rollback history); NULL when out of memory. */
EspKeys *espalier_keys_fork(const EspKeys *k) {
    EspKeys *c = calloc(1, sizeof(EspKeys));
    if (!c) return NULL;
    *c = *k;
    int64_t cap;
    c->stack = dup_array(k->stack, k->stack_cap, sizeof(Frame), &cap);
    c->entries = dup_array(k->entries, k->n_entries, sizeof(KeyEntry), &cap);
    c->entries_cap = (int32_t)cap;
    c->bytes = dup_array(k->bytes, k->n_bytes, 1, &cap);
    c->bytes_cap = (uint32_t)cap;
    c->undo = dup_array(k->undo, k->n_undo, sizeof(Undo), &c->undo_cap);
    c->marks = dup_array(k->marks, k->n_marks, sizeof(Mark), &c->marks_cap);
    c->found = NULL;
    c->found_cap = 0;
    c->taken = NULL;
    c->taken_cap = 0;
    c->saved = NULL;
    c->saved_cap = 0;
    if ((k->stack_cap && !c->stack) || (k->n_entries && !c->entries) || (k->n_bytes && !c->bytes) ||
        (k->n_undo && !c->undo) || (k->n_marks && !c->marks)) {
        espalier_keys_free(c);
        return NULL;
    }
    return c;
}

void espalier_keys_reset(EspKeys *k) {
    k->in_key = k->in_value = k->esc_len = k->high = k->item = k->lit_need = 0;
    k->item_off = 0;
    k->expect_value = 1;
    k->depth = k->n_entries = 0;
    k->n_bytes = k->key_off = 0;
    k->n_undo = k->n_marks = 0;
    k->frame_at = k->frames ? 0 : FRAME_READING;
}

int64_t espalier_keys_accepted(const EspKeys *k) { return k->n_marks; }

/* What the last refused advance would have completed: REFUSED_KEY, REFUSED_ITEM, or 0 (none yet,
 * or a needless escape). */
int32_t espalier_keys_refused(const EspKeys *k) { return k->refused; }

/* 1 accepted, 0 it completes a duplicate key or item (state unchanged), -1 out of memory. strict=0:
 * a needless escape in a key goes through (a duplicate key or item never does). */
int32_t espalier_keys_accept(EspKeys *k, int64_t token, int32_t strict) {
    return advance(k, token, strict);
}

/* Accept tokens in order up to the first duplicate: how many were accepted (-1: out of memory,
 * nothing accepted). */
int64_t espalier_keys_accept_tokens(EspKeys *k, const int32_t *tokens, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int r = advance(k, tokens[i], 1);
        if (r < 0) { rollback(k, i); return -1; }
        if (r == 0) return i;
    }
    return n;
}

void espalier_keys_rollback(EspKeys *k, int64_t n) { rollback(k, n); }

/* How many of tokens espalier_keys_accept_tokens would accept, the state left as it was (-1: out
 * of memory): a closing check's tracker part in one call. */
int64_t espalier_keys_clean_prefix(EspKeys *k, const int32_t *tokens, int64_t n) {
    int64_t done = espalier_keys_accept_tokens(k, tokens, n);
    if (done > 0) rollback(k, done);
    return done;
}

int32_t espalier_keys_filter_row(EspKeys *k, uint32_t *row, int64_t words) {
    return filter_row(k, row, words);
}

typedef struct {
    EspKeys **keys;
    uint32_t **rows;
    int64_t n, words, first, stride;
    int8_t *results;
} RowsJob;

static void *rows_job(void *arg) {
    RowsJob *job = arg;
    for (int64_t j = job->first; j < job->n; j += job->stride)
        job->results[j] = (int8_t)filter_row(job->keys[j], job->rows[j], job->words);
    return NULL;
}

#define MAX_THREADS 64
#define ROWS_PER_THREAD 64 /* a thread's start costs tens of rows' filters (bench/keys.py) */

/* filter_row for n trackers (all distinct) and rows at once, on up to `threads` threads (one
 * per ROWS_PER_THREAD rows at most); results[j]: filter_row's answer for row j. */
void espalier_keys_filter_rows(EspKeys **keys, uint32_t **rows, int64_t n, int64_t words,
                               int64_t threads, int8_t *results) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n / ROWS_PER_THREAD) threads = n / ROWS_PER_THREAD;
    if (threads < 1) threads = 1;
    RowsJob jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 0; i < threads; i++) {
        jobs[i] = (RowsJob){keys, rows, n, words, i, threads, results};
        if (i > 0) started[i] = pthread_create(&ids[i], NULL, rows_job, &jobs[i]) == 0;
    }
    rows_job(&jobs[0]);
    for (int64_t i = 1; i < threads; i++) {
        if (started[i]) pthread_join(ids[i], NULL);
        else rows_job(&jobs[i]); /* no thread: do its share here */
    }
}

static void invalidate(int64_t node, int64_t parent, uint32_t *rows, int64_t words, uint8_t *valid,
                       uint8_t *filled, uint8_t *terminated) {
    valid[node] = filled[node] = terminated[node] = 0;
    memcpy(rows + node * words, rows + parent * words, (size_t)words * 4); /* never all-zero */
}

/* A draft tree's rows, filled by the backend's walk from k's state, filtered node by node
 * (the twin: tests/fixtures/keys_twin.py, filter_tree): a valid node whose token completes a
 * duplicate from its parent's state, or that its parent's filtered row forbids, becomes invalid
 * with its subtree (row copied from the parent: never all-zero); a filled row loses its
 * duplicate completions (never emptied). The tree: first_child, next_sibling (-1: none; node 0
 * the root), visited depth first, k advancing and rolling back along the path; it ends as it
 * began. 0, or -1 out of memory. */
int32_t espalier_keys_filter_tree(EspKeys *k, int64_t n, const int64_t *tokens,
                                  const int64_t *first_child, const int64_t *next_sibling,
                                  uint32_t *rows, int64_t words, uint8_t *valid, uint8_t *filled,
                                  uint8_t *terminated) {
    if (n <= 0) return 0;
    int64_t *buf = malloc((size_t)(3 * n) * sizeof(int64_t));
    int8_t *live = calloc((size_t)n, 1);
    if (!buf || !live) { free(buf); free(live); return -1; }
    int64_t *parent = buf, *stack = buf + n, *path = buf + 2 * n;
    int64_t depth = 0, top = 0; /* path[0..depth): the live nodes k has accepted */
    int32_t rc = 0;
    live[0] = 1;
    if (filled[0] && filter_row(k, rows, words) < 0) rc = -1;
    if (first_child[0] >= 0) { parent[first_child[0]] = 0; stack[top++] = first_child[0]; }
    while (top && rc == 0) {
        int64_t v = stack[--top], p = parent[v];
        if (next_sibling[v] >= 0) { parent[next_sibling[v]] = p; stack[top++] = next_sibling[v]; }
        if (first_child[v] >= 0) { parent[first_child[v]] = v; stack[top++] = first_child[v]; }
        if (!valid[v]) continue;
        if (!live[p]) { invalidate(v, p, rows, words, valid, filled, terminated); continue; }
        while (depth && path[depth - 1] != p) { rollback(k, 1); depth--; }
        int r = allowed(rows + p * words, words, tokens[v]) ? advance(k, tokens[v], 1) : 0;
        if (r < 0) { rc = -1; break; }
        if (r == 0) { invalidate(v, p, rows, words, valid, filled, terminated); continue; }
        live[v] = 1;
        path[depth++] = v;
        if (filled[v] && filter_row(k, rows + v * words, words) < 0) rc = -1;
    }
    rollback(k, depth);
    free(live);
    free(buf);
    return rc;
}

/* The state for tests (parsed by tests/fixtures/keys_twin.py): the bytes it takes, written
 * into out when cap allows. Frames bottom first: kind, expect_key, key count, keys (u32 length,
 * bytes); then in_key, the key's bytes (u32 length, bytes), in_value, esc_len, esc[4], high. */
int64_t espalier_keys_export(const EspKeys *k, uint8_t *out, int64_t cap) {
    int64_t at = 0;
#define PUT(src, len) do { if (at + (int64_t)(len) <= cap) memcpy(out + at, (src), (len)); at += (len); } while (0)
    PUT(&k->depth, 4);
    for (int32_t d = 0; d < k->depth; d++) {
        const Frame *f = &k->stack[d];
        uint32_t count = 0;
        for (int32_t e = f->keys; e >= 0; e = k->entries[e].prev) count++;
        PUT(&f->kind, 4);
        PUT(&f->expect_key, 4);
        PUT(&count, 4);
        for (int32_t e = f->keys; e >= 0; e = k->entries[e].prev) {
            PUT(&k->entries[e].len, 4);
            PUT(k->bytes + k->entries[e].off, k->entries[e].len);
        }
    }
    uint32_t key_len = k->in_key ? k->n_bytes - k->key_off : 0;
    PUT(&k->in_key, 4);
    PUT(&key_len, 4);
    if (key_len) PUT(k->bytes + k->key_off, key_len);
    PUT(&k->in_value, 4);
    PUT(&k->esc_len, 4);
    PUT(k->esc, 4);
    PUT(&k->high, 4);
    /* then per frame: loc, index, vloc, item count, items (u32 length, bytes); then
     * expect_value, item, lit_need, the item's bytes so far (u32 length, bytes) */
    for (int32_t d = 0; d < k->depth; d++) {
        const Frame *f = &k->stack[d];
        uint32_t count = 0;
        for (int32_t e = f->items; e >= 0; e = k->entries[e].prev) count++;
        PUT(&f->loc, 4);
        PUT(&f->index, 4);
        PUT(&f->vloc, 4);
        PUT(&count, 4);
        for (int32_t e = f->items; e >= 0; e = k->entries[e].prev) {
            PUT(&k->entries[e].len, 4);
            PUT(k->bytes + k->entries[e].off, k->entries[e].len);
        }
    }
    uint32_t item_len = k->item ? k->n_bytes - k->item_off : 0;
    PUT(&k->expect_value, 4);
    PUT(&k->item, 4);
    PUT(&k->lit_need, 4);
    PUT(&item_len, 4);
    if (item_len) PUT(k->bytes + k->item_off, item_len);
#undef PUT
    return at;
}
