"""The demo's options and its error."""

from dataclasses import dataclass

import torch


class DemoError(Exception):
    """Options the demo cannot run with, or data it cannot find; the message says what to change."""


@dataclass
class DemoConfig:
    """Options of the demo; the defaults train for 3 to 5 minutes on a 2-core CPU.

    Args:
        steps (int): training steps per optimizer (default: 800)
        batch_size (int): sequences per batch (default: 16)
        seq_len (int): characters per sequence (default: 128)
        dim (int): model width (default: 128)
        layers (int): transformer blocks (default: 2)
        heads (int): attention heads, dividing ``dim`` (default: 4)
        lr (float): peak learning rate (default: 3e-3)
        weight_decay (float): decoupled weight decay (default: 0.1)
        data_mb (float): megabytes of standard-library source to read (default: 3.0)
        val_fraction (float): the tail of the text held out for validation (default: 0.1)
        eval_batches (int): batches of held-out text, the same at every evaluation (default: 8)
        eval_every (int, optional): steps between two evaluations of the validation loss, which is also
            measured after the last step (default: a tenth of ``steps``)
        device (str or torch.device, optional): default ``"cuda"`` when available, else ``"cpu"``
        threads (int, optional): torch's CPU threads while the demo runs; restored afterwards
            (default: as many as other work leaves idle, measured again as training goes: :class:`CpuThreads`)
        torch_impl (str): the torch.optim.AdamW implementation compared against: ``"default"``
            (what ``torch.optim.AdamW(params)`` picks: for-loop on the CPU, foreach on CUDA),
            ``"foreach"``, ``"fused"`` or ``"for-loop"`` (default: ``"default"``)
        out (str): folder for the plot and the results JSON (default: ``"demo_out"``)
        seed (int): seed of the initialisation and the data order (default: 0)
        quiet (bool): no progress bar (default: False)
    """

    steps: int = 800
    batch_size: int = 16
    seq_len: int = 128
    dim: int = 128
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    weight_decay: float = 0.1
    data_mb: float = 3.0
    val_fraction: float = 0.1
    eval_batches: int = 8
    eval_every: int | None = None
    device: str | torch.device | None = None
    threads: int | None = None
    torch_impl: str = "default"
    out: str = "demo_out"
    seed: int = 0
    quiet: bool = False


# ---------------------------------------------------------------------------------------------- data
