# Stand-in for the vendor's Kimi-K3 processor (remote code, AutoProcessor + trust_remote_code=True).
#
# The outputs and the image arithmetic follow the public Kimi-K3 processor (vLLM 0.33.0,
# `transformers_utils/processors/kimi_k3.py`, `kimi_k25_vision_fused.py`, `models/kimi_k3/common/mm_preprocess.py`):
# `media_proc_cfg` keys, navit resize + bottom/right padding to whole merged patches, pixel_values
# [n_patches, 3, p, p] (patches row-major), grid_thws [n_images, 3] = (1, h, w). Unlike vLLM, where the engine
# expands `<|kimi_image_placeholder|>`, this processor expands it itself (the same text vLLM writes), so the model
# runs standalone. A plain class (not ProcessorMixin): AutoProcessor only needs `from_pretrained` and
# `register_for_auto_class` on the class named by auto_map.
from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature, PreTrainedTokenizerFast

PROCESSOR_CONFIG = "processor_config.json"


class KimiK3Processor:
    """Image + text -> input_ids (placeholders expanded), pixel_values [n_patches, 3, p, p], grid_thws [n, 3]."""

    image_token = "<|kimi_image_placeholder|>"  # what a prompt writes where an image goes
    media_pad_token = "<|media_pad|>"  # one per image token; the model scatters image features there
    media_begin_token = "<|media_begin|>"
    media_content_token = "<|media_content|>"
    media_end_token = "<|media_end|>"

    def __init__(
        self,
        tokenizer: Any,
        patch_size: int = 14,
        merge_kernel_size: int | list[int] = 2,
        in_patch_limit: int = 16384,
        patch_limit_on_one_side: int = 512,
        fixed_output_tokens: int | None = None,
        image_mean: tuple[float, ...] | list[float] = (0.5, 0.5, 0.5),
        image_std: tuple[float, ...] | list[float] = (0.5, 0.5, 0.5),
        **kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.patch_size = int(patch_size)
        self.merge = int(merge_kernel_size[0] if isinstance(merge_kernel_size, (list, tuple)) else merge_kernel_size)
        self.in_patch_limit = int(in_patch_limit)
        self.patch_limit_on_one_side = int(patch_limit_on_one_side)
        self.fixed_output_tokens = fixed_output_tokens
        self.image_mean = [float(v) for v in image_mean]
        self.image_std = [float(v) for v in image_std]
        self.media_pad_id = tokenizer.convert_tokens_to_ids(self.media_pad_token)
        if self.media_pad_id is None or self.media_pad_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {self.media_pad_token} token")

    # ---- loading / saving -------------------------------------------------------------------------------------
    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoProcessor") -> None:
        """AutoProcessor calls this on remote classes; nothing to register for a plain class."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> KimiK3Processor:
        path = os.fspath(pretrained_model_name_or_path)
        cfg_file = os.path.join(path, PROCESSOR_CONFIG)
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"{cfg_file} not found")
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
        # Directly, not via AutoTokenizer: that would read config.json and ask again about remote code.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        return cls(tokenizer=tokenizer, **cfg.get("media_proc_cfg", {}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "auto_map": {"AutoProcessor": "processing_kimi_k3.KimiK3Processor"},
            "media_proc_cfg": {
                "patch_size": self.patch_size, "merge_kernel_size": self.merge, "in_patch_limit": self.in_patch_limit,
                "patch_limit_on_one_side": self.patch_limit_on_one_side,
                "fixed_output_tokens": self.fixed_output_tokens, "image_mean": self.image_mean,
                "image_std": self.image_std,
            },
        }

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, PROCESSOR_CONFIG), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
        self.tokenizer.save_pretrained(save_directory)

    # ---- images ----------------------------------------------------------------------------------------------
    def resize_plan(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(new_w, new_h, pad_w, pad_h) as vLLM's navit_resize_image: scale to the patch limits, then pad
        bottom/right to whole merged patches."""
        p, limit = self.patch_size, self.patch_limit_on_one_side
        s1 = math.sqrt(self.in_patch_limit / (max(1, width // p) * max(1, height // p)))
        scale = min(1.0, s1, limit * p / width, limit * p / height)
        new_w = min(max(1, int(width * scale)), limit * p)
        new_h = min(max(1, int(height * scale)), limit * p)
        factor = self.merge * p
        return new_w, new_h, (factor - new_w % factor) % factor, (factor - new_h % factor) % factor

    def preprocess_image(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int], tuple[int, int]]:
        """PIL image / path / HWC uint8 array -> (patches [h*w, 3, p, p] float32, grid (1, h, w), original (W, H)).
        Padding pixels are 0 before normalisation."""
        from PIL import Image

        if isinstance(image, (str, os.PathLike)):
            image = Image.open(image)
        elif isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        image = image.convert("RGB")
        size = image.size
        new_w, new_h, pad_w, pad_h = self.resize_plan(*size)
        if (new_w, new_h) != size:
            image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
        arr = np.zeros((new_h + pad_h, new_w + pad_w, 3), dtype=np.float32)
        arr[:new_h, :new_w] = np.asarray(image, dtype=np.float32)
        x = torch.from_numpy(arr / 255.0)
        mean = torch.tensor(self.image_mean, dtype=torch.float32)
        std = torch.tensor(self.image_std, dtype=torch.float32)
        x = ((x - mean) / std).permute(2, 0, 1)  # [3, H, W]
        p = self.patch_size
        h, w = x.shape[1] // p, x.shape[2] // p
        patches = x.reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p)
        return patches.contiguous(), (1, h, w), size

    def num_image_tokens(self, grid: tuple[int, int, int]) -> int:
        if self.fixed_output_tokens:
            return int(self.fixed_output_tokens)
        return (grid[1] // self.merge) * (grid[2] // self.merge)

    def expansion(self, size: tuple[int, int], n_tokens: int) -> str:
        """What vLLM's prompt update puts in place of one image placeholder (original image size in the text)."""
        return (f"{self.media_begin_token}image {size[0]}x{size[1]}{self.media_content_token}"
                + self.media_pad_token * n_tokens + self.media_end_token)

    # ---- records ---------------------------------------------------------------------------------------------
    def __call__(
        self,
        text: str | list[str] | None = None,
        images: Any = None,
        return_tensors: str | None = "pt",
        padding: bool = True,
        **kwargs: Any,
    ) -> BatchFeature:
        """One or more prompts; `images` is an image, a list (one prompt) or a list of lists (one per prompt).
        A prompt without placeholders gets one `<|kimi_image_placeholder|>` per image in front."""
        texts = [text] if isinstance(text, str) or text is None else list(text)
        texts = ["" if t is None else t for t in texts]
        if images is None:
            per_text_images: list[list[Any]] = [[] for _ in texts]
        elif len(texts) == 1 and not (isinstance(images, list) and images and isinstance(images[0], list)):
            per_text_images = [images if isinstance(images, list) else [images]]
        else:
            per_text_images = [im if isinstance(im, list) else [im] for im in images]
        if len(per_text_images) != len(texts):
            raise ValueError(f"{len(texts)} prompts but {len(per_text_images)} image lists")

        all_patches, grids, id_lists = [], [], []
        for t, ims in zip(texts, per_text_images):
            n_markers = t.count(self.image_token)
            if ims and n_markers == 0:
                t = self.image_token * len(ims) + t
            elif n_markers != len(ims):
                raise ValueError(f"prompt has {n_markers} {self.image_token} markers but {len(ims)} images: {t[:80]!r}")
            pieces = t.split(self.image_token)
            text_parts = [pieces[0]]
            for i, im in enumerate(ims):
                patches, grid, size = self.preprocess_image(im)
                all_patches.append(patches)
                grids.append(grid)
                text_parts += [self.expansion(size, self.num_image_tokens(grid)), pieces[i + 1]]
            id_lists.append(self.tokenizer("".join(text_parts), add_special_tokens=False)["input_ids"])

        max_len = max(len(ids) for ids in id_lists)
        if not padding and len({len(ids) for ids in id_lists}) > 1:
            raise ValueError("prompts of different lengths need padding=True")
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        input_ids = torch.full((len(id_lists), max_len), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(id_lists), max_len), dtype=torch.long)
        for row, ids in enumerate(id_lists):
            sl = slice(max_len - len(ids), max_len) if left else slice(0, len(ids))
            input_ids[row, sl] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, sl] = 1
        data: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if all_patches:
            data["pixel_values"] = torch.cat(all_patches, dim=0)
            data["grid_thws"] = torch.tensor(grids, dtype=torch.long)
        return BatchFeature(data=data, tensor_type=return_tensors)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)


__all__ = ["KimiK3Processor"]
