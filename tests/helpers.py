"""Assertions shared by several test modules (imported as ``from helpers import ...``)."""
import math

import numpy as np
import torch

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same(a, b, path="<root>", *, strict_types=False):
    """Tensors bit-identical with dtype and shape; everything else ==; dict key order kept.

    ``strict_types``: mappings must also be of the same class (OrderedDict vs dict), as an ingested
    torch.save file must come back; a chain restore may turn an OrderedDict into a dict.
    """
    if strict_types:
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        w = BITS[a.element_size()] if a.dtype != torch.bool else torch.bool
        assert torch.equal(a.contiguous().view(w), b.contiguous().view(w)), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}", strict_types=strict_types)
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}", strict_types=strict_types)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def coded_stages(pipeline: list[str]) -> list[str]:
    """A quantized record's pipeline less ``batch/1`` (where its bytes are stored, not how they are coded)."""
    return [s for s in pipeline if s != "batch/1"]


def record_part(container, name: str, part: str) -> bytes:
    """A quantized record's part (``codes``, ``codebook``, ...) in a decoded container, wherever it is stored."""
    from ckptzip.methods.base import Encoded
    from ckptzip.methods.qrecord import part_bytes

    return part_bytes(Encoded(records=container.manifest["records"], blobs=container.blobs), name, part)
