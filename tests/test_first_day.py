"""A researcher's first day: every architecture trains from the README's one command per model,
switching ``model.name`` leaves the previous model's keys behind, training on one's own prepared
data (plain text, JSONL with any text field, a prepared directory) works as the README says and its
errors point at the fix, and a mistyped config name or a broken YAML file says where."""

from __future__ import annotations

import json
import random
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from recurformer import RecurformerError
from recurformer.cli import COMMANDS
from recurformer.cli import main as cli_main
from recurformer.config import load_yaml
from recurformer.data import DataConfig, prepare
from recurformer.models import model_names
from recurformer.training.config import build_from_run_config, load_run_config
from recurformer.training.data import check_model
from recurformer.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
WORDS = "the a cat dog sat ran on under big small red blue tree house went saw".split()


def stories(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 140))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stories.txt"
    path.write_text("<|endoftext|>".join(stories()))
    return path


def section(title: str) -> str:
    """The README's section under the heading ``title`` (up to the next heading of its level)."""
    match = re.search(rf"^(#+) {re.escape(title)}\n(.*?)(?=^\1 |\Z)", README, flags=re.MULTILINE | re.DOTALL)
    assert match, f"README has no section '{title}'"
    return match.group(2)


def architecture_commands() -> dict[str, str]:
    """The README's table: architecture -> its training command."""
    rows = re.findall(r"^\| `(\w+)` \|.*?`(recurformer train [^`]+)`", section("Train each architecture"), re.M)
    return dict(rows)


# -- every architecture from one documented command ------------------------------------------------


def test_readme_lists_the_command_of_every_architecture() -> None:
    commands = architecture_commands()
    assert sorted(commands) == model_names()
    for name, command in commands.items():
        assert command == f"recurformer train --config tinystories-cpu --set model.name={name}"


