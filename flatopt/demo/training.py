"""The training loop, as a user writes it: flatopt.AdamW is a drop-in for torch.optim.AdamW.

Two copies of one model train on the same batches, one with each optimizer, step by step.
"""

import copy

import torch

import flatopt
from flatopt.demo.measure import Progress, make_clock
from flatopt.demo.model import CharTransformer, lm_loss, warmup_cosine

RUNS = ("flatopt.AdamW", "torch.optim.AdamW")

TORCH_IMPLS = {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


class Run:
    """One model, its optimizer and scheduler, and what it measured."""

    def __init__(self, name, model, optimizer, scheduler):
        self.name, self.model, self.optimizer, self.scheduler = name, model, optimizer, scheduler
        self.losses, self.step_s, self.train_step_s = [], [], []
        self.val_loss = None

    def train_step(self, x, y, clock):
        t0 = clock()
        self.optimizer.zero_grad()
        loss = lm_loss(self.model, x, y)
        loss.backward()
        t1 = clock()
        self.optimizer.step()
        t2 = clock()
        self.scheduler.step()
        t3 = clock()
        self.step_s.append(t2 - t1)
        self.train_step_s.append(t3 - t0)
        self.losses.append(loss.item())

    @torch.no_grad()
    def evaluate(self, batches):
        self.model.eval()
        self.val_loss = sum(lm_loss(self.model, x, y).item() for x, y in batches) / len(batches)
        self.model.train()


def train(config, data, device, threads, log):
    """Train both copies interleaved; returns the two runs, the number of parameters and of warm-up steps."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        base = CharTransformer(data.vocab_size, config.seq_len, config.dim, config.layers, config.heads).to(device)
    warmup = max(1, min(100, config.steps // 10))
    runs = []
    for name in RUNS:
        model = copy.deepcopy(base)
        hparams = dict(lr=config.lr, betas=(0.9, 0.99), weight_decay=config.weight_decay)
        if name == "flatopt.AdamW":
            optimizer = flatopt.AdamW(model, **hparams)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), **hparams, **TORCH_IMPLS[config.torch_impl])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.steps, warmup))
        runs.append(Run(name, model, optimizer, scheduler))
    n_params = sum(p.numel() for p in base.parameters())
    log(
        f"model: {n_params / 1e6:.2f}M parameters ({config.layers} blocks, width {config.dim}, {config.heads} heads, "
        f"vocabulary {data.vocab_size}); {config.steps} steps of {config.batch_size} x {config.seq_len} characters, "
        f"lr {config.lr:g} (warm-up {warmup} steps, then cosine), weight decay {config.weight_decay:g}; "
        f"flatopt backend: {runs[0].optimizer.backend}, torch.optim.AdamW implementation: {config.torch_impl}"
    )

    clock = make_clock(device)
    generator = torch.Generator().manual_seed(config.seed)
    progress = Progress(config.steps, enabled=not config.quiet)
    for step in range(config.steps):
        threads.update(step)
        x, y = (t.to(device, non_blocking=True) for t in data.batch(data.train, config.batch_size, generator))
        order = runs if step % 2 == 0 else runs[::-1]  # alternate who goes first: no cache or clock bias
        for run in order:
            run.train_step(x, y, clock)
        progress.update(
            step + 1, f"loss {runs[0].losses[-1]:.3f} / {runs[1].losses[-1]:.3f}, {threads.threads} threads"
        )
    progress.close()

    val_gen = torch.Generator().manual_seed(config.seed + 1)
    batches = [
        tuple(t.to(device) for t in data.batch(data.val, config.batch_size, val_gen))
        for _ in range(config.eval_batches)
    ]
    for run in runs:
        run.evaluate(batches)
    return runs, n_params, warmup


# ------------------------------------------------------------------------------------------- outputs
