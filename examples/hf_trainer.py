"""flatopt.AdamW inside Hugging Face's ``transformers.Trainer``, checked against torch.optim.AdamW.

Trains a tiny causal language model (built from a config: nothing is downloaded) on random token
sequences with ``Trainer``, once with flatopt.AdamW and once with torch.optim.AdamW, from the same
initialisation on the same batches, and prints both loss curves and the largest parameter difference.
Runs on the CPU in seconds.

    python examples/hf_trainer.py                          # optimizer_cls_and_kwargs=(flatopt.AdamW, {...})
    python examples/hf_trainer.py --pass-as instance       # optimizers=(flatopt.AdamW(model, ...), None)
    python examples/hf_trainer.py --bf16 --grad-accum 4 --checkpointing non-reentrant --model llama
    python examples/hf_trainer.py --resume-at 8            # save at step 8, resume there, compare with the whole run
    python examples/hf_trainer.py --in-backward --grad-accum 4   # flatopt.AdamW(..., in_backward=True)

The two ways of handing an optimizer to Trainer:

* ``optimizer_cls_and_kwargs=(flatopt.AdamW, {"lr": ...})``: Trainer calls
  ``flatopt.AdamW(param_groups, **kwargs)`` with two param groups (``weight_decay=args.weight_decay``
  for weights, 0 for biases and norms). flatopt takes param groups as torch.optim does.
* ``optimizers=(flatopt.AdamW(model, ...), None)``: you build it (after the model is on its device
  and in its dtype); Trainer adds its linear LR schedule when the second element is None.

Trainer ends each step with ``model.zero_grad()`` rather than ``optimizer.zero_grad()``. An optimizer
that was given the model (``optimizers=(flatopt.AdamW(model), None)``) sees it at the next forward pass
and frees its gradient buffer then, as torch.optim's gradients are freed; one built by Trainer from param
groups does not know the model, and the :class:`ReleaseGradients` callback below frees it.

In-backward mode (``--in-backward``; ``flatopt.AdamW(..., in_backward=True)`` steps the parameters during
backward): the optimizer must be told the loop's accumulation and clipping, from ``TrainingArguments``
(:func:`in_backward_options`)::

    args = TrainingArguments(..., gradient_accumulation_steps=4, max_grad_norm=1.0)
    kwargs = {"lr": 3e-4, "in_backward": True,
              "accumulation_steps": args.gradient_accumulation_steps,   # 3 passes accumulate, the 4th steps
              "max_grad_norm": args.max_grad_norm or None}              # clips in backward; None when 0
    Trainer(model=model, args=args, optimizer_cls_and_kwargs=(flatopt.AdamW, kwargs), ...)

Without ``accumulation_steps`` the second backward pass of a window is refused; without ``max_grad_norm``
Trainer's first clipping call is (``max_grad_norm=0`` in ``TrainingArguments`` turns Trainer's clipping off).

Requires ``pip install "flatopt[integrations]"`` (transformers, accelerate).
"""

import argparse
import atexit
import dataclasses
import os
import shutil
import tempfile
import time

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback
from transformers.utils import logging

import flatopt

OPTIMIZERS = {"flatopt": flatopt.AdamW, "torch": torch.optim.AdamW}
VOCAB, SEQ = 64, 16


