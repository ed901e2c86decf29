"""Flag and YAML parsing: layering, types, and the one-line message of every bad value."""

import pytest

from tessera.cli.args import parse_run_config

BASE = ["--model", "tiny-gpt", "--lr", "1e-3", "--train-iters", "10"]


def parse(argv, world_size=1):
    return parse_run_config(argv, "tessera train", world_size=world_size)[0]


def error_of(capsys, argv, world_size=1) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv, world_size)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines  # one clear line
    return lines[0]


def test_preset_then_flags_override():
    config = parse(BASE + ["--hidden-size", "128", "--swiglu"])
    assert config.model.hidden_size == 128
    assert config.model.num_layers == 2          # from the preset
    assert config.model.swiglu
    assert config.model.ffn_hidden_size == int(4 * 128 * 2 / 3 / 64) * 64  # Megatron's SwiGLU default
    assert config.optim.lr == 1e-3


def test_derived_defaults():
    config = parse(["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "3", "--seq-length", "16",
                    "--vocab-size", "100", "--lr", "1", "--train-iters", "1", "--micro-batch-size", "2"])
    model = config.model
    assert (model.ffn_hidden_size, model.kv_channels, model.num_query_groups) == (384, 32, 3)
    assert model.max_position_embeddings == 16
    assert model.padded_vocab_size() == 128 and model.padded_vocab_size(tp_size=2) == 256
    assert config.train.global_batch_size == 2 and config.num_micro_batches == 1


