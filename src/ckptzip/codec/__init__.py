"""Lossless stages that turn integer codes and raw bytes into compact byte strings.

Modules (import each one directly; this package re-exports nothing):

- ``delta``     cyclic delta of quantization codes between checkpoints and the O(n) rearrangement
                by source bucket (DynaQuant §6, Algorithms 5-6)
- ``rle``       run-length encoding with the sign trick (values as -v, run lengths > 1 as +L)
- ``entropy``   base of the coder family: the coder registry (``huffman``, ``ans``, ``zstd``,
                ``rans``) and the full code pipeline ``encode_codes`` / ``decode_codes``
- ``streamframe`` the byte framing the coders share: varints, CRC seal, alphabet header, symbol counts
- ``huffman``   canonical, length-limited Huffman coding of integer streams (numba fast path)
- ``ans``       the same interface on constriction's ANS coder
- ``rans``      the same interface: interleaved static rANS, numba kernels (faster than ``ans``)
- ``bitmask``, ``bytegroup``  float-delta helpers for the other methods
- ``stages``    the registry of every record-pipeline descriptor (checked on read)
- ``frames``    the one place that calls zstd and xz (bounded, typed errors)
- ``bitpack``   the one bit-packer (LSB first)
"""
