"""The ``recurformer`` lm-eval model, offline, on local tasks this test writes (JSONL + task
config with absolute paths): lm-eval's numbers == our own computation (one parallel forward per
sequence), batch 4 == batch 1, rolling log-likelihood == ``evaluate``'s scoring of the whole
document through the state, greedy ``generate_until`` == our ``generate``, and the launcher."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from helpers import TEST_CONFIGS, randomize_params  # noqa: E402

from recurformer import build_model  # noqa: E402
from recurformer.cli import main as cli_main  # noqa: E402
from recurformer.data import Tokenizer  # noqa: E402
from recurformer.evaluate.lengths import score_windows  # noqa: E402
from recurformer.models import REGISTRY  # noqa: E402

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "big", "red", "house", "tree", "saw", "blue"]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    rng = random.Random(0)
    return Tokenizer.train_bpe([sentence(rng, 40) + "." for _ in range(50)], 300)


def save_model(tmp: Path, name: str, tok: Tokenizer) -> tuple[Path, torch.nn.Module]:
    cfg = dict(TEST_CONFIGS[name][0], vocab_size=tok.vocab_size)
    model = build_model(name, cfg)
    randomize_params(model, std=0.1)
    model.eval().save_pretrained(tmp / name, tokenizer=tok)
    return tmp / name, model


def write_tasks(tmp: Path) -> tuple[list[dict], list[dict]]:
    rng = random.Random(1)
    mc = [
        {
            "question": sentence(rng, rng.randint(3, 12)),
            "choices": [sentence(rng, rng.randint(1, 4)) for _ in range(3)],
            "answer": rng.randint(0, 2),
        }
        for _ in range(7)
    ]
    docs = [{"text": sentence(rng, rng.randint(40, 160)) + "."} for _ in range(3)]
    for name, rows in (("mc", mc), ("docs", docs)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "rf_mc.yaml").write_text(f"""task: rf_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (tmp / "rf_docs.yaml").write_text(f"""task: rf_docs
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / "docs.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: byte_perplexity
""")
    return mc, docs


def run(path: Path, tmp: Path, batch_size: int, chunk: int = 5) -> dict:
    from lm_eval.tasks import TaskManager

    from recurformer.lm_eval import RecurformerLM

    lm = RecurformerLM(pretrained=str(path), batch_size=batch_size, chunk=chunk, device="cpu")
    tasks = TaskManager(include_path=str(tmp), include_defaults=False)  # only the tasks this test wrote
    return lm_eval.simple_evaluate(
        model=lm, tasks=["rf_mc", "rf_docs"], task_manager=tasks, log_samples=True, bootstrap_iters=0
    )


def first(sample: dict) -> list[float]:
    """The log-likelihood of each request of a logged sample (a float, or (ll, is_greedy))."""
    return [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in sample["resps"]]


def own_loglikelihood(model, tok: Tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | BOS, context): one parallel forward, no state, no batching."""
    ctx = tok.encode(context)
    whole = tok.encode(context + continuation)
    x = torch.tensor([[tok.bos_id, *whole]])
    with torch.no_grad():
        logp = model(x[:, :-1]).logits.float().log_softmax(-1)[0]
    n = len(ctx) + 1
    return float(sum(logp[t - 1, x[0, t]] for t in range(n, x.shape[1])))


@pytest.mark.parametrize("name", ["memory_attention", "transformer_xl"])
def test_lm_eval_numbers_equal_ours(name, tokenizer, offline) -> None:
    tmp = offline
    path, model = save_model(tmp, name, tokenizer)
    mc, docs = write_tasks(tmp)
    one, four = run(path, tmp, 1), run(path, tmp, 4)
    for task in ("rf_mc", "rf_docs"):  # batch 4 == batch 1
        for a, b in zip(one["samples"][task], four["samples"][task]):
            assert first(a) == pytest.approx(first(b), rel=1e-5, abs=1e-5)  # sums of up to 200 fp32 log-probs
    correct = 0
    for s in sorted(one["samples"]["rf_mc"], key=lambda s: s["doc_id"]):
        doc = mc[s["doc_id"]]
        ours = [own_loglikelihood(model, tokenizer, doc["question"], " " + c) for c in doc["choices"]]
        assert first(s) == pytest.approx(ours, abs=1e-4, rel=1e-5)
        correct += max(range(3), key=lambda i: ours[i]) == doc["answer"]
    assert one["results"]["rf_mc"]["acc,none"] == pytest.approx(correct / len(mc))
    total_ll, total_bytes = 0.0, 0
    for s in sorted(one["samples"]["rf_docs"], key=lambda s: s["doc_id"]):
        text = docs[s["doc_id"]]["text"]
        ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(text)]])
        loss, _, n = score_windows(model, ids, last=ids.shape[1] - 1, chunk=7)  # recurformer evaluate's scoring
        assert n == ids.shape[1] - 1
        assert first(s) == pytest.approx([-loss], rel=1e-5)
        total_ll, total_bytes = total_ll - loss, total_bytes + len(text.encode())
    assert one["results"]["rf_docs"]["byte_perplexity,none"] == pytest.approx(
        math.exp(-total_ll / total_bytes), rel=1e-5
    )


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_rolling_and_generation_every_model(name, tokenizer, offline) -> None:
    from lm_eval.api.instance import Instance

    from recurformer.lm_eval import RecurformerLM

    path, model = save_model(offline, name, tokenizer)
    lm = RecurformerLM(pretrained=str(path), batch_size=2, chunk=6, device="cpu")
    rng = random.Random(2)
    texts = [sentence(rng, rng.randint(20, 60)) for _ in range(3)]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
    for t, ll in zip(texts, got):
        ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(t)]])
        loss, _, _ = score_windows(model, ids, last=ids.shape[1] - 1, chunk=ids.shape[1])  # one call, no state carried
        assert ll == pytest.approx(-loss, rel=1e-5)
    ctx = sentence(rng, 8)
    text = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": ["zzz"], "max_gen_toks": 12}), 0)])[0]
    ours = model.generate(
        [tokenizer.bos_id, *tokenizer.encode(ctx)], 12, temperature=0, stop_tokens=[tokenizer.eos_id]
    )[0]
    assert text == tokenizer.decode([t for t in ours if t != tokenizer.eos_id])


def test_launcher(tokenizer, offline, capsys, monkeypatch) -> None:
    from lm_eval.tasks import TaskManager

    init = TaskManager.__init__  # lm-eval's CLI indexes its thousands of built-in tasks first: skip them here
    monkeypatch.setattr(
        TaskManager, "__init__", lambda self, *a, **kw: init(self, *a, **{**kw, "include_defaults": False})
    )
    path, _ = save_model(offline, "memory_attention", tokenizer)
    write_tasks(offline)
    out = offline / "results"
    code = cli_main(
        [
            "lm-eval",
            "--model_args",
            f"pretrained={path}",
            "--tasks",
            "rf_mc",
            "--include_path",
            str(offline),
            "--output_path",
            str(out),
            "--batch_size",
            "2",
        ]
    )
    assert code == 0
    assert list(out.rglob("results*.json"))
    capsys.readouterr()
    assert cli_main(["lm-eval", "--model_args", f"pretrained={path}", "--tasks", str(offline / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"recurformer: error: --tasks {offline / 'nope.yaml'}: no such task file or directory"
    assert cli_main(["lm-eval", "--tasks", "rf_mc", "--include_path", str(offline / "missing")]) == 2
    assert "--include_path" in capsys.readouterr().err