def test_yaml_layering(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny-llama\nhidden-size: 128\ntrain:\n  micro_batch_size: 2\n  global_batch_size: 8\n")
    config = parse(["--config", str(path), "--lr", "1e-3", "--train-iters", "5", "--hidden-size", "256"])
    assert config.model.hidden_size == 256            # flag beats YAML
    assert config.model.position_embedding_type == "rope"  # YAML preset
    assert config.train.micro_batch_size == 2 and config.num_micro_batches == 4
    assert config.optim.lr == 1e-3


def test_yaml_round_trip(tmp_path):
    config = parse(BASE + ["--bf16", "--micro-batch-size", "2", "--global-batch-size", "6"])
    path = tmp_path / "saved.yaml"
    path.write_text(config.to_yaml())
    again = parse(["--config", str(path)])
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize("argv, expected", [
    (BASE + ["--hiden-size", "64"], "--hiden-size (did you mean --hidden-size?)"),
    (BASE + ["--hidden-size", "abc"], "--hidden-size: invalid int value: 'abc'"),
    (BASE + ["--normalization", "BatchNorm"], "--normalization: invalid choice"),
    (["--lr", "1", "--train-iters", "1"], "--num-layers is required"),
    (["--model", "tiny-gpt", "--train-iters", "1"], "--lr is required"),
    (["--model", "tiny-gpt", "--lr", "1"], "--train-iters is required"),
    (["--model", "gpt-5", "--lr", "1", "--train-iters", "1"], "--model gpt-5: unknown preset"),
    (BASE + ["--hidden-size", "65"], "--hidden-size (65) must be divisible by --num-attention-heads (4)"),
    (BASE + ["--group-query-attention"], "--group-query-attention needs --num-query-groups"),
    (BASE + ["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
    (BASE + ["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (BASE + ["--micro-batch-size", "4", "--global-batch-size", "6"],
     "--global-batch-size (6) must be divisible by --micro-batch-size (4) x data-parallel size (1) = 4"),
    (BASE + ["--max-position-embeddings", "32"], "--max-position-embeddings (32) must be at least --seq-length (64)"),
    (BASE + ["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    (BASE + ["--hidden-dropout", "1.5"], "--hidden-dropout must be in [0, 1)"),
    (BASE + ["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (BASE + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "not both"),
    (BASE + ["--min-lr", "1"], "--min-lr (1.0) must not exceed --lr (0.001)"),
    (BASE + ["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (BASE + ["--recompute-method", "block"], "--recompute-method needs --recompute-granularity full"),
    (BASE + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"],
     "--recompute-num-layers (3) must divide --num-layers (2)"),
    (BASE + ["--position-embedding-type", "rope", "--rotary-percent", "0.3"], "--rotary-percent (0.3)"),
    (BASE + ["--micro-batch-size", "0"], "--micro-batch-size must be positive, got 0"),
    (BASE + ["--tensor-model-parallel-size", "3"], "world size (1) must be divisible by --tensor-model-parallel-size (3)"),
    (BASE + ["--config", "/nonexistent.yaml"], "--config /nonexistent.yaml: file not found"),
    (BASE + ["--mock-data", "--data-path", "corpus"], "--mock-data and --data-path are exclusive"),
    (BASE + ["--mock-data", "--train-data-path", "a"], "--mock-data and --train-data-path are exclusive"),
])
def test_bad_values_name_the_flag(capsys, argv, expected):
    assert expected in error_of(capsys, argv)


def test_tensor_parallel_heads_check(capsys):
    message = error_of(capsys, BASE + ["--tensor-model-parallel-size", "8"], world_size=8)
    assert "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (8)" in message


def test_sequence_parallel_on_one_tensor_parallel_rank_is_turned_off_with_a_note():
    config = parse(BASE + ["--sequence-parallel"])          # as Megatron-LM does
    assert not config.parallel.sequence_parallel
    assert config.notes == ["note: --sequence-parallel is off: it splits the sequence over tensor-parallel ranks, "
                            "and --tensor-model-parallel-size is 1"]


def test_train_samples_count_whole_global_batches(capsys):
    config = parse(BASE[:-2] + ["--train-samples", "100", "--global-batch-size", "8", "--lr-warmup-samples", "20"])
    assert config.train.train_iters == 12
    assert "give --train-iters or --train-samples, not both" in error_of(
        capsys, BASE + ["--train-samples", "100", "--global-batch-size", "8"])
    assert "--lr-warmup-iters does not go with --train-samples: give --lr-warmup-samples" in error_of(
        capsys, BASE[:-2] + ["--train-samples", "100", "--lr-warmup-iters", "2"])
    assert "--lr-decay-samples does not go with --train-iters: give --lr-decay-iters" in error_of(
        capsys, BASE + ["--lr-decay-samples", "100"])


def test_world_size_defaults_to_the_launchers(monkeypatch):
    """Under torchrun (or srun) the Python API needs no world_size: the job's is read."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    config, _ = parse_run_config(BASE + ["--micro-batch-size", "2", "--global-batch-size", "16",
                                         "--tensor-model-parallel-size", "2"])
    assert config.world_size == 4 and config.data_parallel_size == 2 and config.num_micro_batches == 4


def test_global_batch_counts_data_parallel_ranks(capsys):
    config = parse(BASE + ["--micro-batch-size", "2", "--global-batch-size", "8"], world_size=2)
    assert config.data_parallel_size == 2 and config.num_micro_batches == 2
    message = error_of(capsys, BASE + ["--micro-batch-size", "2", "--global-batch-size", "6"], world_size=2)
    assert "x data-parallel size (2) = 4" in message


@pytest.mark.parametrize("text, expected", [
    ("hidden_sise: 3\n", "unknown key 'hidden_sise' (did you mean hidden_size?)"),
    ("hidden_size: big\n", "hidden_size (--hidden-size) must be int, got 'big'"),
    ("swiglu: 1\n", "swiglu (--swiglu) must be bool, got 1"),
    ("normalization: BatchNorm\n", "normalization (--normalization) must be one of LayerNorm, RMSNorm"),
    ("[1, 2]\n", "expected a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_yaml_names_the_file_and_key(capsys, tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    message = error_of(capsys, BASE + ["--config", str(path)])
    assert str(path) in message and expected in message


MOE = ["--model", "tiny-moe", "--mock-data", "--lr", "1", "--train-iters", "1"]


@pytest.mark.parametrize("flags, world, expected", [
    (["--expert-model-parallel-size", "3"], 3, "--num-experts (4) must be divisible by --expert-model-parallel-size (3)"),
    (["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"], 4,
     "--expert-model-parallel-size (4) x --expert-tensor-parallel-size (2) must divide --tensor-model-parallel-size "
     "x --context-parallel-size x data-parallel size (4)"),
    (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 4,
     "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel"),
    (["--expert-tensor-parallel-size", "5"], 5, "--moe-ffn-hidden-size (48) must be divisible by "
                                                "--expert-tensor-parallel-size (5)"),
    (["--moe-router-topk", "5"], 1, "--moe-router-topk (5) must not exceed --num-experts (4)"),
    (["--moe-layer-freq", "[1,1]"], 1, "--moe-layer-freq '[1,1]' gives 2 layers, --num-layers is 4"),
])
def test_bad_expert_layouts_name_the_flags(capsys, flags, world, expected):
    assert expected in error_of(capsys, MOE + flags, world_size=world)


def test_moe_flags_from_yaml(tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text("model: tiny-moe\nmoe_layer_freq: 2\nmoe_aux_loss_coeff: [0.01]\nmock_data: true\n")
    config = parse(["--config", str(path), "--lr", "1", "--train-iters", "1"])
    assert config.model.moe_layers() == [True, False, True, False] and config.model.moe_aux_loss_coeff == [0.01]