def files_under(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: its path -> (size, modification time in ns)."""
    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns) for f in root.rglob("*") if f.is_file()}


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """One working directory for every README command, as a user runs them one after another."""
    return tmp_path_factory.mktemp("user")


@pytest.mark.parametrize("name", model_names())
def test_every_architecture_trains_from_its_readme_command(name, corpus, user_dir, monkeypatch) -> None:
    """The README's command for ``name``, with overrides that only make it tiny (width, steps,
    batch, data): the model-specific keys, the train length, the state mode and the run directory
    are the config's. Every command runs in one working directory, and none touches the run
    directory of another (the README's commands once sent Gated DeltaNet into the default run's)."""
    monkeypatch.chdir(user_dir)
    argv = shlex.split(architecture_commands()[name])[1:]
    out = user_dir / load_run_config("tinystories-cpu", [f"model.name={name}"]).train.out_dir
    before = {f: v for f, v in files_under(user_dir / "runs").items() if not Path(f).is_relative_to(out)}
    tiny = [
        "model.dim=32",
        f"data.text_files=[{corpus}]",
        "data.tokenizer=byte",
        f"data.dir={user_dir / 'prepared'}",  # shared: prepared by the first model
        "train.steps=1",
        "train.batch_size=1",
        "train.eval_batches=1",
        "train.precision=fp32",
        "train.loggers=[]",
    ]
    assert cli_main(argv + [a for t in tiny for a in ("--set", t)]) == 0
    saved = json.loads((out / (out / "latest").read_text().strip() / "config.json").read_text())
    assert saved["model"]["name"] == name and saved["train"]["seq_len"] == 256
    after = {f: v for f, v in files_under(user_dir / "runs").items() if not Path(f).is_relative_to(out)}
    assert after == before, f"the README's command for {name} changed another run's directory"


MULTI_MODEL_CONFIGS = [
    p for p in sorted((ROOT / "recurformer" / "configs").rglob("*.yaml")) if "per_model" in load_yaml(str(p))
]


@pytest.mark.parametrize("path", MULTI_MODEL_CONFIGS, ids=lambda p: p.stem)
def test_a_multi_model_config_gives_every_model_its_own_entry_and_run_directory(path) -> None:
    """A bundled config with ``per_model`` entries has one for every registered model, and each
    model's run fits the config's segments and lands in a run directory of its own."""
    assert sorted(load_yaml(str(path))["per_model"]) == model_names()
    dirs = {}
    for name in model_names():
        cfg = load_run_config(str(path), [f"model.name={name}"])
        check_model(build_from_run_config(cfg, cfg.data.vocab_size), cfg, cfg.data.vocab_size)
        dirs[name] = cfg.train.out_dir
    assert len(set(dirs.values())) == len(dirs), dirs


def test_a_run_directory_of_another_model_is_refused_with_a_free_one_offered(corpus, tmp_path) -> None:
    """Training one model into the run directory of another: refused before anything is written,
    a free directory beside it offered first, and what ``--overwrite`` would delete named."""
    tiny = [f"data.text_files=[{corpus}]", "data.tokenizer=byte", f"data.dir={tmp_path / 'p'}", "model.dim=32"]
    tiny += ["model.n_heads=4", "model.n_layers=2", "train.seq_len=64", "train.steps=2", "train.batch_size=1"]
    tiny += ["train.eval_batches=1", "train.loggers=[]"]
    run = tmp_path / "runs" / "default"
    first = [*tiny, f"train.out_dir={run}", "model.name=llama", "train.state=reset"]
    Trainer(load_run_config(None, first), show_progress=False).run()
    before = files_under(run)
    size = sum(v[0] for v in before.values())
    second = [*tiny, f"train.out_dir={run}", "model.name=gated_deltanet"]
    with pytest.raises(RecurformerError) as e:
        Trainer(load_run_config(None, second), show_progress=False)
    assert str(e.value) == (
        f"{run} holds the run of another model (a 'llama' model at step 2, {size / 1e6:.1f} MB); train "
        f"'gated_deltanet' into another directory (train={{\"out_dir\": {str(run) + '-gated_deltanet'!r}}}), "
        f"or pass overwrite=True to replace it (deleting a 'llama' model at step 2, {size / 1e6:.1f} MB)"
    )
    assert files_under(run) == before and not (run.parent / "default-gated_deltanet").exists()
    # the same model: resuming comes first, and --overwrite still says what it deletes
    with pytest.raises(RecurformerError, match=r"continue it with resume=.*to replace it \(deleting a 'llama' model"):
        Trainer(load_run_config(None, first), show_progress=False)


def test_the_default_run_is_unchanged() -> None:
    """README command 1 trains what it trained before the per-model entries."""
    cfg = load_run_config("tinystories-cpu")
    assert cfg.model == {
        "name": "memory_attention",
        "dim": 128,
        "n_layers": 4,
        "n_heads": 4,
        "chunk_size": 32,
        "memory_qkv": "shared",
    }
    assert (cfg.data.dataset, cfg.data.tokenizer, cfg.data.vocab_size) == ("tinystories-sample", "bpe", 4096)
    t = cfg.train
    assert (t.out_dir, t.batch_size, t.seq_len, t.steps, t.state, t.data_order) == (
        "runs/tinystories-cpu",
        8,
        256,
        1000,
        "carry",
        "contiguous",
    )
    assert (t.lr, t.min_lr, t.warmup, t.eval_every, t.eval_batches, t.save_every) == (2e-3, 2e-4, 100, 250, 10, 250)


def test_switching_the_model_leaves_the_previous_models_keys(tmp_path) -> None:
    cfg = load_run_config("tinystories-cpu", ["model.name=transformer_xl"])
    assert cfg.model == {"name": "transformer_xl", "dim": 128, "n_layers": 4, "n_heads": 4, "segment_len": 32}
    assert load_run_config("tinystories-cpu", ["model.name=llama"]).train.state == "reset"
    # a config of the user's own: its model's keys stay with that model, the shared ones stay
    own = tmp_path / "mine.yaml"
    own.write_text("model: {name: memory_attention, dim: 64, n_heads: 4, chunk_size: 16, memory_qkv: separate}\n")
    assert load_run_config(str(own), ["model.name=block_recurrent"]).model == {
        "name": "block_recurrent",
        "dim": 64,
        "n_heads": 4,
    }
    # the command line wins over the config's entry for the model
    cfg = load_run_config("tinystories-cpu", ["model.name=transformer_xl", "model.segment_len=64"])
    assert cfg.model["segment_len"] == 64


def test_a_block_longer_than_the_segment_names_the_key(corpus, tmp_path) -> None:
    """The step before the per_model entry: Block-Recurrent's default block (512) and 256-token segments."""
    over = [f"data.text_files=[{corpus}]", "data.tokenizer=byte", f"data.dir={tmp_path / 'p'}", "model.dim=32"]
    cfg = load_run_config("tinystories-cpu", ["model.name=block_recurrent", "model.block_size=512", *over])
    with pytest.raises(
        RecurformerError,
        match=r"\(512\): set model.block_size to a divisor of 256 or train.seq_len to a multiple of 512$",
    ):
        Trainer(cfg, show_progress=False)


