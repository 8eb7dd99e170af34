"""The PyTorch runner of a family that can take images (Gemma 3: its spec is runlm.families.gemma3)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runlm.errors import UnsupportedOperationError
from runlm.pytorch import vision as vision_module
from runlm.pytorch.base import CachedRunner, DecoderLM
from runlm.pytorch.vision import VisionModel
from runlm.runner import ImageInput, Session, as_numpy


class GemmaRunner(CachedRunner):
    """Gemma 3; with a vision tower (`attach_vision`) it also takes one image per prompt."""

    def __init__(self, model: DecoderLM, family: str, max_context: int | None = None, swa_full: bool = False):
        super().__init__(model, family, max_context, swa_full)
        self.vision: VisionModel | None = None
        self.tokenizer = None  # the tokenizer image prompts are encoded with (given with the tower)

    def attach_vision(self, vision: VisionModel | None, tokenizer) -> None:
        self.vision, self.tokenizer = vision, tokenizer
        if vision is not None:
            vision.to(self.device)

    def to_device(self, device: torch.device) -> None:
        super().to_device(device)
        if self.vision is not None:
            self.vision.to(device)

    def supports_multimodal(self) -> bool:
        return self.vision is not None

    def image_marker(self) -> str | None:
        return vision_module.BOI if self.vision is not None else None

    def _require_vision(self) -> VisionModel:
        if self.vision is None:
            raise UnsupportedOperationError(
                "gemma model has no vision tower: this model cannot take images (load a Gemma 3 vision "
                "checkpoint, or pass mmproj= with llama.cpp's projector GGUF)"
            )
        return self.vision

    def multimodal_prompt_ids(self, prompt: str, tokenizer=None, encode=None) -> list[int]:
        mm_tokens = self._require_vision().config.mm_tokens_per_image
        tok = vision_module.resolve_tokenizer(tokenizer if tokenizer is not None else self.tokenizer)
        return vision_module.multimodal_ids(tok, prompt, mm_tokens, encode)[0]

    @torch.inference_mode()
    def prefill_multimodal(
        self, session: Session, prompt: str, image: ImageInput, on_phase=None, tokenizer=None,
        all_positions: bool = False, ids: Sequence[int] | None = None,
    ) -> np.ndarray:
        """The image's soft tokens replace the text embeddings at its block, which attends bidirectionally."""
        vision = self._require_vision()
        tok = vision_module.resolve_tokenizer(tokenizer if tokenizer is not None else self.tokenizer)
        pixels = vision_module.preprocess(image, vision.config)
        mm_tokens = vision.config.mm_tokens_per_image
        if ids is None:
            ids, group = vision_module.multimodal_ids(tok, prompt, mm_tokens)
        else:
            ids = [int(i) for i in ids]
            group = vision_module.image_groups(tok, ids, mm_tokens)
        self.check_prompt(ids)
        self.check_fits(len(ids))
        if on_phase is not None:
            on_phase("vision")
        features = vision(pixels.to(self.device))[0]
        if on_phase is not None:
            on_phase("prefill")
        self.reset_session(session)
        h = self.model.embed_tokens(torch.tensor(ids, dtype=torch.long, device=self.device))[None]
        group = group.to(h.device)
        h[0, group >= 0] = features.to(h.dtype)
        logits = self.model.forward_embeds(h, session.state, 0, last_only=not all_positions, image_group=group)
        session.tokens = list(ids)
        return as_numpy(logits if all_positions else logits[-1])
