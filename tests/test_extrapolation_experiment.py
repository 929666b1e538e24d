"""`examples/extrapolation.py`: the one-command length-extrapolation experiment, run end to end at its tiny preset."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_script

import sepformer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# On one worker: the end-to-end run (`run`) would otherwise run once in each.
pytestmark = pytest.mark.xdist_group("extrapolation_experiment")
sys.path.insert(0, str(EXAMPLES))
import extrapolation  # noqa: E402  (after the path)
import extrapolation_conditions  # noqa: E402
import extrapolation_report  # noqa: E402
import extrapolation_task  # noqa: E402
from experiment_common import write_csv  # noqa: E402

MODELS = {
    "SepFormer learned": tuple(sepformer.EXTRAPOLATION_METHODS),
    "SepFormer learned, 1.25x wide (the peers' parameters)": tuple(sepformer.EXTRAPOLATION_METHODS),
    "SepFormer learned, last row untrained": ("clamp",),
    "SepFormer learned, random offsets (8L table)": ("-",),
    "SepFormer learned, randomized positions (8L table)": ("-",),
    "SepFormer learned, randomized positions, range per sequence (8L table)": ("-",),
    "SepFormer sinusoidal": ("-",),
    "SepFormer sinusoidal, randomized positions (8L)": ("-",),
    "SepFormer B-spline (n=16)": ("-",),
    "SepFormer B-spline (n=32), randomized positions (8L)": ("-",),
    "SepFormer sinusoidal, randomized positions, range per sequence (8L)": ("-",),
    "SepFormer B-spline (n=32), randomized positions, range per sequence (8L)": ("-",),
    "SepFormer d_pos=0": ("-",),
    "GPT-2 (learned, additive)": tuple(sepformer.EXTRAPOLATION_METHODS),
    "GPT-2, randomized positions (8L table)": ("-",),
    "GPT-2, randomized positions, range per sequence (8L table)": ("-",),
    "GPT-2 sinusoidal (fixed, added), randomized positions, range per sequence (8L)": ("-",),
    "GPT-2 sinusoidal (fixed, added, at the tokens' std 0.02), randomized positions, range per sequence (8L)": ("-",),
    "Llama (rotary)": ("-", "interpolate"),
    "Bloom (ALiBi)": ("-",),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The command as a user types it: tiny preset (3 steps), two seeds, every model and method."""
    output_dir = tmp_path_factory.mktemp("extrapolation")
    stdout, rows = run_script(
        EXAMPLES / "extrapolation.py", "--tiny", "--seeds", "0", "1", output_dir=output_dir, csv_name="results.csv"
    )
    return stdout, rows, output_dir


@pytest.mark.slow
def test_every_model_method_seed_and_length_has_a_row(run):
    _, rows, _ = run
    lengths = {str(16 * m) for m in (1, 2, 4, 8)}
    expected = {
        (model, method, seed, length)
        for model, methods in MODELS.items()
        for method in methods
        for seed in ("0", "1")
        for length in lengths
    }
    assert {(r["model"], r["method"], r["seed"], r["length"]) for r in rows} == expected
    assert len(rows) == len(expected)


@pytest.mark.slow
def test_models_that_cannot_run_are_reported_not_skipped(run):
    stdout, rows, _ = run
    for row in rows:
        beyond = int(row["length"]) > int(row["train_length"])
        cannot = row["method"] == "none" and beyond
        if cannot:
            assert row["status"].startswith("cannot run"), row
            assert math.isnan(float(row["bits_per_byte"]))
        else:
            assert row["status"] == "ok", row
            assert 0 < float(row["bits_per_byte"]) < 12, row
    assert "cannot run: ValueError: position" in stdout  # SepFormer's own error, naming the position
    assert "cannot run: ValueError: its positions stop at L = 16 (a table of L rows, n_positions = L)" in stdout


@pytest.mark.slow
def test_same_tokens_at_every_length(run):
    _, rows, _ = run
    for row in rows:
        total = 1024  # the tiny preset's --eval-tokens, a multiple of 8L = 128
        assert int(row["tokens_scored"]) == total - total // int(row["length"])