def test_a_key_of_another_model_names_its_owner(tmp_path) -> None:
    with pytest.raises(
        RecurformerError,
        match=r"^config key 'model.chunk_size' is a setting of (\w+, )*memory_attention, not of transformer_xl",
    ):
        load_run_config(None, ["model.name=transformer_xl", "model.chunk_size=32"])
    with pytest.raises(RecurformerError, match=r"of rmt, transformer_xl, not of llama; leave it out"):
        load_run_config(None, ["model.name=llama", "model.segment_len=32"])
    with pytest.raises(
        RecurformerError, match=r"unknown config key 'model.chunk_sise' \(did you mean 'chunk_size'\?\)"
    ):
        load_run_config(None, ["model.name=memory_attention", "model.chunk_sise=32"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: llama}\nper_model: {transfomer_xl: {model: {segment_len: 32}}}\n")
    with pytest.raises(
        RecurformerError, match=r"per_model names an unknown model 'transfomer_xl' \(did you mean 'transformer_xl'\?\)"
    ):
        load_run_config(str(bad))


# -- your own data ----------------------------------------------------------------------------------


def tiny_run(tmp: Path) -> list[str]:
    return [
        "model.dim=32",
        "model.n_layers=2",
        "model.chunk_size=8",
        "data.tokenizer=byte",
        f"train.out_dir={tmp / 'run'}",
        "train.steps=1",
        "train.batch_size=1",
        "train.seq_len=32",
        "train.eval_batches=1",
        "train.precision=fp32",
        "train.loggers=[]",
    ]


def sets(items: list[str]) -> list[str]:
    return [a for t in items for a in ("--set", t)]


def test_train_reads_a_jsonl_text_field_as_prepare_does(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(stories(60))))
    base = ["train", "--config", "tinystories-cpu", *sets([*tiny_run(tmp_path), f"data.text_files=[{path}]"])]
    assert cli_main(base) == 2  # no 'text' field: the error names the flag train has
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("has no field 'text' (it has: id, content); set --text-field")
    assert cli_main(base + ["--text-field", "content"]) == 0
    trained = DataConfig(text_files=[str(path)], tokenizer="byte", text_field="content").resolved_dir()
    assert (trained / "meta.json").is_file()
    # prepare with the same field writes the directory train reads: the next run prepares nothing
    assert cli_main(["prepare", "--text", str(path), "--text-field", "content", "--tokenizer", "byte"]) == 0
    assert f"prepared {trained}:" in capsys.readouterr().out
    cfg = load_run_config("tinystories-cpu", [f"data.text_files=[{path}]", "data.text_field=content"])
    assert cfg.data.text_field == "content" and cfg.data.dataset is None


