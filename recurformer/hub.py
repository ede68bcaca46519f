"""Hugging Face Hub conventions, through ``huggingface_hub``: ``save_pretrained(dir)``,
``load(dir_or_repo_id)``, ``push_to_hub(repo_id)``, and a model card.

A pretrained directory is a checkpoint directory without the training state, plus a card:

    model.safetensors   weights
    config.json         {"model": {"name": ..., <the model config>}, "data": ..., "train": ...}
    tokenizer.json      the tokenizer (when there is one)
    README.md           model card: architecture, config, training data, the results row

so ``recurformer eval/generate/probe --checkpoint DIR`` read it as they read a checkpoint, and a
trained run becomes one with ``recurformer export --checkpoint runs/NAME --out DIR``."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml
from huggingface_hub import HfApi, ModelCard, ModelCardData, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from safetensors.torch import save_file

from .checkpoint import load_checkpoint, load_model_weights, metrics, resolve, run_contents
from .compat import FORMAT
from .config import RecurformerError, closest, opt
from .data import Tokenizer
from .files import move_files
from .registry import build_model, description, model_name

CARD = "README.md"
FILES = ["model.safetensors", "config.json", "tokenizer.json", CARD]
EXPORT_FILES = [*FILES, "generation_config.json", "tokenizer_config.json"]  # --format transformers adds two


@dataclass(frozen=True)
class Loaded:
    """A model read from a run, a checkpoint, a pretrained directory or the Hub (``load``)."""

    model: Any  # the StreamingLM, in eval mode, on the device asked for
    tokenizer: Tokenizer | None  # None where the directory has no tokenizer.json
    config: dict[str, Any]  # the run config: model (with its name), data and train sections
    name: str  # the architecture's registered name (model.name)
    path: Path  # the directory read: a run's newest checkpoint, or a Hub repo's cached snapshot


def is_hub_id(path_or_hub_id: str | Path) -> bool:
    """Whether ``path_or_hub_id`` names a Hub repo (``owner/name``) rather than a local directory:
    not a path that exists, nor one that looks local (it starts with ``.``, ``/`` or ``~``, holds a
    backslash, or its first component is a local directory, as ``runs`` in ``runs/typo``)."""
    s = str(path_or_hub_id)
    owner = s.split("/")[0]
    return (
        not Path(s).exists()
        and s.count("/") == 1
        and not s.startswith((".", "/", "~"))
        and not s.endswith("/")
        and "\\" not in s
        and not Path(owner).is_dir()
    )


def locate(path_or_hub_id: str | Path, revision: str | None = None) -> Path:
    """The checkpoint or pretrained directory that ``path_or_hub_id`` names: a local directory
    (``checkpoint.resolve``: a run is its newest checkpoint), or else a Hub repo id, fetched (or
    found in the cache) by ``snapshot_download``."""
    if not is_hub_id(path_or_hub_id):
        path = Path(path_or_hub_id).expanduser()
        if not path.exists():
            siblings = [d.name for d in path.parent.iterdir() if d.is_dir()] if path.parent.is_dir() else []
            close = closest(path.name, siblings)
            hint = f"; did you mean '{path.parent / close}'?" if close else ""
            raise RecurformerError(
                f"checkpoint not found: {path_or_hub_id} (neither a local directory nor a Hub repo id owner/name{hint})"
            )
        return resolve(path)
    try:
        return resolve(snapshot_download(str(path_or_hub_id), revision=revision, allow_patterns=FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError, HFValidationError, OSError) as e:
        raise RecurformerError(
            f"{path_or_hub_id} is no local directory, and getting it from the Hub failed: {str(e).splitlines()[0]}"
        ) from None


def load(path_or_hub_id: str | Path, device: str | torch.device = "cpu", revision: str | None = None) -> Loaded:
    """The model (in eval mode on ``device``), tokenizer and run config saved in a run (its newest
    checkpoint), a checkpoint, a pretrained directory or a Hub repo (``locate``): the one loader
    every command, ``recurformer.load`` and ``StreamingLM.from_pretrained`` use."""
    ck = load_checkpoint(locate(path_or_hub_id, revision))
    mcfg = dict(ck["config"].get("model", {}))
    name = mcfg.pop("name", None)
    if name is None:
        raise RecurformerError(f"{ck['dir'] / 'config.json'} has no model.name")
    model = build_model(name, mcfg)
    load_model_weights(model, ck["model"], str(ck["dir"]))
    tok = Tokenizer.load(ck["tokenizer_dir"]) if ck["tokenizer_dir"] is not None else None
    return Loaded(model.to(device).eval(), tok, ck["config"], name, ck["dir"])


# ----------------------------------------------------------------------------------------------
# naming what a command read and where it writes


def eval_labels(paths: Sequence[str], dirs: Sequence[Path]) -> list[str]:
    """One unique label per checkpoint (``paths`` as given, ``dirs`` as ``hub.locate`` found
    them): the run's name (a Hub repo's id), plus the step where two share a run name, plus the
    full path where even that is not unique."""
    seen: dict[Any, Any] = {}
    for p, d in zip(paths, dirs):
        if d.resolve() in seen:
            raise RecurformerError(f"checkpoints {p} and {seen[d.resolve()]} are the same checkpoint ({d})")
        seen[d.resolve()] = p
    runs = [
        str(p) if is_hub_id(p) else d.parent.name if d.name.startswith("step_") else d.name for p, d in zip(paths, dirs)
    ]
    labels = [f"{r} {d.name}" if runs.count(r) > 1 and d.name.startswith("step_") else r for r, d in zip(runs, dirs)]
    return [str(d) if labels.count(lab) > 1 else lab for lab, d in zip(labels, dirs)]


def default_output(given: str | Path | None, checkpoint: str | Path, name: str) -> Path:
    """``given``, or ``name`` in the run directory of ``checkpoint`` (the directory that holds its
    step_* checkpoints, or the checkpoint / pretrained directory itself; for a Hub repo id, the
    working directory: never the Hub cache)."""
    if given:
        return Path(given)
    if is_hub_id(checkpoint):
        return Path(name)
    d = locate(checkpoint)
    return (d.parent if d.name.startswith("step_") else d) / name


def run_config_of(model: Any, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config`` (a run config dict) with its model section replaced by the model's own config."""
    out = dict(config or {})
    out["model"] = {"name": model_name(model.config), **asdict(model.config)}
    return out


