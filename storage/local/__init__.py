"""Files on local disk: safetensors checkpoints, receiver state files and their journals, DCP metadata."""
