"""Tiny random-weight models built with transformers, written as an HF directory and as GGUF.

The GGUF side follows llama.cpp's conventions on its own (tensor names, the
Q/K row permutation of llama, Gemma's norm weights stored as 1 + w), so that
runlm's GGUF loader is checked against an independent writer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n",
    "Un café, s'il vous plaît. Grüße aus München! 日本語のテキスト 🙂",
    "Numbers 0123456789 and punctuation: ;:,.!?()[]{}",
]
VOCAB = 384
# The shape every tiny text model shares: GQA (4 query heads, 2 KV heads), 16-wide heads.
TINY_DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def tiny_tokenizer(corpus: list[str] = CORPUS):
    """A byte-level BPE trained on a fixed corpus: deterministic, 384 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _write_hf_tokenizer(directory: Path, tok) -> None:
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": CHATML,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


# Gemma 4's control and chat tokens (as its tokenizer numbers the first five), then its turn, thinking and tool markers.
GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>", "<|channel>",
                   "<channel|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                   "<tool_response|>", '<|"|>']
GEMMA4_VOCAB = 640


def tiny_gemma4_tokenizer(corpus: list[str] = CORPUS):
    """A SentencePiece-style BPE shaped as Gemma 4's tokenizer.json: spaces become ▁ in the normalizer, the text splits
    only at runs of newlines, unknown bytes fall back to <0xNN> tokens. Padded with unused tokens to 640, as Gemma's
    vocabulary holds unused ones."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=GEMMA4_VOCAB, special_tokens=GEMMA4_SPECIALS + byte_tokens,
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([f"<unused{i}>" for i in range(GEMMA4_VOCAB - tok.get_vocab_size())])
    return tok


def _write_gemma4_tokenizer(directory: Path, tok, chat_template: str) -> None:
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
        "add_bos_token": True, "chat_template": chat_template, "tokenizer_class": "GemmaTokenizer",
        "extra_special_tokens": GEMMA4_SPECIALS[5:],
    }))


def _randomize(model: torch.nn.Module, seed: int, scale: float = 0.15) -> None:
    """Weights large enough that logits differ clearly between tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(scale * torch.randn(param.shape, generator=gen))


def _gguf_tokenizer(writer, tok) -> None:
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for text, idx in vocab.items():
        tokens[idx] = text
    model = json.loads(tok.to_str())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(
    path: Path,
    arch: str,
    state: dict,
    config,
    tok,
    extra_names: dict,
    permute_qk: bool,
    norm_plus_one: bool,
    quant: str | None = None,
) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    _gguf_tokenizer(writer, tok)
    names = {**LAYER_NAMES, **extra_names}
    for name, tensor in state.items():
        array = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            parts = name.split(".")
            out = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.weight"
        if permute_qk and out.endswith("attn_q.weight"):
            array = _llama_cpp_permute(array, config.num_attention_heads)
        if permute_qk and out.endswith("attn_k.weight"):
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        if norm_plus_one and "norm" in out:
            array = array + 1.0
        if quant is not None and array.ndim == 2 and "token_embd" not in out:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(out, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(out, np.ascontiguousarray(array, dtype=np.float32))
    yield_extra = getattr(config, "_gguf_extra", None)
    if yield_extra:
        yield_extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _finish(
    model, config, directory: Path, arch: str, extra_names: dict, permute_qk: bool, norm_plus_one: bool, gguf_extra=None
):
    directory.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    model.save_pretrained(str(directory / "hf"), safe_serialization=True)
    _write_hf_tokenizer(directory / "hf", tok)
    state = {k: v for k, v in model.state_dict().items() if "rotary" not in k}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config._gguf_extra = gguf_extra
    _write_gguf(directory / "model.gguf", arch, state, config, tok, extra_names, permute_qk, norm_plus_one)
    for quant in QUANTIZED_COPIES:  # the same model with its linear weights quantized, for the fast paths
        path = directory / f"model-{quant.lower()}.gguf"
        _write_gguf(path, arch, state, config, tok, extra_names, permute_qk, norm_plus_one, quant=quant)
    return model


QUANTIZED_COPIES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")


def build_llama(directory: Path, seed: int = 0):
    """LlamaForCausalLM with llama3 rope scaling on and an untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **TINY_DIMS,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    _randomize(model, seed)
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    factors = (base / model.model.rotary_emb.inv_freq.float()).numpy().astype(np.float32)

    def rope_freqs(writer):
        writer.add_rope_freq_base(10000.0)
        writer.add_tensor("rope_freqs.weight", factors)

    return _finish(model, config, directory, "llama", {"post_attention_layernorm": "ffn_norm"}, True, False, rope_freqs)


def build_qwen3(directory: Path, seed: int = 1, tied: bool = True):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **TINY_DIMS,
        num_hidden_layers=2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    _randomize(model, seed)

    def extra(writer):
        writer.add_rope_freq_base(1e6)

    return _finish(model, config, directory, "qwen3", {"post_attention_layernorm": "ffn_norm"}, False, False, extra)


GEMMA_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA_WINDOW = 6


def build_gemma3(directory: Path, seed: int = 2, head_dim: int = 16):
    """Gemma3ForCausalLM with a 6-token window, so short prompts cross it; linear rope scaling on global layers.
    `head_dim` 32 gives heads as wide as a q8_0 block (the q8_0 KV cache needs head_dim % 32 == 0)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **{**TINY_DIMS, "head_dim": head_dim},
        num_hidden_layers=len(GEMMA_LAYERS),
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=16,
        sliding_window=GEMMA_WINDOW,
        layer_types=GEMMA_LAYERS,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    _randomize(model, seed)

    def extra(writer):
        writer.add_rope_freq_base(1e6)
        writer.add_rope_freq_base_swa(1e4)
        writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
        writer.add_sliding_window(GEMMA_WINDOW)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in GEMMA_LAYERS])

    names = {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    return _finish(model, config, directory, "gemma3", names, False, True, extra)


ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def build_qwen3_embedding(directory: Path, seed: int = 3):
    """A Qwen3-Embedding-style sentence-transformers directory, laid out as that model ships: a Qwen3Model
    (no LM head, no `model.` prefix), a tokenizer whose post-processor appends <|endoftext|>, and
    modules.json naming last-token pooling (legacy `pooling_mode_*` keys) then Normalize."""
    from tokenizers import processors
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(**TINY_DIMS, num_hidden_layers=2, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = Qwen3Model(config).eval()
    _randomize(model, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    tok = tiny_tokenizer()
    end = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1", special_tokens=[("<|endoftext|>", end)]
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "padding_side": "left", "add_bos_token": False,
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    (directory / "modules.json").write_text(json.dumps(ST_MODULES))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config.hidden_size, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True,
    }))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    return model


def build_qwen3_reranker(directory: Path, seed: int = 4):
    """A Qwen3-Reranker-style HF directory: a plain Qwen3 causal LM (the reranker's weights are one), whose
    vocabulary has "yes" and "no" tokens, with room for the reranker's long prompt. Name `directory` with
    "rerank" in it, as the real model's name has, for the server to find it a reranker."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**TINY_DIMS, "max_position_embeddings": 2048}, num_hidden_layers=2, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    _randomize(model, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    _write_hf_tokenizer(directory, tiny_tokenizer([*CORPUS, "yes\nno\n" * 16]))
    return model
