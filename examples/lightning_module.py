"""flatopt.AdamW in a Lightning ``LightningModule``, checked against torch.optim.AdamW.

Trains a small next-token model (embedding, MLP, LayerNorm, head) on random token sequences with
``lightning.Trainer``, once with flatopt.AdamW and once with torch.optim.AdamW, from the same
initialisation on the same batches, and prints both loss curves and the largest parameter difference.
Runs on the CPU in seconds.

    python examples/lightning_module.py                              # configure_optimizers returns the optimizer
    python examples/lightning_module.py --scheduler                  # ... and an LR scheduler dict (per step)
    python examples/lightning_module.py --precision bf16-mixed --accumulate 4 --clip 1.0
    python examples/lightning_module.py --resume-at 8                # save at step 8 (an epoch), resume, compare
    python examples/lightning_module.py --in-backward --accumulate 4 # flatopt.AdamW(self, ..., in_backward=True)

``configure_optimizers`` builds the optimizer from the module itself, ``flatopt.AdamW(self, ...)``:
Lightning calls it after moving the module to its device, which is when flatopt must be created.
Lightning calls ``optimizer.step(closure=...)``; the closure runs ``training_step``, ``zero_grad``
(first micro-batch of each accumulation window) and ``backward``, and Lightning clips the gradients
after the closure, inside ``step``, before the update.

Clipping under ``precision="bf16-mixed"`` or ``"16-mixed"``: Lightning refuses ``gradient_clip_val``
for any optimizer that unscales gradients inside its step (``_step_supports_amp_scaling``, as
torch.optim.AdamW(fused=True) and flatopt do), with "does not allow for gradient clipping because it
performs unscaling of gradients internally". bf16 needs no GradScaler, so the gradients are never
scaled: this module's ``configure_gradient_clipping`` clips them itself with
``torch.nn.utils.clip_grad_norm_`` and Lightning's ``gradient_clip_val``. Not for ``16-mixed``,
whose gradients are still scaled at that point.

In-backward mode (``--in-backward``; ``flatopt.AdamW(self, ..., in_backward=True)`` steps the parameters
during backward): ``configure_optimizers`` tells the optimizer the Trainer's accumulation and clipping
(:meth:`NextToken.in_backward_options`)::

    flatopt.AdamW(self, lr=3e-3, in_backward=True,
                  accumulation_steps=self.trainer.accumulate_grad_batches,
                  max_grad_norm=self.trainer.gradient_clip_val or None)

Lightning's clipping call then returns the norm the optimizer clipped by in backward. Without
``accumulation_steps`` the second backward pass of a window is refused; without ``max_grad_norm`` the
first clipping call is.

Requires ``pip install "flatopt[integrations]"`` (lightning).
"""

import argparse
import atexit
import os
import shutil
import tempfile
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import flatopt

VOCAB = 64


