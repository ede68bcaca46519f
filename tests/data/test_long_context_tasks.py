"""The long-context tasks in book text (``data.needles``: RULER's needles; ``data.babi``: bAbI-style
questions): each needle or fact is in the row and the scored value is what a trivial reader of the
decoded row answers; test rows' filler comes from books the training text does not hold; rows are
exactly ``length`` tokens; bad input is one line, before work."""

from __future__ import annotations

import re

import pytest

from recurformer.config import RecurformerError
from recurformer.data import booktext
from recurformer.data.babi import ACTORS, MOVES, OBJECTS, PLACES
from recurformer.data.needles import KEYS
from recurformer.data.synthetic import TASKS, TaskData, get_task, make_split, row_tokens
from recurformer.state import IGNORE_INDEX

V = 1024  # the tasks' default vocabulary: one tokenizer for the whole file (lru_cache)
NUMBER = r"(?P<value>\d{7})"
UUID = r"(?P<value>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"


def decoded(d: TaskData) -> list[tuple[str, str, list[int], list[int]]]:
    """(row text, scored text, row tokens, scored tokens) of every row."""
    tok = booktext.tokenizer(V)
    out = []
    for x, y in zip(d.inputs.tolist(), d.targets.tolist()):
        answer = [t for t in y if t != IGNORE_INDEX]
        out.append((tok.decode(x), tok.decode(answer), x, answer))
    return out


def tok_text(ids: tuple[int, ...]) -> str:
    return booktext.tokenizer(V).decode(ids)


def find(row: list[int], part: list[int]) -> int:
    """The token position of ``part`` in ``row`` (-1 if absent)."""
    return next((i for i in range(len(row) - len(part) + 1) if row[i : i + len(part)] == part), -1)


@pytest.mark.parametrize(
    "task, params, kind, value",
    [
        ("s_niah_1", {"length": 160}, "number", NUMBER),
        ("s_niah_2", {"length": 160}, "number", NUMBER),
        ("s_niah_3", {"length": 288}, "uuid", UUID),
        ("mk_niah", {"length": 384, "num_needles": 3}, "number", NUMBER),
    ],
)
def test_a_needle_is_in_the_row_and_a_reader_of_the_text_finds_the_scored_value(
    task: str, params: dict, kind: str, value: str
) -> None:
    rows = decoded(make_split(task, 48, seed=0, params=params, split="test"))
    n_needles = params.get("num_needles", 1)
    starts = []
    for text, scored, x, answer in rows:
        asked = re.fullmatch(
            rf"(?s).* What is the special magic {kind} for (?P<key>[a-z]+-[a-z]+) mentioned in the provided text\? "
            rf"The special magic {kind} for (?P=key) mentioned in the provided text is \S*",
            text,
        )
        assert asked and asked["key"] in KEYS, text[-200:]
        needles = re.findall(rf"One of the special magic {kind}s for ([a-z]+-[a-z]+) is: {value}\.", text)
        assert len(needles) == n_needles and len({k for k, _ in needles}) == n_needles
        read = dict(needles)[asked["key"]]  # the trivial reader: the value the queried key's needle holds
        assert scored == " " + read
        needle = booktext.encode(V, f" One of the special magic {kind}s for {asked['key']} is: {read}.")
        starts.append(find(x, list(needle)))
        assert x[-len(answer) + 1 :] == answer[:-1], "the value is teacher-forced after the query"
        if task == "s_niah_1":  # the filler is the noise sentences
            assert " The grass is green. The sky is blue. The sun is yellow." in text.replace(tok_text(needle), "")
    filler = params["length"] - 100  # about: the needle at a uniform position of the filler
    assert min(starts) >= 0 and min(starts) < filler / 4 and max(starts) > filler / 2, starts


