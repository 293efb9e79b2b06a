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
        self.val_losses = []  # one per evaluation, on the same held-out batches each time

    @property
    def short_name(self):
        """``flatopt`` or ``torch``: how the progress line tells the two runs apart."""
        return self.name.split(".")[0]

    @property
    def val_loss(self):
        """The latest validation loss, None before the first evaluation."""
        return self.val_losses[-1] if self.val_losses else None

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
        self.val_losses.append(sum(lm_loss(self.model, x, y).item() for x, y in batches) / len(batches))
        self.model.train()


def eval_every(config):
    """Steps between two evaluations of the validation loss: ``config.eval_every``, by default a tenth of
    the run (the progress line, written once per tenth to a log, then shows a fresh one)."""
    return config.eval_every or max(1, config.steps // 10)


def progress_text(runs, threads):
    """The losses on the progress line, each named by its run: ``train loss (flatopt) 2.310 (torch) 2.320 ...``."""

    def losses(values):
        return "  ".join(f"({r.short_name}) {'-' if v is None else format(v, '.3f')}" for r, v in values)

    train = losses((r, r.losses[-1] if r.losses else None) for r in runs)
    val = losses((r, r.val_loss) for r in runs)
    return f"train loss {train} | val loss {val}" + (f" | {threads.threads} threads" if threads is not None else "")


def initial_model(config, data, device):
    """The model every run starts from, initialised from ``config.seed`` (torch's global random state is left as
    it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = CharTransformer(data.vocab_size, config.seq_len, config.dim, config.layers, config.heads)
    return model.to(device)


def warmup_steps(config):
    """Steps of the learning rate's linear warm-up: a tenth of the run, at most 100."""
    return max(1, min(100, config.steps // 10))


def validation_batches(config, data, device, seed):
    """``config.eval_batches`` batches of held-out text drawn from ``seed``: every evaluation uses the same ones."""
    generator = torch.Generator().manual_seed(seed)
    return [
        tuple(t.to(device) for t in data.batch(data.val, config.batch_size, generator))
        for _ in range(config.eval_batches)
    ]


def train_interleaved(runs, config, data, device, val_batches, threads=None, stop=None):
    """Train ``runs`` for ``config.steps`` steps on the same batches, drawn in one order from ``config.seed``,
    interleaved step by step (who goes first alternates), and evaluate each on ``val_batches`` every
    :func:`eval_every` steps and after the last.

    Args:
        threads (CpuThreads, optional): measured again before each step (default: None, torch's threads as set)
        stop (callable, optional): called with the steps done after each step and its evaluations; when it returns
            True, training ends there (default: None, never)

    Returns:
        list[int]: the steps after which the runs were evaluated
    """
    clock = make_clock(device)
    generator = torch.Generator().manual_seed(config.seed)
    every, eval_steps = eval_every(config), []
    progress = Progress(config.steps, enabled=not config.quiet)
    for step in range(config.steps):
        if threads is not None:
            threads.update(step)
        x, y = (t.to(device, non_blocking=True) for t in data.batch(data.train, config.batch_size, generator))
        order = runs if step % 2 == 0 else runs[::-1]  # alternate who goes first: no cache or clock bias
        for run in order:
            run.train_step(x, y, clock)
        done = step + 1
        if done % every == 0 or done == config.steps:  # outside the timed steps
            for run in runs:
                run.evaluate(val_batches)
            eval_steps.append(done)
        progress.update(done, progress_text(runs, threads))
        if stop is not None and stop(done):
            break
    progress.close()
    return eval_steps


def train(config, data, device, threads, log):
    """Train both copies interleaved, evaluating both on the same held-out batches every :func:`eval_every`
    steps and at the end; returns the two runs, the number of parameters, of warm-up steps, and the steps
    after which the validation loss was measured."""
    base = initial_model(config, data, device)
    warmup = warmup_steps(config)
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
    val_batches = validation_batches(config, data, device, config.seed + 1)
    eval_steps = train_interleaved(runs, config, data, device, val_batches, threads)
    return runs, n_params, warmup, eval_steps
