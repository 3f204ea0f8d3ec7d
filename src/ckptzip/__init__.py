"""ckptzip: compressed chains of deep-learning training checkpoints."""
__version__ = "0.1.0"