def where(text: str, task: str) -> str:
    """A trivial bAbI reader: the facts of ``text`` in order (regex), and the answer to its last question."""
    place = r"the (\w+)\."
    at: dict[str, str] = {}
    holder: dict[str, str] = {}
    history: dict[str, list[str]] = {}
    fact = re.compile(rf"\b({'|'.join(ACTORS)}) (moved to|went to|travelled to|journeyed to|went back to|"
                      rf"picked up|got|grabbed|took|dropped|discarded|put down|left) {place}")  # fmt: skip
    story, q = text.rsplit(" Question: ", 1)  # the facts before the last question (and earlier answers)
    for actor, verb, what in fact.findall(story):
        if what in OBJECTS:
            if verb in ("picked up", "got", "grabbed", "took"):
                holder[what] = actor
                history.setdefault(what, []).append(at[actor])
            else:
                del holder[what]
        else:
            at[actor] = what
            for o in [o for o, a in holder.items() if a == actor]:
                history[o].append(what)
    if m := re.match(r"Where is (\w+)\?", q):
        return at[m[1]]
    if m := re.match(r"Where is the (\w+)\?", q):
        return history[m[1]][-1]
    m = re.match(r"Where was the (\w+) before the (\w+)\?", q)
    assert m, q
    h = [p for i, p in enumerate(history[m[1]]) if i == 0 or history[m[1]][i - 1] != p]
    return h[h.index(m[2]) - 1]


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3"])
def test_babi_facts_are_in_the_row_and_a_reader_of_the_text_answers_the_question(task: str) -> None:
    d = make_split(task, 48, seed=1, params={"length": 256, "num_facts": 6}, split="test")
    answers = set()
    for text, scored, _, _ in decoded(d):
        assert scored == " " + where(text, task), text
        answers.add(scored)
    assert len(answers) > 2, "the answers vary"


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3"])
def test_babi_questions_inside_the_story_are_answered_where_they_are_asked(task: str) -> None:
    """With num_questions 3, up to two questions come right after a fact, each scored and answered
    by the facts before it (the reader of the text so far); the last question ends the row."""
    d = make_split(task, 32, seed=4, params={"length": 384, "num_facts": 6, "num_questions": 3}, split="test")
    counts = []
    for text, scored, _, _ in decoded(d):
        asked = [m.start() for m in re.finditer(" Question: ", text)]
        said = [where(text[: text.index("?", a) + 1], task) for a in asked]
        assert scored == "".join(" " + a for a in said), text
        assert all(re.search(r"the \w+\.$", text[:a]) for a in asked[:-1]), "each inner question right after a fact"
        assert text[asked[-1] :].count(" Answer:") == 1 and "." not in text[asked[-1] :], (
            "the last question ends the row"
        )
        counts.append(len(asked))
    assert max(counts) == 3 and (min(counts) == 3 if task == "qa1" else min(counts) >= 1), counts


def test_test_rows_filler_is_not_in_the_training_text() -> None:
    """No 64-token window of a test row's filler is in the training text; a training row's is
    (the check can fail)."""
    tok, train = booktext.tokenizer(V), booktext.text("train")

    def windows(split: str) -> list[str]:
        d = make_split("qa1", 4, seed=2, params={"length": 512, "num_facts": 1}, split=split)
        out = []
        for x in d.inputs.tolist():
            for a in range(0, 512 - 64 - 20, 32):
                w = tok.decode(x[a : a + 64])
                if not any(word in w for word in [*ACTORS, *PLACES]):  # filler only, no fact
                    out.append(w[8:-8])
        return out

    test = windows("test")
    assert len(test) > 20 and not any(w in train for w in test)
    assert all(w in train for w in windows("train"))


