"""Looking after a bucket: ``dcr ls``, ``dcr verify`` and ``dcr gc``."""
