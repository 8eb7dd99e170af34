"""Gemma 3 image + text against transformers on a tiny random Gemma3ForConditionalGeneration.

Checked from the HF directory (safetensors), from the GGUF text model with its mmproj found next to
it, and with the mmproj given explicitly: preprocessing equals Gemma3ImageProcessor (PIL backend:
torchvision is not installed here) bit for bit, vision features and f32 logits of an image + text
prompt within 1e-4, greedy generation equal to transformers' generate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from reference.tiny_vision import IMAGE_SIZE, MM_TOKENS, WINDOW, _write_mmproj, build_gemma3_vision

from runlm.cli.commands import main
from runlm.errors import InvalidInputError, UnsupportedOperationError
from runlm.pytorch import kernels
from runlm.pytorch.loading import load
from runlm.pytorch.vision import multimodal_ids, preprocess, vision_from_mmproj
from runlm.runner import ImageInput

TOL = 1e-4
PROMPT = "Describe <start_of_image> this image."
FORMATS = ["hf", "model.gguf", "explicit-mmproj"]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3_vision")
    model, processor = build_gemma3_vision(directory)
    return model, processor, directory


def _load(directory: Path, fmt: str):
    if fmt == "explicit-mmproj":  # a directory without a projector, the projector passed by path
        return load(directory / "text-only" / "model.gguf", dtype="f32", mmproj=directory / "mmproj-tiny.gguf")
    return load(directory / fmt, dtype="f32")


def image(width: int = 100, height: int = 37, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)


def hf_inputs(processor, text: str, pixels: np.ndarray):
    from PIL import Image

    return processor(text=text, images=[Image.fromarray(pixels)], return_tensors="pt")


@pytest.mark.parametrize("size", [(100, 37), (IMAGE_SIZE, IMAGE_SIZE), (17, 301), (1, 1)])
def test_preprocessing_equals_gemma3_image_processor(tiny_vl, size):
    _, processor, directory = tiny_vl
    pixels = image(*size)
    want = hf_inputs(processor, "<start_of_image>", pixels)["pixel_values"]
    for fmt in ("hf", "model.gguf"):  # mean / std from preprocessor_config.json and from clip.vision.image_*
        config = _load(directory, fmt).runner.vision.config
        got = preprocess(ImageInput(pixels.tobytes(), size[0], size[1]), config)
        assert got.shape == want.shape == (1, 3, IMAGE_SIZE, IMAGE_SIZE)
        assert (got - want).abs().max().item() == 0.0  # max abs diff: exactly 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_vision_features_match_transformers(tiny_vl, fmt):
    model, processor, directory = tiny_vl
    vision = _load(directory, fmt).runner.vision
    pixel_values = hf_inputs(processor, "<start_of_image>", image())["pixel_values"]
    with torch.no_grad():
        want_hidden = model.model.vision_tower(pixel_values=pixel_values).last_hidden_state
        want = model.get_image_features(pixel_values).pooler_output
    with torch.inference_mode():
        hidden = vision.tower(pixel_values)
        assert (hidden - want_hidden).abs().max().item() <= TOL
        got = vision(pixel_values)
    assert got.shape == want.shape == (1, MM_TOKENS, 64)
    assert (got - want).abs().max().item() <= TOL


def test_mmproj_with_f16_projection_loads(tiny_vl, tmp_path):
    """llama.cpp's converter writes mm.input_projection as F16."""
    model, processor, _ = tiny_vl
    path = tmp_path / "mmproj-f16.gguf"
    _write_mmproj(path, model.state_dict(), model.config, proj_type="F16")
    vision = vision_from_mmproj(path, text_hidden=64)
    pixel_values = hf_inputs(processor, "<start_of_image>", image())["pixel_values"]
    with torch.no_grad():
        want = model.get_image_features(pixel_values).pooler_output
    assert (vision(pixel_values) - want).abs().max().item() <= 1e-2


