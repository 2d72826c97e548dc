"""Hugging Face export and import: transformers computes fastpt's logits and fastpt computes HF's,
tokenizers encode alike, and what cannot be converted is refused with one line."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import TINY, assert_one_line_error, read_metrics, run_main, run_quietly, run_train
from fastpt import checkpoint, export, hf, prepare, sample, train
from fastpt.config import PRESETS, ModelConfig
from fastpt.data.dataset import Windows, find_shards
from fastpt.data.loader import TrainLoader
from fastpt.data.tokenizer import ByteTokenizer, load_tokenizer
from fastpt.errors import CheckpointError, ConfigError
from fastpt.model import Transformer

# Small, with a non-default RoPE base and epsilon so that a lost field shows in the logits.
SMALL = ModelConfig(
    vocab_size=300, dim=64, n_layers=2, n_heads=4, ffn_dim=96, max_seq_len=64, norm_eps=1e-5, rope_theta=5000.0
)
TEXT = "def f(x):\n    return {'ä': x ** 2}  # ✓ 🙂\n\n\tclass A: pass"


def randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights away from 1, so that a swapped or lost norm changes the logits."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.2)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)[0] if isinstance(model, Transformer) else model(ids).logits  # (B, T, V)


@pytest.fixture(scope="module")
def run_dir(bpe_data, tmp_path_factory):
    """A 3-step tiny run on a BPE corpus: a checkpoint and the run's tokenizer.json."""
    out = tmp_path_factory.mktemp("hf") / "run"
    code, _, err = run_quietly(train.main, ["--data", str(bpe_data), "--out", str(out), *TINY, "--max-steps", "3"])
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "export"
    export.export(run_dir, out)
    return out


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("n_kv_heads", [0, 2], ids=["mha", "gqa"])
def test_transformers_computes_the_logits_of_an_export(tmp_path, n_kv_heads, tie):
    cfg = dataclasses.replace(SMALL, n_kv_heads=n_kv_heads, tie_embeddings=tie)
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    randomize_norms(ours)
    hf.save_hf(tmp_path, cfg, ours.state_dict(), max_shard_size=40_000)  # sharded, with an index
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 48))
    torch.testing.assert_close(logits(theirs, ids), logits(ours, ids), atol=1e-4, rtol=0)
    assert theirs.num_parameters() == ours.num_params()
    weight_map = json.loads((tmp_path / hf.INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and ("lm_head.weight" in weight_map) is not tie


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_qk_norm_model_exports_as_qwen3_with_its_logits_and_imports_back(tmp_path, tie):
    cfg = dataclasses.replace(SMALL, n_kv_heads=2, tie_embeddings=tie, qk_norm=True)
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    randomize_norms(ours)  # q_norm / k_norm scales away from 1: a misplaced feature shows
    hf.save_hf(tmp_path, cfg, ours.state_dict())
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["use_sliding_window"]) == (
        ["Qwen3ForCausalLM"],
        "qwen3",
        False,
    )
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM" and theirs.num_parameters() == ours.num_params()
    ids = torch.randint(0, cfg.vocab_size, (3, 48))
    torch.testing.assert_close(logits(theirs, ids), logits(ours, ids), atol=1e-4, rtol=0)
    back_cfg, state = hf.load_hf(tmp_path)
    assert back_cfg == cfg and all(torch.equal(state[k], v) for k, v in ours.state_dict().items())
    assert hf.to_hf_config(SMALL, torch.float32, 0, 0)["architectures"] == ["LlamaForCausalLM"]  # no qk_norm


def assert_export_computes_the_checkpoint(ckpt, folder) -> None:
    ours, _ = checkpoint.load_model(ckpt, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 64))
    torch.testing.assert_close(logits(theirs, ids), logits(ours, ids), atol=1e-4, rtol=0)