def test_readme_own_data_commands_run(tmp_path, monkeypatch) -> None:
    """The commands of the README's "Train on your own data", on files of those names, made tiny
    (byte tokenizer, narrow model, one step)."""
    monkeypatch.chdir(tmp_path)
    docs = stories(60)
    Path("my_corpus.txt").write_text("<|endoftext|>".join(docs))
    Path("notes.jsonl").write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(docs)))
    blocks = re.findall(r"```bash\n(.*?)```", section("Train on your own data"), flags=re.DOTALL)
    commands = [shlex.split(line)[1:] for block in blocks for line in block.splitlines() if line.strip()]
    assert [c[0] for c in commands] == ["train", "train", "prepare", "train"]
    tiny = {
        "prepare": ["--tokenizer", "byte"],
        "train": sets(
            ["model.dim=32", "data.tokenizer=byte", "train.steps=1", "train.batch_size=1", "train.loggers=[]"]
        ),
    }
    for argv in commands:
        assert cli_main(argv + tiny[argv[0]]) == 0, argv
    assert sorted(p.name for p in Path("runs").iterdir()) == ["mine", "notes", "notes-rmt"]


def test_data_dir_alone_trains_on_the_prepared_data(corpus, tmp_path) -> None:
    """``--set data.dir=DIR`` on a config that names a dataset trains on what DIR holds."""
    mine = tmp_path / "prepared-mine"
    prepare(mine, text_files=[str(corpus)], tokenizer="byte")
    cfg = load_run_config("tinystories-cpu", [*tiny_run(tmp_path), f"data.dir={mine}"])
    assert cfg.data.dataset is None and cfg.data.text_files == []
    trainer = Trainer(cfg, show_progress=False)
    assert (
        trainer.data_dir == mine
        and trainer.meta["source_key"] == json.loads((mine / "meta.json").read_text())["source_key"]
    )
    data_line = next(line for line in trainer.header if line.startswith("data: "))
    assert (
        data_line.startswith(f"data: text files {corpus}, last") and f"(byte, vocabulary 258) from {mine}" in data_line
    )
    trainer.close_loggers()


def test_data_errors_point_at_the_fix_and_never_at_deleting(corpus, tmp_path) -> None:
    mine = tmp_path / "prepared-mine"
    prepare(mine, text_files=[str(corpus)], tokenizer="byte")
    # a config naming a dataset and a data.dir that holds other data
    own = tmp_path / "both.yaml"
    own.write_text(
        f"model: {{name: llama, dim: 32, n_layers: 1, n_heads: 2}}\ndata: {{dataset: warpeace, tokenizer: byte, dir: {mine}}}\n"
    )
    with pytest.raises(RecurformerError) as e:
        Trainer(load_run_config(str(own), [f"train.out_dir={tmp_path / 'r1'}"]), show_progress=False)
    msg = str(e.value)
    assert "delete" not in msg and "remove" not in msg
    assert msg.startswith(f"prepared data {mine} was made from other data than the configured data source")
    assert "leave out data.dataset and data.text_files" in msg and "point data.dir at another directory" in msg
    # a data.dir with nothing prepared in it, and no source to prepare
    empty = tmp_path / "nothing-here"
    with pytest.raises(
        RecurformerError,
        match=rf"^data.dir {re.escape(str(empty))} holds no prepared data .*recurformer prepare --text FILE --out {re.escape(str(empty))}",
    ):
        Trainer(load_run_config("tinystories-cpu", [*tiny_run(tmp_path), f"data.dir={empty}"]), show_progress=False)
    assert not empty.exists()


