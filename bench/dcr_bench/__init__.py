"""DCR's benchmark, demo and demo models: an extra beside the runtime packages.

``dcr bench`` (``dcr_bench.bench``) and ``dcr demo`` (``dcr_bench.demo``) plug into the ``dcr``
command through the ``dcr.commands`` entry point group; ``python -m dcr_bench.shards`` and
``python -m dcr_bench.receiver_refit`` measure sharded publishing and live-module refits.
"""