def test_export_of_a_trained_run(run_dir, exported):
    assert_export_computes_the_checkpoint(checkpoint.find(run_dir), exported)
    config = json.loads((exported / "config.json").read_text())
    eot = load_tokenizer(run_dir / "tokenizer.json").eot_id
    assert config["bos_token_id"] == config["eos_token_id"] == eot and config["torch_dtype"] == "float32"
    modes = {p.name: p.stat().st_mode & 0o777 for p in exported.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # readable alike (a server account)


@pytest.mark.slow
def test_export_of_an_fsdp_checkpoint_directory(bpe_data, tmp_path):
    run = tmp_path / "fsdp"
    result = run_train(
        "--data", str(bpe_data), "--out", str(run), *TINY, "--max-steps", "2", "--parallel", "fsdp", nproc=2
    )
    assert result.returncode == 0, result.stderr
    shards = checkpoint.find(run)
    assert shards.is_dir()  # DCP shards from both ranks
    export.export(shards, tmp_path / "hf")
    assert_export_computes_the_checkpoint(shards, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()  # found in the run folder above the shards


def test_auto_tokenizer_encodes_like_fastpt_behind_the_document_token(run_dir, exported):
    ours = load_tokenizer(run_dir / "tokenizer.json")
    theirs = AutoTokenizer.from_pretrained(exported)
    texts = [TEXT, "import os\nprint(os.getcwd())\n"]
    ids = ours.encode_batch(texts)
    assert theirs(texts)["input_ids"] == [[ours.eot_id, *i] for i in ids]  # as fastpt trained: BOS first
    assert theirs(texts, add_special_tokens=False)["input_ids"] == ids
    assert theirs.eos_token_id == theirs.bos_token_id == ours.eot_id
    assert theirs.decode(theirs(TEXT)["input_ids"], skip_special_tokens=True) == ours.decode(ids[0]) == TEXT
    assert load_tokenizer(exported).encode_batch(texts) == ids  # fastpt reads the export's file as its own


def test_a_bytes_tokenizer_exports_as_a_byte_level_bpe(tmp_path):
    ByteTokenizer().save(tmp_path / "bytes.json")
    assert hf.save_tokenizer(hf.hf_tokenizer(tmp_path / "bytes.json"), 256, tmp_path, 64) == (256, 256)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    assert theirs(TEXT)["input_ids"] == [256, *ByteTokenizer().encode_batch([TEXT])[0]] == [256, *TEXT.encode()]
    assert theirs.eos_token_id == 256 and theirs.decode(list(TEXT.encode())) == TEXT
    assert load_tokenizer(tmp_path / "tokenizer.json").encode_batch([TEXT])[0] == list(TEXT.encode())


def test_a_tokenizer_without_a_document_token_exports_adding_no_bos(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
    tok.save(str(tmp_path / "plain.json"))
    ours = load_tokenizer(tmp_path / "plain.json")
    assert ours.eot_id is None  # trained without a document token: nothing to put before a text
    assert hf.save_tokenizer(hf.hf_tokenizer(tmp_path / "plain.json"), None, tmp_path, 64) == (None, None)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    assert theirs(TEXT)["input_ids"] == ours.encode_batch([TEXT])[0] and theirs.bos_token is None
    assert theirs.decode(theirs(TEXT)["input_ids"]) == TEXT
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["add_bos_token"] is False


def fastpt_greedy(ckpt, prompt: str, new_tokens: int) -> list[int]:
    """fastpt.sample's greedy ids for `prompt`, the document token first."""
    model, _ = checkpoint.load_model(checkpoint.find(ckpt), torch.device("cpu"))
    tok = load_tokenizer(ckpt / "tokenizer.json")
    ids = [tok.eot_id, *tok.encode_batch([prompt])[0]]
    return sample.generate(model.eval(), ids, new_tokens, temperature=0, vocab=tok.vocab_size)


def test_transformers_default_greedy_generate_on_the_export_is_fastpts_greedy(run_dir, exported):
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    tok = AutoTokenizer.from_pretrained(exported)
    for prompt in ("def ", "import os\n"):
        inputs = tok(prompt, return_tensors="pt")  # as a user writes it: the tokenizer adds the BOS
        theirs = model.generate(**inputs, do_sample=False, max_new_tokens=20)[0].tolist()
        ours = fastpt_greedy(run_dir, prompt, 20)
        # generate stops at the EOS, which for fastpt's tokenizers is the document token too
        assert theirs == ours[: len(theirs)] and (len(theirs) == len(ours) or theirs[-1] == tok.eos_token_id)


def test_a_tokenizer_without_a_hugging_face_twin_exports_the_weights_alone(run_dir, tmp_path, capsys):
    (tmp_path / "char.json").write_text(json.dumps({"type": "char", "chars": "abc", "eot": True}))
    export.export(run_dir, tmp_path / "hf", tokenizer=tmp_path / "char.json")
    assert "fastpt: warning:" in capsys.readouterr().err
    assert not (tmp_path / "hf" / "tokenizer.json").exists() and (tmp_path / "hf" / "model.safetensors").is_file()


def test_greedy_sampling_from_the_export_equals_the_checkpoint(run_dir, exported, capsys):
    def greedy(path) -> str:
        code, out, err = run_main(
            sample.main,
            [
                "--ckpt",
                str(path),
                "--prompt",
                "def ",
                "--temperature",
                "0",
                "--max-new-tokens",
                "24",
                "--device",
                "cpu",
            ],
            capsys,
        )
        assert code == 0, err
        return out

    assert greedy(exported) == greedy(run_dir)


def small_llama(tie: bool) -> LlamaConfig:
    """SMALL as a transformers Llama, with 2 KV heads (GQA)."""
    return LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
    )


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_transformers_llama_imports_with_its_logits_and_exports_back(tmp_path, tie):
    config = small_llama(tie)
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(config).eval()
    randomize_norms(theirs)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    cfg, state = hf.load_hf(tmp_path / "hf")
    assert cfg == dataclasses.replace(SMALL, n_kv_heads=2, tie_embeddings=tie)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, cfg.vocab_size, (3, 48))
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), atol=1e-4, rtol=0)

    hf.save_hf(tmp_path / "back", cfg, state)
    back = load_file(tmp_path / "back" / "model.safetensors")
    expected = {k: v for k, v in theirs.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], v) for k, v in expected.items())


