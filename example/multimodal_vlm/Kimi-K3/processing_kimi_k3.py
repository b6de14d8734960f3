# Stand-in for the vendor's Kimi-K3 processor (remote code, AutoProcessor + trust_remote_code=True).
#
# A plain class (not ProcessorMixin): AutoProcessor only needs `from_pretrained` and `register_for_auto_class`
# on the class named by auto_map. Images are resized so the patch grid is a whole multiple of the merge kernel,
# flattened to patches [n_patches, C*p*p] (channel-major inside a patch, patches row-major), and each image's
# `<|media_pad|>` marker in the prompt is expanded to one token per merged patch group.
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
    image_token = "<|media_pad|>"
    media_start_token = "<|media_start|>"
    media_end_token = "<|media_end|>"

    def __init__(
        self,
        tokenizer: Any,
        patch_size: int = 14,
        merge_kernel_size: tuple[int, int] | list[int] = (2, 2),
        image_mean: tuple[float, ...] | list[float] = (0.5, 0.5, 0.5),
        image_std: tuple[float, ...] | list[float] = (0.5, 0.5, 0.5),
        max_patches: int = 1024,
        **kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.patch_size = int(patch_size)
        self.merge_kernel_size = (int(merge_kernel_size[0]), int(merge_kernel_size[1]))
        self.image_mean = [float(v) for v in image_mean]
        self.image_std = [float(v) for v in image_std]
        self.max_patches = int(max_patches)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {self.image_token} token")

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
        cfg.pop("auto_map", None)
        cfg.pop("processor_class", None)
        # Directly, not via AutoTokenizer: that would read config.json and ask again about remote code.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        return cls(tokenizer=tokenizer, **cfg)

    def to_dict(self) -> dict[str, Any]:
        return {
            "processor_class": type(self).__name__,
            "auto_map": {"AutoProcessor": "processing_kimi_k3.KimiK3Processor"},
            "patch_size": self.patch_size,
            "merge_kernel_size": list(self.merge_kernel_size),
            "image_mean": self.image_mean,
            "image_std": self.image_std,
            "max_patches": self.max_patches,
        }

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        os.makedirs(save_directory, exist_ok=True)
        cfg = self.to_dict()
        cfg.pop("processor_class")
        with open(os.path.join(save_directory, PROCESSOR_CONFIG), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        self.tokenizer.save_pretrained(save_directory)

    # ---- images ----------------------------------------------------------------------------------------------
    def _target_size(self, width: int, height: int) -> tuple[int, int]:
        """(W, H) multiples of patch*merge, aspect kept, at most max_patches patches."""
        unit_h = self.patch_size * self.merge_kernel_size[0]
        unit_w = self.patch_size * self.merge_kernel_size[1]
        scale = min(1.0, math.sqrt(self.max_patches / ((height / self.patch_size) * (width / self.patch_size))))
        th = max(unit_h, round(height * scale / unit_h) * unit_h)
        tw = max(unit_w, round(width * scale / unit_w) * unit_w)
        while (th // self.patch_size) * (tw // self.patch_size) > self.max_patches:
            if th >= tw and th > unit_h:
                th -= unit_h
            elif tw > unit_w:
                tw -= unit_w
            else:
                break
        return tw, th

    def preprocess_image(self, image: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        """PIL image / path / HWC uint8 array -> (patches [h*w, C*p*p] float32, (h, w) patch grid)."""
        from PIL import Image

        if isinstance(image, (str, os.PathLike)):
            image = Image.open(image)
        elif isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        image = image.convert("RGB")
        tw, th = self._target_size(*image.size)
        if (tw, th) != image.size:
            image = image.resize((tw, th), Image.Resampling.BICUBIC)
        arr = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)  # [H, W, C]
        mean = torch.tensor(self.image_mean, dtype=torch.float32)
        std = torch.tensor(self.image_std, dtype=torch.float32)
        arr = ((arr - mean) / std).permute(2, 0, 1)  # [C, H, W]
        p = self.patch_size
        c = arr.shape[0]
        h, w = th // p, tw // p
        patches = arr.reshape(c, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, c * p * p)
        return patches.contiguous(), (h, w)

    def num_image_tokens(self, grid_hw: tuple[int, int]) -> int:
        return (grid_hw[0] // self.merge_kernel_size[0]) * (grid_hw[1] // self.merge_kernel_size[1])

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
        A prompt without a marker gets `<|media_start|><|media_pad|><|media_end|>` per image in front."""
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
                t = "".join(f"{self.media_start_token}{self.image_token}{self.media_end_token}" for _ in ims) + t
            elif n_markers != len(ims):
                raise ValueError(f"prompt has {n_markers} {self.image_token} markers but {len(ims)} images: {t[:80]!r}")
            pieces = t.split(self.image_token)
            ids: list[int] = []
            for i, piece in enumerate(pieces):
                if piece:
                    ids.extend(self.tokenizer(piece, add_special_tokens=False)["input_ids"])
                if i < len(ims):
                    patches, grid = self.preprocess_image(ims[i])
                    all_patches.append(patches)
                    grids.append(grid)
                    ids.extend([self.image_token_id] * self.num_image_tokens(grid))
            id_lists.append(ids)

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
            data["image_grid_hws"] = torch.tensor(grids, dtype=torch.long)
        return BatchFeature(data=data, tensor_type=return_tensors)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)


__all__ = ["KimiK3Processor"]
