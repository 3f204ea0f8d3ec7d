"""Regenerate the golden files the format tests pin: ``python tests/data/make_golden.py``.

golden_v1.ckz        a small hand-built container (manifest + three blobs, one empty); the test
                     asserts encode_container reproduces it byte for byte, so any change to the
                     container bytes shows up as a diff of this file.
golden_chain_v1/     a lossless chain (keyframe + two XOR deltas) of a fixed tiny training state;
                     the test asserts today's reader restores it exactly (files written by an
                     older ckptzip must stay readable). Its bytes depend on the zstd build and the
                     index holds timestamps, so only its contents are compared, not its bytes.

Only regenerate after a deliberate format change (and bump FORMAT_VERSION when old readers
cannot read the new files).
"""
from __future__ import annotations

import pathlib
import shutil
import struct

HERE = pathlib.Path(__file__).resolve().parent
GOLDEN_FILE = HERE / "golden_v1.ckz"
GOLDEN_CHAIN = HERE / "golden_chain_v1"


def golden_container() -> tuple[dict, dict[str, bytes]]:
    """The manifest and blobs of golden_v1.ckz (format_version and blob table are added on encode)."""
    weights = struct.pack("<4f", 1.0, -0.0, 2.5, -3.0)
    blobs = {"0.data": weights, "1.note": b"ckptzip golden\n", "2.empty": b""}
    manifest = {
        "step": 42, "parent_step": None, "keyframe": True, "method": "golden/1", "config": {"level": 3},
        "method_meta": {}, "extra": {"param_link": "none"},
        "skeleton": {"w": {"__t": "tensor", "ref": "w"}, "note": "h\u00e9llo", "pair": {"__t": "tuple", "v": [1, None]},
                     "lr": {"__t": "float", "v": "inf"}},
        "records": {
            "w": {"role": "tensor", "dtype": "float32", "shape": [2, 2], "layer_type": "other", "param": None,
                  "pipeline": ["raw/1"], "meta": {}, "blobs": {"data": "0.data"}},
        },
        "raw_bytes": 16,
    }
    return manifest, blobs


def golden_chain_states() -> list[tuple[int, dict]]:
    """A fixed, RNG-free tiny training state at three steps (weights, Adam moments, an int buffer)."""
    import torch

    out = []
    base = torch.linspace(-1.0, 1.0, 24, dtype=torch.float32).reshape(4, 6)
    for i, step in enumerate((10, 20, 30)):
        w = base + 1e-3 * i * torch.cos(torch.arange(24.0)).reshape(4, 6)
        state = {
            "model": {"lin.weight": w, "lin.bias": torch.full((4,), 0.5 - 0.01 * i),
                      "bn.num_batches_tracked": torch.tensor(step)},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": w * 1e-2,
                                        "exp_avg_sq": (w * 1e-3) ** 2},
                                    1: {"step": torch.tensor(float(step)), "exp_avg": torch.full((4,), -1e-3 * i),
                                        "exp_avg_sq": torch.full((4,), 1e-6 * i)}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}]},
            "epoch": i, "note": None, "bits": torch.tensor([-0.0, float("nan"), float("inf")]).to(torch.bfloat16),
        }
        out.append((step, state))
    return out


def main() -> None:
    from ckptzip.chain import CheckpointChain, KeyframePolicy
    from ckptzip.format import encode_container

    GOLDEN_FILE.write_bytes(encode_container(*golden_container()))
    shutil.rmtree(GOLDEN_CHAIN, ignore_errors=True)
    chain = CheckpointChain(GOLDEN_CHAIN, "lossless", keyframe=KeyframePolicy(every=10))
    for step, state in golden_chain_states():
        chain.save(state, step=step)
    print(f"wrote {GOLDEN_FILE.name} ({GOLDEN_FILE.stat().st_size} bytes) and {GOLDEN_CHAIN.name}/ "
          f"({', '.join(sorted(p.name for p in GOLDEN_CHAIN.iterdir()))})")


if __name__ == "__main__":
    main()