def test_init_from_starts_training_from_the_hf_weights_and_exports_them_back(tiny_data, tmp_path, capsys):
    """--init-from: the first logged loss is HF's own loss on the first batch (warmup makes step 1's
    learning rate 0, so its checkpoint still holds HF's weights: exported, they are HF's tensors);
    then training goes on, and a shape key that contradicts the HF model is refused."""
    config = small_llama(tie=False)
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    args = [
        "--init-from",
        str(tmp_path / "hf"),
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path / "run"),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--seq-len",
        "32",
        "--micro-batch",
        "4",
        "--log-every",
        "1",
        "--warmup-steps",
        "1",
    ]
    code, out, err = run_main(train.main, args + ["--max-steps", "1"], capsys)
    assert code == 0 and f"init from {tmp_path / 'hf'}" in out, err
    batch = TrainLoader(Windows(find_shards(tiny_data, "train"), 32), 4, seed=1337, device=torch.device("cpu")).next()
    expected = torch.nn.functional.cross_entropy(logits(theirs, batch.x).flatten(0, 1), batch.y.flatten())
    assert read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(expected.item(), rel=1e-5)
    export.export(tmp_path / "run", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert all(torch.equal(back[k], v) for k, v in theirs.state_dict().items())

    code, _, err = run_main(train.main, args + ["--max-steps", "4", "--resume"], capsys)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    code, _, err = run_main(
        train.main, args + ["--max-steps", "1", "--out", str(tmp_path / "other"), "--n-layers", "3"], capsys
    )
    assert code == 2 and err == "fastpt: error: 'n_layers' = 3 disagrees with the model of --init-from (2)\n"


def write_config(folder, **changes) -> None:
    """SMALL's exported config.json with fields changed (None removes one)."""
    folder.mkdir(exist_ok=True)
    config = {**hf.to_hf_config(SMALL, torch.float32, 0, 0), **changes}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_type", "mistral"),
        ("architectures", ["LlamaForSequenceClassification"]),
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("hidden_act", "gelu"),
        ("head_dim", 32),
        ("hidden_size", None),
        ("num_attention_heads", 5),
        ("num_key_value_heads", 3),
        ("rms_norm_eps", "1e-5"),
        ("quantization_config", {"quant_method": "bitsandbytes"}),
    ],
)
def test_an_unsupported_config_is_refused_naming_the_field(tmp_path, field, value):
    write_config(tmp_path, **{field: value})
    with pytest.raises(ConfigError, match=f"'{field}'") as error:
        hf.load_hf(tmp_path)
    assert "\n" not in str(error.value)


def test_a_qwen3_with_a_sliding_window_is_refused(tmp_path):
    write_config(tmp_path, model_type="qwen3", architectures=["Qwen3ForCausalLM"], use_sliding_window=True)
    with pytest.raises(ConfigError, match="'use_sliding_window'"):
        hf.load_hf(tmp_path)
    write_config(tmp_path, model_type="qwen3")  # a Qwen3 config that names Llama's class
    with pytest.raises(ConfigError, match="'architectures'"):
        hf.load_hf(tmp_path)