def tiny_model(kind="gpt2", seed=0):
    """A tiny randomly initialised causal LM: ``gpt2`` (tied embeddings, transformers' Conv1D layers,
    dropout 0.1) or ``llama`` (nn.Linear layers, RMSNorm, no dropout)."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    if kind == "llama":
        config = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return LlamaForCausalLM(config)
    raise ValueError(f"unknown model {kind!r}; use 'gpt2' or 'llama'")


class RandomTokens(torch.utils.data.Dataset):
    """Random token sequences a model can learn: each starts at a random token, and each next token
    is a fixed random permutation of the one before."""

    def __init__(self, n=256, seq=SEQ, vocab=VOCAB, seed=0):
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(vocab, generator=g)
        x = torch.empty(n, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for t in range(1, seq):
            x[:, t] = perm[x[:, t - 1]]
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class ReleaseGradients(TrainerCallback):
    """Trainer ends each step with ``model.zero_grad()``, which sets every ``.grad`` to None. flatopt sees it at the
    next forward pass of a layer whose gradients it writes, which it has only when it was given the model: built
    by Trainer from param groups, its flat gradient buffer would stay allocated through the next forward pass,
    where torch.optim's gradients are freed. ``optimizer.zero_grad()`` frees it, as torch.optim's does; with
    torch.optim, or a flatopt optimizer that already freed it, it finds nothing left to free."""

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        optimizer.zero_grad(set_to_none=True)


def checkpointing_args(mode):
    """TrainingArguments for activation (gradient) checkpointing: ``off``, ``default`` (Trainer's own
    kwargs), ``non-reentrant`` or ``reentrant``. transformers 5 renamed ``gradient_checkpointing`` to
    ``activation_checkpointing`` (the old name still works, with a FutureWarning); the name the installed
    version has is used."""
    if mode == "off":
        return {}
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    prefix = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    kwargs = {prefix: True}
    if mode != "default":
        kwargs[prefix + "_kwargs"] = {"use_reentrant": mode == "reentrant"}
    return kwargs


def in_backward_options(args):
    """What an in-backward optimizer must be told about the loop Trainer drives, from its own
    ``TrainingArguments``: the window of ``gradient_accumulation_steps`` backward passes that make one step,
    and the norm Trainer clips by (its ``max_grad_norm``; 0 turns clipping off). Trainer's clipping call,
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)``, then returns the norm the
    optimizer clipped by in backward, and Trainer logs it as ``grad_norm``."""
    return {
        "in_backward": True,
        "accumulation_steps": args.gradient_accumulation_steps,
        "max_grad_norm": args.max_grad_norm or None,
    }


def scratch_dir(prefix):
    """A new temporary directory, removed with everything in it when this process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def build_trainer(
    optimizer="flatopt",
    pass_as="cls",
    model="gpt2",
    steps=16,
    batch_size=4,
    lr=3e-3,
    weight_decay=0.1,
    max_grad_norm=1.0,
    bf16=False,
    grad_accum=1,
    checkpointing="off",
    save_at=None,
    output_dir=None,
    release_grads=True,
    in_backward=False,
    options=None,
    callbacks=(),
    seed=0,
):
    """A ``transformers.Trainer`` over a tiny model, ready to train for ``steps`` optimizer steps.

    Args:
        optimizer: ``"flatopt"`` (flatopt.AdamW) or ``"torch"`` (torch.optim.AdamW)
        pass_as: ``"cls"`` (``optimizer_cls_and_kwargs``) or ``"instance"`` (``optimizers=(opt, None)``)
        model: ``"gpt2"`` or ``"llama"`` (see :func:`tiny_model`)
        max_grad_norm, bf16, grad_accum (``gradient_accumulation_steps``): Trainer's settings
        checkpointing: activation checkpointing (see :func:`checkpointing_args`)
        save_at: save a checkpoint every ``save_at`` steps (default: no checkpoints)
        output_dir: Trainer's ``output_dir`` (default: a temporary directory removed when the process exits)
        release_grads: add :class:`ReleaseGradients`, which frees flatopt's gradient buffer after each step
        in_backward: flatopt in in-backward mode, told Trainer's accumulation and clipping
            (:func:`in_backward_options`)
        options: more keyword arguments for flatopt.AdamW, over those (``{"max_grad_norm": None}`` leaves the
            clipping out, to see what Trainer's first clipping call then says)
        callbacks: more ``TrainerCallback`` objects
    """
    cls = OPTIMIZERS[optimizer]
    net = tiny_model(model, seed)
    output_dir = output_dir or scratch_dir("hf_trainer_")
    saving = {"save_strategy": "steps", "save_steps": save_at} if save_at else {"save_strategy": "no"}
    args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
        weight_decay=weight_decay, max_grad_norm=max_grad_norm, gradient_accumulation_steps=grad_accum,
        bf16=bf16, use_cpu=True, seed=seed, logging_steps=1, report_to=[], dataloader_num_workers=0,
        disable_tqdm=True, **saving, **checkpointing_args(checkpointing),
    )  # fmt: skip
    kwargs = {"lr": lr, "betas": (0.9, 0.95)}
    if in_backward or options:
        if cls is not flatopt.AdamW:
            raise ValueError("in_backward and options apply to flatopt only")
        kwargs.update({**(in_backward_options(args) if in_backward else {}), **(options or {})})
    if pass_as == "cls":
        # Trainer calls cls(param_groups, **kwargs): weight_decay per group from args, lr and the rest from kwargs
        how = {"optimizer_cls_and_kwargs": (cls, kwargs)}
    elif pass_as == "instance":
        params = net if cls is flatopt.AdamW else net.parameters()  # flatopt takes the module itself
        how = {"optimizers": (cls(params, weight_decay=weight_decay, **kwargs), None)}
    else:
        raise ValueError(f"unknown pass_as {pass_as!r}; use 'cls' or 'instance'")
    trainer = Trainer(model=net, args=args, train_dataset=RandomTokens(seed=seed), **how)
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; main() prints its own table
    if release_grads:
        trainer.add_callback(ReleaseGradients())
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer


def inner_optimizer(trainer):
    """The optimizer Trainer steps (accelerate wraps it in an ``AcceleratedOptimizer``)."""
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def train(*args, resume_from=None, **knobs):
    """Train for ``steps`` optimizer steps with ``transformers.Trainer`` and return what happened.

    Args:
        resume_from: a checkpoint directory to resume from (``trainer.train(resume_from_checkpoint=...)``)
        args, knobs: :func:`build_trainer`'s arguments

    Returns:
        dict: ``losses``, ``grad_norms`` (before clipping) and ``lrs``, one per optimizer step as Trainer logs
        them; ``params`` (name -> final parameter); ``optimizer`` (the class Trainer stepped), its groups'
        ``weight_decays``; flatopt's ``in_backward``, ``accumulation_steps``, ``max_grad_norm`` and
        ``last_grad_norm`` (None for torch.optim); ``mixed_precision``
        (accelerate's); ``checkpointing`` (whether the model had activation checkpointing on); ``grad_bytes``
        (what flatopt's gradient buffers hold at the end, None for torch.optim); ``output_dir``.
    """
    trainer = build_trainer(*args, **knobs)
    trainer.train(resume_from_checkpoint=resume_from)
    net, history, inner = trainer.model, trainer.state.log_history, inner_optimizer(trainer)
    held = None  # bytes flatopt's gradient buffers hold after training
    if isinstance(inner, flatopt.AdamW):
        held = sum(b.grad.untyped_storage().nbytes() for b in flatopt.inspect(inner).buffers if b.grad is not None)
    renamed = hasattr(type(net), "is_activation_checkpointing")  # transformers 5's name for it
    last_norm = getattr(inner, "last_grad_norm", None)
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "lrs": [h["learning_rate"] for h in history if "learning_rate" in h],
        "params": {n: p.detach().clone() for n, p in net.named_parameters()},
        "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "weight_decays": [group["weight_decay"] for group in inner.param_groups],
        "in_backward": getattr(inner, "in_backward", False),
        "accumulation_steps": getattr(inner, "accumulation_steps", None),
        "max_grad_norm": getattr(inner, "max_grad_norm", None),
        "last_grad_norm": None if last_norm is None else float(last_norm),
        "mixed_precision": trainer.accelerator.mixed_precision,
        "checkpointing": net.is_activation_checkpointing if renamed else net.is_gradient_checkpointing,
        "grad_bytes": held,
        "output_dir": trainer.args.output_dir,
    }


def max_param_diff(a, b):
    """The largest absolute difference between two runs' parameters, and the parameter it is in."""
    return max(((a[n] - b[n]).abs().max().item(), n) for n in a)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pass-as",
        choices=["cls", "instance"],
        default="cls",
        help="optimizer_cls_and_kwargs (cls) or optimizers=(opt, None) (instance)",
    )
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16=True (autocast; on the CPU too)")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="Trainer's clipping (0: off)")
    parser.add_argument(
        "--checkpointing",
        choices=["off", "default", "non-reentrant", "reentrant"],
        default="off",
        help="activation (gradient) checkpointing and its use_reentrant",
    )
    parser.add_argument(
        "--resume-at",
        type=int,
        default=None,
        help="also save a checkpoint every this many steps, resume from the first one and compare",
    )
    parser.add_argument(
        "--in-backward",
        action="store_true",
        help="flatopt in in-backward mode, with accumulation_steps and max_grad_norm from TrainingArguments",
    )
    parser.add_argument("--only", choices=["flatopt", "torch"], default=None, help="run one optimizer only")
    args = parser.parse_args(argv)
    logging.disable_progress_bar()  # the bar of each checkpoint's save

    common = dict(
        pass_as=args.pass_as, model=args.model, steps=args.steps, lr=args.lr, bf16=args.bf16,
        grad_accum=args.grad_accum, max_grad_norm=args.max_grad_norm, checkpointing=args.checkpointing,
    )  # fmt: skip
    print("transformers.Trainer: " + ", ".join(f"{k}={v}" for k, v in common.items()))
    if args.in_backward and args.max_grad_norm:
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
    print("  step  " + "  ".join(f"{name:>10}" for name in runs))
    for i, losses in enumerate(zip(*(r["losses"] for r in runs.values()))):
        print(f"  {i + 1:4d}  " + "  ".join(f"{loss:10.6f}" for loss in losses))
    summary = dict(runs)
    if len(runs) == 2:
        diff, where = max_param_diff(runs["flatopt"]["params"], runs["torch"]["params"])
        print(f"  largest parameter difference, flatopt vs torch: {diff:.3g} ({where})")
        summary["param_diff"] = diff
    if args.resume_at:
        name, whole = next(iter(runs.items()))
        checkpoint = os.path.join(whole["output_dir"], f"checkpoint-{args.resume_at}")
        mode = {"in_backward": True} if args.in_backward and name == "flatopt" else {}
        resumed = train(name, save_at=args.resume_at, resume_from=checkpoint, **common, **mode)
        diff, where = max_param_diff(whole["params"], resumed["params"])
        print(f"  {name} resumed from {checkpoint}: largest parameter difference from the whole run: {diff:.3g}")
        summary["resumed"], summary["resume_diff"] = resumed, diff
    return summary


if __name__ == "__main__":
    main()
