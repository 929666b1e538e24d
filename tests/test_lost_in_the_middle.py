"""`examples/lost_in_the_middle.py`: the paper's two tasks on saved checkpoints (a tiny Llama with a BPE tokenizer and a
chat template, tiny SepFormers with their byte tokenizer), end to end at `--tiny`; prompts, spans, metrics, refusals."""

import csv
import functools
import importlib.util
import json
import random
import re
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import sepformer
from sepformer import PositionalScaling, SepFormerForCausalLM, SepFormerTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import lost_in_the_middle as litm  # noqa: E402  (after the path)
import lost_in_the_middle_options as options  # noqa: E402
import lost_in_the_middle_task as task  # noqa: E402
import real_models_report as report  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|user|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
QA_RECORDS = [
    {
        "question": "who wrote the tiny test",
        "answers": ["The Maintainers", "maintainers"],
        "ctxs": [
            {"title": "Unrelated", "text": "Nothing to see here.", "isgold": False},
            {"title": "Tests", "text": "The tiny test was written by the maintainers.", "isgold": True},
            {"title": "Weather", "text": "It rained on Tuesday.", "isgold": False},
            {"title": "Sport", "text": "The match ended in a draw.", "isgold": False},
        ],
    },
    {
        "question": "what colour is the sky",
        "answers": ["blue"],
        "ctxs": [
            {"title": "Sky", "text": "On a clear day the sky is blue.", "isgold": True},
            {"title": "Grass", "text": "Grass is green.", "isgold": False},
            {"title": "Snow", "text": "Snow is white.", "isgold": False},
        ],
    },
]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the test machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bpe_tokenizer(extra_texts: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained offline on this task's own prompts (and `extra_texts`), with a chat template."""
    texts = [example.text for example in task.kv_examples(random.Random(1), 4, 4)]
    texts += [example.text for example in task.qa_examples(QA_RECORDS, 3)] + list(extra_texts)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            bos_token_id=0,
            eos_token_id=1,
        )
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def save_sepformer(folder: Path, **config) -> str:
    tokenizer = SepFormerTokenizer()
    torch.manual_seed(0)
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    SepFormerForCausalLM(tiny_config(**{"max_position_embeddings": 1024, **ids, **config})).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def sepformer_dir(tmp_path_factory) -> str:
    """Rotary on, so that Attention Buckets' bases mean something: every mitigation applies."""
    return save_sepformer(tmp_path_factory.mktemp("sepformer"), rotary_dim=4)


@pytest.fixture(scope="module")
def learned_sepformer_dir(tmp_path_factory) -> str:
    """A learned positional table only: Attention Buckets' bases are refused."""
    return save_sepformer(tmp_path_factory.mktemp("sepformer_learned"))


@pytest.fixture
def qa_file(tmp_path) -> str:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in QA_RECORDS))
    return str(path)


