"""Train a small model under DistributedDataParallel with flatopt.AdamW, in step mode or in in-backward mode.

    torchrun --nproc-per-node 2 examples/ddp.py                  # CPU ranks (gloo), or one GPU per rank (nccl)
    torchrun --nproc-per-node 2 examples/ddp.py --in-backward    # each DDP bucket stepped once averaged

Step mode: DDP averages the gradients into the flat gradient buffer's views during backward; ``opt.step()`` is
then one launch per flat buffer. In-backward mode (the optimizer given the DDP wrapper): flatopt's communication
hook steps each DDP bucket as soon as DDP has averaged it, during backward, and frees its gradients; clipping is
left out there (refused under DDP: the gradients are applied before their global norm is known). Either way every
rank holds the same parameters, which the script checks at the end.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import flatopt


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--in-backward", action="store_true", help="step each DDP bucket during backward")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
    ddp = DistributedDataParallel(model)
    if args.in_backward:
        opt = flatopt.AdamW(ddp, lr=1e-3, weight_decay=0.1, in_backward=True)  # the wrapper: its buckets are stepped
    else:
        opt = flatopt.AdamW(ddp.module, lr=1e-3, weight_decay=0.1)
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
        x, y = torch.randn(16, 64, generator=gen).to(device), torch.randn(16, 8, generator=gen).to(device)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()  # in-backward mode: the parameters are updated here
        if not args.in_backward:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}")

    # the replicas hold identical parameters
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    if rank == 0:
        print(f"replicas {'identical' if same else 'DIFFER'} after {args.steps} steps")
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