def random_tokens(n=64, seq=16, vocab=VOCAB, seed=0):
    """(inputs, targets) pairs of random token sequences a model can learn: each next token is a fixed
    random permutation of the one before."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    x = torch.empty(n, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, seq + 1):
        x[:, t] = perm[x[:, t - 1]]
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


class NextToken(L.LightningModule):
    """A small next-token model whose ``configure_optimizers`` returns flatopt.AdamW (or torch.optim.AdamW).

    Args:
        optimizer: ``"flatopt"`` or ``"torch"``
        scheduler: also return a per-step cosine LR schedule (``{"optimizer": ..., "lr_scheduler": {...}}``)
        total_steps: the schedule's length
        in_backward: flatopt in in-backward mode, told the Trainer's accumulation and clipping
            (:meth:`in_backward_options`)
        options: more keyword arguments for flatopt.AdamW, over those
    """

    def __init__(
        self, optimizer="flatopt", lr=3e-3, weight_decay=0.1, scheduler=False, total_steps=16, width=32,
        in_backward=False, options=None,
    ):  # fmt: skip
        super().__init__()
        self.optimizer_name, self.lr, self.weight_decay = optimizer, lr, weight_decay
        self.scheduler, self.total_steps = scheduler, total_steps
        self.in_backward, self.options = in_backward, dict(options or {})
        self.net = nn.Sequential(
            nn.Embedding(VOCAB, width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width),
            nn.LayerNorm(width), nn.Linear(width, VOCAB),
        )  # fmt: skip
        self.losses = []  # one per micro-batch
        self.grad_norms = []  # what each clipping call returned: the norm before clipping, one per optimizer step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x).flatten(0, 1).float(), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "flatopt":
            kwargs = {**(self.in_backward_options() if self.in_backward else {}), **self.options}
            opt = flatopt.AdamW(self, lr=self.lr, betas=(0.9, 0.95), weight_decay=self.weight_decay, **kwargs)
        elif self.optimizer_name == "torch":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=self.weight_decay)
        else:
            raise ValueError(f"unknown optimizer {self.optimizer_name!r}; use 'flatopt' or 'torch'")
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def in_backward_options(self):
        """What an in-backward optimizer must be told about the loop Lightning drives, from the Trainer's own
        settings: the window of ``accumulate_grad_batches`` backward passes that make one step, and the norm
        it clips by (``gradient_clip_val``; None turns clipping off). Lightning's clipping call,
        ``torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)``, then returns the norm the optimizer
        clipped by in backward. The gradients are applied during backward: ``gradient_clip_algorithm="value"``
        cannot be honoured and is refused."""
        if self.trainer.gradient_clip_val and self.trainer.gradient_clip_algorithm == "value":
            raise ValueError("in-backward mode clips by the norm only: use gradient_clip_algorithm='norm'")
        return {
            "in_backward": True,
            "accumulation_steps": self.trainer.accumulate_grad_batches,
            "max_grad_norm": self.trainer.gradient_clip_val or None,
        }

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # Lightning's own clipping refuses optimizers that unscale in their step under mixed precision (see the
        # module's docstring). Without a GradScaler (32-true, bf16-mixed) the gradients are not scaled, and this
        # is what Lightning's clipping does.
        if not gradient_clip_val:
            return
        if self.trainer.precision == "16-mixed":
            raise RuntimeError("fp16 gradients are still scaled here; clip after scaler.unscale_ or use bf16-mixed")
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(self.parameters(), gradient_clip_val)
        else:
            self.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)))


def scratch_dir(prefix):
    """A new temporary directory, removed with everything in it when this process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def make_trainer(steps, precision="32-true", clip=1.0, accumulate=1, callbacks=()):
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, precision=precision, gradient_clip_val=clip or None,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def train(
    optimizer="flatopt",
    steps=16,
    precision="32-true",
    clip=1.0,
    accumulate=1,
    scheduler=False,
    lr=3e-3,
    batch_size=8,
    save_at=None,
    resume_from=None,
    output_dir=None,
    in_backward=False,
    options=None,
    module_cls=None,
    seed=0,
):
    """Fit a :class:`NextToken` for ``steps`` optimizer steps and return what happened.

    An epoch is 64 sequences, 8 batches (``64 // batch_size``), in a fixed order (no shuffling).

    Args:
        optimizer: ``"flatopt"`` or ``"torch"``
        precision: Lightning's ``precision`` (``"32-true"``, ``"bf16-mixed"``)
        clip: ``gradient_clip_val`` (0: off); accumulate: ``accumulate_grad_batches``
        save_at: save a checkpoint every ``save_at`` optimizer steps (``ModelCheckpoint(every_n_train_steps=...)``),
            at an epoch's end: Lightning resumes exactly from there, since a DataLoader cannot resume mid-epoch
        output_dir: where ``save_at`` saves (default: a temporary directory removed when the process exits)
        resume_from: a checkpoint to resume from (``trainer.fit(..., ckpt_path=...)``); the module is then
            initialised from another seed, so that what it trains with comes from the checkpoint
        in_backward: flatopt in in-backward mode, told the Trainer's accumulation and clipping
            (:meth:`NextToken.in_backward_options`); options: more keyword arguments for flatopt.AdamW
        module_cls: a :class:`NextToken` subclass to train instead

    Returns:
        dict: ``optimizer`` (the class Lightning stepped) and its final ``lr``, ``losses`` (per micro-batch),
        ``grad_norms`` (what the clipping calls returned), ``last_grad_norm`` (in-backward mode with clipping),
        ``params`` (name -> final parameter), ``checkpoint`` (with ``save_at``).
    """
    torch.manual_seed(seed if resume_from is None else seed + 1)
    module = (module_cls or NextToken)(
        optimizer, lr=lr, scheduler=scheduler, total_steps=steps, in_backward=in_backward, options=options
    )
    loader = torch.utils.data.DataLoader(random_tokens(seed=seed), batch_size=batch_size, shuffle=False)
    callbacks, checkpoint = [], None
    if save_at:
        per_epoch = len(loader) // accumulate
        if save_at % per_epoch:
            raise ValueError(
                f"save_at={save_at} is not at an epoch's end: an epoch is {per_epoch} optimizer steps here, and "
                "Lightning resumes exactly only from an epoch's end (the DataLoader cannot resume mid-epoch)"
            )
        directory = output_dir or scratch_dir("lightning_")
        callbacks = [ModelCheckpoint(directory, "{step}", save_top_k=-1, every_n_train_steps=save_at)]
        checkpoint = os.path.join(directory, f"step={save_at}.ckpt")
    trainer = make_trainer(steps, precision=precision, clip=clip, accumulate=accumulate, callbacks=callbacks)
    trainer.fit(module, loader, ckpt_path=resume_from)
    opt = trainer.optimizers[0]
    last_norm = getattr(opt, "last_grad_norm", None)
    return {
        "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
        "lr": opt.param_groups[0]["lr"],
        "losses": module.losses,
        "grad_norms": module.grad_norms,
        "last_grad_norm": None if last_norm is None else float(last_norm),
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "checkpoint": checkpoint,
    }


