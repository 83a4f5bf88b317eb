"""A tiny Llama written as a real GGUF file (llama.cpp's layout, as its convert_hf_to_gguf.py writes it) with the
tiny tokenizer embedded, so that every script can train from a .gguf path in seconds (tests/test_gguf.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

# llama.cpp stores each matrix in Q8_0 blocks (32 values, one scale): loading dequantises them, as for any
# quantized file. The norms stay F32, as llama.cpp keeps them.
QUANT = "Q8_0"
# The tiny tokenizer's 648 tokens and <|endoftext|>: transformers rebuilds a byte-level GGUF vocabulary with
# GPT2Tokenizer, which adds that token when the file lacks it; a file that has it keeps 649 tokens.
EXTRA_TOKEN = "<|endoftext|>"
VOCAB = 649
_CONTROL, _USER_DEFINED, _NORMAL = 3, 4, 1  # llama.cpp's token types


def _rope_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a q / k projection's rows (rotary pairs interleaved); transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokens(tokenizer_dir: str) -> tuple[list[str], list[int], list[str]]:
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    vocab = dict(spec["model"]["vocab"])
    added = {t["id"]: t for t in spec["added_tokens"]}
    vocab.update({t["content"]: i for i, t in added.items()})
    vocab[EXTRA_TOKEN] = len(vocab)
    tokens = sorted(vocab, key=vocab.get)
    kinds = [
        _CONTROL
        if (i in added and added[i]["special"]) or t == EXTRA_TOKEN
        else _USER_DEFINED
        if i in added
        else _NORMAL
        for i, t in enumerate(tokens)
    ]
    return tokens, kinds, [" ".join(pair) for pair in spec["model"]["merges"]]


def write_tiny_gguf(path, model: torch.nn.Module, tokenizer_dir: str, *, shape_keys: bool = True) -> None:
    """``model`` (a LlamaForCausalLM, untied head) and the tokenizer in ``tokenizer_dir`` as GGUF file ``path``.
    ``shape_keys=False`` leaves out the keys that give the model's shape (a file with incomplete metadata)."""
    import gguf

    c = model.config
    quant = gguf.GGMLQuantizationType[QUANT]
    w = gguf.GGUFWriter(str(path), "llama")
    if shape_keys:
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_block_count(c.num_hidden_layers)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_vocab_size(c.vocab_size)
    tokens, kinds, merges = _tokens(tokenizer_dir)
    assert len(tokens) == c.vocab_size, (len(tokens), c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<s>"))
    w.add_eos_token_id(tokens.index("</s>"))
    w.add_pad_token_id(tokens.index("<pad>"))
    w.add_unk_token_id(tokens.index("<unk>"))
    with open(os.path.join(tokenizer_dir, "chat_template.jinja"), encoding="utf-8") as f:
        w.add_chat_template(f.read())

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def put(name: str, array: np.ndarray) -> None:
        if array.ndim == 2:
            blocks = gguf.quants.quantize(array, quant)
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=quant)
        else:
            w.add_tensor(name, array)

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    put("output.weight", state["lm_head.weight"])
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(c.num_hidden_layers):
        ours = f"model.layers.{i}."
        for theirs, name in names.items():
            put(f"blk.{i}.{theirs}.weight", state[f"{ours}{name}.weight"])
        put(f"blk.{i}.attn_q.weight", _rope_order(state[f"{ours}self_attn.q_proj.weight"], c.num_attention_heads))
        put(f"blk.{i}.attn_k.weight", _rope_order(state[f"{ours}self_attn.k_proj.weight"], c.num_key_value_heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
