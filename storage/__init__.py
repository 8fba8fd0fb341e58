"""I/O under ROOT: the bucket layout and its keys, manifests and commit markers, the commit protocol,
chunk transfers and the shared reader; local files (checkpoints, receiver states) in ``storage.local``."""