def test_a_test_row_of_a_million_tokens_reads_books_the_training_text_does_not_hold() -> None:
    """A test row longer than books_val takes its filler from books_val and the training books
    after the train slice: 1M tokens fit, no 64-token window of its filler (sampled over the whole
    row, most of it beyond books_val's length) is in the training text, and the fact is found."""
    tok, train = booktext.tokenizer(V), booktext.text("train")
    L = 1_000_000
    assert len(booktext.stream("test", V)) < L < len(booktext.filler_stream("test", V, L))
    d = make_split("qa1", 1, seed=5, params={"length": L, "num_facts": 1}, split="test")
    x = d.inputs[0].tolist()
    assert len(x) == L
    windows = [tok.decode(x[a : a + 64])[8:-8] for a in range(0, L - 200, L // 40)]
    filler = [w for w in windows if not any(word in w for word in [*ACTORS, *PLACES])]
    assert len(filler) > 30 and not any(w in train for w in filler)
    assert re.search(rf" ({'|'.join(ACTORS)}) ({'|'.join(MOVES)}) the ({'|'.join(PLACES)})[.]", tok.decode(x))


@pytest.mark.parametrize("task", ["s_niah_2", "mk_niah", "qa2"])
def test_rows_are_length_tokens(task: str) -> None:
    t = get_task(task)
    for L in (400, 640):
        p = t.at_length(t.params(), L)
        assert row_tokens(task, p) == L == make_split(task, 2, 0, p).inputs.shape[1]
    assert TASKS[task].texts and "split" not in t.params()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: get_task("s_niah1"), r"unknown task 's_niah1' \(did you mean 's_niah_1'"),
        (
            lambda: make_split("s_niah_2", 2, 0, {"length": 40}),
            r"needles or facts take up to \d+ tokens, more than the filler \(\d+ tokens\) of a row of 40 tokens: "
            r'set task=\{"length": \d+\} or more$',
        ),
        (
            lambda: make_split("mk_niah", 2, 0, {"num_needles": 300}),
            r'from 256 keys, got task=\{"num_needles": 300\}: set task=\{"num_needles": 256\}$',
        ),
        (
            lambda: make_split("s_niah_2", 2, 0, {"length": 3_000_000}, split="test"),
            r's_niah_2 at task=\{"length": 3000000\} needs more filler than the test text has '
            r"\(books_val and the unread training books: [\d,]+ tokens at vocabulary 1024\): "
            r'set task=\{"length": \d+\} or less$',
        ),
        (
            lambda: make_split("s_niah_2", 2, 0, {"length": 1_000_000}, split="train"),
            r"needs more filler than the train text has \(books_train: [\d,]+ tokens at vocabulary 1024\)",
        ),
        (
            lambda: make_split("qa3", 2, 0, {"num_facts": 2}),
            r'qa3 needs at least 3 facts .* set task=\{"num_facts": 3\} or more$',
        ),
        (
            lambda: make_split("qa1", 2, 0, {"num_facts": 2, "num_questions": 3}),
            r'got task=\{"num_questions": 3\} for task=\{"num_facts": 2\}: set task=\{"num_questions": 1\} to 2$',
        ),
        (lambda: make_split("qa1", 2, 0, {"vocab_size": 100}), r"give one in \[258, 65536\]"),
        (lambda: make_split("qa1", 2, 0, split="val"), r"unknown text split 'val': the splits are 'train', 'test'$"),
    ],
)
def test_bad_input_is_one_line(call, message: str) -> None:
    with pytest.raises(RecurformerError, match=message) as e:
        call()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "task, params", [("s_niah_3", {}), ("mk_niah", {"num_needles": 8}), ("qa3", {"num_facts": 20})]
)
def test_the_length_a_too_short_row_names_fits_every_seed(task: str, params: dict) -> None:
    with pytest.raises(RecurformerError, match=r'set task=\{"length": (\d+)\} or more') as e:
        make_split(task, 2, 0, {**params, "length": 64})
    fits = int(re.search(r'"length": (\d+)\} or more', str(e.value))[1])
    for seed in range(3):
        assert make_split(task, 64, seed, {**params, "length": fits}, split="test").inputs.shape == (64, fits)
