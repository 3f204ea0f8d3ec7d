"""Asynchronous checkpointing: stage into shared memory, compress and commit in an agent process.

``AsyncCheckpointEngine`` (engine.py) is what ``Compressor(..., async_save=True)`` uses; staging.py
holds the shared-memory slot format, agent.py the agent process, and one module each the options,
ownership, slot pool, agent supervision, handles and distributed agreement. The design is in
engine.py's docstring.
"""
from .distributed import newest_common_step
from .engine import AsyncCheckpointEngine
from .handle import SaveHandle
from .options import BackpressureWarning, EngineOptions, OversubscriptionWarning

__all__ = ["AsyncCheckpointEngine", "EngineOptions", "SaveHandle", "BackpressureWarning", "OversubscriptionWarning",
           "newest_common_step"]
