"""Request indices as Model Runner V2's ``RequestState`` hands them out.

Each live request holds an index below ``max_num_seqs``; a finished or preempted request's
index is freed, and the last freed is the first taken, so a new request can take the index
of one whose step is still in flight. Batches carry them as ``idx_mapping``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class RequestIndices:
    """The index of each live request id, assigned and freed as MRV2 does."""

    def __init__(self, max_num_seqs: int) -> None:
        self._free = list(range(max_num_seqs))
        self.of: dict[str, int] = {}

    def free(self, req_ids: Iterable[str]) -> None:
        """Free the indices of ``req_ids`` (MRV2 frees them in sorted order); ids without
        one are ignored."""
        for req_id in sorted(req_ids):
            index = self.of.pop(req_id, None)
            if index is not None:
                self._free.append(index)

    def add(self, req_id: str) -> None:
        """Give ``req_id`` an index (MRV2 first removes a request it is given again)."""
        self.free([req_id])
        if not self._free:
            raise RuntimeError(f"no free request index for {req_id} (max_num_seqs)")
        self.of[req_id] = self._free.pop()

    def mapping(self, req_ids: list[str]) -> tuple[np.ndarray, torch.Tensor]:
        """``(idx_mapping_np, idx_mapping)`` of a batch: intp on the host, int64 tensor."""
        host = np.fromiter(map(self.of.__getitem__, req_ids), np.intp, len(req_ids))
        return host, torch.from_numpy(host.astype(np.int64))