@pytest.mark.slow
def test_table_and_plot(run):
    stdout, _, output_dir = run
    assert "| model | method | params | 16 (1L) | 32 (2L) | 64 (4L) | 128 (8L) |" in stdout
    assert " ± " in stdout  # two seeds: mean ± std
    assert (output_dir / "results.md").read_text().strip() in stdout
    assert (output_dir / "extrapolation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_table_and_plot_from_the_csv_of_runs_made_side_by_side(run, tmp_path):
    """`--from-csv` trains nothing and gives the table of the runs it reads."""
    stdout, _, output_dir = run
    again, rows = run_script(
        EXAMPLES / "extrapolation.py",
        "--tiny",
        "--from-csv",
        str(output_dir / "results.csv"),
        output_dir=tmp_path,
        csv_name="results.csv",
    )
    assert (tmp_path / "results.md").read_text() == (output_dir / "results.md").read_text()
    assert len(rows) == len(list(csv_rows(output_dir / "results.csv")))
    assert (tmp_path / "extrapolation.png").exists()


FIELDS = extrapolation_report.RESULT_FIELDS


def write_results(path, rows, fields=FIELDS):
    """A results.csv of `rows`, each a row of the tiny preset's run with some fields changed."""
    row = dict(
        model="Llama (rotary)",
        method="-",
        seed=0,
        train_length=16,
        length=16,
        bits_per_byte=2.0,
        bits_per_byte_beyond_L="nan",
        tokens_scored=960,
        status="ok",
        parameters=1,
        train_steps=3,
        train_bits_per_byte=2.0,
        train_seconds=1.0,
    )
    write_csv([{**row, **changes} for changes in rows], path, fields)
    return str(path)


@pytest.mark.parametrize(
    "fields, rows, message",
    [
        ([f for f in FIELDS if f not in ("seed", "length")], [{}], " has no column seed, length: give"),
        (FIELDS, [{}, {"seed": 1, "length": "x"}], r", line 3: column length holds 'x', not an integer"),
        (FIELDS, [{"bits_per_byte": ""}], r", line 2: column bits_per_byte holds '', not a number"),
        (FIELDS, [], r": no rows; give the results.csv"),
    ],
    ids=["columns missing", "not an integer", "not a number", "no rows"],
)
def test_a_malformed_csv_is_refused_naming_the_file_and_what_is_wrong(fields, rows, message, tmp_path):
    path = write_results(tmp_path / "results.csv", rows, fields)
    with pytest.raises(SystemExit, match=re.escape(f"--from-csv {path}") + message):
        extrapolation_report.read_csv([path], extrapolation.parse_args(["--tiny"]))


def test_rows_of_a_cell_given_twice_are_refused(tmp_path):
    """Two copies of a run's results.csv would count every row twice in the mean over seeds."""
    args = extrapolation.parse_args(["--tiny"])
    first, other = (write_results(tmp_path / name, [{}, {"seed": 1}]) for name in ("a.csv", "b.csv"))
    assert len(extrapolation_report.read_csv([first], args)) == 2
    with pytest.raises(
        SystemExit,
        match=f"--from-csv {first} and {other} both hold Llama \\(rotary\\) / -, seed 0, "
        "length 16: give each run's results once",
    ):
        extrapolation_report.read_csv([first, other], args)


def csv_rows(path):
    import csv

    with open(path) as handle:
        return list(csv.DictReader(handle))


def test_training_blocks_give_position_L_minus_1_a_target(tmp_path):
    """Blocks of L + 1 tokens; the row trained without that target sees exactly what blocks of L tokens give."""
    args = extrapolation.parse_args(["--tiny"])
    blocks, _ = extrapolation_task.token_data(args, sepformer.SepFormerTokenizer())
    assert blocks.shape[1] == args.block_size + 1
    torch.manual_seed(0)
    model = extrapolation_conditions.Contender("SepFormer learned").build(args, 259)
    last_row_gradients = []
    model.model.embed_positions.weight.register_hook(lambda grad: last_row_gradients.append(grad[-1].clone()))
    order = torch.arange(4)[None]
    args.max_steps = 1
    extrapolation.train(model, blocks, order, args, "untrained", last_position_target=False)
    extrapolation.train(model, blocks, order, args, "trained")
    untrained, trained = last_row_gradients
    assert torch.equal(untrained, torch.zeros_like(untrained)) and trained.abs().sum() > 0


def test_documentation_text_is_split_by_topic():
    train, validation = extrapolation_task.documentation_topics(10**7, validation_fraction=0.1)
    assert train and validation and not set(train) & set(validation)
    seen = {paragraph for text in train for paragraph in text.split("\n\n")}
    assert not any(paragraph in seen for text in validation for paragraph in text.split("\n\n"))
    assert sum(map(len, validation)) > 8 * 64 * 4  # enough for the default preset's 8L windows


def test_bits_per_byte_is_the_model_loss():
    """The scoring agrees with the model's own loss on the same windows, and 'beyond L' with a manual slice."""
    args = extrapolation.parse_args(["--tiny"])
    torch.manual_seed(0)
    model = extrapolation_conditions.Contender("SepFormer learned").build(args, 259).eval()
    stream = torch.randint(0, 256, (8 * 32,))
    length = 32  # 2L: positions past L need a method
    total, beyond = extrapolation.bits_per_byte(model, stream, length, args, position_extrapolation="clamp")
    windows = stream.view(-1, length)
    with torch.no_grad():
        logits = model(input_ids=windows, position_extrapolation="clamp").logits
        loss = model(input_ids=windows, labels=windows, position_extrapolation="clamp").loss
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), windows[:, 1:], reduction="none")
    assert total == pytest.approx(loss.item() / math.log(2), rel=1e-5)
    assert beyond == pytest.approx(nll[:, args.block_size - 1 :].mean().item() / math.log(2), rel=1e-5)