def test_too_little_text_names_the_batch_size_and_the_seq_len_that_fit(tmp_path, monkeypatch, capsys) -> None:
    """The README's command on a short text: its validation split holds too few tokens for 8 streams
    of 256; the error names both options with values that fit, and each of them trains."""
    monkeypatch.chdir(tmp_path)
    Path("mine.txt").write_text("<|endoftext|>".join(stories(20)))
    base = ["model.dim=32", "model.n_layers=1", "data.tokenizer=byte", "data.text_files=[mine.txt]"]
    argv = ["train", "--config", "tinystories-cpu", *sets([*base, "train.steps=1", "train.loggers=[]"])]
    assert cli_main(argv) == 2
    assert not Path("runs/tinystories-cpu").exists()  # no run left behind by the refused one
    err = capsys.readouterr().err.strip().splitlines()[-1]
    fit = re.fullmatch(
        r"recurformer: error: (\d+) tokens in the validation split are too few for 8 streams of seq_len 256 "
        r"\(each needs 257, the shortest has \d+\): use --set (train.batch_size=\d+) \(at seq_len 256\) "
        r"or --set (train.seq_len=\d+) \(at batch_size 8\)",
        err,
    )
    assert fit, err
    assert fit[2] == f"train.batch_size={int(fit[1]) // 257}" and int(fit[3].split("=")[1]) % 32 == 0  # chunks of 32
    for fix in fit[2], fit[3]:
        assert cli_main([*argv, "--set", fix, "--set", f"train.out_dir=runs/{fix}"]) == 0, fix
    with pytest.raises(RecurformerError, match=r'use train=\{"batch_size": \d+\} \(at seq_len 256\) or train='):
        Trainer(load_run_config("tinystories-cpu", [*base, "train.loggers=[]"]), show_progress=False).run()


# -- small things -----------------------------------------------------------------------------------


def test_a_mistyped_config_name_gets_a_suggestion() -> None:
    with pytest.raises(
        RecurformerError, match=r"^config file not found: tinystories-cpuu \(did you mean 'tinystories-cpu'\?"
    ):
        load_yaml("tinystories-cpuu")


def test_a_broken_yaml_file_says_file_and_line(tmp_path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("model:\n  name: llama\n  dim: [1, 2\ntrain:\n  steps: 3\n")
    with pytest.raises(RecurformerError) as e:
        load_yaml(bad)
    assert re.match(rf"^{re.escape(str(bad))}:\d+:\d+: not valid YAML: ", str(e.value)), str(e.value)
    bad.write_text("model:\n  name: llama\n   dim: 3\n")
    with pytest.raises(RecurformerError, match=rf"^{re.escape(str(bad))}:3:\d+: not valid YAML: "):
        load_yaml(bad)


def test_a_broken_set_value_is_one_line(capsys) -> None:
    assert cli_main(["train", "--config", "tinystories-cpu", "--set", "data.text_files=[a.txt"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("recurformer: error: --set data.text_files=[a.txt: the value is not valid YAML (")
        and "\n" not in err
    )
    with pytest.raises(RecurformerError, match=r"^unknown model '\['a'\]' \(valid models: "):
        load_run_config("tinystories-cpu", ["model.name=[a]"])


def test_top_level_help_lists_every_command(capsys) -> None:
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    description = capsys.readouterr().out.split("\n\n")[1]  # between the usage lines and the arguments
    for name in [*COMMANDS, "lm-eval"]:
        assert re.search(rf"\b{name}\b", description), name


def test_readme_example_outputs_are_ignored_by_git() -> None:
    """Outputs named in the code blocks of the README and of docs/install.md, docs/gpu.md."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    docs = [README, *((ROOT / "docs" / n).read_text(encoding="utf-8") for n in ("install.md", "gpu.md"))]
    blocks = "\n".join(b for d in docs for b in re.findall(r"```.*?```", d, flags=re.DOTALL))
    outputs = re.findall(r"(?:(?<![\w-])(?:--out|--json|-w)\s+|out_dir=)([a-z][\w.\-]*(?:/[\w.\-]+)*)", blocks)
    outputs += re.findall(r"export\([^,]+, \"([^\"]+)\"\)", blocks)
    assert {"my-model", "niah.json", "exported/api-tour", "wheels"} <= set(outputs)
    for path in outputs:
        found = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
        assert found.returncode == 0, f"{path} (a README example's output) is not in .gitignore"
