"""Rank processes for tests/test_dcp_dist.py: FSDP2 on a tiny GPT (gloo on 127.0.0.1, CPU).

    python tests/dcp_worker.py <scenario> <rank> <world> <port> <args.json>

Scenarios (each rank writes ``<out>/<scenario>-r<rank>.json``):
  save    train a few AdamW steps; at each save step write the state with ckptzip lossless and
          plain DCP (the oracle), at the last one also with ckptzip dynaquant (sketches merged
          across ranks, config searched collectively with eval_fn = validation loss of the FSDP model)
  load    a fresh FSDP2 model + optimizer at this world size; load the lossless root and the plain
          DCP checkpoint; every local shard must be bit-identical
  sketches  dist.all_reduce_sketches where ranks hold different keys: the merge equals one sketch
          of every rank's values
  kill    commit step 1, then rank 1 SIGKILLs itself after writing its step-2 file (before the
          commit); the survivors' dcp.save must fail
"""
import datetime
import json
import math
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

warnings.filterwarnings("ignore")  # DCP warns about no_dist / planner signatures; not under test


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (z.view(B, T, self.heads, C // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Byte-level GPT: vocab 256, d 64, 2 blocks, 4 heads, lm_head tied to wte (~0.12M params)."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's init: N(0, 0.02), zero biases
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):  # (B, T) -> (B, T, 256)
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def text() -> torch.Tensor:
    from ckptzip.demo.workloads import stdlib_text

    return torch.frombuffer(bytearray(stdlib_text(200_000)), dtype=torch.uint8).long()


def batch(data: torch.Tensor, seed: int, n: int = 8, seq: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq, (n,), generator=g)
    return torch.stack([data[s:s + seq] for s in starts.tolist()])


def loss_of(model, b) -> torch.Tensor:
    logits = model(b[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 256), b[:, 1:].reshape(-1))


def build(world: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyGPT()
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def state_of(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "loop": {"epoch": 1, "tag": "tiny-gpt"}}


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def bits_equal(a, b) -> bool:
    a, b = local(a), local(b)
    w = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(w), b.contiguous().view(w))


@torch.no_grad()
def val_loss(model, data) -> float:
    return float(loss_of(model, batch(data, 999, n=16)))


def main(scenario, rank, world, port, args):
    from ckptzip.dcp import CompressedReader, CompressedWriter
    from ckptzip.dcp.tools import flat_tensors

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    out = {}
    data = text()
    if scenario == "save":
        model, opt = build(world, seed=0)
        vb = batch(data, 999, n=16)

        @torch.no_grad()
        def eval_fn(m):  # under FSDP: a collective forward on every rank
            return float(loss_of(m, vb))

        for step in range(1, args["steps"] + 1):
            loss_of(model, batch(data, step)).backward()
            opt.step()
            opt.zero_grad()
            if step in args["save_at"]:
                sd = state_of(model, opt)
                dcp.save(sd, storage_writer=CompressedWriter(args["lossless"], step=step, method="lossless"))
                if step == max(args["save_at"]):  # one sharded search + encode: the slowest save here
                    dcp.save(sd, storage_writer=CompressedWriter(args["dynaquant"], step=step, method="dynaquant",
                                                                 model=model, eval_fn=eval_fn, threshold=0.01))
                dcp.save(sd, checkpoint_id=f"{args['plain']}/{step}")
        out["val_loss"] = eval_fn(model)
    elif scenario == "load":
        model, opt = build(world, seed=1)
        loss_of(model, batch(data, 0)).backward()
        opt.step()  # creates the optimizer state the load fills in
        ours, plain = state_of(model, opt), state_of(model, opt)
        dcp.load(ours, storage_reader=CompressedReader(args["lossless"]))
        dcp.load(plain, checkpoint_id=f"{args['plain']}/{args['step']}")
        a, b = dict(flat_tensors(ours)), dict(flat_tensors(plain))
        out["keys_equal"] = sorted(a) == sorted(b)
        out["differ"] = [k for k in a if not bits_equal(a[k], b[k])]
        out["n_tensors"] = len(a)
        out["loop"] = ours["loop"]
    elif scenario == "sketches":  # dist.all_reduce_sketches with key sets that differ between ranks
        from ckptzip import dist as cdist
        from ckptzip.sketch import LogSketch

        g = torch.Generator().manual_seed(rank)
        data = {"both": torch.randn(5000, generator=g), f"only{rank}": torch.randn(300, generator=g) * 1e-3}
        merged = cdist.all_reduce_sketches({k: LogSketch(0.01).add(v) for k, v in data.items()}, dist.group.WORLD)
        everything = [None] * world
        dist.all_gather_object(everything, {k: v.tolist() for k, v in data.items()})
        out["keys"] = sorted(merged)
        out["exact"] = all(merged[k] == LogSketch(0.01).add(torch.tensor(sum((d.get(k, []) for d in everything), [])))
                           for k in merged)
    elif scenario == "kill":
        model, opt = build(world, seed=0)
        loss_of(model, batch(data, 1)).backward()
        opt.step()
        sd = state_of(model, opt)
        dcp.save(sd, storage_writer=CompressedWriter(args["root"], step=1))
        dcp.save(sd, checkpoint_id=f"{args['plain']}/1")

        class DyingWriter(CompressedWriter):
            def write_data(self, plan, planner):
                fut = super().write_data(plan, planner)
                if self.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # file written, commit never happens
                return fut

        loss_of(model, batch(data, 2)).backward()
        opt.step()
        try:
            dcp.save(state_of(model, opt), storage_writer=DyingWriter(args["root"], step=2))
            out["save2"] = "returned"
        except Exception as e:  # noqa: BLE001 - the survivors must see the failure
            out["save2"] = f"raised {type(e).__name__}"
        json.dump(out, open(f"{args['out']}/{scenario}-r{rank}.json", "w"))
        os._exit(0)  # the group is broken: no barrier, no teardown
    json.dump(out, open(f"{args['out']}/{scenario}-r{rank}.json", "w"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
