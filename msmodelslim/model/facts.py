"""What the launch, the plan and the run need to know of a model besides its units, read from config.json once.

The family adapter builds it (`ModelAdapter.facts`) and passes it down; nothing outside model/ reads the config
for these numbers, so a family that spells them otherwise says so in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from msmodelslim.source.quant_scheme import text_part

# config.json spellings of the routed-expert counts across Hugging Face MoE families, first found wins
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_token", "num_experts_per_tok")


def first_int(section: dict[str, Any], keys: tuple[str, ...]) -> int:
    """The first of `keys` in `section` that holds a positive integer, else 0."""
    for key in keys:
        value = section.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


@dataclass(frozen=True)
class ModelFacts:
    hidden_size: int
    num_experts: int  # routed experts; 0 for a dense model
    top_k: int  # routed experts per token; 0 for a dense model
    dtype_bytes: int  # of the compute dtype the samples' state is kept in
    # the samples' state between units per token: [hidden] tensors, in words (the hidden state, plus what the family
    # passes alongside: Kimi's finished attention-residual blocks and MTP input embeddings)
    state_tensors: int = 1
    state_parts: tuple[str, ...] = ("hidden states",)

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype_bytes: int = 2, state_tensors: int = 1,
                    state_parts: tuple[str, ...] = ("hidden states",)) -> ModelFacts:
        """From a config.json mapping (its text part for a multimodal model)."""
        text = text_part(config)
        return cls(hidden_size=first_int(text, ("hidden_size",)), num_experts=first_int(text, EXPERT_COUNT_KEYS),
                   top_k=first_int(text, TOP_K_KEYS), dtype_bytes=dtype_bytes, state_tensors=state_tensors,
                   state_parts=state_parts)

    @property
    def state_bytes_per_token(self) -> int:
        """The samples' state between units per token on the host: its [hidden] tensors and the token id."""
        return self.state_tensors * self.hidden_size * self.dtype_bytes + 8