def shareable(config: dict[str, Any]) -> dict[str, Any]:
    """A run config without this machine's paths: the prepared-data and run directories are
    dropped, text files keep their names only."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    data, train = out.get("data"), out.get("train")
    if isinstance(data, dict):
        data.pop("dir", None)
        if data.get("text_files"):
            data["text_files"] = [Path(f).name for f in data["text_files"]]
    if isinstance(train, dict):
        train.pop("out_dir", None)
    return out


def results_row(run_dir: Path, step: int | None = None) -> dict[str, Any]:
    """The last logged metrics of a run (``metrics.jsonl``) up to ``step``: train loss, val loss,
    tokens. Empty when the run has no metrics file."""
    row: dict[str, Any] = {}
    for rec in metrics(run_dir, step):
        row.update({k: v for k, v in rec.items() if k in ("step", "loss", "val_loss", "tokens")})
    return row


def model_card(
    model: Any, config: dict[str, Any], results: dict[str, Any] | None = None, lower_case: bool = False
) -> ModelCard:
    """A Hub model card: metadata header, architecture, config, training data (``lower_case``:
    the tokenizer lower-cases its input), results row."""
    name = config["model"]["name"]
    data = config.get("data") or {}
    train = config.get("train") or {}
    dataset = data.get("dataset") or (
        "text files: " + ", ".join(data.get("text_files", [])) if data.get("text_files") else None
    )
    meta = ModelCardData(
        library_name="recurformer", tags=["recurformer", name, "recurrent-transformer", "text-generation"]
    )
    n = model.num_params()
    lines = [
        f"# recurformer {name}",
        "",
        f"**Architecture:** {description(name)}. {n:,} parameters ({n / 1e6:.2f}M; the token embedding is "
        "tied with the output head).",
        "",
        "```python",
        "import recurformer",
        'model, tokenizer = recurformer.load("<this directory or repo id>")',
        "```",
        "",
        "## Config",
        "",
        "```yaml",
        yaml.safe_dump({k: v for k, v in config.items() if v}, sort_keys=False).strip(),
        "```",
        "",
        "## Training data",
        "",
    ]
    if dataset:
        lines.append(f"{dataset}, {data.get('tokenizer', '?')} tokenizer (vocabulary {model.config.vocab_size}).")
        if train:
            per_step = train.get("batch_size", 0) * train.get("seq_len", 0) * train.get("grad_accum", 1)
            lines.append(
                f"{train.get('steps')} steps of {per_step:,} tokens per rank (train.state={train.get('state')}, "
                f"data_order={train.get('data_order')})."
            )
    else:
        lines.append("Not recorded (the model was saved outside a training run).")
    if lower_case:
        lines.append(
            "The tokenizer was learned from lower-case text: `tokenizer.json` lower-cases its input (a "
            "`Lowercase` normalizer), so write prompts in any case."
        )
    lines += ["", "## Results", ""]
    if results:
        lines += [
            "| " + " | ".join(results) + " |",
            "|" + "---|" * len(results),
            "| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in results.values()) + " |",
        ]
    else:
        lines.append("No results recorded.")
    return ModelCard(f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def save_pretrained(
    model: Any,
    directory: str | Path,
    tokenizer: Tokenizer | None = None,
    config: dict[str, Any] | None = None,
    results: dict[str, Any] | None = None,
) -> Path:
    """Write weights, config, tokenizer and model card to ``directory``; returns it. Nothing
    written holds a path of this machine (``shareable``); a tokenizer learned from lower-case
    text is saved with a lower-case normalizer (``Tokenizer.lowercasing``)."""
    out = Path(directory)
    refuse_run_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = shareable(run_config_of(model, config))
    lower = tokenizer is not None and tokenizer.lowercase
    if tokenizer is not None and lower:
        tokenizer = tokenizer.lowercasing()
    with tempfile.TemporaryDirectory(dir=out, prefix=".tmp_") as tmp:  # every file whole, or not at all
        t = Path(tmp)
        tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(tensors, t / "model.safetensors", metadata={"format": str(FORMAT)})
        (t / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(t)
        model_card(model, cfg, results, lower).save(t / CARD)
        written = move_files(t, out)
    for name in set(EXPORT_FILES) - set(written):  # e.g. the tokenizer of an earlier save: it would not fit
        (out / name).unlink(missing_ok=True)
    return out


def refuse_run_dir(out: Path) -> None:
    """One line when ``out`` is not a directory, or holds a run or a training checkpoint: a model
    written there would sit beside the run's checkpoints (``checkpoint.resolve`` then refuses the
    directory as ambiguous), so no option allows it."""
    if out.exists() and not out.is_dir():
        raise RecurformerError(f"{out} exists and is not a directory")
    found = run_contents(out) + [n for n in ("train_state.json", "train_state.safetensors") if (out / n).is_file()]
    if found:
        raise RecurformerError(
            f"{out} holds a run or a training checkpoint ({', '.join(found[-3:])}); a model written there would sit "
            f"beside its checkpoints: write it into a directory of its own"
        )


def claim_export_dir(out: Path, config: dict[str, Any], overwrite: bool) -> None:
    """Refuse (one line) to export into ``out`` when it holds a run
    (``refuse_run_dir``, whatever ``overwrite`` says), or, unless ``overwrite``, anything but an
    earlier export of the same run: files an export writes only, with a ``config.json`` of the same
    model (and data and training, where it records them) as ``config``, the one to be written.
    ``overwrite`` replaces the export's files and leaves any other file in place."""
    refuse_run_dir(out)
    if not out.is_dir() or overwrite:
        return
    others = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES and not p.name.startswith(".tmp_"))
    what = f"files an export does not write ({', '.join(others[:3])})" if others else None
    if what is None and (out / "config.json").is_file() and not _same_run(out / "config.json", config):
        what = "the export of another model or run (its config.json differs)"
    if what:
        raise RecurformerError(
            f"{out} holds {what}; export into another directory, or pass {opt('overwrite', True)} to write the "
            f"export's files there"
        )


