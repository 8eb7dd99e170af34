"""Tiny random-weight models of each family, made with transformers and converted to GGUF by llama.cpp's own
`convert_hf_to_gguf.py` (the copy the llama-cpp-python sdist vendors, fetched from PyPI once and kept under
$RUNLM_HOME/test-references), so runlm reads each family as llama.cpp's converter writes it.

The converter identifies a byte-level BPE tokenizer by hashing how it splits a fixed text; the tiny tokenizer is no
released one, so it is told the GPT-2 pre-tokenizer the tiny tokenizer was trained with, and families whose
converter reads a SentencePiece model (Gemma 2, Phi-3) take that byte-level BPE instead. Everything else (tensor names,
Q/K row order, norm offsets, metadata keys) is the converter's own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

from reference.tiny import (
    GEMMA4_VOCAB,
    TINY_DIMS,
    _randomize,
    _write_gemma4_tokenizer,
    _write_hf_tokenizer,
    tiny_gemma4_tokenizer,
    tiny_tokenizer,
)
from runlm.catalog import runlm_home

LLAMA_CPP_PYTHON = "0.3.36"  # whose vendored llama.cpp converts the models
_VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
# What the tests take from the vendored llama.cpp: the converter, and Gemma 4's vocabulary with llama.cpp's own
# tokenizer cases for it, and its chat template.
GEMMA4_VOCAB_FILE = "models/ggml-vocab-gemma-4.gguf"
GEMMA4_TEMPLATE = "models/templates/google-gemma-4-31B-it.jinja"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", GEMMA4_VOCAB_FILE, GEMMA4_VOCAB_FILE + ".inp",
          GEMMA4_VOCAB_FILE + ".out", GEMMA4_TEMPLATE)

# Runs the converter with the tiny tokenizer's pre-tokenizer named (see the module docstring).
_RUN_CONVERTER = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
conversion.base.TextModel._set_vocab_sentencepiece = lambda self, *args, **kwargs: self._set_vocab_gpt2()
import conversion.phi
conversion.phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_dir() -> Path:
    """The parts of llama.cpp the tests use (_PARTS: its converter first), unpacked from the llama-cpp-python sdist
    (downloaded with pip the first time)."""
    target = runlm_home() / "test-references" / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if all((target / part).exists() for part in _PARTS):
        return target
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-I", "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", scratch,
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}"],
            check=True, cwd=scratch,
        )  # fmt: skip
        (sdist,) = Path(scratch).glob("*.tar.gz")
        unpacked = Path(scratch) / "unpacked"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers()
                       if m.name.startswith(tuple(_VENDOR + part for part in _PARTS)) and m.isfile()]
            for member in members:
                member.name = member.name[len(_VENDOR):]
            archive.extractall(unpacked, members=members, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() and not all((target / part).exists() for part in _PARTS):
            shutil.rmtree(target, ignore_errors=True)  # an older unpacking, without some part
        try:
            os.replace(unpacked, target)
        except OSError:  # another run put it there first
            pass
    return target


def convert(hf_dir: Path, out: Path, outtype: str = "f32", *options: str) -> Path:
    """hf_dir converted by llama.cpp's converter to `out` (f32, f16, bf16 or q8_0); `options`: more of its flags."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN_CONVERTER, str(converter_dir()), str(hf_dir), "--outfile", str(out),
         "--outtype", outtype, *options],
        capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-3000:]}")
    return out


# Rows 256 wide, so llama.cpp's K-quants (256-value blocks) apply as they do at full size.
DIMS = {**TINY_DIMS, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "num_hidden_layers": 4,
        "bos_token_id": 1, "eos_token_id": 2}


def _tiny(config_class: str, model_class: str, **extra):
    def make():
        import transformers

        params = {**DIMS, **extra}
        if "rope_theta" in params:  # transformers 5 spelling
            params["rope_parameters"] = {"rope_type": "default", "rope_theta": params.pop("rope_theta")}
        config = getattr(transformers, config_class)(**{k: v for k, v in params.items() if v is not None})
        return getattr(transformers, model_class)(config)

    return make