@pytest.mark.parametrize("method", ["clamp", "sinusoidal", "fourier", "interpolate"])
def test_gpt2_reads_past_its_table_by_the_rule_of_a_sepformer_table_of_the_same_rows(method):
    """The control: GPT-2's additive table extended by a rule equals a SepFormer's learned table of the same rows
    extended by it (`LearnedPositions`, the rows the SepFormer contenders read), added to the token embeddings."""
    args = extrapolation.parse_args(["--tiny"])
    torch.manual_seed(0)
    gpt2 = extrapolation_conditions.Contender("GPT-2", extrapolation_conditions.PEER_TOKENS, "gpt2").build(args, 259)
    gpt2.eval()
    length, train_length = 64, args.block_size
    table = sepformer.SepFormerConfig(hidden_size=64, position_size=32, max_position_embeddings=train_length)
    learned = sepformer.positional_maps.LearnedPositions(table)
    learned.weight.data.copy_(gpt2.transformer.wpe.weight)
    ids = torch.randint(0, 256, (2, length))
    positions = torch.arange(length).expand(2, -1)
    with torch.no_grad():
        rows = learned(positions, sepformer.PositionExtrapolation(method))  # (2, n, d)
        # GPT-2 at position 0 everywhere, with the rows less row 0 added to the token embeddings
        embeds = gpt2.transformer.wte(ids) + rows - gpt2.transformer.wpe.weight[0]
        expected = gpt2(inputs_embeds=embeds, position_ids=torch.zeros_like(ids)).logits
        with extrapolation_conditions.Contender("GPT-2", family="gpt2").reading(gpt2, method, length, train_length):
            logits = gpt2(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert gpt2.transformer.wpe.weight.shape[0] == train_length  # restored


def test_the_wide_sepformer_has_as_many_parameters_as_the_peers():
    """At the default preset the parameter-matched SepFormer is within 5% of every peer's count; the plain one has
    about 30% fewer."""
    args = extrapolation.parse_args([])
    built = {c.name: c.build(args, 259).num_parameters() for c in extrapolation_conditions.contenders(args)}
    peers = [built[name] for name in ("GPT-2 (learned, additive)", "Llama (rotary)", "Bloom (ALiBi)")]
    wide = built["SepFormer learned, 1.25x wide (the peers' parameters)"]
    assert all(abs(wide - peer) / peer < 0.05 for peer in peers), (wide, peers)
    assert built["SepFormer learned"] < 0.75 * min(peers)


@pytest.mark.parametrize("randomized_range", ["fixed", "per_sequence"])
def test_gpt2_trains_on_randomized_positions_as_sepformer_draws_them(randomized_range):
    """The control of randomized positions: in training GPT-2's table (8L rows) is read at sorted distinct positions
    drawn from [0, 8L), other ones for each sequence; in eval at 0..n-1."""
    args = extrapolation.parse_args(["--tiny"])
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    contender = extrapolation_conditions.Contender("GPT-2", no_dropout, "gpt2", randomized_range=randomized_range)
    model = contender.build(args, 259)
    assert model.transformer.wpe.num_embeddings == 8 * args.block_size
    read = []
    model.transformer.wpe.register_forward_hook(lambda module, inputs, output: read.append(inputs[0]))
    ids = torch.randint(0, 256, (64, args.block_size))
    model.train()(ids)
    positions = read[-1].expand(64, -1)
    assert (positions.diff(dim=-1) > 0).all() and positions.max() < 8 * args.block_size
    assert len({tuple(row) for row in positions.tolist()}) > 1 and (positions[:, -1] > args.block_size).any()
    with torch.no_grad():
        model.eval()(ids)
    torch.testing.assert_close(read[-1].expand(64, -1), torch.arange(args.block_size).expand(64, -1))
    # causal attention over the drawn positions, with or without a cache (without one, and without a mask,
    # transformers would read them as packed sequences): the model given those positions and a full mask by hand
    model.train()
    hooked = model(ids[:2], use_cache=False).logits
    model.eval()  # the hook off (and dropout): the same positions given by hand
    by_hand = model(ids[:2], position_ids=read[-1], attention_mask=torch.ones_like(ids[:2]), use_cache=False).logits
    torch.testing.assert_close(hooked, by_hand)


def test_the_sinusoidal_gpt2_adds_the_fixed_sinusoid_and_does_not_train_it():
    args = extrapolation.parse_args(["--tiny"])
    contender = extrapolation_conditions.Contender(
        "GPT-2", family="gpt2", randomized_range="fixed", sinusoid_std=2**-0.5
    )
    model = contender.build(args, 259)
    length, width = 8 * args.block_size, args.hidden_size
    table = model.transformer.wpe.weight
    assert not table.requires_grad and table.shape == (length, width)
    i, k = torch.arange(length)[:, None].float(), torch.arange(0, width, 2).float()
    torch.testing.assert_close(table[:, 0::2], torch.sin(i / 10000 ** (k / width)))
    torch.testing.assert_close(table[:, 1::2], torch.cos(i / 10000 ** (k / width)))


def test_llama_interpolate_reads_rotary_at_the_compressed_positions():
    """Linear position interpolation on Llama: its rotary at each window's positions `i · (L-1)/(n-1)`, the positions
    a SepFormer's `interpolate` reads its table at."""
    args = extrapolation.parse_args(["--tiny"])
    torch.manual_seed(0)
    llama = extrapolation_conditions.Contender("Llama", family="llama").build(args, 259).eval()
    length, train_length = 64, args.block_size
    compressed = torch.arange(length) * (train_length - 1) / (length - 1)
    hidden, ids = torch.zeros(1, length, args.hidden_size), torch.randint(0, 256, (1, length))
    expected = llama.model.rotary_emb(hidden, compressed[None])  # the default rotary at fractional positions
    with extrapolation_conditions.Contender("Llama", family="llama").reading(
        llama, "interpolate", length, train_length
    ):
        cos, sin = llama.model.rotary_emb(hidden, torch.arange(length)[None])
        with torch.no_grad():
            interpolated = llama(ids).logits
    torch.testing.assert_close((cos, sin), expected, atol=1e-6, rtol=1e-5)
    assert llama.model.rotary_emb.rope_type == "default"  # restored
    with torch.no_grad():
        assert not torch.allclose(llama(ids).logits, interpolated)  # the trained rotary is back


def no_data(*args, **kwargs):
    raise AssertionError("the data was read")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-heads", "1"], "SepFormer learned cannot be built with these flags: position_size=32 is not allowed"),
        (
            ["--block-size", "8"],
            "SepFormer B-spline (n=16) cannot be built with these flags: bspline control_points=16 is "
            "more than the position_table_size=8",
        ),
    ],
    ids=["one head", "spline longer than L"],
)
def test_sizes_a_model_refuses_stop_the_run_before_the_data_is_read(flags, message, monkeypatch, tmp_path):
    """Not after the models before it have trained (the B-spline comes seventh)."""
    monkeypatch.setattr(extrapolation, "token_data", no_data)
    with pytest.raises(SystemExit, match=re.escape(message)):
        extrapolation.main(["--tiny", *flags, "--output-dir", str(tmp_path)])