@pytest.mark.parametrize(
    "prompt, reference_text",
    [
        (PROMPT, PROMPT),
        ("<start_of_image>What is shown?", "<start_of_image>What is shown?"),
        ("What is shown?", "<start_of_image>What is shown?"),  # no marker: the image goes before the text
        ("Look: <start_of_image>", "Look: <start_of_image>"),
    ],
)
def test_prompt_expansion_equals_gemma3_processor(tiny_vl, prompt, reference_text):
    _, processor, directory = tiny_vl
    tokenizer = load(directory / "hf").tokenizer
    ids, group = multimodal_ids(tokenizer, prompt, MM_TOKENS)
    reference = hf_inputs(processor, reference_text, image())
    assert ids == reference["input_ids"][0].tolist()
    assert ((group >= 0).long() == reference["token_type_ids"][0]).all()
    assert set(group[group >= 0].tolist()) == {0}


@pytest.mark.parametrize("fmt", FORMATS)
def test_multimodal_logits_match_transformers(tiny_vl, fmt):
    model, processor, directory = tiny_vl
    pixels = image()
    inputs = hf_inputs(processor, PROMPT, pixels)
    with torch.no_grad():
        want = model(**inputs).logits[0]
        causal_only = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0]
    assert MM_TOKENS > WINDOW  # sliding layers cut into the image block
    assert (want - causal_only).abs().max().item() > 1e-2  # the bidirectional image mask matters here
    runner = _load(directory, fmt).runner
    assert runner.supports_multimodal()
    phases: list[str] = []
    session = runner.new_session()
    image_input = ImageInput(pixels.tobytes(), 100, 37)
    got = runner.prefill_multimodal(session, PROMPT, image_input, on_phase=phases.append, all_positions=True)
    assert phases == ["vision", "prefill"]
    assert got.shape == want.shape
    assert np.abs(got - want.numpy()).max() <= TOL
    assert session.tokens == inputs["input_ids"][0].tolist() == runner.multimodal_prompt_ids(PROMPT)


@pytest.mark.parametrize("fmt", FORMATS)
def test_generate_multimodal_equals_transformers_greedy(tiny_vl, fmt):
    model, processor, directory = tiny_vl
    pixels = image(45, 80, seed=1)
    inputs = hf_inputs(processor, PROMPT, pixels)
    n = 12
    out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1] :]
    runner = _load(directory, fmt).runner
    streamed: list[int] = []
    phases: list[str] = []
    got = runner.generate_multimodal(
        PROMPT, pixels.tobytes(), 45, 80, None, n, lambda t: streamed.append(t) or True, phases.append
    )
    assert got == want.tolist() == streamed
    assert phases == ["vision", "prefill"]
    # Decoding ran on the cached path: the session holds the prompt and every fed token.
    assert len(runner.own_session.tokens) == inputs["input_ids"].shape[1] + n - 1
    # The session goes on with decode_logits like any prefilled one.
    with torch.no_grad():
        context = torch.cat([inputs["input_ids"][0], want]).tolist()
        types = torch.cat([inputs["token_type_ids"][0], torch.zeros(n, dtype=torch.long)])
        ref = model(
            input_ids=torch.tensor([context]), pixel_values=inputs["pixel_values"], token_type_ids=types[None]
        ).logits[0, -1]
    assert np.abs(runner.decode_logits(got[-1]) - ref.numpy()).max() <= TOL


def test_on_token_false_stops_and_tokenizer_argument(tiny_vl):
    _, _, directory = tiny_vl
    runner = load(directory / "model.gguf").runner
    rgb = image().tobytes()
    full = runner.generate_multimodal(PROMPT, rgb, 100, 37, None, 8)
    seen: list[int] = []
    out = runner.generate_multimodal(PROMPT, rgb, 100, 37, None, 8, lambda t: seen.append(t) or len(seen) < 3)
    assert out == seen == full[:3]
    # An explicit tokenizer (a directory or a tokenizer.json) gives the same ids as the attached one.
    assert runner.generate_multimodal(PROMPT, rgb, 100, 37, directory / "hf", 8) == full
    assert runner.generate_multimodal(PROMPT, rgb, 100, 37, directory / "hf" / "tokenizer.json", 8) == full
    assert runner.generate_multimodal(PROMPT, rgb, 100, 37, None, 0) == []


