"""A training process for tests/test_lease.py: a digits MLP saved through a Compressor, driven line
by line so that two of them can be interleaved exactly.

Run as ``python chain_writer.py CHAIN_URL DATA_FILE`` (DATA_FILE: digits features and labels saved
with torch.save, loaded with weights_only=True); stdin commands, one answer line each:

    open [takeover]   -> "opened"             a new Compressor on the chain (closing none before)
    restore           -> "restored STEP|none"
    save              -> "saved STEP"         one Adam step, then a save of step latest+1
    close             -> "closed"
    quit              -> exits
A failed command answers "error <ExceptionClass>: <message>" and the process keeps serving.
"""
from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

from ckptzip.api import Compressor  # noqa: E402
from ckptzip.demo.workloads import DigitsMLP  # noqa: E402


def main() -> None:
    url = sys.argv[1]
    data = torch.load(sys.argv[2], weights_only=True)
    x, y = data["x"], data["y"]
    torch.manual_seed(0)
    model = DigitsMLP(hidden=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ck, step = None, 0
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        try:
            if cmd[0] == "open":
                ck = Compressor(model, opt, url, method="lossless", takeover="takeover" in cmd)
                out = "opened"
            elif cmd[0] == "restore":
                got = ck.restore()
                step = got or 0
                out = f"restored {got if got is not None else 'none'}"
            elif cmd[0] == "save":
                idx = torch.randint(0, len(x), (32,))
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                ck.save(step + 1)
                step += 1
                out = f"saved {step}"
            elif cmd[0] == "close":
                ck.close()
                out = "closed"
            elif cmd[0] == "quit":
                return
            else:
                out = f"error ValueError: unknown command {line.strip()!r}"
        except Exception as e:
            out = f"error {type(e).__name__}: {e}"
        print(out, flush=True)


if __name__ == "__main__":
    main()
