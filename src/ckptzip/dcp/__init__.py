"""ckptzip inside torch.distributed.checkpoint: compressed, resharding DCP checkpoints.

    import torch.distributed.checkpoint as dcp
    from ckptzip.dcp import CompressedReader, CompressedWriter

    dcp.save(state_dict, storage_writer=CompressedWriter(root, step=100, method="dynaquant"))
    dcp.load(state_dict, storage_reader=CompressedReader(root))   # latest; any world size

Modules, in the order a save uses them: shardstate (write items -> records), memory (the rank's
reference between saves), merge (sketches shared across ranks), search (collective config search),
rankfile (one rank's container), layout (step folders, the commit, retention), meta (DCP metadata
as JSON), writer / reader (the DCP storage layer), tools (ls / inspect / verify / restore for the
CLI). docs/DCP.md has the design.
"""
from .memory import forget
from .reader import CompressedReader
from .writer import CompressedWriter

__all__ = ["CompressedWriter", "CompressedReader", "forget"]
