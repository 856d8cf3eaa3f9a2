#!/usr/bin/env python3
"""Write a tiny random-weight llama-architecture GGUF model, byte-identical on every run.

Runs inside the sid chroot made by scripts/real-engine.sh (python3-gguf, python3-numpy).
Usage: gen-gguf.py OUT.gguf

The model: n_embd 128, 4 layers, 4 heads / 2 KV heads, n_ff 384, F16 weights (F32 norms).
Vocabulary: SentencePiece-style ("llama" tokenizer) with <unk> <s> </s>, the ChatML markers,
byte fallback <0x00>..<0xFF>, printable ASCII and a few merged pieces. Two weight choices keep
temperature-0 output varied and free of early stops:
  - embeddings and the output matrix are scaled up, so the next token depends strongly on the
    current one and on the context (not one token forever);
  - residual dimension 0 carries a constant nobody writes to, and the output rows of the control
    and byte tokens are strongly negative along it, so generation does not end at a random </s>
    and the text is printable ASCII.
"""
import sys

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType, LlamaFileType, TokenType

N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF, N_CTX = 128, 4, 4, 2, 384, 2048
SEED = 20261201

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vocab():
    toks, scores, types = [], [], []

    def add(t, s, ty):
        toks.append(t)
        scores.append(s)
        types.append(ty)

    add("<unk>", 0.0, TokenType.UNKNOWN)
    add("<s>", 0.0, TokenType.CONTROL)
    add("</s>", 0.0, TokenType.CONTROL)
    add("<|im_start|>", 0.0, TokenType.CONTROL)
    add("<|im_end|>", 0.0, TokenType.CONTROL)
    for b in range(256):
        add("<0x%02X>" % b, 0.0, TokenType.BYTE)
    add("\u2581", -1.0, TokenType.NORMAL)
    for c in range(33, 127):
        add(chr(c), -2.0, TokenType.NORMAL)
    merges = ["\u2581t", "\u2581a", "he", "in", "th", "er", "on", "\u2581the", "an", "re",
              "\u2581s", "\u2581o", "\u2581w", "nd", "at", "ou", "\u2581c", "en", "is", "ing",
              "\u2581one", "\u2581two", "\u2581three", "\u2581four", "\u2581five", "ed", "or"]
    for i, m in enumerate(merges):
        add(m, -0.5 - 0.01 * i, TokenType.NORMAL)
    return toks, scores, types


def main(out):
    rng = np.random.default_rng(SEED)
    toks, scores, types = vocab()
    n_vocab = len(toks)
    # Never generated: control tokens (no early stop) and byte tokens (output stays printable
    # ASCII, so streamed and whole responses split into the same characters).
    quiet = [i for i, t in enumerate(types) if t != TokenType.NORMAL]

    w = GGUFWriter(out, "llama")
    w.add_name("detproxy-tiny-llama")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    def mat(rows, cols, std):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float16)

    kv = N_EMBD // N_HEAD * N_HEAD_KV
    emb = (rng.standard_normal((n_vocab, N_EMBD)) * 1.0).astype(np.float32)
    emb[:, 0] = 4.0  # the constant residual dimension
    w.add_tensor("token_embd.weight", emb.astype(np.float16))
    for i in range(N_LAYER):
        p = "blk.%d." % i
        w.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", mat(N_EMBD, N_EMBD, 0.25))
        w.add_tensor(p + "attn_k.weight", mat(kv, N_EMBD, 0.25))
        w.add_tensor(p + "attn_v.weight", mat(kv, N_EMBD, 0.15))
        o = mat(N_EMBD, N_EMBD, 0.08)
        o[0, :] = 0  # nothing writes to dimension 0
        w.add_tensor(p + "attn_output.weight", o)
        w.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", mat(N_FF, N_EMBD, 0.15))
        w.add_tensor(p + "ffn_up.weight", mat(N_FF, N_EMBD, 0.15))
        d = mat(N_EMBD, N_FF, 0.08)
        d[0, :] = 0
        w.add_tensor(p + "ffn_down.weight", d)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    outw = (rng.standard_normal((n_vocab, N_EMBD)) * 0.6).astype(np.float32)
    outw[:, 0] = 0
    outw[quiet, :] = 0
    outw[quiet, 0] = -8.0
    w.add_tensor("output.weight", outw.astype(np.float16))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: gen-gguf.py OUT.gguf")
    main(sys.argv[1])
