"""``recurformer eval``: the length extrapolation of each checkpoint on its own val split or the
text given, logged as it goes and written as a table, JSON and figure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Sequence

from ..config import RecurformerError, make_options, opt, option, say
from ..device import cpu_threads, device_option
from ..nn import NonFiniteLogits
from ..report import claim_outputs, json_option, write_report
from .lengths import LengthOptions, eval_tokens, evaluate_options, window_ends
from .results import LengthResult, figure, json_doc, markdown_table, save_json


@dataclass
class EvalOptions(LengthOptions):
    """``recurformer eval`` (``evaluate_checkpoints``): ``LengthOptions`` for each checkpoint, on
    its own val split or the text given, and where the results go."""

    checkpoint: list[str] = option(
        None, "run or checkpoint directories or Hub repo ids (one line each in the plot)", nargs="+", required=True
    )
    window: int | None = option(None, "evaluate a dense model with a sliding-window mask of this size", range=">= 1")
    data: str | None = option(None, "a prepared dataset directory (default: the checkpoint's own)", group="source")
    dataset: str | None = option(
        None, "a bundled dataset's val split, encoded with the checkpoint's tokenizer", group="source"
    )
    text: list[str] | None = option(
        None, "text files, encoded with the checkpoint's tokenizer", nargs="+", group="source"
    )
    device: str = device_option()
    out: str | None = json_option(
        "output JSON, a PNG plot beside it (default: eval.json in the first checkpoint's run directory; a Hub "
        "repo id's: the working directory)"
    )


@cpu_threads()
def evaluate_checkpoints(
    checkpoints: Sequence[str],
    lengths: Sequence[int] | None = None,
    out: str | Path | None = None,
    *,
    meta: dict[str, Any] | None = None,
    log: Callable[[str], object] = say,
    **options: Any,
) -> dict[str, list[LengthResult]]:
    """``recurformer eval``: length extrapolation of each checkpoint at ``lengths`` (default:
    ``EvalOptions``'s; ``options``: its other fields), on its own val split by
    default, or ``data``/``dataset``/``text``; ``windows`` evenly spaced windows per length, all of
    them with None), ``window`` W evaluating a dense model with a sliding window; logs a table,
    writes ``out`` (JSON with ``meta``; default ``eval.json`` in the first checkpoint's run
    directory) and its PNG plot. The JSON is rewritten (atomically) as each length finishes, with
    ``"complete": false`` until the end, ``cuda_graphs`` reads every aligned chunk through a CUDA
    graph (``evaluate_lengths``'s ``graphs``), so an interrupted eval keeps what it finished; progress
    shows on stderr (``progress.Progress``): a bar on a terminal, lines with the time left elsewhere.
    Every option is checked before any work."""
    from ..device import graphs_or_eager, memory_kind, pick_device
    from ..hub import default_output, eval_labels, load, locate
    from ..progress import Progress

    given = {"checkpoint": list(checkpoints), "out": out} | ({"lengths": list(lengths)} if lengths is not None else {})
    o = make_options(EvalOptions, given | options)  # checked where built (LengthOptions.__post_init__)
    lengths, last, windows, warm_state = o.lengths, o.last, o.windows, o.warm_state  # the log's
    window, data, dataset, text = o.window, o.data, o.dataset, o.text
    dev = pick_device(o.device)
    graphs = graphs_or_eager(o.cuda_graphs, dev, opt("cuda_graphs"), "this evaluation runs")
    dirs = [locate(p) for p in checkpoints]  # a Hub id fetched once, before any work
    labels = eval_labels(checkpoints, dirs)
    path_out = default_output(out, checkpoints[0], "eval.json")
    claim_outputs(path_out, f"{opt('out')} file")  # before the work, not after it
    results: dict[str, list[LengthResult]] = {}
    cache: dict[Any, Any] = {}
    trained: dict[str, Any] = {}
    for path, d, label in zip(checkpoints, dirs, labels):
        loaded = load(d, dev)
        model, name, tok, config = loaded.model, loaded.name, loaded.tokenizer, loaded.config
        if window:
            if not hasattr(model, "set_window"):
                raise RecurformerError(f"{opt('window')} applies to dense attention models (llama), not {name}")
            model.set_window(window)
            label += f" (window {window})"
        tokens = eval_tokens(tok, config, data=data, dataset=dataset, text=text, cache=cache)
        span = o.context_for(len(tokens))
        every = len(window_ends(len(tokens), span, last))
        n = min(every, windows or every)
        every_one = opt("windows", "None", True)
        how = (
            "every window of the evaluation text" if n == every else f"evenly spaced, of {every:,}; {every_one} for all"
        )
        log(
            f"evaluating {label} ({name}) at lengths {lengths}: {n:,} windows ({how}), loss on the last {last} tokens of each, "
            f"{n * sum(warm_state + L for L in lengths):,} tokens to read"
        )

        def keep(r: LengthResult, label: str = label) -> None:
            """Each length as it finishes, into the JSON: an interrupted eval keeps what it finished."""
            results[label] = [*results.get(label, []), r]
            save_json(results, path_out, meta or {}, complete=False)
            log(
                f"  L={r.length:>6}: loss {r.loss:.4f} [{r.loss_low:.4f}, {r.loss_high:.4f}]  acc {r.accuracy:.3f}  "
                f"{r.windows} windows, bootstrap over {r.units} {r.unit}  {r.tokens_per_s:,.0f} tok/s  peak {memory_kind(dev)} {r.peak_memory_mb:,.0f} MB"
            )

        progress = Progress(n * len(lengths), label, "window")
        try:
            bos = tok.bos_id if tok is not None else None
            evaluate_options(label, model, tokens, o, bos, graphs, progress=progress.update, done=keep, note=log)
        except NonFiniteLogits as e:
            kept = f"{path_out} keeps the results before it" if results else "nothing written"
            raise RecurformerError(f"{path} gives {e} although its weights load; {kept}") from None
        except BaseException as e:  # Ctrl-C, a scheduler's SIGTERM, a failure
            if results and not isinstance(e, RecurformerError):
                log(f'stopped: {path_out} keeps the lengths finished so far ("complete": false)')
            raise
        finally:
            progress.close()
        trained[label] = config.get("train", {}).get("seq_len")
    title = f"loss on the last {last} tokens (nats/token, lower is better)"
    drawn = partial(figure, results, title, last, trained, warm_state)
    write_report(path_out, ["", markdown_table(results)], json_doc(results, meta or {}), drawn, log, end="")
    return results
