"""Hyper-parameter tables copied to the device without waiting and without allocating.

An LR scheduler changes ``lr`` before every step, so every ``step()`` copies the table of
hyper-parameters (a few hundred bytes) to the device. An asynchronous copy reads its host
memory when the device reaches it, later than the call returns, so that memory must not be
written again before then. ``PinnedStaging`` keeps a few pinned host tables, each with an event
recorded after the copy that reads it, and writes a table again only once its event has
completed; when every table is still in flight (the host ran far ahead of the device), it
adds one, up to ``MAX_SLOTS``, and beyond that falls back to a fresh pinned copy.
"""

import torch

MAX_SLOTS = 8


class _Slot:
    def __init__(self, shape):
        self.tensor = torch.empty(shape, dtype=torch.float32, pin_memory=True)
        self.array = self.tensor.numpy()
        self.event = torch.cuda.Event()


class PinnedStaging:
    """Copies float rows into a float32 CUDA table on the current stream, asynchronously."""

    def __init__(self):
        self.slots = []

    def upload(self, table, rows):
        """``table[...] = rows`` (a list of equal-length lists of floats), ordered on the current stream."""
        if torch.cuda.is_current_stream_capturing():  # no reuse of host memory a graph would read at each replay
            table.copy_(torch.tensor(rows, dtype=torch.float32).pin_memory(), non_blocking=True)
            return
        slot = next((s for s in self.slots if s.tensor.shape == table.shape and s.event.query()), None)
        if slot is None:
            if len(self.slots) >= MAX_SLOTS:
                table.copy_(torch.tensor(rows, dtype=torch.float32).pin_memory(), non_blocking=True)
                return
            slot = _Slot(table.shape)
            self.slots.append(slot)
        slot.array[...] = rows
        table.copy_(slot.tensor, non_blocking=True)
        slot.event.record(torch.cuda.current_stream(table.device))
