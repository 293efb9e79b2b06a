"""Train a small model sharded by FSDP2 (``fully_shard``) with flatopt.AdamW, then save the model and the
optimizer with torch.distributed.checkpoint, load them into a new model and optimizer, and go on.

    torchrun --nproc-per-node 2 examples/fsdp2.py              # CPU ranks (gloo), or one GPU per rank (nccl)
    torchrun --nproc-per-node 4 examples/fsdp2.py --load DIR   # resume a checkpoint saved on any number of ranks

Each rank keeps its optimizer states for its local shards in flat buffers, and FSDP2 keeps the local shards
of the parameters there too: ``opt.step()`` is one launch per flat buffer on each rank.
"""

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import flatopt


def build(device, world):
    """The model, sharded: one fully_shard group per block, and the root."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)], nn.Linear(64, 8))
    model.to(device)
    mesh = init_device_mesh(device, (world,))
    for block in model[:4]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = flatopt.AdamW(model, lr=1e-3, weight_decay=0.1)  # after fully_shard: it takes over the local shards
    return model, opt


def train(model, opt, device, rank, steps, first=0):
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
        x, y = torch.randn(16, 64, generator=gen).to(device), torch.randn(16, 8, generator=gen).to(device)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = opt.clip_grad_norm_(1.0)  # the global norm: one scalar all-reduce
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--load", help="resume from this DCP checkpoint instead of training from scratch")
    parser.add_argument(
        "--save", help="where to save the checkpoint (default: a temporary directory removed at the end)"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model, opt = build(device, world)
    if args.load:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=args.load)  # resharded for this number of ranks
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    train(model, opt, device, rank, args.steps)

    path = args.save
    if path is None:
        path = [tempfile.mkdtemp(prefix="flatopt-fsdp2-") if rank == 0 else None]
        dist.broadcast_object_list(path)
        path = path[0]
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    if rank == 0:
        print(f"saved the model and the optimizer (DTensor states, sharded) to {path}")

    # a new model and optimizer loaded from the checkpoint take the same steps as the ones that saved it
    model2, opt2 = build(device, world)
    state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model2, state["model"])
    set_optimizer_state_dict(model2, opt2, state["optim"])
    train(model, opt, device, rank, 3, first=args.steps)
    train(model2, opt2, device, rank, 3, first=args.steps)
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), model2.parameters()))
    print(f"rank {rank}: resumed model {'matches' if same else 'DIFFERS FROM'} the original after 3 more steps")
    dist.barrier()  # no rank tears gloo down while another still talks to it
    if args.save is None and rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
