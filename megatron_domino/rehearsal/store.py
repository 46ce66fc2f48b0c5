"""The launcher's key-value store for a rehearsal, where one process plays one rank of the job.

The library uses the store for start-up verdicts, barriers of the long phases and heartbeats. Here the
other ranks do not exist, so the store answers as they would in a healthy job where every rank runs this
rank's program: a counter others also increment (``add``) advances by the world size per call, so a
barrier's count is complete at once; a key only another rank sets (rank 0's start-up verdict) has the
healthy answer given in ``answers`` (by key prefix); any other missing key is a rehearsal error naming it,
rather than a wait forever.
"""
from __future__ import annotations

import torch.distributed as dist


class RehearsalStoreError(RuntimeError):
    pass


class RehearsalStore(dist.Store):
    def __init__(self, world_size: int, answers: dict[str, str]):
        super().__init__()
        self.world_size, self.answers = world_size, answers
        self._values: dict[str, bytes] = {}

    @staticmethod
    def _bytes(value) -> bytes:
        return value if isinstance(value, bytes) else str(value).encode()

    def set(self, key: str, value) -> None:
        self._values[key] = self._bytes(value)

    def get(self, key: str) -> bytes:
        if key in self._values:
            return self._values[key]
        for prefix, answer in self.answers.items():
            if prefix in key:
                return answer.encode()
        raise RehearsalStoreError(f"the rehearsed rank waits for store key {key!r}, which only another rank "
                                  f"sets: add its healthy value to RehearsalStore.answers")

    def add(self, key: str, amount: int) -> int:
        value = int(self._values.get(key, b"0")) + amount * self.world_size
        self._values[key] = str(value).encode()
        return value

    def append(self, key: str, value) -> None:
        self._values[key] = self._values.get(key, b"") + self._bytes(value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        current = self._values.get(key)
        if current is None and not self._bytes(expected) or current == self._bytes(expected):
            self._values[key] = self._bytes(desired)
        return self._values.get(key, self._bytes(expected))

    def check(self, keys: list[str]) -> bool:
        return all(key in self._values for key in keys)

    def delete_key(self, key: str) -> bool:
        return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._values)

    def wait(self, keys, timeout=None) -> None:
        missing = [key for key in keys if key not in self._values]
        if missing:
            raise RehearsalStoreError(f"the rehearsed rank waits for store keys {missing} that no rank here sets")
