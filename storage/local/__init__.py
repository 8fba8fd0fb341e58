"""Files on local disk: safetensors checkpoints, receiver state files and their undo journals, DCP metadata."""
