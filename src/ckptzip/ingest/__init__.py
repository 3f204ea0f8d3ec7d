"""Existing checkpoints on disk <-> ckptzip training states, and back to the same files.

Each kind of source is a versioned layout (layout.py), registered under its descriptor, which is
written into every ingested state's ``__layout__`` so a restore needs nothing but the chain:

=================  ==========================================================  ===============
descriptor         source                                                      module
=================  ==========================================================  ===============
``torch-file/1``   a ``torch.save`` file of state dicts in any dict structure  torchfile.py
``hf-trainer/1``   a Hugging Face Trainer ``checkpoint-N/`` folder             trainer.py
``lightning/1``    the dict Lightning hands to a ``CheckpointIO`` (+ pointer)  lightning.py
``lightning/0``    v0.1's Lightning layout (read only)                         lightning.py
=================  ==========================================================  ===============

Call order::

    sources = find_sources(paths)             # detects, validates and orders by step (sources.py)
    for src in sources:
        state = load_source(src)              # {"model", "optimizer", "extra", "__layout__"}
        chain.save(state, src.step)
    ...
    write_restored(chain.load(step), out)     # .pt / .safetensors / the folder again (restore.py)

Loading never unpickles: torch files go through ``torch.load(weights_only=True)`` (safeload.py),
and files that need pickle (``rng_state.pth``, ``training_args.bin``) are kept byte for byte.
``compress.py`` is the job behind ``ckptzip compress`` (imported on its own: it needs the chain).
"""
from .layout import LAYOUT_KEY, LAYOUTS, SourceLayout, layout_of
from .lightning import LIGHTNING_LAYOUT
from .restore import check_output, model_weights, output_kind, rebuild, write_restored
from .sources import Source, find_sources, load_source
from .torchfile import TORCH_LAYOUT
from .trainer import TRAINER_LAYOUT

__all__ = [
    "LAYOUT_KEY", "LAYOUTS", "SourceLayout", "layout_of", "TORCH_LAYOUT", "TRAINER_LAYOUT", "LIGHTNING_LAYOUT",
    "Source", "find_sources", "load_source", "rebuild", "model_weights", "output_kind", "check_output",
    "write_restored",
]
