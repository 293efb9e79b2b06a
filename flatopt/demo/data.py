"""The data: Python source from this interpreter's standard library, as characters."""

import sysconfig
from pathlib import Path

import torch

from flatopt.demo.config import DemoError


def load_stdlib_text(max_bytes):
    """Bytes of the standard library's top-level ``.py`` files, in sorted order, up to ``max_bytes``.

    Returns:
        (bytes, dict): the text and where it came from (folder, number of files).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise DemoError(
            f"found no .py files in the standard library folder {root}; the demo trains on them "
            "(this Python may ship its standard library zipped)"
        )
    chunks, total, used = [], 0, 0
    for path in files:
        if total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        used += 1
    return b"".join(chunks)[:max_bytes], {"source": str(root), "files": used}


class CharData:
    """A byte-level vocabulary over ``text`` (the bytes that occur), a train / validation split
    and random windows of it.

    Args:
        text (bytes): the corpus
        val_fraction (float): the tail of the corpus held out for validation
        seq_len (int): characters per sequence; each window has one more for the target
    """

    def __init__(self, text, val_fraction, seq_len):
        raw = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        present = torch.bincount(raw, minlength=256) > 0
        self.vocab = present.nonzero().flatten()  # token id -> byte
        lookup = torch.full((256,), -1, dtype=torch.long)
        lookup[self.vocab] = torch.arange(len(self.vocab))
        tokens = lookup[raw]
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
        self.seq_len = seq_len
        for name, split in (("training", self.train), ("validation", self.val)):
            if len(split) < seq_len + 2:
                raise DemoError(
                    f"the {name} text has {len(split)} characters, fewer than --seq-len + 2 = {seq_len + 2}; "
                    "read more data (--data-mb) or use a shorter --seq-len"
                )

    @property
    def vocab_size(self):
        return len(self.vocab)

    def batch(self, split, batch_size, generator):
        """``batch_size`` random windows of ``split``: inputs and next-character targets, int64 [B, T]."""
        starts = torch.randint(len(split) - self.seq_len - 1, (batch_size, 1), generator=generator)
        windows = split[starts + torch.arange(self.seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]


# --------------------------------------------------------------------------------------------- model
