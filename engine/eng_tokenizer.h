/*
 * eng_tokenizer.h - engine-internal constructor of the tokenizer behind the
 * eng_tok_* calls of eng.h.
 *
 * Until a real vocabulary lands (tiktoken issue), every model gets the
 * byte-level tokenizer: ids 0..255 are the bytes themselves; ids 256.. are
 * named specials "<|bos|>", "<|eos|>", then "<|special_N|>" up to vocab_size.
 * A config's bos/eos ids, when set and inside the vocabulary, name the bos
 * and eos tokens; otherwise 256 and 257 are used when vocab_size allows.
 */
#ifndef ENG_TOKENIZER_H
#define ENG_TOKENIZER_H

#include "eng.h"
#include "eng_config.h"

kds_status eng__tok_create_bytes(const eng_config *c, eng_tokenizer **out, kds_err *err);
void eng__tok_free(eng_tokenizer *t);

#endif
