"""Memory Attention against a literal reading of Algorithm 1 of Liang, "Block-wise Recurrent
Transformer" (``algorithm_1``) and the properties of its memory update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import randomize_params

import recurformer.models.memory_attention as ma
from recurformer import build_model
from recurformer.cli import main as cli_main
from recurformer.layers import rope_cos_sin
from recurformer.reference import algorithm_1

CFG = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=8)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        dict(memory_qkv="separate"),
        dict(memory_source="post_wo"),
        dict(init_memory="learned"),
        dict(memory_ffn=False, memory_norm=False),
        dict(memory_update="gated"),
        dict(memory_update="gated", memory_source="post_wo", init_memory="learned"),
        dict(memory_update="write_gate", init_memory="learned"),
    ],
    ids=["shared", "separate", "post_wo", "learned", "no_ffn_norm", "gated", "gated_post_wo_learned", "write_gate"],
)
def test_matches_algorithm_1(extra) -> None:
    model = build_model("memory_attention", dict(CFG, **extra)).double().eval()
    randomize_params(model, 0.2)
    tokens = torch.randint(0, 61, (2, 5 * 8))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, algorithm_1(model, tokens), rtol=1e-10, atol=1e-10)


def test_gated_update_limits() -> None:
    """A gate shut (g = 0) is the paper's model with the same weights; a gate open (g = 1) keeps the
    initial zero memory for ever, so every chunk reads only itself."""
    tokens = torch.randint(0, 61, (2, 5 * 8))
    seed = build_model("memory_attention", CFG).double().eval()
    randomize_params(seed, 0.2)
    gated = build_model("memory_attention", dict(CFG, memory_update="gated")).double().eval()
    assert set(gated.state_dict()) - set(seed.state_dict()) == {
        f"layers.{i}.attn.mem_gate.{p}" for i in range(2) for p in ("weight", "bias")
    }
    gated.load_state_dict(seed.state_dict(), strict=False)
    with torch.no_grad():
        want = seed(tokens).logits
        for layer in gated.layers:
            layer.attn.mem_gate.weight.zero_()
            layer.attn.mem_gate.bias.fill_(-1e4)
        torch.testing.assert_close(gated(tokens).logits, want, rtol=0, atol=0)
        for layer in gated.layers:
            layer.attn.mem_gate.bias.fill_(1e4)
        alone = torch.cat([seed(tokens[:, i : i + 8]).logits for i in range(0, 40, 8)], 1)
        torch.testing.assert_close(gated(tokens).logits, alone, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(want, alone)
    fresh = build_model("memory_attention", dict(CFG, memory_update="gated"))
    assert torch.equal(fresh.layers[0].attn.mem_gate.bias, torch.ones(32))  # a fresh gate keeps ~73%


def test_closed_write_gate_holds_the_memory_exactly() -> None:
    """``memory_update: write_gate``: with the gate shut (g = sigmoid(-1e4) = 0) the memory after
    any number of chunks is bit for bit the one before them (the keep path is the identity: no
    evolution, norm or gain); at its initial bias (-5) the chunks move it."""
    model = build_model("memory_attention", dict(CFG, memory_update="write_gate")).double().eval()
    assert all(torch.equal(b.attn.write_gate.proj.bias, torch.full((32,), -5.0)) for b in model.layers)
    randomize_params(model, 0.2)
    tokens = torch.randint(0, 61, (2, 4 * 8 + 3))
    with torch.no_grad():
        state = model(tokens[:, :8]).state  # a memory written by an open gate (bias ~1)
        for block in model.layers:
            block.attn.write_gate.proj.bias.fill_(-5.0)
        moved = model(tokens[:, 8:], state=state).state
        for block in model.layers:
            block.attn.write_gate.proj.bias.fill_(-1e4)
        held = model(tokens[:, 8:], state=state).state
    for before, after, near in zip(state.layers, held.layers, moved.layers):
        assert float(before.memory.abs().min()) > 0
        assert torch.equal(after.memory, before.memory)
        assert not torch.equal(near.memory, before.memory)


def test_gradient_crosses_chunks_through_memory() -> None:
    model = build_model("memory_attention", CFG).double()
    randomize_params(model, 0.2)
    tokens = torch.randint(0, 61, (1, 3 * 8))
    emb = {}
    handle = model.tok_emb.register_forward_hook(lambda m, i, o: emb.setdefault("out", o))
    out = model(tokens, targets=tokens)
    handle.remove()
    loss3 = F.cross_entropy(out.logits[0, 16:], tokens[0, 16:])  # a loss on chunk 3 only
    g_emb, *g_par = torch.autograd.grad(loss3, [emb["out"], *model.layers[0].attn.mem_ffn.parameters()])
    assert g_emb[0, :8].abs().sum() > 0  # chunk 1's tokens reach chunk 3's loss (only via memory)
    assert all(g.abs().sum() > 0 for g in g_par)
    assert out.state.layers[0].memory.requires_grad  # the returned state is not detached


def test_zero_memory_stays_zero() -> None:
    model = build_model("memory_attention", CFG)
    randomize_params(model, 0.5)
    layer = model.layers[0].attn
    z = torch.zeros(3, 8, 32)
    assert torch.equal(layer.evolve(z), z)
    k, v = layer.memory_kv(z, *rope_cos_sin(torch.arange(8), 8, 1e4, torch.float32))
    assert not k.any() and not v.any()


def test_positions_never_exceed_2c_minus_1(monkeypatch) -> None:
    seen: list[int] = []

    def spy(positions, *a, **k):
        seen.append(int(positions.max()))
        return rope_cos_sin(positions, *a, **k)

    monkeypatch.setattr(ma, "rope_cos_sin", spy)
    model = build_model("memory_attention", CFG)
    tokens = torch.randint(0, 61, (1, 203))
    state = None
    for piece in tokens.split(50, dim=1):  # streaming across calls too
        state = model(piece, state=state).state
    assert seen and max(seen) == 2 * 8 - 1


def test_shared_qkv_saves_two_d_squared_per_layer() -> None:
    shared = build_model("memory_attention", dict(CFG, memory_qkv="shared")).num_params()
    separate = build_model("memory_attention", dict(CFG, memory_qkv="separate")).num_params()
    assert separate - shared == 2 * 32 * 32 * CFG["n_layers"]


@pytest.mark.parametrize("name,expected", [("memory_attention", 11.14e6), ("llama", 7.16e6)])
def test_seed_config_parameter_count(name, expected, capsys) -> None:
    args = [
        "info",
        "--model",
        name,
        "--set",
        "dim=288",
        "--set",
        "n_layers=6",
        "--set",
        "n_heads=6",
        "--set",
        "vocab_size=4096",
    ]
    if name == "memory_attention":
        args += ["--set", "chunk_size=32", "--set", "memory_qkv=shared"]
    assert cli_main(args) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("parameters:"))
    count = int(line.split()[1].replace(",", ""))
    assert abs(count - expected) / expected < 0.005, line


def test_reset_mid_chunk_is_a_clear_error() -> None:
    from recurformer import RecurformerError

    model = build_model("memory_attention", CFG)
    st = model(torch.randint(0, 61, (2, 5))).state.reset(torch.tensor([True, False]))
    with pytest.raises(RecurformerError, match="only at a chunk boundary"):
        model(torch.randint(0, 61, (2, 3)), state=st)