def _same_run(path: Path, config: dict[str, Any]) -> bool:
    """Whether the ``config.json`` at ``path`` records the model of ``config`` (and its data and
    training sections, where the file has them: a transformers export records the model only)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    new = json.loads(json.dumps(config))
    sections = [k for k in ("data", "train") if k in old]
    return (
        isinstance(old, dict) and old.get("model") == new.get("model") and all(old[k] == new.get(k) for k in sections)
    )


def push_to_hub(
    model: Any,
    repo_id: str,
    tokenizer: Tokenizer | None = None,
    config: dict[str, Any] | None = None,
    results: dict[str, Any] | None = None,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload recurformer model",
) -> str:
    """``save_pretrained`` into a temporary directory and ``upload`` it to ``repo_id``."""
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp, tokenizer, config, results)
        return upload(tmp, repo_id, private, token, commit_message)


def upload(
    directory: str | Path,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload recurformer model",
) -> str:
    """Upload a pretrained directory to the Hub repo ``repo_id`` (created if needed); returns
    the commit URL."""
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id, folder_path=str(directory), commit_message=commit_message, allow_patterns=FILES
    )
    return str(info.commit_url)


class HubMixin:
    """``save_pretrained``, ``from_pretrained`` and ``push_to_hub`` as methods of a model
    (``nn.StreamingLM`` inherits them)."""

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> Path:
        """Weights, config, model card (+ ``tokenizer=``) in Hub layout; see ``recurformer.hub``."""
        return save_pretrained(self, directory, **kwargs)

    @classmethod
    def from_pretrained(cls, dir_or_repo_id: str | Path, **kwargs: Any) -> Any:
        """The model saved in a local directory (pretrained, checkpoint or run) or a Hub repo."""
        model = load(dir_or_repo_id, **kwargs).model
        if not isinstance(model, cls):
            raise RecurformerError(f"{dir_or_repo_id} holds a {type(model).__name__}, not a {cls.__name__}")
        return model

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> str:
        """Upload to the Hub repo ``repo_id``; see ``recurformer.hub.push_to_hub``."""
        return push_to_hub(self, repo_id, **kwargs)
