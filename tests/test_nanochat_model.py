"""nanochat's model options (--parameter-free-norms, --embed-norm, --layer-scalars, --backout,
--value-embeds, --qk-norm-scale) and its init (--init nanochat): what each computes, its parameters and
their init and optimizer groups, at their neutral values the plain model, compiled in one graph, a run
that resumes exactly, and export's one-line refusal (DDP and FSDP: tests/test_distributed.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY, assert_one_line_error, assert_resumes_exactly, run_main, train_refuses
from fastpt import checkpoint, export, hf
from fastpt.config import PRESETS, TrainConfig
from fastpt.errors import ConfigError
from fastpt.model import Transformer
from fastpt.nanochat_parts import Smear, ValueGate, nanochat_init
from fastpt.optim import optimizers_for

CFG = dataclasses.replace(PRESETS["tiny"], vocab_size=97, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=32)
OPTIONS = {
    "parameter_free_norms": True,
    "embed_norm": True,
    "layer_scalars": True,
    "backout": True,
    "value_embeds": True,
    "smear": True,
    "qk_norm_scale": 1.2,
}
FLAGS = ("--parameter-free-norms", "--embed-norm", "--layer-scalars", "--backout", "--value-embeds", "--smear")
FLAGS = (*FLAGS, "--qk-norm-scale", "1.2", "--init", "nanochat", "--no-tie-embeddings")


def model(**options) -> Transformer:
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(CFG, **options))


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))


def logits(m: Transformer) -> torch.Tensor:
    with torch.no_grad():
        return m(tokens()).logits


@pytest.mark.parametrize("key", OPTIONS)
def test_each_option_changes_the_model_and_counts_its_parameters(key):
    plain, changed = model(), model(**{key: OPTIONS[key]})
    assert changed.num_params() == changed.cfg.num_params()
    assert (changed.num_params() == plain.num_params()) == (key == "qk_norm_scale")  # the only one of no weights
    if key not in ("parameter_free_norms", "smear"):  # at init: the plain model's ones, a smear of weight 0
        assert not torch.equal(logits(plain), logits(changed))
    everything = model(**OPTIONS)
    assert everything.num_params() == everything.cfg.num_params()


def test_parameter_free_norms_have_no_weight_to_learn_or_save():
    plain, free = model(), model(parameter_free_norms=True)
    torch.testing.assert_close(logits(free), logits(plain), rtol=0, atol=0)  # the same ones, at init
    assert not [n for n, _ in free.named_parameters() if "norm" in n]
    assert not [k for k in free.state_dict() if "norm" in k]
    assert {n for n, _ in plain.named_parameters() if "norm" in n} == {
        "norm.weight",
        *(f"layers.{i}.{norm}.weight" for i in range(3) for norm in ("attention_norm", "ffn_norm")),
    }


def test_the_embed_norm_makes_the_blocks_input_blind_to_the_embeddings_scale():
    for norm, same in ((False, False), (True, True)):
        m = model(embed_norm=norm, tie_embeddings=False)
        before = logits(m)
        with torch.no_grad():
            m.tok_embeddings.weight.mul_(10)
        assert torch.allclose(logits(m), before, atol=1e-5) == same


def test_layer_scalars_start_as_nanochats_and_at_one_and_zero_are_the_plain_model():
    scaled = model(layer_scalars=True)
    torch.testing.assert_close(scaled.layer_scalars.resid.detach(), torch.tensor([1.15, 1.10, 1.05]))
    torch.testing.assert_close(scaled.layer_scalars.x0.detach(), torch.tensor([0.20, 0.125, 0.05]))
    with torch.no_grad():
        scaled.layer_scalars.resid.fill_(1.0)
        scaled.layer_scalars.x0.zero_()
    torch.testing.assert_close(logits(scaled), logits(model()), rtol=0, atol=0)


def test_backout_takes_a_share_of_the_middle_blocks_output_from_the_last_hidden_state():
    m = model(backout=True)
    assert m.backout.layer == 1 and m.backout.weight.item() == pytest.approx(0.2)
    seen = {}
    m.layers[1].register_forward_hook(lambda _, __, out: seen.update(middle=out[0]))
    m.layers[2].register_forward_hook(lambda _, __, out: seen.update(last=out[0]))
    m.norm.register_forward_hook(lambda _, args, __: seen.update(normed=args[0]))
    logits(m)
    torch.testing.assert_close(seen["normed"], seen["last"] - 0.2 * seen["middle"])
    with torch.no_grad():
        m.backout.weight.zero_()
    torch.testing.assert_close(logits(m), logits(model()), rtol=0, atol=0)


def test_value_embeddings_sit_in_every_other_block_from_the_last_and_at_zero_are_the_plain_model():
    for n_layers, blocks in ((3, {0, 2}), (4, {1, 3})):
        m = model(value_embeds=True, n_layers=n_layers)
        assert set(map(int, m.value_embeds.tables)) == blocks
        assert {i for i, layer in enumerate(m.layers) if layer.attention.value_gate is not None} == blocks
    m, plain = model(value_embeds=True), model()
    assert plain.load_state_dict(m.state_dict(), strict=False).unexpected_keys  # the same weights, less its own
    assert not torch.equal(logits(m), logits(plain))
    with torch.no_grad():
        for table in m.value_embeds.tables.values():
            table.weight.zero_()
    torch.testing.assert_close(logits(m), logits(plain), rtol=0, atol=0)


def test_the_value_gate_is_three_sigmoids_per_kv_head_of_the_first_12_channels():
    gate = ValueGate(dim=32, kv_heads=2)
    assert gate.proj.weight.shape == (2, 12) and 0 <= gate.proj.weight.min() <= gate.proj.weight.max() <= 0.02
    x, v, ve = torch.randn(1, 5, 32), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 16)
    with torch.no_grad():
        gate.proj.weight.zero_()
        torch.testing.assert_close(gate(x, v, ve), v + 1.5 * ve.view_as(v))  # 3 * sigmoid(0)
        gate.proj.weight[1].fill_(100.0)  # head 1 saturates at 3 where its channels sum above 0
        x[..., :12] = 1.0
        torch.testing.assert_close(gate(x, v, ve)[..., 1, :], v[..., 1, :] + 3 * ve.view_as(v)[..., 1, :])


def test_qk_norm_after_rope_makes_attention_blind_to_the_scale_of_wq_and_wk():
    for scale, same in ((0.0, False), (1.2, True)):
        m = model(qk_norm_scale=scale)
        before = logits(m)
        with torch.no_grad():
            for layer in m.layers:
                layer.attention.wq.weight.mul_(7)
                layer.attention.wk.weight.mul_(3)
        assert torch.allclose(logits(m), before, atol=1e-5) == same
    assert not torch.equal(logits(model(qk_norm_scale=1.2)), logits(model(qk_norm_scale=1.0)))


def test_a_second_qk_norm_is_one_line():
    with pytest.raises(ConfigError, match="'qk_norm' .* and 'qk_norm_scale' .* pick one"):
        dataclasses.replace(CFG, qk_norm=True, qk_norm_scale=1.2).check()


def test_nanochat_init_starts_each_weight_at_its_scale():
    m = model(tie_embeddings=False, dim=64, vocab_size=4096)
    nanochat_init(m)
    bound = (3 / 64) ** 0.5
    assert m.tok_embeddings.weight.std().item() == pytest.approx(0.8, rel=0.03)
    assert m.output.weight.std().item() == pytest.approx(0.001, rel=0.03)
    for layer in m.layers:
        attention, mlp = layer.attention, layer.feed_forward
        assert not attention.wo.weight.any() and not mlp.w2.weight.any()
        for w, most in ((attention.wq.weight, bound), (attention.wv.weight, bound), (mlp.w1.weight, 0.4 * bound)):
            assert w.abs().max() <= most and w.abs().max() > 0.95 * most  # uniform on [-most, most]


def test_nanochat_init_with_a_tied_head_is_one_line(tmp_path, capsys):
    train_refuses(capsys, [*TINY, "--out", str(tmp_path), "--init", "nanochat"], "'init' = 'nanochat'", "untied")


def test_nanochats_adamw_groups_give_the_value_embeddings_and_scalars_theirs():
    m = model(**OPTIONS, tie_embeddings=False)
    cfg = TrainConfig(optimizer="muon", adamw_groups="nanochat", embed_lr=0.3)
    groups = {g["name"]: g for g in optimizers_for(m, cfg)[0].param_groups}
    want = {"value_embed": (0.15, (0.8, 0.995)), "resid": (0.005, (0.8, 0.95)), "x0": (0.5, (0.96, 0.95))}
    want["scalar"] = (0.2, (0.8, 0.95))
    assert {name: (groups[name]["peak_lr"], groups[name]["betas"]) for name in want} == want
    names = {id(p): n for n, p in m.named_parameters()}
    scalars = [g for g in optimizers_for(m, cfg)[0].param_groups if g["name"] == "scalar"]  # decayed or not
    in_scalars = {names[id(p)] for g in scalars for p in g["params"]}
    assert in_scalars == {"backout.weight", "smear.weight", "smear.gate.weight"}
    assert {g["weight_decay"] for g in scalars} == {0.0}
    shared = {g["name"] for g in optimizers_for(m, dataclasses.replace(cfg, adamw_groups="shared"))[0].param_groups}
    assert shared == {"embed", "head", "value_embed", "lr"}  # the scalars at --lr, as the norms would be


def test_the_smear_adds_a_gated_share_of_the_previous_tokens_embedding():
    smear = Smear(dim=32)
    assert smear.weight.item() == 0 and smear.gate.weight.shape == (1, 24)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(smear(x), x)  # weight 0: off at the start
    with torch.no_grad():
        smear.weight.fill_(0.5)
        smear.gate.weight.zero_()  # sigmoid(0) = 1/2: a quarter of the previous token
    want = torch.cat((x[:, :1], x[:, 1:] + 0.25 * x[:, :-1]), dim=1)
    torch.testing.assert_close(smear(x), want)
    torch.testing.assert_close(smear(x[:, 3:4], before=x[:, 2:3]), want[:, 3:4])  # one token, decoding


def test_a_trained_smear_decodes_with_a_kv_cache_as_without():
    m = model(smear=True)
    with torch.no_grad():
        m.smear.weight.fill_(0.7)
    x = tokens()
    with torch.no_grad():
        full = m(x).logits
        prompt = m(x[:, :-3], kv_cache=[])
        cache = prompt.cache
        for t in range(x.size(1) - 3, x.size(1)):
            out = m(x[:, t : t + 1], kv_cache=cache)
            torch.testing.assert_close(out.logits[:, -1], full[:, t], rtol=1e-5, atol=1e-5)
            cache = out.cache
    assert len(cache) == CFG.n_layers + 1  # the layers' keys and values, then the last embedding


def test_the_options_decode_with_a_kv_cache_as_without():
    m = model(**OPTIONS)
    x = tokens()
    with torch.no_grad():
        full = m(x).logits
        out = m(x[:, :-1], kv_cache=[])
        last = m(x[:, -1:], kv_cache=out.cache).logits
    torch.testing.assert_close(last[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", OPTIONS)
def test_each_option_is_refused_by_export_with_one_line_naming_it(key):
    with pytest.raises(ConfigError, match=f"'{key}' = {OPTIONS[key]!r}: no Hugging Face architecture"):
        hf.to_hf_config(dataclasses.replace(CFG, **{key: OPTIONS[key]}), torch.float32, 0, 0)


def test_a_run_with_every_option_resumes_exactly_and_refuses_export(tiny_data, tmp_path, capsys):
    flags = (*FLAGS, "--optimizer", "muon", "--adamw-groups", "nanochat")
    assert_resumes_exactly(tiny_data, tmp_path, capsys, flags, 4)
    loaded, _ = checkpoint.load_model(checkpoint.latest(tmp_path / "run"), torch.device("cpu"))
    assert {k: getattr(loaded.cfg, k) for k in OPTIONS} == OPTIONS
    code, _, err = run_main(export.main, [str(tmp_path / "run"), "--out", str(tmp_path / "hf")], capsys)
    assert_one_line_error(code, err, "'parameter_free_norms' = True", "no Hugging Face architecture")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_every_option_compiles_in_one_graph_without_recompiles():
    import torch._dynamo

    m = model(**OPTIONS)
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            x = tokens(seed)
            loss = compiled(x, labels=x.roll(-1, 1)).loss
            loss.backward()
            torch.testing.assert_close(loss, m(x, labels=x.roll(-1, 1)).loss, atol=1e-5, rtol=1e-5)
