"""Nothing computed from the weights outlives the call that computed it, except on the cache of one generation.

Fused optimizers (`torch.optim.AdamW(fused=True)`, `Trainer`'s default `adamw_torch_fused`) and writes through `.data`
change the weights without moving their version counters or data pointers. So after any such change, the model must
answer exactly as a fresh model given the same weights: in a no-grad evaluation, past the positional table, with
MS-PoE's fractional positions, and in `generate`.
"""

import pytest
import torch
from conftest import tiny_config
from torch.utils.data import Dataset
from transformers import DynamicCache, Trainer, TrainerCallback, TrainingArguments

from sepformer import SepFormerCache, SepFormerForCausalLM

L = 16  # the tiny models' positional table
VARIANTS = {
    "learned table": dict(),
    "layer norms": dict(norm_type="layernorm"),
    "learned table, clamp past L": dict(position_extrapolation="clamp"),
    "learned table, sinusoidal past L": dict(position_extrapolation="sinusoidal"),
    "learned table, fourier past L": dict(position_extrapolation="fourier"),
    "learned table, interpolate past L": dict(position_extrapolation="interpolate"),
    "B-spline map": dict(positional_map={"map": "bspline", "control_points": 6}),
    "B-spline map, linear past L": dict(positional_map={"map": "bspline", "control_points": 6, "extension": "linear"}),
}
PROBE = torch.randint(0, 256, (2, 2 * L + 3), generator=torch.Generator().manual_seed(1))  # in range and past L
MS_POE = {"layers": [0, 1], "r_min": 1.2, "r_max": 1.8}  # ranked at prefill, fractional positions past L - 1


def model_of(variant: str) -> SepFormerForCausalLM:
    torch.manual_seed(0)
    return SepFormerForCausalLM(tiny_config(max_position_embeddings=L, **VARIANTS[variant])).eval()


def fresh_copy(model: SepFormerForCausalLM) -> SepFormerForCausalLM:
    """A new model given `model`'s weights: nothing kept from `model`'s earlier calls."""
    copy = SepFormerForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def answers(model) -> list[torch.Tensor]:
    """No-grad logits on the probe, with and without MS-PoE, and greedy tokens from a cached generation; past the
    table where the model reads rows past it (MS-PoE's fractional positions read rows `L, L+1, ...` too)."""
    config = model.config
    past_table = config.map_options().map == "bspline" or config.position_extrapolation not in ("none", "interpolate")
    probe = PROBE if past_table or config.position_extrapolation == "interpolate" else PROBE[:, :L]
    with torch.no_grad():
        outputs = [model(probe).logits, model(probe if past_table else PROBE[:, :L], ms_poe=MS_POE).logits]
    new_tokens = L + 8 if past_table else 4
    outputs.append(model.generate(PROBE[:, : L - 4], max_new_tokens=new_tokens, do_sample=False))
    return outputs