def max_param_diff(a, b):
    """The largest absolute difference between two runs' parameters, and the parameter it is in."""
    return max(((a[n] - b[n]).abs().max().item(), n) for n in a)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps (max_steps)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (0: off)")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--scheduler", action="store_true", help="return a per-step cosine LR scheduler dict too")
    parser.add_argument(
        "--resume-at",
        type=int,
        default=None,
        help="also save a checkpoint every this many steps (at an epoch's end), resume from the first and compare",
    )
    parser.add_argument(
        "--in-backward",
        action="store_true",
        help="flatopt in in-backward mode, with accumulation_steps and max_grad_norm from the Trainer's settings",
    )
    parser.add_argument("--only", choices=["flatopt", "torch"], default=None, help="run one optimizer only")
    args = parser.parse_args(argv)

    common = dict(steps=args.steps, lr=args.lr, precision=args.precision, clip=args.clip, accumulate=args.accumulate,
                  scheduler=args.scheduler)  # fmt: skip
    print("lightning.Trainer, " + ", ".join(f"{k}={v}" for k, v in common.items()))
    if args.in_backward and args.clip:
        print(
            "  flatopt in in-backward mode clips in backward by the running norm (docs/in-backward.md, 'Clipping'), "
            "not by torch's exact global norm: with clipping on, the runs differ by more than float noise"
        )
    runs = {}
    for name in [args.only] if args.only else ["flatopt", "torch"]:
        t0 = time.perf_counter()
        mode = {"in_backward": True} if args.in_backward and name == "flatopt" else {}
        runs[name] = train(name, save_at=args.resume_at, **common, **mode)
        print(f"  {runs[name]['optimizer']}{' (in_backward=True)' if mode else ''}: {time.perf_counter() - t0:.1f} s")
    print("  micro-batch  " + "  ".join(f"{name:>10}" for name in runs))
    for i, losses in enumerate(zip(*(r["losses"] for r in runs.values()))):
        print(f"  {i + 1:11d}  " + "  ".join(f"{loss:10.6f}" for loss in losses))
    summary = dict(runs)
    if len(runs) == 2:
        diff, where = max_param_diff(runs["flatopt"]["params"], runs["torch"]["params"])
        print(f"  largest parameter difference, flatopt vs torch: {diff:.3g} ({where})")
        summary["param_diff"] = diff
    if args.resume_at:
        name, whole = next(iter(runs.items()))
        mode = {"in_backward": True} if args.in_backward and name == "flatopt" else {}
        resumed = train(name, save_at=args.resume_at, resume_from=whole["checkpoint"], **common, **mode)
        diff, where = max_param_diff(whole["params"], resumed["params"])
        print(
            f"  {name} resumed from {whole['checkpoint']}: largest parameter difference from the uninterrupted run: "
            f"{diff:.3g} ({where})"
        )
        summary["resumed"], summary["resume_diff"] = resumed, diff
    return summary


if __name__ == "__main__":
    main()
