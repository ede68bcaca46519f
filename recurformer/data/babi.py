"""bAbI-style questions in book text, as BABILong builds them (Kuratov et al., "BABILong: Testing
the Limits of LLMs with Long Context Reasoning-in-a-Haystack", 2024): a story of ``num_facts``
facts from the bAbI task definitions (Weston et al., "Towards AI-Complete Question Answering: A Set
of Prerequisite Toy Tasks", 2015), its facts kept in order at uniform random positions of book text
(``booktext``), then the question and the one-word answer, scored by exact match.

- ``qa1`` (single supporting fact): actors move ("Mary moved to the bathroom."); "Where is Mary?"
  is answered by her last move.
- ``qa2`` (two supporting facts): actors also pick up and drop objects ("John picked up the
  football."); "Where is the football?" is answered by where its carrier is, or where it was dropped.
- ``qa3`` (three supporting facts): "Where was the football before the kitchen?" is answered by the
  place the object was in just before it came to that place (asked only of a place it came to once).

Actors, places, objects and verbs come from small lists (bAbI's own words). ``length`` is the row's
input tokens; the question is " Question: ...? Answer:" and the answer " place". With
``num_questions`` > 1, the story also asks questions inside it as bAbI's own stories do, each right
after a fact and answered there (scored too): more to learn from per row in training
(``synth.train_settings``), while a test asks the one question at the end, as BABILong does.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Callable

import numpy as np

from ..config import opt
from .booktext import Parts, check_fits, encode, layout
from .rows import Arrays, need

ACTORS = ["Mary", "John", "Daniel", "Sandra"]
PLACES = ["bathroom", "hallway", "kitchen", "garden", "office", "bedroom"]
OBJECTS = ["football", "apple", "milk"]
MOVES = ["moved to", "went to", "travelled to", "journeyed to", "went back to"]
GETS = ["picked up", "got", "grabbed", "took"]
DROPS = ["dropped", "discarded", "put down", "left"]
FACT = " {actor} {verb} the {what}."
QUESTIONS = {
    "qa1": " Question: Where is {actor}? Answer:",
    "qa2": " Question: Where is the {obj}? Answer:",
    "qa3": " Question: Where was the {obj} before the {place}? Answer:",
}
TRIES = 1000  # stories drawn for one row before its task is declared unanswerable

History = dict[str, list[str]]  # each actor's and object's places in order
Question = tuple[str, str]  # (the question, its answer)
# a story: its facts, the questions asked right after some of them (by fact index), the last question
Story = tuple[list[str], dict[int, Question], Question]


def _pick(rng: np.random.Generator, words: list[str]) -> str:
    return words[int(rng.integers(len(words)))]


def _simulate(rng: np.random.Generator, num_facts: int, objects: bool) -> tuple[list[str], list[History]]:
    """``num_facts`` facts of a random world (moves; with ``objects`` also pick-ups and drops), and
    after each fact, each actor's and object's places in order ("where it was", consecutive
    repeats dropped)."""
    at: dict[str, str] = {}  # actor -> place
    holder: dict[str, str] = {}  # object -> actor carrying it
    history: dict[str, list[str]] = {}
    facts: list[str] = []
    snapshots: list[History] = []

    def arrive(thing: str, place: str) -> None:
        h = history.setdefault(thing, [])
        if not h or h[-1] != place:
            h.append(place)

    while len(facts) < num_facts:
        actor = _pick(rng, ACTORS)
        carried = [o for o, a in holder.items() if a == actor]
        free = [o for o in OBJECTS if o not in holder]
        action = rng.random() if objects else 0.0
        if action < 0.5 or actor not in at:
            at[actor] = _pick(rng, PLACES)
            facts.append(FACT.format(actor=actor, verb=_pick(rng, MOVES), what=at[actor]))
            arrive(actor, at[actor])
            for o in carried:
                arrive(o, at[actor])
        elif action < 0.8 and free:
            o = _pick(rng, free)
            holder[o] = actor
            facts.append(FACT.format(actor=actor, verb=_pick(rng, GETS), what=o))
            arrive(o, at[actor])
        elif carried:
            o = _pick(rng, carried)
            del holder[o]
            facts.append(FACT.format(actor=actor, verb=_pick(rng, DROPS), what=o))
        if len(snapshots) < len(facts):
            snapshots.append({k: list(v) for k, v in history.items()})
    return facts, snapshots


def _qa1(rng: np.random.Generator, history: History) -> Question | None:
    actor = _pick(rng, sorted(history))
    return QUESTIONS["qa1"].format(actor=actor), history[actor][-1]


def _qa2(rng: np.random.Generator, history: History) -> Question | None:
    placed = sorted(o for o in OBJECTS if o in history)
    if not placed:
        return None
    o = _pick(rng, placed)
    return QUESTIONS["qa2"].format(obj=o), history[o][-1]


def _qa3(rng: np.random.Generator, history: History) -> Question | None:
    asks = [(o, j) for o in OBJECTS for j in range(1, len(history.get(o, []))) if history[o].count(history[o][j]) == 1]
    if not asks:
        return None
    o, j = asks[int(rng.integers(len(asks)))]
    return QUESTIONS["qa3"].format(obj=o, place=history[o][j]), history[o][j - 1]


ASK: dict[str, Callable[[np.random.Generator, History], Question | None]] = {"qa1": _qa1, "qa2": _qa2, "qa3": _qa3}


def _story(rng: np.random.Generator, task: str, num_facts: int, num_questions: int) -> Story | None:
    """A story of ``num_facts`` facts and its last question (None when it asks nothing
    answerable), with up to ``num_questions - 1`` more questions asked inside it, bAbI's format:
    each right after a fact, about the world at that point, at distinct facts drawn uniformly from
    those that have an answerable question."""
    facts, snapshots = _simulate(rng, num_facts, objects=task != "qa1")
    ask = ASK[task]
    last = ask(rng, snapshots[-1])
    if last is None:
        return None
    if num_questions == 1:  # (no draws: the rows of one question stay what they were)
        return facts, {}, last
    inside = [(k, q) for k in range(num_facts - 1) if (q := ask(rng, snapshots[k])) is not None]
    picked = rng.permutation(len(inside))[: num_questions - 1]
    return facts, dict(inside[k] for k in picked), last


@lru_cache(maxsize=16)
def _longest(vocab_size: int, task: str) -> tuple[int, int]:
    """The most tokens a fact takes, and the task's question with its answer, over every word."""
    words = [*itertools.product(ACTORS, MOVES, PLACES), *itertools.product(ACTORS, GETS + DROPS, OBJECTS)]
    fact = max(len(encode(vocab_size, FACT.format(actor=a, verb=v, what=w))) for a, v, w in words)
    asks = {QUESTIONS[task].format(actor=a, obj=o, place=p) for a, o, p in itertools.product(ACTORS, OBJECTS, PLACES)}
    answer = max(len(encode(vocab_size, " " + p)) for p in PLACES)
    return fact, max(len(encode(vocab_size, q)) for q in asks) + answer