def assert_answers_as_fresh_copy(model) -> None:
    was_training = model.training
    model.eval()
    mine, fresh = answers(model), answers(fresh_copy(model))
    model.train(was_training)
    for index, (actual, expected) in enumerate(zip(mine, fresh, strict=True)):
        assert torch.equal(actual, expected), f"answer {index}: {(actual.float() - expected.float()).abs().max()}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_adamw_steps_leave_nothing_stale(variant):
    """A plain loop with the optimizer that bumps no version counter: evaluate, step, evaluate."""
    model = model_of(variant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        assert_answers_as_fresh_copy(model)  # a no-grad pass, as an evaluation between steps makes
        model.train()
        model(PROBE[:, :L], labels=PROBE[:, :L]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_answers_as_fresh_copy(model)


def test_weights_written_through_data_are_seen():
    """PEFT's merge and hand edits write through `.data`: no version counter moves, no address changes."""
    model = model_of("B-spline map")
    answers(model)
    for parameter in model.parameters():
        parameter.data.mul_(1.5)
    assert_answers_as_fresh_copy(model)


class Blocks(Dataset):
    def __init__(self, count: int):
        self.ids = torch.randint(0, 256, (count, L), generator=torch.Generator().manual_seed(2))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class CompareWithFreshCopy(TrainerCallback):
    """At every evaluation: the evaluated loss equals a fresh copy's, and so do the model's answers."""

    def __init__(self, evaluation: Blocks):
        self.evaluation, self.checked = evaluation, 0

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        with torch.no_grad():  # one batch of all the evaluation blocks, as the trainer's evaluation batch is
            expected = fresh_copy(model)(input_ids=self.evaluation.ids, labels=self.evaluation.ids).loss.item()
        assert metrics["eval_loss"] == expected, f"step {state.global_step}: {metrics['eval_loss']} != {expected}"
        assert_answers_as_fresh_copy(model)
        self.checked += 1


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
@pytest.mark.parametrize("variant", ["learned table", "learned table, fourier past L", "B-spline map"])
def test_trainer_evaluations_between_steps_see_the_current_weights(tmp_path, optim, variant):
    model = model_of(variant)
    evaluation = Blocks(4)
    check = CompareWithFreshCopy(evaluation)
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        optim=optim,
        learning_rate=1e-2,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=Blocks(8), eval_dataset=evaluation, callbacks=[check])
    assert trainer.args.optim.value == optim
    trainer.train()
    assert check.checked == 4


def test_an_emptied_cache_starts_a_new_generation():
    """A cache emptied by `reset` (or a crop of every token) keeps nothing made from the weights of its last
    generation: after the weights change, its next generation equals a fresh model's."""
    model = model_of("learned table, fourier past L")
    prompt = PROBE[:, : L - 4]
    for empty in (lambda cache: cache.reset(), lambda cache: cache.crop(-cache.get_seq_length())):
        cache = SepFormerCache(config=model.config)
        model.generate(prompt, max_new_tokens=L, do_sample=False, past_key_values=cache)
        empty(cache)
        for parameter in model.parameters():
            parameter.data.mul_(1.5)
        again = model.generate(prompt, max_new_tokens=L, do_sample=False, past_key_values=cache)
        assert torch.equal(again, fresh_copy(model).generate(prompt, max_new_tokens=L, do_sample=False))


def holding_the_same_keys_and_values(cache: SepFormerCache) -> DynamicCache:
    """A `DynamicCache` with copies of `cache`'s keys and values: a cache that keeps nothing made from the weights."""
    copy = DynamicCache()
    for index, layer in enumerate(cache.layers):
        copy.update(layer.keys.clone(), layer.values.clone(), index)
    return copy


def second_turns(model, cache, turn: torch.Tensor) -> list:
    """Greedy tokens and logits of `generate` continuing `cache` on `turn`, and of the same continuation of a cache
    holding the same keys and values but nothing made from the weights."""
    reference = holding_the_same_keys_and_values(cache)
    settings = dict(max_new_tokens=L // 2, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return [model.generate(turn, past_key_values=given, **settings) for given in (cache, reference)]


@pytest.mark.parametrize("change", ["weights scaled", "another model", "float64"])
def test_a_generate_continuing_a_cache_starts_from_the_current_weights(change):
    """transformers' multi-turn recipe: a second `generate` continuing the first one's cache after the weights changed
    (or with another model, or in float64) uses the current weights, not what the first generation laid out: the fused
    decoding weights and the positional rows past the table."""
    model = model_of("learned table, fourier past L")
    cache = SepFormerCache(config=model.config)
    first = model.generate(PROBE[:1, :6], max_new_tokens=4, do_sample=False, past_key_values=cache)
    if change == "weights scaled":
        for parameter in model.parameters():
            parameter.data.mul_(1.5)
    elif change == "another model":
        torch.manual_seed(1)
        model = SepFormerForCausalLM(model.config).eval()
    else:
        model.to(torch.float64)
    turn = torch.cat((first, PROBE[:1, 20:23]), 1)
    continued, reference = second_turns(model, cache, turn)
    assert torch.equal(continued.sequences, reference.sequences)
    for actual, expected in zip(continued.logits, reference.logits, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