# family -> a tiny random model of it, each with what makes the family differ on (untied heads where released
# models tie them, to show an untied head is used).
FAMILIES = {
    "qwen2": _tiny("Qwen2Config", "Qwen2ForCausalLM", rms_norm_eps=1e-6, tie_word_embeddings=False,
                   rope_theta=1e6),
    # YaRN stretching a 64-position original context 4x
    "qwen2-yarn": _tiny("Qwen2Config", "Qwen2ForCausalLM", rms_norm_eps=1e-6, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                         "original_max_position_embeddings": 64}),
    "mistral": _tiny("MistralConfig", "MistralForCausalLM", rms_norm_eps=1e-5, tie_word_embeddings=False,
                     sliding_window=None, rope_theta=1e6),
    "granite": _tiny("GraniteConfig", "GraniteForCausalLM", head_dim=None, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                     attention_multiplier=0.015625, logits_scaling=8.0, rope_theta=1e4),
    "gemma2": _tiny("Gemma2Config", "Gemma2ForCausalLM", rms_norm_eps=1e-6, sliding_window=8,
                    query_pre_attn_scalar=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    hidden_activation="gelu_pytorch_tanh", pad_token_id=0, rope_theta=1e4),
    "olmo2": _tiny("Olmo2Config", "Olmo2ForCausalLM", head_dim=None, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   rope_theta=5e5),
    # partial RoPE (48 of 64 values) with LongRoPE's factors, at the context its short factors serve
    "phi3": _tiny("Phi3Config", "Phi3ForCausalLM", rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0,
                  original_max_position_embeddings=256, rope_parameters={
                      "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                      "original_max_position_embeddings": 256,
                      "short_factor": [1.0 + 0.05 * i for i in range(24)],
                      "long_factor": [1.0 + 0.5 * i for i in range(24)]}),
    "smollm3": _tiny("SmolLM3Config", "SmolLM3ForCausalLM", rms_norm_eps=1e-6, tie_word_embeddings=True,
                     rope_theta=5e6, pad_token_id=0),
    # YaRN over an original context of 8 positions, so the attention temperature steps up within the test's prompt
    "mistral3": _tiny("Ministral3Config", "Ministral3ForCausalLM", rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                       "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
    # Gemma 4's dense text model: sliding layers of 64-wide heads beside global ones of 128 (one KV head, keys as
    # values, a quarter of each head rotated), Gemma 4's own tokenizer and its chat template
    "gemma4": _tiny("Gemma4TextConfig", "Gemma4ForCausalLM", vocab_size=GEMMA4_VOCAB, bos_token_id=2, eos_token_id=1,
                    pad_token_id=0, rms_norm_eps=1e-6, sliding_window=8, final_logit_softcapping=30.0,
                    hidden_activation="gelu_pytorch_tanh", layer_types=["sliding_attention", "full_attention"] * 2,
                    global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True,
                    hidden_size_per_layer_input=0, tie_word_embeddings=True, rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1e6}}),
    # Gemma 4 E2B's kind: per-layer inputs, the last three layers reusing the keys and values of the last earlier
    # layer of their kind (one sliding, one global), with MLPs twice as wide; a window of 8 behind a 20-token prompt
    "gemma4-e2b": _tiny("Gemma4TextConfig", "Gemma4ForCausalLM", vocab_size=GEMMA4_VOCAB,
                        vocab_size_per_layer_input=GEMMA4_VOCAB, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                        rms_norm_eps=1e-6, sliding_window=8, final_logit_softcapping=30.0,
                        hidden_activation="gelu_pytorch_tanh", num_hidden_layers=6,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                        global_head_dim=128, hidden_size_per_layer_input=64, num_kv_shared_layers=3,
                        use_double_wide_mlp=True, tie_word_embeddings=True, rope_parameters={
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1e6}}),
}  # fmt: skip

