"""A run of ``recurformer train``: stateful segment training (``steps.SegmentSteps``) of one
registered model to ``train.steps`` in the one loop (``loop.run_loop``), its run directory, its
checkpoints (``parts``), its logs and its stop on a signal. Runs on one process or under
``torchrun`` (DDP)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import checkpoint as ckpt
from .. import loggers
from ..config import RecurformerError, opt
from ..device import fast_matmuls, graphs_or_eager
from ..progress import Progress
from .config import RunConfig
from .data import run_data
from .loop import Cadence, run_loop
from .meter import RunLog
from .parts import ModelWeights, OptimizerState, Stateful, restore_parts, save_parts, state_dicts
from .ranks import join_processes
from .signals import StopSignals, TrainingInterrupted
from .steps import CarriedState, SegmentSteps, StreamCursors


class Trainer(SegmentSteps):
    """Holds everything that a checkpoint must restore: model, optimizer, step, data streams,
    carried state, RNG. ``run()`` trains to ``train.steps``.

    ``train.out_dir`` is never silently reused: it must not hold another run, unless ``resume``
    continues that very run (from its newest checkpoint, or from an older one when ``overwrite``
    allows deleting the later ones) or ``overwrite`` allows replacing it. Messages name options
    with ``config.opt`` (``--resume`` on the command line, ``resume=`` in Python)."""

    def __init__(
        self,
        cfg: RunConfig,
        resume: str | None = None,
        show_progress: bool = True,
        overwrite: bool = False,
        stop: StopSignals | None = None,
    ) -> None:
        t = cfg.train
        device, rank, world = join_processes(t.device)
        graphs = graphs_or_eager(
            t.cuda_graphs,
            device,
            "train.cuda_graphs",
            "this run trains",
            world,
            f" (train without captured steps: {opt('train.cuda_graphs', False)})",
        )
        self.show_progress = show_progress and rank == 0
        out_dir = Path(t.out_dir)
        resumed = ckpt.load_checkpoint(resume, with_train_state=True, resuming=True) if resume else None
        if resumed is not None and (saved := resumed["config"].get("model", {}).get("name")) != cfg.model["name"]:
            raise RecurformerError(
                f"checkpoint {resumed['dir']} holds a '{saved}' model, the config asks for '{cfg.model['name']}'"
            )
        self.resumed_from: Path | None = resumed["dir"] if resumed is not None else None
        self.unreadable: list[str] = []  # the checkpoints after the resumed one that did not read, deleted
        if rank == 0:  # before the data is prepared: fail fast
            self.unreadable = ckpt.claim_run_dir(out_dir, resumed, overwrite, cfg.model["name"])
        data = run_data(cfg.data, resumed, rank, world)
        self.meta, self.val_tokens, self.tokenizer, self.data_dir = data.meta, data.val_tokens, data.tokenizer, data.dir
        super().__init__(cfg, data, device, rank, world, out_dir)
        if t.warmup > t.steps:  # the warmup is cut off before it reaches train.lr
            self._note(
                f"warning: train.warmup = {t.warmup} is more than train.steps = {t.steps}: the learning rate never "
                f"reaches train.lr = {t.lr:g} (it ends at {self.update.lr_at(t.steps - 1):.3g}); set train.warmup to "
                f"at most {t.steps}, e.g. {t.steps // 10}"
            )
        if graphs is not None:
            self.capture_steps(graphs)
        if resumed is not None:
            restore_parts(self.parts(), resumed)
        self.stop = stop or StopSignals()  # installed by run(); by train_main from the start
        self.logs = RunLog([], self.out_dir)
        self.header: list[str] = []
        self.last: dict[str, Any] = {}  # the last metrics logged
        self.existing = ckpt.entries(self.out_dir)  # what the run directory held before this run
        if self.rank == 0:
            ckpt.open_run_dir(self.out_dir, resumed["dir"].parent if resumed is not None else None, self.step)
            sinks, notes = loggers.make_sinks(t.loggers, self.out_dir, self._config_dict())
            self.logs = RunLog(sinks, self.out_dir)
            self.header = loggers.run_header(self, notes)

    @property
    def peak_flops(self) -> float:
        """The matmul peak the mfu is taken of (``Throughput``: re-measured once where stale)."""
        return self.meter.peak_flops

    @property
    def peak_source(self) -> str:
        return self.meter.peak_source

    def _config_dict(self) -> dict[str, Any]:
        d = asdict(self.cfg)
        d["model"] = {"name": self.cfg.model["name"], **asdict(self.model.config)}
        d["data"]["dir"] = str(self.data_dir)
        return d

    def parts(self) -> dict[str, Stateful]:
        """The named parts of the training state; ``train`` (this trainer) holds the counters."""
        return {
            "train": self,
            "model": ModelWeights(self.model, str(self.resumed_from)),
            "optimizer": OptimizerState(self.opt),
            "rng": ckpt.RNGState(),
            "streams": StreamCursors(self),
            "state": CarriedState(self),
            "pace": self.pacing,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "world_size": self.world, "data_key": self.data.key}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("world_size", 1) != self.world:
            raise RecurformerError(
                f"checkpoint was written by {sd.get('world_size')} ranks; resume it on the same number (got {self.world})"
            )
        self.step, self.tokens_seen = sd["step"], sd["tokens_seen"]

    def save(self) -> Path | None:
        """Every rank gives its parts (carried states and data cursors are gathered); rank 0
        writes one checkpoint."""
        sd = state_dicts(self.parts())
        if self.rank != 0:
            dist.barrier()  # wait until rank 0 has written the checkpoint
            return None
        path = save_parts(
            self.out_dir, self.step, sd, self._config_dict(), self.data.tokenizer_json, self.cfg.train.keep_last
        )
        if self.world > 1:
            dist.barrier()
        return path

    def close_loggers(self) -> None:
        self.logs.close()

    def _say(self, msg: str) -> None:
        if self.show_progress:
            tqdm.write(msg)

    def run(self) -> dict[str, Any]:
        """Train to ``train.steps``; returns the last metrics logged. On SIGINT/SIGTERM: finish the
        step, save, raise ``TrainingInterrupted``."""
        with self.stop.installed(), fast_matmuls(self.device):
            t = self.cfg.train
            if self.resumed_from is not None and self.step >= t.steps:
                self._say(
                    f"{self.resumed_from} is already at step {self.step} of train.steps={t.steps}: the run is finished "
                    f"(raise it with {opt('train.steps', 'N', True)} to train further)"
                )
                return {}
            self._val_streams()  # a validation split too short for the streams fails now, not at the first evaluation
            stop = self.stop.agreed(self.world, self.device)
            if stop:  # a signal while the run was being set up
                raise TrainingInterrupted(stop, self.step, None, self.out_dir)
            if self.show_progress:
                print("\n".join(self.header), flush=True)
            else:  # without the header, still say why a run will be slow
                for line in self.header:
                    if line.startswith("warning:"):
                        print(line, file=sys.stderr, flush=True)
            if self.resumed_from is not None:
                gone = f" (deleted {', '.join(self.unreadable)} after it: unreadable)" if self.unreadable else ""
                self._say(
                    f"resuming from {self.resumed_from} at step {self.step} of {t.steps}, writing to {self.out_dir}{gone}"
                )
            self.model.train()
            self.last = {}
            self.meter.start(self.tokens_seen)
            cadence = Cadence(t.steps, t.log_every, t.eval_every, t.save_every)
            self.bar = Progress(t.steps, "train", "step", initial=self.step, show=self.show_progress)
            try:
                run_loop(self, cadence, self.bar, self.stopped, self.meter.paused)
            finally:
                self.bar.close()
            return self.last

    def take_step(self) -> torch.Tensor:
        """``train_step`` with its loss unread: the loop reads it at a log point or before a
        checkpoint, so steps queue their work without waiting for the device."""
        return self.train_step(read=False)

    def log(self, loss: torch.Tensor) -> None:
        """The step's metrics (one wait for the device, so the clock counts the queued steps)."""
        value = self.read_loss(loss)
        tps, mean_tps, mfu = self.meter.lap(self.tokens_seen)
        # tok_per_s: the last log interval's rate; mean_tok_per_s and mfu: the run so far
        self.last = {
            "step": self.step,
            "loss": value,
            "lr": self.update.lr_at(self.step - 1),
            "tokens": self.tokens_seen,
            "tok_per_s": tps,
            "mean_tok_per_s": mean_tps,
            "mfu": mfu,
        }
        self.bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{tps:,.0f}", mean_tok_s=f"{mean_tps:,.0f}", mfu=f"{mfu:.0%}")
        self.logs.log(self.last)

    def validate(self) -> None:
        val = self.evaluate()
        self.last = {**self.last, "step": self.step, "val_loss": val}
        self.logs.log({"step": self.step, "val_loss": val, "tokens": self.tokens_seen})
        self._say(f"step {self.step}: val loss {val:.4f}")

    def checkpoint(self, loss: torch.Tensor) -> None:
        if self.unread.total is not None:  # never save a model whose loss went non-finite
            self.read_loss(loss)
        path = self.save()
        if path is not None:
            self._say(f"saved {path}")

    def stopped(self) -> TrainingInterrupted | None:
        """What to raise, once the step is saved, when a signal asked to stop (None: train on)."""
        signum = self.stop.agreed(self.world, self.device)
        return (
            TrainingInterrupted(signum, self.step, self.out_dir / f"step_{self.step:06d}", self.out_dir)
            if signum
            else None
        )
