/* The part of llguidance's C ABI that espalier's native walk uses, for one llguidance series.
 *
 * llguidance's Python wheel ships its library (llguidance/_lib*.so, which exports the C API) but
 * not its header, so the two structs espalier fills are declared here, read from llguidance's
 * src/ffi.rs for the series ESP_LLG_SERIES. pyproject.toml pins llguidance to that series; at
 * load, constrained/backends/llguidance/native/capi.py checks the installed version against it and probes the
 * library's LlgConstraintInit (espalier_llg_check_layout) before any matcher is made.
 */
#ifndef ESPALIER_LLG_ABI_H
#define ESPALIER_LLG_ABI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ESP_LLG_SERIES "1.9"

typedef size_t (*EspLlgTokenizeFn)(const void *user, const uint8_t *bytes, size_t len,
                                   uint32_t *out, size_t cap);

/* LlgTokenizerInitV2: the library reads `struct_size` bytes of it (later fields default). */
typedef struct EspLlgTokenizerInit {
    size_t struct_size;
    uint32_t vocab_size;
    uint32_t tok_eos;
    const uint32_t *token_lens;
    const uint8_t *token_bytes;
    const char *tokenizer_json;
    bool tokenize_assumes_string;
    EspLlgTokenizeFn tokenize_fn;
    bool use_approximate_greedy_tokenize_fn;
    const void *tokenize_user_data;
    const char *const *slices;
    const uint32_t *tok_eos_extra;
    uint32_t tok_eos_extra_count;
} EspLlgTokenizerInit;

/* LlgParserLimits: zero fields take llguidance's defaults. */
typedef struct EspLlgParserLimits {
    size_t max_items_in_row;
    uint64_t initial_lexer_fuel;
    uint64_t step_lexer_fuel;
    size_t step_max_items;
    size_t max_lexer_states;
    size_t max_grammar_size;
    bool precompute_large_lexemes;
    bool verbose_errors;
} EspLlgParserLimits;

/* LlgConstraintInit: no size field, so espalier_llg_check_layout probes its size at load. */
typedef struct EspLlgConstraintInit {
    const void *tokenizer;
    uint32_t log_buffer_level;
    uint32_t log_stderr_level;
    bool ff_tokens_ok;
    bool backtrack_ok;
    EspLlgParserLimits limits;
} EspLlgConstraintInit;

typedef void *(*EspLlgNewTokenizerFn)(const EspLlgTokenizerInit *init, char *err, size_t err_len);
typedef void (*EspLlgSetDefaultsFn)(EspLlgConstraintInit *init, const void *tokenizer);

#endif
