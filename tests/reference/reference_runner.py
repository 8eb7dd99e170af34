"""A second, independent runner: transformers' own model behind runlm's contract, and nothing more.

It implements the three required calls (plus `max_context`, and the image calls for a Gemma 3
vision model) and inherits every other default from `runlm.runner.LmRunner`: each decode re-runs
the whole context, batches step one session at a time, and there are no snapshots, so the prompt
cache can never reuse anything. None of runlm's model, kernel or cache code runs. Driving the
engine, scheduler and server with it shows they use nothing beyond the contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from runlm.runner import ImageInput, LmRunner, Session

IMAGE_MARKER = "<start_of_image>"


class ReferenceRunner(LmRunner):
    """`model` is a transformers causal LM (or Gemma3ForConditionalGeneration with `processor`)."""

    def __init__(self, model: Any, family: str, context: int = 512, processor: Any = None):
        self.model, self.name, self.context, self.processor = model.eval(), family, context, processor
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab = config.vocab_size

    def family(self) -> str:
        return self.name

    def vocab_size(self) -> int:
        return self.vocab

    def max_context(self) -> int:
        return self.context

    @torch.no_grad()
    def predict_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        self.check_prompt(prompt_ids)
        return self.model(input_ids=torch.tensor([list(prompt_ids)])).logits[0, -1].float()

    # -- one image per prompt, through transformers' Gemma3Processor -------------------------
    def supports_multimodal(self) -> bool:
        return self.processor is not None

    def image_marker(self) -> str | None:
        return IMAGE_MARKER if self.processor is not None else None

    def _inputs(self, prompt: str, image: ImageInput) -> dict[str, torch.Tensor]:
        pixels = np.frombuffer(image.rgb, dtype=np.uint8).reshape(image.height, image.width, 3)
        return self.processor(text=prompt, images=Image.fromarray(pixels), return_tensors="pt")

    def multimodal_prompt_ids(self, prompt: str, tokenizer: Any = None, encode=None) -> list[int]:
        if encode is not None:  # the processor's own expansion, tokenized by the caller
            return encode(prompt.replace(self.processor.boi_token, self.processor.full_image_sequence))
        blank = ImageInput(bytes(3), 1, 1)  # the expansion does not depend on the pixels
        return self._inputs(prompt, blank)["input_ids"][0].tolist()

    def prefill_multimodal(self, session: Session, prompt: str, image: ImageInput, on_phase=None,
                           tokenizer: Any = None, all_positions: bool = False, ids=None) -> torch.Tensor:
        inputs = self._inputs(prompt, image)
        session.tokens = inputs["input_ids"][0].tolist() if ids is None else [int(i) for i in ids]
        session.state = inputs["pixel_values"]  # every later step runs the image again with the whole context
        return self._forward(session.tokens, session.state, all_positions)

    def extend(self, session: Session, ids: Sequence[int], all_positions: bool = False) -> torch.Tensor:
        if session.state is None:  # text only: the contract's default
            return super().extend(session, ids, all_positions)
        self.check_tokens(ids)
        self.check_fits(len(session.tokens) + len(ids))
        session.tokens = session.tokens + [int(t) for t in ids]
        logits = self._forward(session.tokens, session.state, all_positions=True)
        return logits[-len(ids):] if all_positions else logits[-1]

    @torch.no_grad()
    def _forward(self, ids: list[int], pixel_values: torch.Tensor, all_positions: bool) -> torch.Tensor:
        input_ids = torch.tensor([ids])
        soft = self.model.config.image_token_index
        token_type_ids = (input_ids == soft).long()
        out = self.model(input_ids=input_ids, pixel_values=pixel_values, token_type_ids=token_type_ids)
        logits = out.logits[0].float()
        return logits if all_positions else logits[-1]
