/* Structured outputs: set every token a row's grammar forbids to -inf, in place.
 * logits: n rows of `vocab` floats, `stride` floats apart; masks: n rows of `words` 32-bit words, bit t of
 * word w allowing token 32 * w + t (llguidance's layout). A word of all ones is skipped: inside a JSON
 * string most of the vocabulary is allowed, between keys almost none is, and either way a row costs about
 * one pass over its words. */
#include <math.h>
#include <stdint.h>

void apply_bitmask(float *logits, long stride, const uint32_t *masks, int words, int n, int vocab) {
    for (int r = 0; r < n; r++) {
        float *row = logits + (long)r * stride;
        const uint32_t *m = masks + (long)r * words;
        for (int w = 0; w < words; w++) {
            uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            int base = w * 32;
            int end = vocab - base < 32 ? vocab - base : 32;
            if (bits == 0) {  /* nothing allowed here: a plain store loop, which the compiler vectorizes */
                for (int b = 0; b < end; b++) row[base + b] = -INFINITY;
                continue;
            }
            for (int b = 0; b < end; b++)
                if (!((bits >> b) & 1u)) row[base + b] = -INFINITY;
        }
    }
}
