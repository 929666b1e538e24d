"""The task of `position_bias.py`: key-value retrieval with one-token documents ("Lost in the Middle", scaled down),
`<bos> d(k1,v1) ... d(kn,vn) <sep> q(k_gold) -> v_gold`; its training lists (the answers mostly at the ends), IN2's
(the answers anywhere), and the test and validation prompts (the gold at every slot), each from a stream of its own."""

import argparse
from dataclasses import dataclass

import datasets
import torch


@dataclass(frozen=True)
class Vocabulary:
    """Our own ids, no tokenizer: one document token per (key, value), then the query keys, the values, the specials."""

    num_keys: int
    num_values: int

    def document(self, key, value):
        return key * self.num_values + value

    def query(self, key):
        return self.num_keys * self.num_values + key

    def value(self, value):
        return self.num_keys * self.num_values + self.num_keys + value

    @property
    def bos(self):
        return self.value(self.num_values)

    @property
    def sep(self):
        return self.bos + 1

    @property
    def pad(self):
        return self.bos + 2

    @property
    def dummy_document(self) -> tuple[int]:
        """A reserved document id, never in training data, never queried: the calibration's dummy."""
        return (self.bos + 3,)

    def __len__(self):
        return self.bos + 4


def random_lists(generator: torch.Generator, count: int, num_pairs: int, vocab: Vocabulary):
    """`count` lists of `num_pairs` documents, `<bos> d1 ... dn <sep>`: distinct keys within a list, values drawn
    with replacement. Returns the ids (count, n + 2), the keys and the values (count, n)."""
    keys = torch.rand(count, vocab.num_keys, generator=generator).argsort(-1)[:, :num_pairs]
    values = torch.randint(0, vocab.num_values, (count, num_pairs), generator=generator)
    prefix = torch.cat(
        [torch.full((count, 1), vocab.bos), vocab.document(keys, values), torch.full((count, 1), vocab.sep)], 1
    )
    return prefix, keys, values


def training_slots(generator: torch.Generator, shape: tuple[int, int], num_pairs: int, args) -> torch.Tensor:
    """Gold slots of training queries: with probability `gold_at_ends` one of the first or last `end_slots`,
    otherwise any slot, uniformly."""
    anywhere = torch.randint(0, num_pairs, shape, generator=generator)
    end = torch.randint(0, 2 * args.end_slots, shape, generator=generator)
    end = torch.where(end < args.end_slots, end, num_pairs - 2 * args.end_slots + end)  # 0..e-1, n-e..n-1
    return torch.where(torch.rand(shape, generator=generator) < args.gold_at_ends, end, anywhere)


def training_examples(generator: torch.Generator, count: int, vocab: Vocabulary, args) -> dict:
    """The list, <sep>, then `num_pairs` queries (drawn with replacement, see `training_slots`), each followed by its
    value; only the values are labelled."""
    prefix, keys, values = random_lists(generator, count, args.num_pairs, vocab)
    slots = training_slots(generator, (count, args.num_pairs), args.num_pairs, args)
    queries = torch.stack([vocab.query(keys.gather(1, slots)), vocab.value(values.gather(1, slots))], -1)
    input_ids = torch.cat([prefix, queries.view(count, -1)], 1)
    labels = torch.full_like(input_ids, -100)
    answers = slice(prefix.shape[1] + 1, None, 2)  # the value after each query
    labels[:, answers] = input_ids[:, answers]
    return {"input_ids": input_ids.tolist(), "labels": labels.tolist()}


def training_set(seed: int, vocab: Vocabulary, args) -> datasets.Dataset:
    """Every step's batch, in order."""
    generator = torch.Generator().manual_seed(seed)
    columns = {"input_ids": [], "labels": []}
    for _ in range(args.max_steps):
        for name, rows in training_examples(generator, args.batch_size, vocab, args).items():
            columns[name] += rows
    return datasets.Dataset.from_dict(columns).with_format("torch")


def in2_steps(args, fraction: float) -> int:
    return round(fraction * args.max_steps)


def in2_arguments(args, fraction: float) -> argparse.Namespace:
    """The IN2 fine-tune's settings: the training's (same learning rate, batch size and weight decay; a fresh AdamW
    with its own warm-up and cosine decay), for `fraction` of its steps, on lists whose answers sit at every slot
    uniformly (`gold_at_ends` 0), without checkpoints (fine-tuned models are not saved)."""
    changed = dict(max_steps=in2_steps(args, fraction), gold_at_ends=0.0, save_steps=None, resume=False)
    return argparse.Namespace(**{**vars(args), **changed})


def in2_set(seed: int, vocab: Vocabulary, in2_args) -> datasets.Dataset:
    """The IN2 fine-tune's batches (`in2_arguments`), from a stream of their own: neither the training's, the test's
    nor the validation's."""
    return training_set(30_000 + seed, vocab, in2_args)


def prompts_by_slot(generator: torch.Generator, per_slot: int, num_pairs: int, vocab: Vocabulary) -> dict:
    """`per_slot` prompts per gold slot: the list, <sep>, the gold key's query; the answer is the gold value."""
    columns = {"input_ids": [], "answer": [], "gold_slot": []}
    for slot in range(num_pairs):
        prefix, keys, values = random_lists(generator, per_slot, num_pairs, vocab)
        columns["input_ids"].append(torch.cat([prefix, vocab.query(keys[:, slot : slot + 1])], 1))
        columns["answer"].append(vocab.value(values[:, slot]))
        columns["gold_slot"].append(torch.full((per_slot,), slot))
    return {name: torch.cat(parts) for name, parts in columns.items()}


def evaluation_set(seed: int, num_pairs: int, vocab: Vocabulary, args) -> dict:
    """The test prompts of a seed: {"input_ids": (N, n + 3), "answer": (N,), "gold_slot": (N,)}."""
    return prompts_by_slot(torch.Generator().manual_seed(10_000 + seed), args.eval_per_slot, num_pairs, vocab)


def validation_batches(seed: int, num_pairs: int, vocab: Vocabulary, args) -> list[dict]:
    """Prompts for the positional-dimension search, from a stream that is neither training nor test: the prompt and
    its answer as one sequence, only the answer labelled."""
    prompts = prompts_by_slot(torch.Generator().manual_seed(20_000 + seed), args.validation_per_slot, num_pairs, vocab)
    input_ids = torch.cat([prompts["input_ids"], prompts["answer"][:, None]], 1)
    labels = torch.full_like(input_ids, -100)
    labels[:, -1] = input_ids[:, -1]
    columns = {"input_ids": input_ids, "labels": labels, "gold_position": prompts["gold_slot"]}
    batches = zip(*(column.split(args.eval_batch_size) for column in columns.values()), strict=True)
    return [dict(zip(columns, batch, strict=True)) for batch in batches]


def document_spans(num_pairs: int) -> tuple[tuple[int, int], ...]:
    """Each document is one token, after <bos>."""
    return tuple((1 + k, 2 + k) for k in range(num_pairs))


def train_length(num_pairs: int) -> int:
    return 3 * num_pairs + 2  # <bos>, n documents, <sep>, n (query, value) pairs
