"""One vocabulary for quantization granularity and integer dtypes, shared by every quantizer.

Conventions (PyTorch layout): a weight is [out_features, in_features]; an activation is [..., features].
- PerChannel: one scale per output channel of a weight, i.e. per row, reduced over the input dim -> scale [out, 1].
- PerToken: one scale per token of an activation, reduced over the LAST dim only -> scale [..., 1].
  (Numerically the same reduction as PerChannel on a 2-D weight; kept distinct because it names a runtime quantity.)
These are the only two the serving schemes use (W8A8_DYNAMIC / W4A8_DYNAMIC): per-tensor and per-group scales have
no consumer, so they have no type.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Granularity:
    """Base of the granularity value types."""


@dataclass(frozen=True)
class PerChannel(Granularity):
    pass


@dataclass(frozen=True)
class PerToken(Granularity):
    pass


@dataclass(frozen=True)
class IntDtype:
    """A signed integer grid [qmin, qmax] = [-2^(bits-1), 2^(bits-1) - 1], stored in torch.int8."""

    name: str
    bits: int

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1


int4 = IntDtype("int4", 4)
int8 = IntDtype("int8", 8)
INT_DTYPES: dict[str, IntDtype] = {"int4": int4, "int8": int8}


def int_dtype(name_or_bits: str | int) -> IntDtype:
    """`"int4"` / `4` -> int4; raise ValueError naming the value for anything else."""
    if isinstance(name_or_bits, int) and not isinstance(name_or_bits, bool):
        for d in INT_DTYPES.values():
            if d.bits == name_or_bits:
                return d
    elif isinstance(name_or_bits, str) and name_or_bits in INT_DTYPES:
        return INT_DTYPES[name_or_bits]
    raise ValueError(f"unsupported integer dtype {name_or_bits!r}; expected one of {sorted(INT_DTYPES)}")
