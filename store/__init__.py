"""r3capture.store: the bounded block store (see block_store.py for the lifecycle)."""

from r3capture.store.block_store import BlockObjectStoreError, BlockStore

__all__ = ["BlockObjectStoreError", "BlockStore"]
