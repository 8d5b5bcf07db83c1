"""r3capture.store: the bounded block store (see block_store.py for the lifecycle)."""

from r3capture.store.block_store import BlockObjectStoreError, BlockStore
from r3capture.store.keys import (
    KEY_WORDS,
    as_key_rows,
    key_rows,
    key_rows_from_strings,
    key_string,
)

__all__ = [
    "KEY_WORDS",
    "BlockObjectStoreError",
    "BlockStore",
    "as_key_rows",
    "key_rows",
    "key_rows_from_strings",
    "key_string",
]
