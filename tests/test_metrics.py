"""The `evaluate` metric scripts of `sepformer/metrics/`: loaded offline by path, checked by hand."""

import doctest
import math

import evaluate
import numpy as np
import pytest
import torch

from sepformer.metrics import METRICS, metric_path


@pytest.fixture(scope="module")
def accuracy_by_position():
    return evaluate.load(metric_path("accuracy_by_position"))


def test_metric_path_names_shipped_scripts():
    for name in METRICS:
        assert metric_path(name).endswith(f"sepformer/metrics/{name}.py")
    with pytest.raises(ValueError, match="unknown metric 'bleu'"):
        metric_path("bleu")


def test_accuracy_by_position_token_ids(accuracy_by_position):
    result = accuracy_by_position.compute(
        predictions=[3, 5, 7, 1, 9], references=[3, 4, 7, 1, 2], positions=[2, 0, 0, 2, 1]
    )
    assert result["accuracy"] == pytest.approx(3 / 5)
    assert result["accuracy_by_position"] == {0: 0.5, 1: 0.0, 2: 1.0}
    assert list(result["accuracy_by_position"]) == [0, 1, 2]  # in position order
    assert result["count_by_position"] == {0: 2, 1: 1, 2: 2}


def test_accuracy_by_position_sequences_need_every_token(accuracy_by_position):
    # a multi-token answer is right only if every token matches and nothing is missing or extra
    result = accuracy_by_position.compute(
        predictions=[[1, 2], [1, 2], [1], [4, 5, 6]],
        references=[[1, 2], [1, 3], [1, 2], [4, 5, 6]],
        positions=[0, 0, 1, 1],
    )
    assert result["accuracy_by_position"] == {0: 0.5, 1: 0.5}
    assert result["accuracy"] == 0.5


def test_accuracy_by_position_a_shorter_or_longer_sequence_is_a_miss_not_broadcast(accuracy_by_position):
    # compared element-wise with broadcasting, each of these would be a hit
    result = accuracy_by_position.compute(
        predictions=[[3], [3, 3], [], [7]], references=[[3, 3], [3], [3], [7]], positions=[0, 1, 2, 3]
    )
    assert result["accuracy_by_position"] == {0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0}


def test_accuracy_by_position_strings_and_batches(accuracy_by_position):
    accuracy_by_position.add_batch(predictions=["a1", "b2"], references=["a1", "b3"], positions=[0, 1])
    accuracy_by_position.add_batch(predictions=["c"], references=["c"], positions=[1])
    result = accuracy_by_position.compute()
    assert result["accuracy_by_position"] == {0: 1.0, 1: 0.5}
    assert result["count_by_position"] == {0: 1, 1: 2}


def test_accuracy_by_position_strings_are_compared_as_strings_even_when_they_read_as_numbers(accuracy_by_position):
    # "03" and " 3" are other strings than "3", not the number 3 (evaluate casts them where int64 comes first)
    result = accuracy_by_position.compute(predictions=["3", "03", " 3"], references=["3", "3", "3"], positions=[0] * 3)
    assert result["accuracy"] == pytest.approx(1 / 3)
    result = accuracy_by_position.compute(predictions=["3", "abc"], references=["3", "abd"], positions=[0, 1])
    assert result["accuracy_by_position"] == {0: 1.0, 1: 0.0}
    accuracy_by_position.add_batch(predictions=["7"], references=["7"], positions=[0])
    accuracy_by_position.add_batch(predictions=["Paris"], references=["paris"], positions=[1])
    assert accuracy_by_position.compute()["accuracy_by_position"] == {0: 1.0, 1: 0.0}


@pytest.mark.parametrize("name", METRICS)
def test_the_examples_in_the_metrics_descriptions_give_what_they_say(name):
    """The example each metric shows its users (in `inputs_description`) run as a doctest."""
    description = evaluate.load(metric_path(name)).inputs_description
    test = doctest.DocTestParser().get_doctest(
        description, {"evaluate": evaluate, "math": math, "metric_path": metric_path}, name, None, 0
    )
    assert test.examples
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_perplexity_from_losses():
    metric = evaluate.load(metric_path("perplexity"), "losses")
    losses = [[math.log(2), math.log(2)], [math.log(8)]]  # mean nats = log(32) / 3
    result = metric.compute(predictions=losses)
    assert result["num_tokens"] == 3
    assert result["mean_loss"] == pytest.approx(math.log(32) / 3)
    assert result["perplexity"] == pytest.approx(32 ** (1 / 3))
    assert result["bits_per_token"] == pytest.approx(5 / 3)
    assert result["perplexities"] == pytest.approx([2.0, 8.0])


def test_perplexity_from_logits_matches_hand_computed_and_torch():
    # uniform logits over 4 tokens: every scored token costs log 4 nats, perplexity 4
    metric = evaluate.load(metric_path("perplexity"))
    result = metric.compute(predictions=[np.zeros((3, 4)).tolist()], references=[[0, 1, 2]])
    assert result["perplexity"] == pytest.approx(4.0)
    assert result["num_tokens"] == 2  # shifted: the first label has no prediction

    # a causal LM's loss with -100 labels, by torch
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, 3] = -100
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    result = metric.compute(predictions=logits.tolist(), references=labels.tolist())
    assert result["num_tokens"] == 7
    assert result["mean_loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(expected.item()), rel=1e-6)

    unshifted = metric.compute(predictions=logits.tolist(), references=labels.tolist(), shift=False)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1))
    assert unshifted["num_tokens"] == 9
    assert unshifted["mean_loss"] == pytest.approx(expected.item(), rel=1e-6)


def test_perplexity_rejects_an_unknown_configuration():
    with pytest.raises(ValueError, match="'logits' \\(default\\) or 'losses'"):
        evaluate.load(metric_path("perplexity"), "bleu")


def test_perplexity_allows_impossible_tokens_and_infinite_losses():
    # -inf logits mark impossible tokens (a constrained vocabulary): only the others share the probability mass
    logits = np.zeros((3, 4))
    logits[:, 2:] = -np.inf
    result = evaluate.load(metric_path("perplexity")).compute(predictions=[logits.tolist()], references=[[0, 1, 0]])
    assert result["perplexity"] == pytest.approx(2.0)
    # a token of probability 0 costs +inf nats: an infinite perplexity, not an error
    result = evaluate.load(metric_path("perplexity"), "losses").compute(predictions=[[0.5, math.inf]])
    assert result["perplexity"] == math.inf


def test_perplexity_past_the_float_range_is_inf_not_an_error():
    """A mean loss over about 709.8 nats (a diverged model): exp overflows float64, the perplexity is inf."""
    result = evaluate.load(metric_path("perplexity"), "losses").compute(predictions=[[800.0], [709.0]])
    assert result["perplexity"] == math.inf and result["mean_loss"] == pytest.approx(754.5)
    assert result["perplexities"] == [math.inf, pytest.approx(math.exp(709.0))]
    logits = [[0.0, -1000.0], [0.0, 0.0]]  # position 0 predicts the label 1: a loss of 1000 nats
    result = evaluate.load(metric_path("perplexity")).compute(predictions=[logits], references=[[0, 1]])
    assert result["perplexity"] == math.inf and result["mean_loss"] == pytest.approx(1000.0)


def test_accuracy_by_position_takes_tensors_and_arrays(accuracy_by_position):
    result = accuracy_by_position.compute(
        predictions=torch.tensor([[1, 2], [3, 4]]),
        references=np.array([[1, 2], [3, 5]]),
        positions=torch.tensor([0, 1]),
    )
    assert result["accuracy_by_position"] == {0: 1.0, 1: 0.0}
