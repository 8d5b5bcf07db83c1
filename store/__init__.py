"""r3capture.store: the bounded block store (see block_store.py for the lifecycle)."""

from r3capture.store.block_store import BlockObjectStoreError, BlockStore
from r3capture.store.keys import (
    KEY_WORDS,
    NO_KEY_OBJECTS,
    KeyObjects,
    as_key_objects,
    as_key_rows,
    join_key_objects,
    key_objects,
    key_objects_of_hashes,
    key_rows,
    key_rows_from_strings,
    key_string,
    rows_of_key_objects,
)

__all__ = [
    "KEY_WORDS",
    "NO_KEY_OBJECTS",
    "BlockObjectStoreError",
    "BlockStore",
    "KeyObjects",
    "as_key_objects",
    "as_key_rows",
    "join_key_objects",
    "key_objects",
    "key_objects_of_hashes",
    "key_rows",
    "key_rows_from_strings",
    "key_string",
    "rows_of_key_objects",
]
