"""Pure logic of DCR: dtypes, raw bits, chunk grids, deltas, codecs, digests, placements, planning.

No I/O and no Prefect. Importing this package (or any module but ``bits`` and ``conversion``, the
two torch bridges) does not import torch, so tools that only read a bucket start fast.
"""
