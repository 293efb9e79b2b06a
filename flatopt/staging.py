"""Hyper-parameter tables copied to the device without waiting and without allocating.

An LR scheduler changes ``lr`` before every step, so every ``step()`` copies the table of
hyper-parameters (a few hundred bytes) to the device. An asynchronous copy reads its host
memory when the device reaches it, later than the call returns, so that memory must not be
written again before then. ``PinnedStaging`` keeps a ring of pinned host tables, each with an
event recorded after the copy that reads it, and takes them in turn: the next one is written
again only once its event has completed. When it has not (the host runs more steps ahead of the
device than the ring is long), a table is added to the ring, up to ``MAX_SLOTS``; beyond that a
fresh pinned copy is made, as ``tensor.pin_memory()`` does.
"""

import torch

MAX_SLOTS = 64  # tables of a few hundred bytes: the host may run this many changed steps ahead


def _fresh_copy(table, rows):
    """The copy without the ring: a new pinned tensor, which PyTorch keeps until the copy has run."""
    table.copy_(torch.tensor(rows, dtype=table.dtype, device="cpu").pin_memory(), non_blocking=True)


class _Slot:
    def __init__(self, shape, dtype):
        self.tensor = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        self.array = self.tensor.numpy()
        self.event = torch.cuda.Event()


class PinnedStaging:
    """Copies float rows into a CUDA table (float32 or float64) on the current stream, asynchronously."""

    def __init__(self):
        self.slots = []
        self.next = 0  # the slot to try first

    def upload(self, table, rows):
        """``table[...] = rows`` (a list of equal-length lists of floats), ordered on the current stream."""
        if torch.cuda.is_current_stream_capturing():  # the caller's capture: leave the ring out of its graph
            _fresh_copy(table, rows)
            return
        first = self.slots[0].tensor if self.slots else None
        if first is not None and (first.shape != table.shape or first.dtype != table.dtype):  # a new table: a new ring
            self.slots, self.next = [], 0
        slot = self.slots[self.next] if self.slots else None
        if slot is None or not slot.event.query():
            if len(self.slots) >= MAX_SLOTS:
                _fresh_copy(table, rows)
                return
            slot = _Slot(table.shape, table.dtype)  # grows the ring at the slot in turn: the busy one goes round again
            self.slots.insert(self.next, slot)
        slot.array[...] = rows
        table.copy_(slot.tensor, non_blocking=True)
        slot.event.record(torch.cuda.current_stream(table.device))  # the stream copy_ ran on
        self.next = (self.next + 1) % len(self.slots)