def _babi(
    rng: np.random.Generator,
    n: int,
    task: str,
    least: int,
    vocab_size: int,
    length: int,
    num_facts: int,
    num_questions: int,
    split: str,
) -> Arrays:
    """``n`` rows of a story's facts in the ``split`` text, each with its questions and answers."""
    need(
        num_facts >= least,
        f"task {task} needs at least {least} facts to ask its question, got {opt('task.num_facts', num_facts)}: "
        f"set {opt('task.num_facts', least)} or more",
    )
    need(
        1 <= num_questions <= num_facts,
        f"task {task} asks its questions after its facts (one at the end, the others right after a fact): "
        f"got {opt('task.num_questions', num_questions)} for {opt('task.num_facts', num_facts)}: "
        f"set {opt('task.num_questions', 1)} to {num_facts}",
    )
    fact, rest = _longest(vocab_size, task)
    check_fits(task, length, vocab_size, split, num_facts * fact + (num_questions - 1) * rest, rest, noise=False)
    parts: list[Parts] = []
    for _ in range(n):
        drawn = next(
            (s for s in (_story(rng, task, num_facts, num_questions) for _ in range(TRIES)) if s is not None), None
        )
        need(
            drawn is not None,
            f"task {task} drew no answerable story in {TRIES} tries: set {opt('task.num_facts', 2 * num_facts)}",
        )
        assert drawn is not None
        facts, inside, (question, answer) = drawn
        inserts, tails = [], []
        for k, f in enumerate(facts):
            inserts.append(list(encode(vocab_size, f)))
            tails.append(0)
            if k in inside:
                said = list(encode(vocab_size, " " + inside[k][1]))
                inserts[-1] += list(encode(vocab_size, inside[k][0])) + said
                tails[-1] = len(said)
        parts.append(Parts(inserts, list(encode(vocab_size, question)), list(encode(vocab_size, " " + answer)), tails))
    return layout(rng, length, vocab_size, split, parts)


def qa1(
    rng: np.random.Generator,
    n: int,
    vocab_size: int = 1024,
    length: int = 256,
    num_facts: int = 4,
    num_questions: int = 1,
    *,
    split: str = "train",
) -> Arrays:
    """bAbI QA1, single supporting fact: "Where is Mary?" after ``num_facts`` moves in book text."""
    return _babi(rng, n, "qa1", 1, vocab_size, length, num_facts, num_questions, split)


def qa2(
    rng: np.random.Generator,
    n: int,
    vocab_size: int = 1024,
    length: int = 256,
    num_facts: int = 6,
    num_questions: int = 1,
    *,
    split: str = "train",
) -> Arrays:
    """bAbI QA2, two supporting facts: "Where is the football?" after moves, pick-ups and drops."""
    return _babi(rng, n, "qa2", 2, vocab_size, length, num_facts, num_questions, split)


def qa3(
    rng: np.random.Generator,
    n: int,
    vocab_size: int = 1024,
    length: int = 320,
    num_facts: int = 8,
    num_questions: int = 1,
    *,
    split: str = "train",
) -> Arrays:
    """bAbI QA3, three supporting facts: "Where was the football before the kitchen?"."""
    return _babi(rng, n, "qa3", 3, vocab_size, length, num_facts, num_questions, split)


BABI = {f.__name__: f for f in (qa1, qa2, qa3)}