def test_bad_inputs(tiny_vl):
    _, _, directory = tiny_vl
    runner = load(directory / "hf").runner
    rgb = image().tobytes()
    bad = [
        (rgb[:-1], 100, 37),  # one byte short
        (rgb + b"\0\0\0", 100, 37),
        (b"", 0, 0),
        (b"", 0, 37),
        (b"\0" * 3 * 16385, 16385, 1),  # absurd width
        ("not bytes", 100, 37),
        (rgb, 100.0, 37),
    ]
    for data, width, height in bad:
        with pytest.raises(InvalidInputError):
            runner.generate_multimodal(PROMPT, data, width, height, None, 4)
    with pytest.raises(InvalidInputError, match="2 <start_of_image> markers"):
        runner.generate_multimodal(PROMPT + PROMPT, rgb, 100, 37, None, 4)
    with pytest.raises(InvalidInputError):
        runner.generate_multimodal("<image_soft_token> hi", rgb, 100, 37, None, 4)
    with pytest.raises(InvalidInputError):
        runner.generate_multimodal(PROMPT, rgb, 100, 37, directory / "missing-tokenizer", 4)


def test_text_only_model_refuses_images(tiny_vl):
    _, _, directory = tiny_vl
    loaded = load(directory / "text-only" / "model.gguf")  # no mmproj next to it
    assert not loaded.runner.supports_multimodal()
    with pytest.raises(UnsupportedOperationError, match="no vision tower"):
        loaded.runner.generate_multimodal(PROMPT, image().tobytes(), 100, 37, None, 4)
    # Text generation is untouched by the vision path.
    ids = loaded.tokenizer.encode("The quick brown fox")
    assert load(directory / "model.gguf").runner.generate(ids, 6) == loaded.runner.generate(ids, 6)


@pytest.mark.skipif(not kernels.available(), reason="with the kernels off, a q8_0 load is refused for that")
def test_q8_0_kv_cache_is_refused_with_a_vision_tower(tiny_vl):
    """An image prompt's prefill runs on torch's attention, which cannot read q8_0 blocks."""
    _, _, directory = tiny_vl
    with pytest.raises(InvalidInputError, match="kv_type 'q8_0' cannot be used here: this model has a vision tower"):
        load(directory / "model.gguf", kv_type="q8_0")  # its mmproj found next to it


# -- CLI ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_args", [("hf",), ("text-only/model.gguf", "--mmproj", "mmproj-tiny.gguf")])
def test_cli_generate_with_image(tiny_vl, tmp_path, capsys, model_args):
    from PIL import Image

    _, _, directory = tiny_vl
    pixels = image()
    path = tmp_path / "photo.png"
    Image.fromarray(pixels).save(path)
    args = [str(directory / a) if i != 1 else a for i, a in enumerate(model_args)]
    code = main(["generate", "-m", *args, "--dtype", "f32", "--image", str(path), "--max-tokens", "6", "Describe."])
    out = capsys.readouterr().out
    assert code == 0
    loaded = load(directory / "hf", dtype="f32")
    text = loaded.chat_template.render([{"role": "user", "content": "<start_of_image>Describe."}])
    greedy = loaded.runner.generate_multimodal(text, pixels.tobytes(), 100, 37, None, 6)
    stop = next((i for i, t in enumerate(greedy) if t in loaded.tokenizer.stop_ids), len(greedy))
    assert out == loaded.tokenizer.decode(greedy[:stop]) + "\n"


def test_cli_rejects_corrupt_image_and_text_only_model(tiny_vl, tmp_path, capsys):
    _, _, directory = tiny_vl
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    assert main(["generate", "-m", str(directory / "hf"), "--image", str(bad), "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("runlm: error:") and "cannot read the image" in err and err.count("\n") == 1
    good = tmp_path / "ok.png"
    from PIL import Image

    Image.fromarray(image()).save(good)
    assert main(["generate", "-m", str(directory / "text-only" / "model.gguf"), "--image", str(good), "hi"]) == 1
    assert "no vision tower" in capsys.readouterr().err
