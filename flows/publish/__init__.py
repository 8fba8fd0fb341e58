"""The publisher: sources, plan, baseline, encode, manifest and commit; sharded trainers' ranks."""