def test_a_model_name_that_matches_nothing_stops_the_run():
    """Even beside one that matches: a mistyped name would silently drop its model."""
    args = extrapolation.parse_args(["--tiny", "--models", "llama", "gtp2"])
    with pytest.raises(SystemExit, match="--models gtp2 matches none of: SepFormer learned, "):
        extrapolation_conditions.contenders(args)


@pytest.mark.slow
def test_data_parallel_run_gives_the_table_of_one_process(run, tmp_path):
    """`torchrun --nproc_per_node 2` runs the experiment unchanged: 2 processes of half the batch each train as one
    process does (same global batches, same order), so the table is the one-process run's (seed 0 of `run`); but
    for randomized positions, which each process draws for its half of the batch from the same seed (the halves get
    the same draws, where one process draws for the whole batch): those models train on other positions, so their
    rows agree within the smoke run's noise only."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(EXAMPLES / "extrapolation.py"),
        "--tiny",
        "--seeds",
        "0",
        "--output-dir",
        str(tmp_path),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "data parallel over 2 processes" in completed.stdout
    assert completed.stdout.count("| model | method | params |") == 1  # only the main process prints
    single = {(r["model"], r["method"], r["length"]): r for r in run[1] if r["seed"] == "0"}
    parallel = {(r["model"], r["method"], r["length"]): r for r in csv_rows(tmp_path / "results.csv")}
    assert parallel.keys() == single.keys()
    for key, row in parallel.items():
        assert row["status"] == single[key]["status"], key
        tolerance = 0.05 if "randomized positions" in key[0] else 0.01
        train_bits = float(single[key]["train_bits_per_byte"])
        assert float(row["train_bits_per_byte"]) == pytest.approx(train_bits, abs=tolerance), key
        if row["status"] == "ok":
            bits = float(single[key]["bits_per_byte"])
            assert float(row["bits_per_byte"]) == pytest.approx(bits, abs=tolerance), key