def run(model: str, output_dir: Path, *flags: str) -> tuple[list[dict], str]:
    """`main` as the command line runs it; the CSV's rows (checked against the returned ones) and results.md."""
    returned = litm.main(["--model", model, "--tiny", "--output-dir", str(output_dir), *flags])
    with open(output_dir / "results.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == litm.RESULT_FIELDS
        rows = list(reader)
    assert [(r["mitigation"], int(r["slot"]), int(r["n"])) for r in rows] == [
        (r["mitigation"], r["slot"], r["n"]) for r in returned
    ]
    assert (output_dir / "lost_in_the_middle.png").read_bytes().startswith(PNG)
    return rows, (output_dir / "results.md").read_text()


def check_rows(rows: list[dict], model: str, mitigations, slots: int, per_slot: int) -> None:
    """One row per (mitigation, slot), in that order, each over `per_slot` prompts. Accuracy 0: an untrained model
    never writes a UUID (or "blue"), but the prompt holds every value, so a prompt scored with the answer fails."""
    assert [(r["model"], r["mitigation"], int(r["slot"])) for r in rows] == [
        (model, mitigation, slot) for mitigation in mitigations for slot in range(1, slots + 1)
    ]
    assert all(int(r["n"]) == per_slot and float(r["accuracy"]) == 0 for r in rows)


# --------------------------------------------------------------------------------------------------- end to end


def test_tiny_run_on_a_sepformer_evaluates_every_mitigation_at_every_slot(sepformer_dir, tmp_path):
    rows, table = run(sepformer_dir, tmp_path)
    check_rows(rows, sepformer_dir, litm.MITIGATIONS, litm.TINY["num_documents"], litm.TINY["examples_per_slot"])
    for mitigation in litm.MITIGATIONS:
        row = (
            rf"^\| {mitigation} \| [^|]+ \|( [01]\.\d{{2}} \|){{3}} [01]\.\d{{3}} \| [01]\.\d{{2}} \| \d+\.\d{{2}} \|$"
        )
        assert re.search(row, table, re.MULTILINE), mitigation
    assert "left out" not in table


def test_tiny_run_on_a_llama_with_a_chat_template(llama_dir, tmp_path):
    """Every mitigation runs or is left out saying why (as long as add_mitigations lacks it, or the channel search
    finds no positional channel in an untrained Llama)."""
    rows, table = run(llama_dir, tmp_path, "--num-documents", "2")
    left_out = dict(re.findall(r"^left out: (\w+) \((.+)\)$", table, re.MULTILINE))
    taken = [mitigation for mitigation in litm.MITIGATIONS if mitigation not in left_out]
    check_rows(rows, llama_dir, taken, 2, litm.TINY["examples_per_slot"])
    assert {
        "none",
        "stable_mask",
        "ms_poe",
        "attention_calibration",
        "parallel_context_windows",
        "reorder_documents",
    } <= set(taken)
    assert set(left_out) <= {"positional_scaling", "attention_buckets"}


def test_multi_document_qa_from_a_file_of_the_papers_format(sepformer_dir, qa_file, tmp_path):
    rows, table = run(
        sepformer_dir, tmp_path, "--qa-file", qa_file, "--mitigations", "none", "parallel_context_windows"
    )
    check_rows(rows, sepformer_dir, ["none", "parallel_context_windows"], 3, 2)
    assert table.startswith("multi-document QA")


def test_each_answer_is_scored_against_its_own_prompt_and_counted_at_its_gold_slot(
    sepformer_dir, tmp_path, monkeypatch
):
    def answers(model, tokenizer, prompts, condition, max_new_tokens):  # right at slots 1 and 3 of 4
        return [f' "{p.example.answers[0]}"' if p.example.slot % 2 == 0 else "no idea" for p in prompts]

    monkeypatch.setattr(litm, "generate", answers)
    rows, _ = run(
        sepformer_dir, tmp_path, "--mitigations", "none", "ms_poe", "--num-documents", "4", "--batch-size", "3"
    )
    assert [(r["mitigation"], int(r["slot"]), float(r["accuracy"])) for r in rows] == [
        (m, slot, float(slot % 2)) for m in ("none", "ms_poe") for slot in range(1, 5)
    ]
    with open(tmp_path / "outputs.csv", newline="") as handle:
        written = list(csv.DictReader(handle))
    assert len(written) == 2 * 4 * litm.TINY["examples_per_slot"]
    for row in written:  # each prompt's own answer and output, scored as the table counts it
        assert (row["output"] == f' "{row["answer"]}"') == (int(row["slot"]) % 2 == 1) == (row["correct"] == "1")


def test_a_mitigation_the_model_refuses_stops_a_run_that_names_it_before_any_evaluation(
    learned_sepformer_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(litm, "evaluate", lambda *args: pytest.fail("evaluated"))
    with pytest.raises(
        SystemExit,
        match=r"--mitigations attention_buckets: refused for --model .*: attention_buckets "
        r"bases=.* mean nothing for this model",
    ):
        litm.main(
            [
                "--model",
                learned_sepformer_dir,
                "--tiny",
                "--output-dir",
                str(tmp_path / "out"),
                "--mitigations",
                "none",
                "attention_buckets",
            ]
        )
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_with_ids_past_the_models_embedding_is_refused_before_any_evaluation(
    llama_dir, tmp_path, monkeypatch
):
    tokenizer = bpe_tokenizer()
    tokenizer.add_special_tokens({"pad_token": "<pad>"})  # id 400: the Llama has 400 embedding rows
    tokenizer.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((Path(llama_dir) / name).read_bytes())
    monkeypatch.setattr(litm, "evaluate", lambda *args: pytest.fail("evaluated"))
    with pytest.raises(
        SystemExit,
        match=r"its tokenizer gives ids up to 400 \(the largest prompt id \d+, the pad id "
        r"400\), past the model's 400 embedding rows",
    ):
        litm.main(["--model", str(tmp_path), "--tiny", "--output-dir", str(tmp_path / "out")])


def test_a_model_whose_positions_end_before_the_answer_stops_the_run_before_any_evaluation(tmp_path, monkeypatch):
    short = save_sepformer(tmp_path / "short", max_position_embeddings=64)
    monkeypatch.setattr(litm, "evaluate", lambda *args: pytest.fail("evaluated"))
    with pytest.raises(
        SystemExit,
        match=r"--model .*short cannot generate 4 tokens after the longest prompt \(\d+ "
        r"tokens\): ValueError: .*64",
    ):
        litm.main(["--model", short, "--tiny", "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_default_run_leaves_out_what_the_model_refuses_and_says_why(learned_sepformer_dir, tmp_path, capsys):
    rows, table = run(learned_sepformer_dir, tmp_path)
    taken = [mitigation for mitigation in litm.MITIGATIONS if mitigation != "attention_buckets"]
    check_rows(rows, learned_sepformer_dir, taken, litm.TINY["num_documents"], litm.TINY["examples_per_slot"])
    assert re.search(r"^left out: attention_buckets \(attention_buckets bases=.* mean nothing", table, re.MULTILINE)
    assert "left out: --mitigations attention_buckets: refused" in capsys.readouterr().out


def test_without_add_mitigations_another_model_takes_none_only(llama_dir, tmp_path, monkeypatch):
    monkeypatch.delattr(litm.sepformer, "add_mitigations")
    with pytest.raises(
        SystemExit, match="--mitigations ms_poe: refused for --model .*: this copy of sepformer has no add_mitigations"
    ):
        litm.parse_args(["--model", llama_dir, "--mitigations", "none", "ms_poe"])
    rows, table = run(llama_dir, tmp_path)
    check_rows(rows, llama_dir, ["none"], litm.TINY["num_documents"], litm.TINY["examples_per_slot"])
    assert all(
        f"left out: {mitigation} (this copy of sepformer has no add_mitigations" in table
        for mitigation in litm.OPTION_CLASSES
    )


@pytest.mark.parametrize(
    "mitigation", ["none", "attention_calibration", "parallel_context_windows", "reorder_documents"]
)
def test_a_left_padded_batch_generates_what_each_prompt_generates_alone(llama_dir, mitigation):
    args = litm.parse_args(["--model", llama_dir, "--mitigations", mitigation])
    tokenizer = litm.load_tokenizer(args)
    model = litm.load_model(args)
    encoder = task.Encoder(tokenizer)
    prompts = [encoder(example) for example in task.qa_examples(QA_RECORDS, 3)[::2]]
    assert len({len(prompt.input_ids) for prompt in prompts}) > 1  # padding happens
    condition = litm.Condition(mitigation, litm.PAPER.get(mitigation, {}))
    alone = [litm.generate(model, tokenizer, [prompt], condition, 6)[0] for prompt in prompts]
    assert litm.generate(model, tokenizer, prompts, condition, 6) == alone


# ----------------------------------------------------------------------------------------------- prompts, spans


def test_each_object_is_asked_with_the_gold_key_at_every_slot():
    examples = task.kv_examples(random.Random(0), 2, 5)
    assert [example.slot for example in examples] == [*range(5), *range(5)]
    for first in (0, 5):
        objects = examples[first : first + 5]
        assert len({example.documents for example in objects}) == 1  # the same object, another key asked
        pairs = [re.fullmatch(r'[{ ]"(.+)": "(.+)"(,\n|})', document).groups()[:2] for document in objects[0].documents]
        for example in objects:
            key, value = pairs[example.slot]
            assert example.tail == f'\n\nKey: "{key}"\nCorresponding value:' and example.answers == (value,)
        assert all(uuid.UUID(text).version == 4 for pair in pairs for text in pair)
    assert examples[0].documents != examples[5].documents
    assert task.kv_examples(random.Random(0), 2, 5) == examples
    assert task.kv_examples(random.Random(1), 2, 5) != examples


def test_the_prompts_are_the_papers():
    pairs = [("test key1", "test value1"), ("test key2", "test value2"), ("test key3", "test value3")]
    example = task.Example(
        task.KV_HEAD,
        task.kv_documents(task.kv_records(pairs)),
        '\n\nKey: "test key2"\nCorresponding value:',
        ("test value2",),
        1,
    )
    assert example.text == "\n".join(
        [
            "Extract the value corresponding to the specified key in the JSON object below.",
            "",
            "JSON data:",
            '{"test key1": "test value1",',
            ' "test key2": "test value2",',
            ' "test key3": "test value3"}',
            "",
            'Key: "test key2"',
            "Corresponding value:",
        ]
    )
    qa = task.qa_examples(QA_RECORDS[1:], 2)
    assert qa[0].text == (
        "Write a high-quality answer for the given question using only the provided search results (some of which "
        "might be irrelevant).\n\nDocument [1](Title: Sky) On a clear day the sky is blue.\nDocument [2](Title: "
        "Grass) Grass is green.\n\nQuestion: what colour is the sky\nAnswer:"
    )


def test_the_gold_document_moves_to_every_slot_among_the_others_in_their_order():
    examples = task.qa_examples(QA_RECORDS[:1], 3)
    for slot, example in enumerate(examples):
        titles = [re.match(r"Document \[\d\]\(Title: (\w+)\)", document).group(1) for document in example.documents]
        assert example.slot == slot and titles.index("Tests") == slot
        assert [title for title in titles if title != "Tests"] == ["Unrelated", "Weather"]
        assert example.answers == ("The Maintainers", "maintainers")


@pytest.mark.parametrize("tokenizer", ["bpe with chat template", "sepformer bytes"])
def test_spans_are_exact_token_ranges_of_the_documents_in_the_final_ids(tokenizer):
    tokenizer = bpe_tokenizer() if tokenizer.startswith("bpe") else SepFormerTokenizer()
    encoder = task.Encoder(tokenizer)
    for example in [*task.kv_examples(random.Random(0), 1, 4), *task.qa_examples(QA_RECORDS, 3)]:
        prompt = encoder(example)
        if encoder.chat:
            expected = tokenizer.apply_chat_template(
                [{"role": "user", "content": example.text}], add_generation_prompt=True
            )["input_ids"]
        else:
            expected = tokenizer(example.text)["input_ids"]
        assert list(prompt.input_ids) == list(expected)
        assert [tokenizer.decode(prompt.input_ids[start:end]) for start, end in prompt.spans] == list(example.documents)
        assert [end for _, end in prompt.spans[:-1]] == [start for start, _ in prompt.spans[1:]]  # no gaps: PCW


def test_spans_follow_the_whole_prompt_s_tokens_where_the_text_before_a_document_tokenises_otherwise():
    """A tokenizer that merges the header's closing `\\n\\n` when it ends the text, but not before `Document` (as
    SmolLM2's): the first document's span must not start at the header's newlines."""
    tokenizer = bpe_tokenizer(extra_texts=(task.QA_HEAD,) * 50)
    assert len(tokenizer(task.QA_HEAD)["input_ids"]) < len(tokenizer(task.QA_HEAD + "Document")["input_ids"]) - 1
    for chat in (True, False):
        encoder = task.Encoder(tokenizer, chat=chat)
        for example in task.qa_examples(QA_RECORDS, 3):
            prompt = encoder(example)
            documents = [tokenizer.decode(prompt.input_ids[start:end]) for start, end in prompt.spans]
            assert documents == list(example.documents)


def test_reordered_examples_are_the_papers_prompts_in_the_new_order():
    """Reordering writes the contents anew at their places: the JSON object keeps its braces and commas, the search
    results their numbers from 1; the gold's slot stays where it was given."""
    example = task.kv_examples(random.Random(0), 1, 3)[1]
    moved = example.reordered([2, 0, 1])
    pairs = [re.fullmatch(r'[{ ]"(.+)": "(.+)"(,\n|})', document).groups()[:2] for document in example.documents]
    reordered_pairs = [pairs[2], pairs[0], pairs[1]]
    assert moved.documents == task.kv_documents(task.kv_records(reordered_pairs)) and moved.slot == 1
    assert json.loads("".join(moved.documents)) == dict(reordered_pairs)
    qa = task.qa_examples(QA_RECORDS[:1], 3)[0].reordered([1, 2, 0])
    assert [document[:13] for document in qa.documents] == ["Document [1](", "Document [2](", "Document [3]("]
    assert qa.contents == tuple(task.qa_examples(QA_RECORDS[:1], 3)[0].contents[j] for j in (1, 2, 0))


@pytest.mark.parametrize("rounds", [1, 2])
def test_the_reordering_condition_generates_on_the_prompts_written_in_the_model_s_order(llama_dir, rounds, monkeypatch):
    """`reorder_documents` in the experiment: the order of `sepformer.document_relevance` and `relevance_order` (a
    round before the last by "last", each on the prompts the one before wrote), the prompts written anew in that order
    and run without a mitigation: the ids that reach `generate` are those of the rewritten prompts."""
    args = litm.parse_args(["--model", llama_dir, "--mitigations", "reorder_documents"])
    tokenizer, model = litm.load_tokenizer(args), litm.load_model(args)
    encoder = task.Encoder(tokenizer)
    prompts = written = [encoder(example) for example in task.kv_examples(random.Random(0), 1, 4)[:2]]
    for strategy in ("last", "ends")[-rounds:]:
        batch = litm.padded(tokenizer, written, model.device)
        spans = tuple(prompt.spans for prompt in written)
        order = sepformer.relevance_order(
            sepformer.document_relevance(model, batch["input_ids"], batch["attention_mask"], spans), strategy
        ).tolist()
        assert order != [list(range(4))] * 2  # the model moves some document
        written = [encoder(prompt.example.reordered(row)) for prompt, row in zip(written, order, strict=True)]
    fed, generate = [], model.generate
    monkeypatch.setattr(
        model, "generate", lambda input_ids, **kwargs: fed.append(input_ids) or generate(input_ids, **kwargs)
    )
    condition = litm.Condition("reorder_documents", {**litm.PAPER["reorder_documents"], "rounds": rounds})
    litm.generate(model, tokenizer, prompts, condition, 2)
    assert torch.equal(fed[-1], litm.padded(tokenizer, written, model.device)["input_ids"])


@pytest.mark.parametrize("tokenizer", ["sepformer bytes", "bpe"])
def test_a_token_across_a_document_boundary_goes_to_the_later_document(tokenizer):
    tokenizer = SepFormerTokenizer() if tokenizer.startswith("sepformer") else bpe_tokenizer()
    tokenizer.add_tokens(["d!e"])  # one token across the boundary between the documents "cd" and "!ef"
    encoder = task.Encoder(tokenizer, chat=False)
    prompt = encoder(task.Example("ab", ("cd", "!ef", "gh"), "?", ("x",), 0))
    documents = [tokenizer.decode(prompt.input_ids[start:end]) for start, end in prompt.spans]
    assert documents[0].endswith("c") and documents[1] == "d!ef" and documents[2].endswith("gh")
    with pytest.raises(ValueError, match=re.escape("document 1 of 'abcd!ef?' has no token of its own")):
        encoder(task.Example("ab", ("cd", "!", "ef"), "?", ("x",), 0))


# ------------------------------------------------------------------------------------------------------ metrics


def test_exact_match_metrics_on_hand_cases():
    assert task.kv_correct(' "AB12-cd"', ("ab12-CD",)) and task.kv_correct("ab12-cd, I think", ("ab12-cd",))
    assert not task.kv_correct("ab12-c", ("ab12-cd",)) and not task.kv_correct("", ("ab12-cd",))
    assert task.qa_correct("It was written by THE maintainers!", ("The Maintainers",))
    assert task.qa_correct("Paris, France.", ("london", "paris"))
    assert task.qa_correct("the U.S. navy", ("US Navy",))  # punctuation gone on both sides
    assert not task.qa_correct("blu", ("blue",)) and not task.qa_correct("maintainer", ("maintainers",))
    # the first line only, as the paper's evaluation: copying the documents after it earns nothing
    assert task.qa_correct("Paris.\nDocument [1](Title: London)", ("paris",))
    assert not task.qa_correct("I do not know.\nDocument [1](Title: Sky) The sky is blue.", ("blue",))
    assert task.normalize_answer("  The  Eiffel-Tower, an icon ") == "eiffeltower icon"


# ----------------------------------------------------------------------------------------- positional scaling


def test_positional_scaling_on_another_model_is_the_searchs_pick_on_validation_prompts(llama_dir, monkeypatch):
    args = litm.parse_args(["--model", llama_dir, "--tiny", "--mitigations", "positional_scaling"])
    tokenizer = litm.load_tokenizer(args)
    model = litm.load_model(args)
    seen, picked = [], PositionalScaling(factor=-0.5, channels=(3, 5))

    def search(model, batches):
        seen.extend(batches)
        return type("Result", (), {"option": picked})

    monkeypatch.setattr(litm, "search_positional_scaling", search)
    assert litm.scaling_channels(model, task.Encoder(tokenizer), args) == {"channels": (3, 5), "factor": -0.5}
    assert [int(batch["gold_position"]) for batch in seen] == list(range(args.num_documents))
    tests = {example.answers for example in task.kv_examples(random.Random(args.seed), 2, args.num_documents)}
    for batch in seen:
        answer = tokenizer.decode(batch["input_ids"][batch["labels"] != -100])
        assert batch["input_ids"].shape[0] == 1 and (answer,) not in tests  # another stream than the test's
        assert str(uuid.UUID(answer)) == answer


def test_positional_scaling_where_the_search_finds_no_channel_is_refused(llama_dir):
    args = litm.parse_args(["--model", llama_dir, "--tiny", "--mitigations", "none", "positional_scaling"])
    tokenizer = litm.load_tokenizer(args)
    model = litm.load_model(args)
    with pytest.raises(
        SystemExit,
        match="positional_scaling: refused for --model .*: the channel search does not "
        "run on it .no channel of the attention input is monotone",
    ):
        litm.scaling_channels(model, task.Encoder(tokenizer), args)


def test_positional_scaling_on_sepformer_is_the_options_default(sepformer_dir):
    args = litm.parse_args(["--model", sepformer_dir, "--tiny"])
    model = litm.load_model(args)
    assert litm.scaling_channels(model, None, args) == {}  # the option's defaults: its positional block


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_model_is_loaded_in_the_dtype_asked_for(sepformer_dir, dtype):
    args = litm.parse_args(["--model", sepformer_dir, "--dtype", dtype, "--mitigations", "none"])
    assert litm.load_model(args).dtype == getattr(torch, dtype)


# ----------------------------------------------------------------------------------------------------- refusals


def bad_qa(tmp_path, *lines: str) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def two_golds():
    return json.dumps({**QA_RECORDS[1], "ctxs": [{**ctx, "isgold": True} for ctx in QA_RECORDS[1]["ctxs"]]})


REFUSED = [
    (["--num-documents", "0"], "--num-documents: 0 is not allowed: give an integer >= 1"),
    (["--examples-per-slot", "-1"], "--examples-per-slot: -1 is not allowed"),
    (["--max-new-tokens", "0"], "--max-new-tokens: 0 is not allowed"),
    (["--batch-size", "0"], "--batch-size: 0 is not allowed"),
    (["--seed", "-1"], "--seed: -1 is not allowed"),
    (["--dtype", "float64"], "--dtype: invalid choice: 'float64'"),
    (["--mitigations", "none", "none"], "--mitigations: none given more than once"),
    (["--mitigations", "attention_sinks"], "--mitigations: invalid choice: 'attention_sinks'"),
    (["--device", "gpu0"], "--device: 'gpu0' is not a torch device"),
    (["--qa-file", "missing.jsonl"], "--qa-file: 'missing.jsonl' is not a file"),
]


@pytest.mark.parametrize("flags, message", REFUSED)
def test_bad_flags_are_refused_by_the_parser(llama_dir, flags, message, capsys):
    with pytest.raises(SystemExit):
        litm.parse_args(["--model", llama_dir, *flags])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a CUDA GPU takes --device cuda")
def test_cuda_without_a_gpu_is_refused(llama_dir, capsys):
    with pytest.raises(SystemExit):
        litm.parse_args(["--model", llama_dir, "--device", "cuda"])
    assert "--device: cuda is not available on this machine" in capsys.readouterr().err


@pytest.mark.parametrize(
    "lines, flags, message",
    [
        (["{not json"], [], "line 1 is not JSON"),
        (["[1, 2]"], [], "line 1: a record is an object with question"),
        (
            [json.dumps(QA_RECORDS[0]), json.dumps({"question": "q", "answers": "a", "ctxs": []})],
            [],
            "line 2: a record is an object with question (a string), answers (strings) and ctxs",
        ),
        ([two_golds()], [], "line 1 has 3 documents with isgold: true; give exactly one"),
        ([json.dumps({**QA_RECORDS[1], "ctxs": QA_RECORDS[1]["ctxs"][1:]})], [], "has 0 documents with isgold: true"),
        ([json.dumps(QA_RECORDS[1])], ["--num-documents", "4"], "line 1 has 3 documents: --num-documents 4 needs"),
        ([json.dumps(QA_RECORDS[0])], ["--examples-per-slot", "2"], "has 1 questions: --examples-per-slot 2 needs"),
    ],
)
def test_bad_qa_files_are_refused_before_the_model_is_loaded(llama_dir, tmp_path, monkeypatch, lines, flags, message):
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit, match=re.escape(message)):
        litm.main(
            [
                "--model",
                llama_dir,
                "--tiny",
                "--qa-file",
                bad_qa(tmp_path, *lines),
                *flags,
                "--output-dir",
                str(tmp_path / "out"),
            ]
        )


def test_a_chat_template_that_rewrites_the_message_is_refused_before_the_model_is_loaded(
    llama_dir, tmp_path, monkeypatch
):
    tokenizer = bpe_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE.replace("m['content']", "m['content'] | upper")
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit, match="the tokenizer's chat template changes the user's message"):
        litm.main(["--model", str(tmp_path), "--tiny", "--output-dir", str(tmp_path / "out")])


def test_a_model_without_a_config_or_a_tokenizer_is_refused_before_loading(llama_dir, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=f"--model {tmp_path}: no config to load"):
        litm.parse_args(["--model", str(tmp_path)])
    (tmp_path / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit, match=f"--model {tmp_path}: no tokenizer to load"):
        litm.main(["--model", str(tmp_path), "--output-dir", str(tmp_path / "out")])


# ------------------------------------------------------------------------------------- variants, tuning, GGUF


def test_short_keys_and_the_completion_prompt(llama_dir):
    """6 lowercase letters to a 4-digit number; the completion prompt has no chat template, opens the answer's quote,
    and keeps exact spans; its default budget of new tokens is the longest value's tokens + 2."""
    examples = task.kv_examples(random.Random(0), 2, 5, keys="short", prompt="completion")
    for example in examples:
        key = re.search(r'Key: "([a-z]{6})"\nCorresponding value: "$', example.tail).group(1)
        value = example.answers[0]
        assert re.fullmatch(r"[1-9]\d{3}", value) and f'"{key}": "{value}"' in example.documents[example.slot]
    assert task.kv_examples(random.Random(0), 2, 5, keys="short", prompt="completion") == examples
    args = litm.parse_args(["--model", llama_dir, "--keys", "short", "--prompt", "completion", "--num-documents", "5"])
    tokenizer = litm.load_tokenizer(args)
    encoder = task.Encoder(tokenizer, chat=False)
    prompts, _ = litm.prompts_and_metric(encoder, args)
    assert not tokenizer.decode(prompts[0].input_ids).startswith("<s><|user|>")
    for prompt in prompts:
        for document, (start, end) in zip(prompt.example.documents, prompt.spans, strict=True):
            assert tokenizer.decode(prompt.input_ids[start:end]) == document
    longest = max(len(tokenizer(p.example.answers[0], add_special_tokens=False)["input_ids"]) for p in prompts)
    assert args.max_new_tokens == longest + 2
    with pytest.raises(ValueError, match="keys is one of"):
        task.kv_examples(random.Random(0), 1, 2, keys="hex")


def test_tune_picks_on_prompts_of_its_own_and_writes_each_setting(llama_dir, tmp_path, monkeypatch):
    seen = []
    evaluate = litm.evaluate

    def recording(model, tokenizer, prompts, correct, conditions, args):
        seen.append(({prompt.example.answers for prompt in prompts}, conditions))
        return evaluate(model, tokenizer, prompts, correct, conditions, args)

    monkeypatch.setattr(litm, "evaluate", recording)
    flags = ["--keys", "short", "--prompt", "completion", "--tune", "--mitigations", "none", "stable_mask", "ms_poe"]
    rows, table = run(llama_dir, tmp_path, *flags)
    tuning_answers, test_answers = seen[0][0], seen[-1][0]
    assert tuning_answers.isdisjoint(test_answers)
    with open(tmp_path / "tuning.csv", newline="") as handle:
        tried = list(csv.DictReader(handle))
    expected = {
        "stable_mask": len(litm.GRID["stable_mask"]),  # the paper's settings are in both grids
        "ms_poe": len(litm.GRID["ms_poe"]),
    }
    assert {name: sum(row["mitigation"] == name for row in tried) for name in expected} == expected
    assert (tried[0]["mitigation"], tried[0]["settings"]) == ("none", "defaults")  # the reference
    assert tried[1]["settings"] == "gamma=0.05" and float(tried[1]["worst"]) <= float(tried[1]["mean"])
    choices = {(row["mitigation"], row["choice"]) for row in rows}
    assert choices == {("none", "paper"), *((name, choice) for name in expected for choice in ("paper", "tuned"))}
    assert "stable_mask (tuned)" in table and "ms_poe (tuned)" in table


def test_tune_tries_its_grid_in_place_of_paper_settings_the_model_refuses(learned_sepformer_dir, tmp_path, capsys):
    """A learned positional table has no rotary base: bucket bases are refused, scales are served. Without --tune the
    method is left out; with it, the scales grid is tried and only the tuned row runs."""
    flags = ["--keys", "short", "--prompt", "completion", "--mitigations", "none", "attention_buckets"]
    with pytest.raises(SystemExit, match="attention_buckets: refused"):
        run(learned_sepformer_dir, tmp_path / "paper", *flags)
    rows, table = run(learned_sepformer_dir, tmp_path / "tuned", *flags, "--tune")
    assert "its paper settings are refused" in capsys.readouterr().out
    assert {(row["mitigation"], row["choice"]) for row in rows} == {("none", "paper"), ("attention_buckets", "tuned")}
    with open(tmp_path / "tuned" / "tuning.csv", newline="") as handle:
        tried = [row["settings"] for row in csv.DictReader(handle) if row["mitigation"] == "attention_buckets"]
    assert tried == [options.describe(settings) for settings in litm.IN_PLACE_OF_PAPER["attention_buckets"]]
    assert tried[0] == "scales=1.0 0.7692"  # the inverse of the first base multiples, 1.0 and 1.3
    assert re.search(r"^left out: attention_buckets at its paper settings \(attention_buckets bases=", table, re.M)


def test_a_method_whose_paper_settings_and_in_place_grid_are_all_refused_is_refused(
    learned_sepformer_dir, tmp_path, monkeypatch, capsys
):
    """With every setting of the in-place grid refused too, --tune does not keep the method: a run that names it stops
    before any evaluation, the default run leaves it out."""
    monkeypatch.setitem(litm.IN_PLACE_OF_PAPER, "attention_buckets", [{"bases": (1e4, 2e4)}])  # bases again
    flags = ["--keys", "short", "--prompt", "completion", "--tune"]
    with pytest.raises(SystemExit, match="--mitigations attention_buckets: refused"):
        run(learned_sepformer_dir, tmp_path / "named", *flags, "--mitigations", "none", "attention_buckets")
    assert "tuning grid of attention_buckets: left out bases=10000.0 20000.0" in capsys.readouterr().out
    rows, table = run(learned_sepformer_dir, tmp_path / "all", *flags)
    assert "attention_buckets" not in {row["mitigation"] for row in rows}
    assert re.search(r"^left out: attention_buckets \(attention_buckets bases=", table, re.MULTILINE)


def test_a_run_stopped_part_way_resumes_with_what_it_finished(llama_dir, tmp_path, monkeypatch):
    """Each condition (each setting --tune tries too) is kept as it finishes; --resume reads those back and runs the
    rest: the same rows as a run never stopped, and no condition run twice."""
    flags = ["--keys", "short", "--prompt", "completion", "--tune", "--mitigations", "none", "stable_mask"]
    calls, generate, finished = [], litm.generate, tmp_path / "stopped" / "finished"

    def counted(model, tokenizer, prompts, condition, max_new_tokens, stop_after=None):
        if stop_after is not None and finished.exists() and len(list(finished.iterdir())) == stop_after:
            raise KeyboardInterrupt
        calls.append(condition)
        return generate(model, tokenizer, prompts, condition, max_new_tokens)

    monkeypatch.setattr(litm, "generate", counted)
    whole, _ = run(llama_dir, tmp_path / "whole", *flags)
    total = len(calls)  # the checks before the run, then one call per condition (the tiny prompts are one batch)
    monkeypatch.setattr(litm, "generate", functools.partial(counted, stop_after=2))
    with pytest.raises(KeyboardInterrupt):
        litm.main(["--model", llama_dir, "--tiny", "--output-dir", str(tmp_path / "stopped"), *flags])
    assert len(list(finished.iterdir())) == 2
    calls.clear()
    monkeypatch.setattr(litm, "generate", counted)
    resumed, _ = run(llama_dir, tmp_path / "stopped", *flags, "--resume")
    assert len(calls) == total - 2
    timeless = [{key: value for key, value in row.items() if key != "seconds_per_prompt"} for row in whole]
    assert [{key: value for key, value in row.items() if key != "seconds_per_prompt"} for row in resumed] == timeless
    assert (tmp_path / "stopped" / "tuning.csv").read_text() == (tmp_path / "whole" / "tuning.csv").read_text()
    calls.clear()
    run(llama_dir, tmp_path / "stopped", *flags, "--resume", "--seed", "1")  # another seed: other prompts, run anew
    assert len(calls) == total
    monkeypatch.setattr(litm, "EVALUATION", litm.EVALUATION + 1)  # answers scored otherwise: nothing read back
    calls.clear()
    run(llama_dir, tmp_path / "stopped", *flags, "--resume")
    assert len(calls) == total
    copy = shutil.copytree(llama_dir, tmp_path / "model")
    run(str(copy), tmp_path / "copied", *flags)
    calls.clear()
    reweighted = AutoModelForCausalLM.from_pretrained(copy)
    with torch.no_grad():
        reweighted.lm_head.weight.mul_(2)
    reweighted.save_pretrained(copy)  # other weights under the same path: nothing read back
    run(str(copy), tmp_path / "copied", *flags, "--resume")
    assert len(calls) == total
    config = json.loads((copy / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": 3.0}
    (copy / "config.json").write_text(json.dumps(config))  # another config, the same weights: run anew
    calls.clear()
    run(str(copy), tmp_path / "copied", *flags, "--resume")
    assert len(calls) == total
    latest = max((tmp_path / "copied" / "finished").iterdir(), key=lambda path: path.stat().st_mtime_ns)
    latest.write_text(latest.read_text()[:20])  # cut short (by hand, or a full disk): run again, not a crash
    calls.clear()
    run(str(copy), tmp_path / "copied", *flags, "--resume")
    assert len(calls) == total - len(list((tmp_path / "whole" / "finished").iterdir())) + 1


def test_resume_runs_again_a_qa_file_whose_answers_changed(sepformer_dir, tmp_path, monkeypatch):
    """The same questions and documents (the same prompts) with other gold answers score otherwise: not read back."""
    calls, generate = [], litm.generate

    def counted(model, tokenizer, prompts, condition, max_new_tokens):
        calls.append(condition)
        return generate(model, tokenizer, prompts, condition, max_new_tokens)

    monkeypatch.setattr(litm, "generate", counted)
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in QA_RECORDS))
    flags = ["--qa-file", str(path), "--mitigations", "none", "--resume"]
    run(sepformer_dir, tmp_path / "out", *flags)
    total = len(calls)
    calls.clear()
    run(sepformer_dir, tmp_path / "out", *flags)  # the same file: every condition read back, only the checks run
    checks = len(calls)
    assert checks < total
    records = [{**record, "answers": ["someone else"]} for record in QA_RECORDS]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    calls.clear()
    run(sepformer_dir, tmp_path / "out", *flags)
    assert len(calls) == total


def test_tune_is_refused_with_a_qa_file_and_its_count_without_tune(llama_dir, qa_file, capsys):
    for flags, message in (
        (["--qa-file", qa_file, "--tune"], "--keys, --prompt completion and --tune are for key-value retrieval"),
        (["--qa-file", qa_file, "--prompt", "completion"], "--keys, --prompt completion and --tune are for key-value"),
        (["--tune-examples", "3"], "--tune-examples is read only with --tune"),
    ):
        with pytest.raises(SystemExit):
            litm.parse_args(["--model", llama_dir, *flags])
        assert message in capsys.readouterr().err


def test_settings_make_the_options_they_name(llama_dir):
    config = LlamaConfig(num_hidden_layers=6, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    spans = (((0, 2), (2, 5), (5, 9), (9, 10), (10, 12)),)
    assert options.windows(spans, 2) == (((0, 5), (5, 12)),)
    assert options.windows(spans, 5) == spans
    ms_poe = options.make_option("ms_poe", {"r_min": 1.0, "r_max": 1.1, "layers": "last half"}, spans, config)
    assert ms_poe.layers == (3, 4, 5) and (ms_poe.r_min, ms_poe.r_max) == (1.0, 1.1)
    buckets = options.make_option("attention_buckets", {"base_multiples": (1.0, 1.3)}, spans, config)
    assert buckets.bases == (1e5, 1.3e5)
    pcw = options.make_option("parallel_context_windows", {"windows": 3}, spans, config)
    assert pcw.spans == (((0, 5), (5, 9), (9, 12)),)  # 2, 1 and 2 documents
    assert options.describe({"gamma": 0.2}) == "gamma=0.2" and options.describe({}) == "defaults"
    assert all(
        setting != {} or name == "parallel_context_windows" for name, grid in options.GRID.items() for setting in grid
    )  # one window per document is the paper's PCW, in its grid


find_spec = importlib.util.find_spec


def write_gguf(path: Path, architecture: str) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_files_that_cannot_be_read_are_refused_before_any_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    bert = write_gguf(tmp_path / "bert.gguf", "bert")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + bytes(6))
    cases = [
        (bert, "holds a 'bert' model, which transformers does not read from GGUF (it reads llama, mistral"),
        (cut, "is not a complete GGUF file"),
        (tmp_path / "missing.gguf", "missing.gguf: no such file"),
    ]
    for path, message in cases:
        with pytest.raises(SystemExit, match=re.escape(message)):
            litm.main(["--model", str(path), "--tiny", "--output-dir", str(tmp_path / "out")])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name))
    with pytest.raises(SystemExit, match=re.escape("needs the gguf package (pip install -e '.[gguf]')")):
        litm.main(["--model", str(bert), "--tiny", "--output-dir", str(tmp_path / "out")])


