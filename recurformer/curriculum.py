"""Training recipes for a state that must remember: schedules and initial states.

*Schedules* (curricula) change a few training values at given steps, e.g. the number of segments
backpropagated through before the state is detached, 1 -> 2 -> 4 -> 8, each stage starting from
the last (Bulatov et al., "Scaling Transformer to 1M tokens and beyond with RMT", 2023, §3: the
curriculum over the number of segments), or the length of a synthetic task. A schedule is either
explicit stages, each with the step at which it starts::

    schedule: {stages: [{step: 0, truncation: 1}, {step: 500, truncation: 2}, {step: 1000, truncation: 4}]}

or doubling: every key of ``double`` starts at its base value and doubles every ``double_every``
steps until it reaches the value given (which must be the base times a power of two)::

    schedule: {double_every: 500, double: {truncation: 4}}     # the same schedule as above

The value in force at a step is a pure function of the step, so a resumed run is in the same
stage as the run it continues, unless the schedule is *self-paced* (synth only): with
``advance_below: x`` a stage's step is its latest start, and it starts earlier, at the step after
the mean training loss of the stage before it over its last ``advance_window`` steps first falls
below x nats. The model then moves on once it has learned a stage, not at a step tuned to one
model, as the ARMT authors' curriculum moves on at a target metric (Rodkin et al., "Associative
Recurrent Memory Transformer", 2024, §4; BABILong, Kuratov et al. 2024, stops each stage early)::

    schedule: {advance_below: 0.1, stages: [{step: 3000, length: 128}]}   # distance 0, then 128

Where the stages start is then the run's own (``Pace``), saved with its progress.

*Initial states* (Buitrago Ruiz & Gu, "Understanding and Improving Length Generalization in
Recurrent Models", ICML 2025, §4: state passing and noise as initial states): a row that starts a
new document begins from the model's own initial state (``zero``), from that state plus Gaussian
noise N(0, sigma^2) on every floating-point tensor of its layer states (``noise``), or from the
final state of another stream's last segment (``passing``), so the model sees non-zero states at
the start of training documents and not only after reading one. ``share`` < 1 gives the noisy or
passed state to that fraction of the starting rows only; the others begin from the initial state,
which then keeps being trained (with ``passing`` alone no row ever starts from it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .config import RecurformerError, check_range
from .nn import State, StreamingLM

StateInit = Literal["zero", "noise", "passing"]


@dataclass
class Schedule:
    """Stages ``[{step: S, key: value, ...}, ...]`` (steps strictly increasing) or doubling."""

    stages: list[dict[str, int]] = field(default_factory=list)
    double_every: int = 0
    double: dict[str, int] = field(default_factory=dict)
    advance_below: float = 0.0  # self-paced: a stage starts once the last one's training loss is below this (0: off)
    advance_window: int = 100  # the steps that mean is over

    def check(self, where: str, keys: tuple[str, ...], base: dict[str, int]) -> None:
        """One-line errors for a schedule that is not monotone in steps, names a key outside
        ``keys``, or doubles to a value that is not the base times a power of two."""
        if self.stages and self.double_every:
            raise RecurformerError(f"{where}: give either 'stages' or 'double_every', not both")
        check_range("double_every", self.double_every, (0, True, None, False), f"config key '{where}.double_every'")
        if bool(self.double_every) != bool(self.double):
            raise RecurformerError(
                f"{where}: 'double_every' and 'double' go together (got double_every={self.double_every}, double={self.double})"
            )
        if not (isinstance(self.advance_below, (int, float)) and self.advance_below >= 0):
            raise RecurformerError(
                f"config key '{where}.advance_below' must be a training loss >= 0 (0: off), got {self.advance_below!r}"
            )
        check_range(
            "advance_window", self.advance_window, (1, True, None, False), f"config key '{where}.advance_window'"
        )
        last = -1
        for i, st in enumerate(self.stages):
            if not isinstance(st, dict) or not isinstance(st.get("step"), int) or isinstance(st.get("step"), bool):
                raise RecurformerError(f"config key '{where}.stages[{i}]' needs an integer 'step', got {st!r}")
            if st["step"] <= last:
                raise RecurformerError(
                    f"config key '{where}.stages' must start at increasing steps, got step {st['step']} after step {last}"
                )
            last = st["step"]
            for k, v in st.items():
                if k != "step":
                    self._check_value(f"{where}.stages[{i}].{k}", k, v, keys)
        for k, v in self.double.items():
            self._check_value(f"{where}.double.{k}", k, v, keys)
            b = base[k]
            if b < 1:
                raise RecurformerError(f"config key '{where}.double.{k}' doubles from {b}; set a base value >= 1")
            if v < b or v % b or (v // b) & (v // b - 1):
                raise RecurformerError(
                    f"config key '{where}.double.{k}' must be {b} (the base value) times a power of two, got {v}"
                )

    @staticmethod
    def _check_value(name: str, key: str, value: Any, keys: tuple[str, ...]) -> None:
        if key not in keys:
            raise RecurformerError(f"config key '{name}' is not schedulable (schedulable: {', '.join(keys)})")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RecurformerError(f"config key '{name}' must be an integer >= 1, got {value!r}")

    def stage_list(self, base: dict[str, int]) -> list[dict[str, int]]:
        """Every stage ``{step, key: value}`` with every key of ``base`` filled in (stage 0 at
        step 0 holds the base values unless the schedule's first stage starts there)."""
        out = [{"step": 0, **base}]
        if self.double_every:
            k = 1
            while any(1 <= base[key] and base[key] << k <= top for key, top in self.double.items()):
                out.append(
                    {
                        **out[-1],
                        "step": k * self.double_every,
                        **{key: min(base[key] << k, top) for key, top in self.double.items()},
                    }
                )
                k += 1
        for st in self.stages:
            if st["step"] == 0:
                out[0] = {**out[0], **st}
            else:
                out.append({**out[-1], **st})
        return out

    def at(self, step: int, base: dict[str, int], pace: Pace | None = None) -> dict[str, int]:
        """The values in force at ``step`` (0-based: the step about to be taken); a self-paced
        run's stages start where its ``pace`` says."""
        current = base
        for i, st in enumerate(self.stage_list(base)):
            if (st["step"] if pace is None else pace.starts[i]) <= step:
                current = {k: v for k, v in st.items() if k != "step"}
        return current

    def pace(self, base: dict[str, int]) -> Pace:
        """A run's pace before its first step: every stage at its own step."""
        return Pace(starts=[st["step"] for st in self.stage_list(base)])

    def observe(self, pace: Pace, step: int, loss: float) -> int | None:
        """Record step ``step``'s training loss; with ``advance_below``, when the mean over the
        current stage's last ``advance_window`` steps is below it, the next stage starts at the
        next step (if it would start later). Returns the stage so started, or None."""
        if not self.advance_below:
            return None
        stage = sum(s <= step for s in pace.starts) - 1
        if stage != pace.stage:  # a stage started (at its step, or advanced): count its own steps
            pace.stage, pace.recent = stage, []
        pace.recent = (pace.recent + [loss])[-self.advance_window :]
        nxt = stage + 1
        if nxt < len(pace.starts) and pace.starts[nxt] > step + 1 and len(pace.recent) == self.advance_window:
            if sum(pace.recent) / len(pace.recent) < self.advance_below:
                pace.starts[nxt] = step + 1
                return nxt
        return None

    def sets(self, key: str) -> bool:
        """Whether the schedule changes ``key`` at all."""
        return key in self.double or any(key in st for st in self.stages)

    def values(self, key: str, base: dict[str, int]) -> list[int]:
        """Every value ``key`` takes over the run (for checks before any work starts)."""
        return sorted({st[key] for st in self.stage_list(base)})


@dataclass
class Pace:
    """Where a run's schedule is: ``starts``, the step each stage of ``Schedule.stage_list``
    starts at (its own step, or earlier for a self-paced one), the current ``stage`` and the
    training losses of its last steps (``recent``). Saved with a run's progress (``asdict``)."""

    starts: list[int]
    stage: int = 0
    recent: list[float] = field(default_factory=list)


def schedule_from(value: Any, where: str) -> Schedule:
    """Build a ``Schedule`` from its config mapping (``{}`` or None: no schedule)."""
    if value is None or value == {}:
        return Schedule()
    if isinstance(value, Schedule):
        return value
    if not isinstance(value, dict):
        raise RecurformerError(f"config key '{where}' must be a mapping (stages or double_every), got {value!r}")
    names = {f.name for f in dataclasses.fields(Schedule)}
    for k in value:
        if k not in names:
            raise RecurformerError(f"unknown config key '{where}.{k}' (valid keys: {', '.join(sorted(names))})")
    stages, double = value.get("stages") or [], value.get("double") or {}
    if not isinstance(stages, list):
        raise RecurformerError(f"config key '{where}.stages' must be a list of mappings, got {stages!r}")
    if not isinstance(double, dict):
        raise RecurformerError(f"config key '{where}.double' must be a mapping key: final value, got {double!r}")
    every, window = value.get("double_every", 0), value.get("advance_window", 100)
    for key, v in (("double_every", every), ("advance_window", window)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise RecurformerError(f"config key '{where}.{key}' must be an integer, got {v!r}")
    below = value.get("advance_below", 0.0)
    if not isinstance(below, (int, float)) or isinstance(below, bool):
        raise RecurformerError(f"config key '{where}.advance_below' must be a number, got {below!r}")
    return Schedule(
        stages=[dict(s) if isinstance(s, dict) else s for s in stages],
        double_every=every,
        double=dict(double),
        advance_below=float(below),
        advance_window=window,
    )


# ----------------------------------------------------------------------------------------------
# initial states


def check_state_init(value: str, where: str) -> None:
    if value not in ("zero", "noise", "passing"):
        raise RecurformerError(f"config key '{where}' must be one of ['zero', 'noise', 'passing'], got {value!r}")


def check_state_init_share(share: float, kind: str, where: str) -> None:
    """``share`` is a fraction in [0, 1], and one other than 1 needs a noisy or passed state to share."""
    if not 0 <= share <= 1:
        raise RecurformerError(f"config key '{where}_share' is a fraction of rows in [0, 1], got {share}")
    if share != 1 and kind == "zero":
        raise RecurformerError(f"config key '{where}_share' = {share} needs {where} noise or passing, got zero")


def initial_state(
    model: StreamingLM,
    kind: str,
    rows: torch.Tensor,
    state: State | None,
    batch_size: int,
    device: torch.device | str,
    generator: torch.Generator,
    sigma: float = 1.0,
    share: float = 1.0,
) -> State:
    """The state to read the next segment from, where the rows marked in ``rows`` ([B] bool)
    start a new document and the others continue ``state`` (None: every row starts).

    ``zero``: the model's initial state (a fresh row, reset lazily by the model itself).
    ``noise``: the initial state plus N(0, sigma^2) on every floating-point layer-state tensor,
    drawn from ``generator`` (on the CPU, so a seed gives the same noise on every device).
    ``passing``: row b takes the final state of row (b + s) mod B of ``state``, s in 1..B-1
    drawn from ``generator`` once per call (another stream's segment; where ``state`` is None the
    rows start from zero). The new states are detached: no gradient reaches the other stream.
    ``share`` < 1: each starting row takes the noisy or passed state with that probability (drawn
    from ``generator`` first) and the initial state otherwise; 1 draws nothing."""
    check_state_init(kind, "train.state_init")
    fresh = model.init_state(batch_size, device)
    rows = rows.to(fresh.fresh.device)
    if state is None:
        if kind != "noise":  # nothing to pass yet: every row starts from the initial state
            return fresh
        rows, state = torch.ones_like(rows), fresh
    if share < 1:
        given_rows = rows & (torch.rand(rows.shape, generator=generator) < share).to(rows.device)
        state, rows = state.reset(rows & ~given_rows), given_rows
    if kind == "zero" or not bool(rows.any()):
        return state.reset(rows)
    if kind == "passing":
        if batch_size < 2:
            raise RecurformerError(
                "state_init=passing needs a batch of at least 2 rows (a row takes another stream's state)"
            )
        shift = int(torch.randint(1, batch_size, (1,), generator=generator))
        perm = (torch.arange(batch_size) + shift) % batch_size
        given = state.detach().map(lambda t: t[perm.to(t.device)])
        return _where_rows(rows, given, state)
    if state.pos % model.reset_boundary:
        raise RecurformerError(f"a noisy initial state needs a segment boundary, the stream is at position {state.pos}")
    layers = [layer.reset(s, torch.ones_like(rows)) for layer, s in zip(model.layers, fresh.layers)]

    def noisy(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.numel() == 0:
            return t
        return t + sigma * torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.device, t.dtype)

    given = State(
        fresh=torch.zeros_like(fresh.fresh),
        start=torch.full_like(fresh.start, state.pos),
        pos=state.pos,
        layers=[s.map(noisy) for s in layers],
        start_floor=state.pos,
    )
    return _where_rows(rows, given, state)


def _where_rows(rows: torch.Tensor, given: State, own: State) -> State:
    """Per row: ``given`` where ``rows``, else ``own`` (the two share shapes and position)."""

    def pick(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dim() == 0 or a.shape[0] != rows.shape[0]:
            return b
        return torch.where(rows.view(-1, *([1] * (a.dim() - 1))).to(a.device), a, b)

    layers = []
    for g, o in zip(given.layers, own.layers):
        gt, ot = g.tensors(), o.tensors()
        layers.append(
            dataclasses.replace(o, **{k: pick(gt[k], ot[k]) for k in ot if k in gt and gt[k].shape == ot[k].shape})
        )
    a, b = given.start_floor, own.start_floor  # a bound below every start of either, when both know one
    return dataclasses.replace(
        own,
        fresh=own.fresh & ~rows,
        start=pick(given.start, own.start),
        layers=layers,
        any_fresh=None,
        start_floor=None if a is None or b is None else min(a, b),
    )


__all__ = ["Schedule", "StateInit", "check_state_init", "check_state_init_share", "initial_state", "schedule_from"]
