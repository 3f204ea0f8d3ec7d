"""Quantizers: tensor -> (integer codes, codebook, side data) and back. See quant/base.py."""
