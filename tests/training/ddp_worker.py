"""Run by tests/training/test_ddp.py under torchrun: train a few steps and dump what the test compares."""

import os
import sys

import torch

from recurformer.training.config import load_run_config
from recurformer.training.trainer import Trainer

out, steps, resume = sys.argv[1], int(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None)
overrides = sys.argv[4:]
cfg = load_run_config(None, overrides + [f"train.steps={steps}"])
tr = Trainer(cfg, resume=resume, show_progress=False)
losses = [tr.train_step() for _ in range(steps - tr.step)]
tr.save()
rank = int(os.environ.get("RANK", 0))
flat = tr.state.to_flat()
torch.save(
    {
        "params": {k: v.detach().clone() for k, v in tr.model.state_dict().items()},
        "state": flat,
        "losses": losses,
        "streams": tr.streams.state_dict(),
    },
    os.path.join(out, f"rank{rank}.pt"),
)
if tr.world > 1:
    torch.distributed.destroy_process_group()
