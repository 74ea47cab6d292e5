"""tokenizer_config.py N_RANKS OUT - write tokenizer_config.json in the layout
of Kimi's (Hugging Face, tokenization_kimi.TikTokenTokenizer): 256 special
ids right after the N_RANKS ranks; the named ones sit at Kimi-K2's offsets
(kda-model-spec.md section 7: [BOS] = N, [EOS] = N+1, <|im_end|> = N+2, ...,
[UNK] = N+254, [PAD] = N+255), the others are <|reserved_token_ID|>.
"kdaserve_pattern": "cl100k" tells kdaserve's loader which pre-tokeniser the
ranks belong to (Kimi's own files have no such key and get the Kimi one).
"""
import json
import sys

NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
         6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
         11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
         13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
         17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}


def config(n):
    dec = {}
    for off in range(256):
        name = NAMED.get(off, f"<|reserved_token_{n + off}|>")
        dec[str(n + off)] = {"content": name, "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": True}
    return {
        "added_tokens_decoder": dec,
        "additional_special_tokens": [v for k, v in sorted(NAMED.items()) if 2 <= k < 254],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
        "kdaserve_pattern": "cl100k",
    }


if __name__ == "__main__":
    n, out = int(sys.argv[1]), sys.argv[2]
    with open(out, "w") as f:
        json.dump(config(n), f, indent=2)
        f.write("\n")
    print(f"tokenizer_config: wrote {out} (specials {n}..{n + 255})", file=sys.stderr)
