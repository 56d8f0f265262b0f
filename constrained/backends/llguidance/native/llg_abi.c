/* llguidance's C structs, filled on the C side of the ABI (llg_abi.h), and the load-time probe
 * of the library's layout. The llguidance functions come in as pointers resolved by the caller
 * from the library Python already loaded; this file links against nothing but libc. */
#include <string.h>

#include "llg_abi.h"

enum {
    LAYOUT_OK = 0,
    LAYOUT_TOKENIZER_FIELD = 1,
    LAYOUT_LOG_FIELDS = 2,
    LAYOUT_FLAG_FIELDS = 3,
    LAYOUT_LIMITS = 4,
    LAYOUT_LARGER = 5,
};

/* The llguidance series llg_abi.h describes ("1.9"). */
const char *espalier_llg_series(void) { return ESP_LLG_SERIES; }

/* Bytes of an LlgConstraintInit as llg_abi.h declares it. */
size_t espalier_llg_constraint_init_size(void) { return sizeof(EspLlgConstraintInit); }

/* Whether the library's llg_constraint_init_set_defaults writes the struct llg_abi.h declares:
 * the tokenizer pointer, log levels and flags at their offsets, non-zero default limits, and
 * nothing past its end. LAYOUT_OK, else the first check that failed. */
int32_t espalier_llg_check_layout(EspLlgSetDefaultsFn set_defaults) {
    EspLlgConstraintInit probe[2]; /* the second one catches writes past the declared struct */
    unsigned char *bytes = (unsigned char *)probe;
    memset(probe, 0xA5, sizeof probe);
    set_defaults(&probe[0], probe);
    const EspLlgConstraintInit *init = &probe[0];
    if (init->tokenizer != (const void *)probe) return LAYOUT_TOKENIZER_FIELD;
    if (init->log_buffer_level != 0 || init->log_stderr_level != 1) return LAYOUT_LOG_FIELDS;
    if (init->ff_tokens_ok || init->backtrack_ok) return LAYOUT_FLAG_FIELDS;
    const EspLlgParserLimits *limits = &init->limits;
    const size_t sentinel = (size_t)0xA5A5A5A5A5A5A5A5ull;
    if (limits->max_items_in_row == 0 || limits->max_items_in_row == sentinel ||
        limits->max_grammar_size == 0 || limits->max_grammar_size == sentinel)
        return LAYOUT_LIMITS;
    for (size_t i = sizeof(EspLlgConstraintInit); i < sizeof probe; i++)
        if (bytes[i] != 0xA5) return LAYOUT_LARGER;
    return LAYOUT_OK;
}

/* llguidance's defaults with stderr logging off (grammar warnings stay in the Python side's
 * errors) and `step_max_items` Earley items a mask into `init`
 * (espalier_llg_constraint_init_size() bytes). */
void espalier_llg_constraint_init(EspLlgSetDefaultsFn set_defaults, EspLlgConstraintInit *init,
                                  const void *tokenizer, size_t step_max_items) {
    memset(init, 0, sizeof *init);
    set_defaults(init, tokenizer);
    init->log_stderr_level = 0;
    init->limits.step_max_items = step_max_items;
}

/* An LlgTokenizer from token bytes (special ids already marked), the primary stop id and
 * `n_extra` more, and a tokenize callback that wants valid UTF-8; NULL with `err` set on
 * failure. */
void *espalier_llg_new_tokenizer(EspLlgNewTokenizerFn new_tokenizer, uint32_t vocab_size,
                                 const uint32_t *token_lens, const uint8_t *token_bytes,
                                 EspLlgTokenizeFn tokenize_fn, const void *tokenize_user,
                                 const uint32_t *stops, uint32_t n_stops, char *err,
                                 size_t err_len) {
    EspLlgTokenizerInit init;
    memset(&init, 0, sizeof init);
    init.struct_size = sizeof init;
    init.vocab_size = vocab_size;
    init.tok_eos = stops[0];
    init.token_lens = token_lens;
    init.token_bytes = token_bytes;
    init.tokenize_assumes_string = true;
    init.tokenize_fn = tokenize_fn;
    init.tokenize_user_data = tokenize_user;
    init.tok_eos_extra = n_stops > 1 ? stops + 1 : NULL;
    init.tok_eos_extra_count = n_stops > 1 ? n_stops - 1 : 0;
    return new_tokenizer(&init, err, err_len);
}
