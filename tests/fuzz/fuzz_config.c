/*
 * fuzz_config.c - libFuzzer target: config.json (eng_config_parse,
 * engine/eng_config.h). The input is the file's text.
 *
 * Property: every config that parses is written back by eng_config_to_json
 * as a config that parses to the identical eng_config (memcmp: both start
 * zeroed, and eng_config_parse fills its own zeroed copy before handing it
 * out, so padding compares equal too), and that second text is a fixed
 * point. One field is exempt by design: has_vision says the checkpoint has
 * a vision tower, and a written config is a generated model's, which has
 * none (tests/test_k3_config.c, round_trip). The sizes derived from a parsed config (parameters, state)
 * must compute without overflow (UBSan watches).
 */
#include "fuzz_util.h"

static void parse_or_die(const char *text, size_t n, const char *what, eng_config *c) {
    kds_err e = {0};
    memset(c, 0, sizeof *c);
    if (eng_config_parse(text, n, what, c, &e) != KDS_OK)
        fz_fail("%s does not parse: %s\n--- text:\n%s", what, e.msg, text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    eng_config a, b, c;
    kds_err e = {0};
    memset(&a, 0, sizeof a);
    if (eng_config_parse((const char *)data, size, "config.json", &a, &e) != KDS_OK) {
        if (e.status == KDS_OK || !e.msg[0]) fz_fail("parse failed without a message");
        return 0;
    }
    /* one walk of the plan (K3's lists 140k tensors: the slowest part of a
     * run); tensor_count is the same walk */
    (void)eng_config_param_count(&a);
    (void)eng_config_state_size(&a);
    char *j1 = eng_config_to_json(&a);
    if (!j1) fz_fail("eng_config_to_json gave NULL");
    parse_or_die(j1, strlen(j1), "the written config", &b);
    b.has_vision = a.has_vision;
    if (memcmp(&a, &b, sizeof a) != 0) {
        /* name the first differing byte's offset for the report */
        const unsigned char *x = (const void *)&a, *y = (const void *)&b;
        size_t off = 0;
        while (off < sizeof a && x[off] == y[off]) off++;
        fz_fail("config changes when written and read back (first difference at byte %zu of "
                "eng_config)\n--- written:\n%s", off, j1);
    }
    char *j2 = eng_config_to_json(&b);
    if (!j2) fz_fail("eng_config_to_json gave NULL");
    if (strcmp(j1, j2) != 0) fz_fail("written config is not a fixed point:\n%s\n---\n%s", j1, j2);
    parse_or_die(j2, strlen(j2), "the rewritten config", &c);
    c.has_vision = a.has_vision;
    if (memcmp(&a, &c, sizeof a) != 0) fz_fail("the rewritten config reads differently");
    free(j1);
    free(j2);
    return 0;
}
