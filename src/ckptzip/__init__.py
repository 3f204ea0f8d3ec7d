"""ckptzip: compressed chains of deep-learning training checkpoints.

The public surface is small; everything else is imported from its module.
"""
from .api import Compressor
from .chain import CheckpointChain, KeyframePolicy, RetentionPolicy
from .errors import (ChainBusyError, CkptzipError, CorruptCheckpointError, IncompleteCheckpointError,
                     StateMismatchError, StepNotFoundError, StorageError, UnknownMethodError)
from .methods.base import available_methods, get_method

__version__ = "0.1.0"
__all__ = [
    "Compressor", "CheckpointChain", "KeyframePolicy", "RetentionPolicy", "get_method", "available_methods",
    "CkptzipError", "CorruptCheckpointError", "IncompleteCheckpointError", "StepNotFoundError",
    "UnknownMethodError", "ChainBusyError", "StateMismatchError", "StorageError", "__version__",
]
