"""Asynchronous checkpointing: stage into shared memory, compress and commit in an agent process.

``AsyncCheckpointEngine`` (engine.py) is what ``Compressor(..., async_save=True)`` uses; staging.py
holds the shared-memory slot format, agent.py the agent process. The design is in engine.py's
docstring.
"""
from .engine import AsyncCheckpointEngine, BackpressureWarning, EngineOptions, SaveHandle, newest_common_step

__all__ = ["AsyncCheckpointEngine", "EngineOptions", "SaveHandle", "BackpressureWarning", "newest_common_step"]
