"""A tiny random-weight Gemma3ForConditionalGeneration: HF directory, GGUF text model, llama.cpp mmproj GGUF.

The mmproj is written the way llama.cpp's convert_hf_to_gguf.py writes Gemma 3's (Gemma3VisionModel):
general.architecture "clip", clip.projector_type "gemma3", clip.vision.* hyper-parameters, tensor
names from gguf-py's own MMPROJ name map, and mm.soft_emb_norm stored with Gemma's 1 added.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from reference import tiny

IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
IMAGE_SIZE, PATCH, MM_TOKENS = 64, 8, 16  # 8x8 patches pooled 2x2 into 4x4 soft tokens
IMAGE_MEAN, IMAGE_STD = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]  # not the defaults: the loaders must read them
WINDOW = tiny.GEMMA_WINDOW  # shorter than the image block: sliding layers cut into it


def vision_tokenizer():
    """The tiny byte-level BPE with Gemma 3's image tokens as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=tiny.VOCAB,
        special_tokens=tiny.SPECIALS + IMAGE_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny.CORPUS, trainer=trainer)
    return tok


def _write_tokenizer(directory: Path, tok) -> None:
    tok.save(str(directory / "tokenizer.json"))
    boi, eoi, soft = IMAGE_TOKENS
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": tiny.CHATML,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "extra_special_tokens": {"boi_token": boi, "eoi_token": eoi, "image_token": soft},
            }
        )
    )


def processor(hf_dir: Path):
    """transformers' Gemma3Processor over the tiny tokenizer, with the PIL image processor (no torchvision here)."""
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=IMAGE_MEAN, image_std=IMAGE_STD
    )
    return Gemma3Processor(images, AutoTokenizer.from_pretrained(str(hf_dir)), image_seq_length=MM_TOKENS)


def build_gemma3_vision(directory: Path, seed: int = 3):
    """Write directory/hf, directory/model.gguf + directory/mmproj-tiny.gguf, and directory/text-only/model.gguf.

    Returns (transformers model, Gemma3Processor).
    """
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    tok = vision_tokenizer()
    ids = {t: tok.token_to_id(t) for t in IMAGE_TOKENS}
    text = Gemma3TextConfig(
        **tiny.TINY_DIMS,
        num_hidden_layers=len(tiny.GEMMA_LAYERS),
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=tiny.GEMMA_LAYERS,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        layer_norm_eps=1e-6,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=MM_TOKENS,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    tiny._randomize(model, seed)

    directory.mkdir(parents=True, exist_ok=True)
    hf = directory / "hf"
    model.save_pretrained(str(hf), safe_serialization=True)
    _write_tokenizer(hf, tok)
    proc = processor(hf)
    proc.image_processor.save_pretrained(str(hf))  # preprocessor_config.json, as Google's checkpoints carry
    _write_tokenizer(hf, tok)

    state = model.state_dict()
    _write_text_gguf(directory / "model.gguf", state, model.config.text_config, tok)
    _write_mmproj(directory / "mmproj-tiny.gguf", state, model.config)
    (directory / "text-only").mkdir(exist_ok=True)
    shutil.copyfile(directory / "model.gguf", directory / "text-only" / "model.gguf")
    return model, proc


def _write_text_gguf(path: Path, state: dict, text_config, tok) -> None:
    """The text model through tiny.py's independent llama.cpp-style writer, image tokens marked as control."""
    prefix = "model.language_model."
    text_state = {"model." + k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}

    def extra(writer):
        import gguf

        writer.add_rope_freq_base(1e6)
        writer.add_rope_freq_base_swa(1e4)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
        writer.add_sliding_window(WINDOW)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in tiny.GEMMA_LAYERS])

    text_config._gguf_extra = extra
    names = {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    with mock.patch.object(tiny, "SPECIALS", tiny.SPECIALS + IMAGE_TOKENS):
        tiny._write_gguf(path, "gemma3", text_state, text_config, tok, names, False, True)


def _write_mmproj(path: Path, state: dict, config, proj_type: str = "F32") -> None:
    import gguf

    vc = config.vision_config
    blocks = vc.num_hidden_layers
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config.text_config.hidden_size)
    writer.add_vision_image_size(vc.image_size)
    writer.add_vision_patch_size(vc.patch_size)
    writer.add_vision_embedding_length(vc.hidden_size)
    writer.add_vision_feed_forward_length(vc.intermediate_size)
    writer.add_vision_block_count(blocks)
    writer.add_vision_head_count(vc.num_attention_heads)
    writer.add_vision_image_mean(IMAGE_MEAN)
    writer.add_vision_image_std(IMAGE_STD)
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vc.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    scale = (vc.image_size // vc.patch_size) // int(config.mm_tokens_per_image**0.5)
    if scale != 4:  # as the converter: only a non-default pooling is written
        writer.add_vision_projector_scale_factor(scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks)
    for key, tensor in state.items():
        if key.startswith("model.vision_tower."):
            hf_name = "vision_tower.vision_model." + key[len("model.vision_tower.") :]  # Google's layout
        elif key.startswith("model.multi_modal_projector."):
            hf_name = key[len("model.") :].replace("_weight", ".weight")
        else:
            continue
        out = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert out is not None, hf_name
        array = tensor.float().numpy()
        if "soft_emb_norm" in hf_name:
            array = array + 1.0
        if "input_projection" in hf_name and proj_type == "F16":
            writer.add_tensor(out, array.astype(np.float16))
        else:
            writer.add_tensor(out, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