def test_weights_that_do_not_match_the_config_are_refused_naming_the_tensor(tmp_path):
    hf.save_hf(tmp_path, SMALL, Transformer(SMALL).state_dict())
    write_config(tmp_path, intermediate_size=128)
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.gate_proj.weight' has shape"):
        hf.load_hf(tmp_path)
    write_config(tmp_path, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.2.input_layernorm.weight'"):
        hf.load_hf(tmp_path)


def test_export_replaces_only_an_earlier_export_and_only_when_asked(run_dir, tmp_path, capsys, monkeypatch):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    monkeypatch.chdir(notes)
    for out in (str(notes), "."):  # not even with --overwrite: it is not a model folder
        assert_one_line_error(
            *run_main(export.main, [str(run_dir), "--out", out, "--overwrite"], capsys)[::2],
            "did not write (todo.txt): nothing deleted",
        )
    assert os.listdir(notes) == ["todo.txt"]
    assert_one_line_error(
        *run_main(export.main, [str(run_dir), "--out", str(run_dir), "--overwrite"], capsys)[::2],
        "holds the checkpoint",
    )
    out = tmp_path / "hf"
    assert_one_line_error(
        *run_main(export.main, [str(run_dir), "--out", str(out), "--max-shard-size", "lots"], capsys)[::2],
        "--max-shard-size",
    )
    assert run_main(export.main, [str(run_dir), "--out", str(out)], capsys)[0] == 0
    assert_one_line_error(*run_main(export.main, [str(run_dir), "--out", str(out)], capsys)[::2], "--overwrite")
    code, _, err = run_main(
        export.main, [str(checkpoint.find(run_dir)), "--out", str(out), "--overwrite", "--dtype", "bf16"], capsys
    )
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


def test_export_help_lists_its_options(capsys):
    code, out, _ = run_main(export.main, ["--help"], capsys)
    assert code == 0
    for option in ("RUN_DIR_OR_CKPT", "--out", "--dtype", "--max-shard-size", "--tokenizer", "--overwrite"):
        assert option in out


def test_preset_parameter_counts():
    with torch.device("meta"):
        assert Transformer(PRESETS["1b"]).num_params() == 1_100_048_384  # TinyLlama-1.1B
        tinyllama = LlamaForCausalLM(LlamaConfig(**hf.to_hf_config(PRESETS["1b"], torch.bfloat16, 1, 2)))
    assert tinyllama.num_parameters() == 1_100_048_384
    for name, cfg in PRESETS.items():
        cfg = dataclasses.replace(cfg, vocab_size=cfg.vocab_size or 257)  # tiny takes the data's vocab
        with torch.device("meta"):
            assert Transformer(cfg).num_params() == cfg.num_params(), name


@pytest.mark.slow
def test_init_from_without_data_prepares_the_default_corpus_with_the_models_tokenizer(
    exported, tiny_data, tmp_path, monkeypatch, capsys
):
    """The HF folder's own tokenizer.json prepares the default corpus, so the ids mean what the
    weights learned; a folder without one is refused rather than trained on another tokenizer's ids,
    and data of another tokenizer is a warning."""
    from test_data import few_stdlib_files

    monkeypatch.setenv("FASTPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prepare, "stdlib_sources", few_stdlib_files)
    args = ["--device", "cpu", "--dtype", "fp32", "--seq-len", "32", "--micro-batch", "4", "--max-steps", "2"]
    code, out, err = run_main(train.main, args + ["--init-from", str(exported), "--out", str(tmp_path / "run")], capsys)
    assert code == 0 and "preparing the default corpus" in out and "warning" not in err, err
    (corpus,) = (tmp_path / "cache").iterdir()
    assert json.loads((corpus / "meta.json").read_text())["tokenizer"] == str(exported / "tokenizer.json")
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (exported / "tokenizer.json").read_bytes()

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((exported / name).read_bytes())
    code, _, err = run_main(train.main, args + ["--init-from", str(bare), "--out", str(tmp_path / "other")], capsys)
    assert_one_line_error(code, err, str(bare), "tokenizer.json", "--data")

    code, _, err = run_main(
        train.main,
        args + ["--init-from", str(exported), "--data", str(tiny_data), "--out", str(tmp_path / "bytes")],
        capsys,
    )
    assert code == 0 and f"fastpt: warning: {tiny_data} was not prepared with {exported / 'tokenizer.json'}" in err


def test_init_from_an_export_of_a_default_run_reuses_the_cached_default_corpus(tmp_path, monkeypatch, capsys):
    """A default run (no --data) exported and continued with --init-from and no --data: the export's
    tokenizer.json is byte-identical to the cached corpus's, so that corpus is reused, not prepared again."""
    from test_data import few_stdlib_files

    monkeypatch.setenv("FASTPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prepare, "stdlib_sources", few_stdlib_files)
    args = [*TINY, "--max-steps", "2", "--vocab-size", "512", "--out"]
    code, out, err = run_main(train.main, args + [str(tmp_path / "first")], capsys)
    assert code == 0 and "preparing the default corpus" in out, err
    export.export(tmp_path / "first", tmp_path / "hf")
    (corpus,) = (tmp_path / "cache").iterdir()
    # the export's tokenizer.json is the corpus's with a post-processor that adds the BOS
    assert prepare.encoding_content(tmp_path / "hf" / "tokenizer.json") == prepare.encoding_content(
        corpus / "tokenizer.json"
    )
    code, out, err = run_main(
        train.main, ["--init-from", str(tmp_path / "hf"), *args[:-3], "--out", str(tmp_path / "continued")], capsys
    )
    assert code == 0 and "preparing the default corpus" not in out and "warning" not in err, err
    assert f"data {corpus}:" in out and list((tmp_path / "cache").iterdir()) == [corpus]
    other = tmp_path / "other.json"  # a tokenizer that encodes otherwise is another corpus
    config = json.loads((corpus / "tokenizer.json").read_text())
    other.write_text(json.dumps({**config, "normalizer": {"type": "Lowercase"}}))
    assert prepare.default_corpus(512, other) != corpus


# Contexts and endings in the stdlib's own idiom, which the tiny run read; no context starts with
# whitespace, which the task's `trim` would drop.
MC_ROWS = [
    ("def __init__(self", [", name):", ", *args, **kwargs):", "):"]),
    ("import", ["os", "sys", "re"]),
    ("return", ["None", "self", "True"]),
    ("for i in", ["range(n):", "items:", "self:"]),
    ("if not", ["self.", "isinstance(x, str):", "None:"]),
    ("raise", ["ValueError(", "TypeError(msg)", "KeyError"]),
    ("class", ["A:", "Error(Exception):", "object"]),
    ("self.", ["name = name", "_lock", "x"]),
    ("lambda", ["x: x", "self: self", "*args: None"]),
    ("except", ["Exception:", "KeyError:", "(OSError, ValueError) as e:"]),
]


@pytest.mark.slow
def test_lm_eval_scores_an_export_as_fastpts_mc_acc(run_dir, exported, bpe_data, tmp_path):
    """lm-eval's HFLM on the export, on a task defined here from a local JSONL (no download), gives
    the accuracies --eval-mc gives on the same rows: acc is --eval-mc-norm none, acc_norm char."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from fastpt import distributed
    from fastpt.multiple_choice import MultipleChoice, read_tasks

    rows = [{"ctx": ctx + " ", "endings": endings, "label": i % 3} for i, (ctx, endings) in enumerate(MC_ROWS)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "fastpt_mc.yaml").write_text(
        "task: fastpt_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{ctx | trim}}"\ndoc_to_choice: "{{endings}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    lm = HFLM(pretrained=str(exported), device="cpu", batch_size=8)
    evaluated = lm_eval.simple_evaluate(
        model=lm, tasks=["fastpt_mc"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")), log_samples=True
    )
    results, samples = evaluated["results"]["fastpt_mc"], evaluated["samples"]["fastpt_mc"]
    model, _ = checkpoint.load_model(checkpoint.find(run_dir), torch.device("cpu"))
    cpu, no_autocast = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    for metric, norm in (("acc", "none"), ("acc_norm", "char")):
        mc = MultipleChoice(read_tasks(str(tmp_path / "mc.jsonl")), bpe_data, 32, 4, norm)
        ours = mc.accuracy(model, cpu, no_autocast, distributed.Dist())["mc_acc"]
        assert results[f"{metric},none"] == pytest.approx(ours, abs=1e-9), (metric, results, ours)
    # The same log-likelihood of every ending: each read behind the document token, as it was trained.
    choices = [c for row in mc.tasks[0] for c in row]
    nats = mc._nats(choices, -(-len(choices) // mc.micro_batch), model, cpu, no_autocast)
    theirs = [float(ll) for s in sorted(samples, key=lambda s: s["doc_id"]) for ll, _ in s["filtered_resps"]]
    assert theirs == pytest.approx([-n for n in nats], abs=1e-4)