# Mixture-of-experts families (tests/models/test_moe.py): 8 experts, 2 per token, expert rows 256 wide for the K-quants.
MOE_FAMILIES = {
    "qwen3moe": _tiny("Qwen3MoeConfig", "Qwen3MoeForCausalLM", rms_norm_eps=1e-6, tie_word_embeddings=False,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
                      rope_theta=1e6),
    # a shared expert beside the routed ones (its output gated by a sigmoid), Q/K/V biases, weights not renormalized
    "qwen2moe": _tiny("Qwen2MoeConfig", "Qwen2MoeForCausalLM", rms_norm_eps=1e-6, tie_word_embeddings=False,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[], rope_theta=1e6),
    # llama's architecture with experts (llama.cpp writes Mixtral so)
    "mixtral": _tiny("MixtralConfig", "MixtralForCausalLM", rms_norm_eps=1e-5, tie_word_embeddings=False,
                     num_local_experts=8, num_experts_per_tok=2, intermediate_size=256, sliding_window=None,
                     rope_theta=1e6),
    # sliding windows of 8 in every other layer, YaRN stretching a 64-position original context 4x. gpt-oss blends
    # YaRN over its exact correction range, llama.cpp over that range rounded out to whole dimensions (and with betas
    # 32 and 1 whatever the file says): this base puts the range's end just under 6 and its start below 0, where the
    # two agree.
    "gpt-oss": _tiny("GptOssConfig", "GptOssForCausalLM", rms_norm_eps=1e-5, tie_word_embeddings=False,
                     num_local_experts=8, num_experts_per_tok=2, intermediate_size=256, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"] * 2,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 2.38e5, "factor": 4.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}),
    # Gemma 4 26B-A4B's kind: experts beside each dense MLP, a router on the residual with its own scales
    "gemma4-26b": _tiny("Gemma4TextConfig", "Gemma4ForCausalLM", vocab_size=GEMMA4_VOCAB, bos_token_id=2,
                        eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6, sliding_window=8,
                        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                        layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=128,
                        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
                        tie_word_embeddings=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
                        moe_intermediate_size=256, rope_parameters={
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1e6}}),
}  # fmt: skip


# what each tiny model's GGUF says it is, and the runlm family that reads it, where those are not its name
ARCHITECTURES = {"mistral": "llama", "qwen2-yarn": "qwen2", "mixtral": "llama", "gemma4-e2b": "gemma4",
                 "gemma4-26b": "gemma4"}
RUNLM_FAMILIES = {"mistral": "llama32", "qwen2-yarn": "qwen2", "mixtral": "llama32", "gemma4-e2b": "gemma4",
                  "gemma4-26b": "gemma4"}


def transformers_logits(hf_dir: Path, ids: list[int]):
    """transformers' float32 logits [len(ids), vocab] (numpy) of the tiny model in `hf_dir`."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].numpy()


def build(family: str, directory: Path, seed: int = 7) -> Path:
    """The family's tiny model as an HF directory (directory / "hf") and its f32 GGUF (directory / "f32.gguf")."""
    directory.mkdir(parents=True, exist_ok=True)
    gguf = directory / "f32.gguf"
    if gguf.is_file():
        return gguf
    torch.manual_seed(seed)
    model = {**FAMILIES, **MOE_FAMILIES}[family]().eval()
    # Weights of 0.05: at 0.15 a 4-layer random model's top logits sit so close that the 8-bit rounding of
    # activations, which llama.cpp and runlm each do their own way, flips about one greedy step in ten.
    _randomize(model, seed, scale=0.05)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's scale of each block's output: not 1, so it shows
                buffer.fill_(0.5 + 0.25 * int(name.split(".")[2]))
        if family.startswith("gemma4"):
            # Gemma 4 does not scale its queries: q / k norm weights near 1 would give scores of up to the head
            # size, a softmax as sharp as argmax, where a float16 cache's rounding decides. Trained ones are smaller.
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.mul_(0.3)
    model.save_pretrained(str(directory / "hf"), safe_serialization=True)
    if family.startswith("gemma4"):
        template = (converter_dir() / GEMMA4_TEMPLATE).read_text(encoding="utf-8")
        _write_gemma4_tokenizer(directory / "hf", tiny_gemma4_tokenizer(), template)
    else:
        _write_hf_tokenizer(directory / "hf", tiny_tokenizer())
    return convert(directory / "hf", gguf)


def dequantized(f32_gguf: Path, quantized: Path) -> Path:
    """A copy of `f32_gguf` whose tensors hold `quantized`'s weights dequantized by the gguf package: the quantized
    file's own model in float32, the reference both runtimes' integer arithmetic approximates."""
    import gguf
    import numpy as np

    out = quantized.with_name(f"{quantized.stem}-dequantized.gguf")
    if out.is_file():
        return out
    source = {tensor.name: tensor for tensor in gguf.GGUFReader(quantized).tensors}
    scratch = out.with_suffix(".partial")
    shutil.copyfile(f32_gguf, scratch)
    target = gguf.GGUFReader(scratch, "r+")
    for tensor in target.tensors:
        weights = source[tensor.name]
        values = gguf.quants.dequantize(weights.data, weights.tensor_type)
        tensor.data[...] = values.astype(np.float32).reshape(tensor.data.shape)
    target.data.flush()
    del target
    os.replace(scratch, out)
    return out


__all__ = ["ARCHITECTURES", "FAMILIES", "MOE_FAMILIES", "RUNLM_FAMILIES", "build", "convert", "converter_dir",
           "dequantized", "transformers_logits"]