def test_verdicts_meet_their_thresholds_exactly():
    """Accuracies are fractions of a few prompts: a worst slot 0.2 -> 0.3 rises by 0.10 (0.0999... in floats) and a
    mean 0.65 -> 0.60 falls by 0.05, not more (0.0500...04 in floats)."""
    none = {0: (0.65, 0.2)}  # seed -> (mean, worst slot)
    assert report.verdict({0: (0.70, 0.3)}, none) == "helps"
    assert report.verdict({0: (0.60, 0.2)}, none) == "neutral"
    assert report.verdict({0: (0.59, 0.2)}, none) == "hurts"


def test_the_report_averages_seeds_and_gives_each_method_its_verdict(tmp_path):
    """Two seeds of a 2-slot run written by hand: `helps` needs the worst slot +0.10 without a lower mean on every
    seed, `hurts` a mean 0.05 lower on every seed."""
    accuracy = {  # mitigation -> seed -> (slot 1, slot 2)
        "none": {0: (0.5, 1.0), 1: (0.4, 0.8)},
        "ms_poe": {0: (0.7, 1.0), 1: (0.6, 0.8)},  # worst +0.2, mean up: helps
        "stable_mask": {0: (0.3, 0.9), 1: (0.2, 0.8)},  # mean down 0.15, 0.1: hurts
        "attention_buckets": {0: (0.7, 1.0), 1: (0.4, 0.8)},  # helps on one seed only: neutral
        "positional_scaling": {0: (0.3, 1.0), 1: (0.4, 0.8)},  # mean down 0.1 on one seed only: neutral
    }
    paths = []
    for seed in (0, 1):
        rows = [
            dict(
                model="m",
                keys="short",
                prompt="completion",
                num_documents=2,
                seed=seed,
                mitigation=name,
                choice="paper",
                settings="defaults",
                slot=slot + 1,
                accuracy=by_seed[seed][slot],
                n=10,
                seconds_per_prompt=0.5,
            )
            for name, by_seed in accuracy.items()
            for slot in range(2)
        ]
        paths.append(tmp_path / f"seed{seed}.csv")
        litm.write_csv(rows, paths[-1], litm.RESULT_FIELDS)
    text = report.main([*map(str, paths), "--output-dir", str(tmp_path)])
    header = (
        "| model | task | pairs | mitigation | choice | settings | verdict | mean | worst slot | s/prompt | seeds |"
    )
    assert text.startswith(header)
    verdicts = dict(
        re.findall(r"^\| m \| short, completion \| 2 \| (\w+) \| paper \| defaults \| (\w*) \|", text, re.M)
    )
    assert verdicts == {
        "none": "",
        "ms_poe": "helps",
        "stable_mask": "hurts",
        "attention_buckets": "neutral",
        "positional_scaling": "neutral",
    }
    assert "| none | paper | defaults |  | 0.675 (0.600-0.750) | 0.45 (0.40-0.50) | 0.50 | 0, 1 |" in text
    assert (tmp_path / "real_models_m_2.png").read_bytes().startswith(PNG)
    report.main([*map(str, paths), "--output-dir", str(tmp_path), "--label", "_apart"])
    assert (tmp_path / "real_models_tables_apart.md").read_text() == text + "\n"
    assert (tmp_path / "real_models_m_2_apart.png").read_bytes().startswith(PNG)
    # a second run of seed 0 with the plain model again: the same answers are taken once, other ones refused
    with open(paths[0], newline="") as handle:
        again = [row for row in csv.DictReader(handle) if row["mitigation"] == "none"]
    litm.write_csv(again, tmp_path / "again.csv", litm.RESULT_FIELDS)
    assert report.main([*map(str, paths), str(tmp_path / "again.csv"), "--output-dir", str(tmp_path)]) == text
    again[0]["accuracy"] = 0.9
    litm.write_csv(again, tmp_path / "again.csv", litm.RESULT_FIELDS)
    with pytest.raises(SystemExit, match="slot 1 has accuracy 0.9 here and 0.5 in another results file"):
        report.main([*map(str, paths), str(tmp_path / "again.csv"), "--output-dir", str(tmp_path)])
