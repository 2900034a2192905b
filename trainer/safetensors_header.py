"""A safetensors header checked as data before anything is sized or built from it."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from trainer.checks import is_integer

#: Bytes per value of each safetensors dtype (the library's own table adds its newer ones).
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
               "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


@functools.cache
def _dtype_bytes() -> dict[str, int]:
    import safetensors.torch

    library = getattr(safetensors.torch, "_TYPES", {})
    return {**DTYPE_BYTES, **{name: dtype.itemsize for name, dtype in library.items()}}


def described_values(header: Any, data_bytes: int) -> int:
    """How many values the tensors of `header` (the parsed JSON) hold; ValueError unless each
    tensor's dtype and shape fill its byte range and the ranges tile the `data_bytes` after the
    header exactly (what safetensors itself loads)."""
    if not isinstance(header, Mapping):
        raise ValueError("its header is not a JSON object")
    total, ranges = 0, []
    for key, info in header.items():
        if key == "__metadata__":
            if not (isinstance(info, Mapping) and all(isinstance(v, str) for v in info.values())):
                raise ValueError("its __metadata__ is not a map of strings")
            continue
        offsets = info.get("data_offsets") if isinstance(info, Mapping) else None
        shape = info.get("shape") if isinstance(info, Mapping) else None
        width = _dtype_bytes().get(info.get("dtype")) if isinstance(info, Mapping) else None
        if not (width is not None and isinstance(shape, list) and all(is_integer(d) and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(is_integer(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] and offsets[1] - offsets[0] == math.prod(shape) * width):
            raise ValueError(f"tensor {str(key)[:80]!r}: its dtype, shape and data_offsets disagree")
        ranges.append(offsets)
        total += math.prod(shape)
    end = 0
    for begin, stop in sorted(ranges):
        if begin != end:
            raise ValueError(f"its tensors leave bytes {end} to {begin} undescribed or overlap")
        end = stop
    if end != data_bytes:
        raise ValueError(f"its tensors describe {end} bytes of data, the file holds {data_bytes}")
    return total
