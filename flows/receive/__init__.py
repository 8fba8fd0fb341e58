"""The receiver: state files (rewritten or patched in place) and live modules (through their loader)."""
