"""The lost-in-the-middle tasks (Liu et al. 2023, arXiv 2307.03172) with the paper's prompts and metrics: key-value
retrieval over random UUIDs and multi-document QA from the paper's JSON lines, the gold at every slot; and each prompt's
token ids with its documents' token spans (`Encoder`)."""

import dataclasses
import functools
import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from itertools import accumulate


def kv_documents(contents: tuple[str, ...]) -> tuple[str, ...]:
    """The paper's JSON object, one string per pair (`contents`: `"k": "v"`): `{"k": "v",\\n`, ` "k": "v",\\n`, ...,
    ` "k": "v"}`."""
    last = len(contents) - 1
    return tuple(
        ("{" if i == 0 else " ") + content + (",\n" if i < last else "}") for i, content in enumerate(contents)
    )


def qa_documents(contents: tuple[str, ...]) -> tuple[str, ...]:
    """The paper's search results (`contents`: `(Title: t) text`), numbered from 1, one per line."""
    last = len(contents) - 1
    return tuple(f"Document [{i + 1}]{content}" + ("\n" if i < last else "") for i, content in enumerate(contents))


LAYOUTS = {"kv": kv_documents, "qa": qa_documents}


@dataclass(frozen=True)
class Example:
    """One prompt, `head + "".join(documents) + tail`, with its answers and the gold document's slot (0-based); each
    document is its content written at its place (`layout`: the JSON object's punctuation, the search result's
    number)."""

    head: str
    documents: tuple[str, ...]
    tail: str
    answers: tuple[str, ...]
    slot: int
    contents: tuple[str, ...] = ()
    layout: str = ""

    @property
    def text(self) -> str:
        return self.head + "".join(self.documents) + self.tail

    def reordered(self, order: list[int]) -> "Example":
        """The prompt with the contents in `order` (entry `j`: the document now at place `j`), each written at its new
        place, as the paper writes a prompt in any order; `slot` stays where the gold was given."""
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"an example of layout {self.layout!r} cannot be written in another order: {list(LAYOUTS)}"
            )
        contents = tuple(self.contents[j] for j in order)
        return dataclasses.replace(self, documents=LAYOUTS[self.layout](contents), contents=contents)


KV_HEAD = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
QA_HEAD = (
    "Write a high-quality answer for the given question using only the provided search results (some of which "
    "might be irrelevant).\n\n"
)


KEYS = ("uuid", "short")
PROMPTS = ("chat", "completion")


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_pair(rng: random.Random, keys: str) -> tuple[str, str]:
    """A key and its value: two UUIDs (the paper's), or 6 random lowercase letters and a 4-digit number (`short`,
    which models of a few hundred million parameters copy)."""
    if keys == "uuid":
        return random_uuid(rng), random_uuid(rng)
    return "".join(rng.choices(string.ascii_lowercase, k=6)), str(rng.randrange(1000, 10000))


def kv_records(pairs: list[tuple[str, str]]) -> tuple[str, ...]:
    """The contents of the JSON object's pairs, `"k": "v"`."""
    return tuple(f'"{key}": "{value}"' for key, value in pairs)


def kv_examples(
    rng: random.Random, count: int, num_documents: int, keys: str = "uuid", prompt: str = "chat"
) -> list[Example]:
    """`count` JSON objects of `num_documents` pairs, each asked for the key at every slot in turn. The `chat`
    prompt (the paper's) ends in `Corresponding value:`; the `completion` prompt also opens the answer's quote, so a
    model that continues text writes the value next."""
    if keys not in KEYS or prompt not in PROMPTS:
        raise ValueError(f"keys={keys!r}, prompt={prompt!r}: keys is one of {KEYS}, prompt one of {PROMPTS}")
    opening = ' "' if prompt == "completion" else ""
    examples = []
    for _ in range(count):
        pairs = [random_pair(rng, keys) for _ in range(num_documents)]
        records = kv_records(pairs)
        examples += [
            Example(
                KV_HEAD,
                kv_documents(records),
                f'\n\nKey: "{key}"\nCorresponding value:{opening}',
                (value,),
                slot,
                records,
                "kv",
            )
            for slot, (key, value) in enumerate(pairs)
        ]
    return examples


def qa_examples(records: list[dict], num_documents: int) -> list[Example]:
    """Each question with its gold document at every slot among the first `num_documents - 1` other documents."""
    examples = []
    for record in records:
        gold = next(ctx for ctx in record["ctxs"] if ctx.get("isgold") is True)
        others = [ctx for ctx in record["ctxs"] if ctx is not gold][: num_documents - 1]
        question, answers = f"\n\nQuestion: {record['question']}\nAnswer:", tuple(record["answers"])
        for slot in range(num_documents):
            ctxs = [*others[:slot], gold, *others[slot:]]
            contents = tuple(f"(Title: {ctx['title']}) {ctx['text']}" for ctx in ctxs)
            examples.append(Example(QA_HEAD, qa_documents(contents), question, answers, slot, contents, "qa"))
    return examples


def read_qa_file(path: str, count: int, num_documents: int) -> list[dict]:
    """The first `count` records of a JSON-lines file of the paper's format, each checked; a bad one stops the run,
    with its line number."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if len(records) == count:
                break
            if line.strip():
                records.append(checked_qa_record(line, f"--qa-file {path} line {number}", num_documents))
    if len(records) < count:
        raise SystemExit(
            f"--qa-file {path} has {len(records)} questions: --examples-per-slot {count} needs as many; "
            "give a smaller --examples-per-slot"
        )
    return records


def strings(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(text, str) for text in value)


def checked_qa_record(line: str, where: str, num_documents: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise SystemExit(f"{where} is not JSON: {error}") from None
    record = record if isinstance(record, dict) else {}
    answers, ctxs = record.get("answers"), record.get("ctxs")
    if not (
        isinstance(record.get("question"), str)
        and strings(answers)
        and isinstance(ctxs, list)
        and all(isinstance(ctx, dict) and strings([ctx.get("title"), ctx.get("text")]) for ctx in ctxs)
    ):
        raise SystemExit(
            f"{where}: a record is an object with question (a string), answers (strings) and ctxs "
            "(objects with title and text, one with isgold: true), as the paper's released data"
        )
    golds = sum(ctx.get("isgold") is True for ctx in ctxs)
    if golds != 1:
        raise SystemExit(f"{where} has {golds} documents with isgold: true; give exactly one")
    if len(ctxs) < num_documents:
        raise SystemExit(
            f"{where} has {len(ctxs)} documents: --num-documents {num_documents} needs as many; give a "
            "smaller --num-documents"
        )
    return record


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, as the paper's QA metric: lower case, no punctuation, no articles, single spaces."""
    text = "".join(char for char in text.lower() if char not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def kv_correct(output: str, answers: tuple[str, ...]) -> bool:
    """The paper's key-value metric: the value appears in the output, case-insensitive."""
    return any(answer.lower() in output.lower() for answer in answers)


def qa_correct(output: str, answers: tuple[str, ...]) -> bool:
    """The paper's `best_subspan_em` on the output's first line (as its evaluation script cuts it, so that an output
    copying the documents gets no credit): a normalised answer appears in the normalised line."""
    line = normalize_answer(output.split("\n")[0])
    return any(normalize_answer(answer) in line for answer in answers)


# ------------------------------------------------------------------------------------------------- tokenisation


@dataclass(frozen=True)
class Prompt:
    """An example's token ids (after the chat template) and its documents' (start, end) token spans in them."""

    example: Example
    input_ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    encoder: "Encoder" = field(default=None, compare=False, repr=False)  # what made it (and makes a reordered example)


class Encoder:
    """Token ids and document spans of examples, through the tokenizer's chat template when it has one and `chat` is
    true (a `completion` prompt is the text as it is, with the tokenizer's special tokens). A document's
    span starts where the tokenisation of the text before it stops agreeing with the whole prompt's: exactly its
    tokens where the tokenizer starts a token at its boundary; a token that crosses a boundary is the later one's."""

    def __init__(self, tokenizer, chat: bool = True):
        self.tokenizer = tokenizer
        self.chat = chat and bool(getattr(tokenizer, "chat_template", None))
        self.ids = functools.lru_cache(maxsize=1024)(self._ids)  # the text before each boundary, once per object

    def _ids(self, text: str) -> tuple[int, ...]:
        # a chat template writes its special tokens itself; a plain prompt gets the tokenizer's (e.g. <bos>)
        return tuple(self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"])

    def framed(self, prompt: str) -> tuple[str, int]:
        """The text the model reads and where `prompt` starts in it: the chat template's user turn and generation
        prompt around it, or the prompt as it is."""
        if not self.chat:
            return prompt, 0
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        if (start := text.find(prompt)) < 0:
            raise ValueError(
                "the tokenizer's chat template changes the user's message, so the documents cannot be "
                f"found in its text: {text!r}"
            )
        return text, start

    def tokens_before(self, text: str, end: int, ids: tuple[int, ...]) -> int:
        """How many of `ids` (all of `text`) lie before character `end`: where the tokenisation of `text[:end]` stops
        agreeing with that of the whole text."""
        prefix = self.ids(text[:end])
        if ids[: len(prefix)] == prefix:
            return len(prefix)
        return next(i for i, (mine, whole) in enumerate(zip(prefix, ids, strict=False)) if mine != whole)

    def token_boundaries(self, text: str, boundaries: list[int]) -> tuple[tuple[int, ...], list[int]]:
        """The ids of `text` and how many of them lie before each character offset of `boundaries` (a token across one
        is the later part's): from the tokenizer's character offsets where it gives them (a fast tokenizer), else
        where the tokenisation of the text before it stops agreeing with the whole's (`tokens_before`)."""
        if not getattr(self.tokenizer, "is_fast", False):
            ids = self.ids(text)
            return ids, [self.tokens_before(text, boundary, ids) for boundary in boundaries]
        encoding = self.tokenizer(text, add_special_tokens=not self.chat, return_offsets_mapping=True)
        ends = [end for _, end in encoding["offset_mapping"]]
        before = [next((k for k, end in enumerate(ends) if end > boundary), len(ends)) for boundary in boundaries]
        return tuple(encoding["input_ids"]), before

    def __call__(self, example: Example) -> Prompt:
        text, start = self.framed(example.text)
        boundaries = list(accumulate(map(len, example.documents), initial=start + len(example.head)))
        ids, starts = self.token_boundaries(text, boundaries)
        spans = tuple(zip(starts[:-1], starts[1:], strict=True))
        if empty := [k for k, (first, end) in enumerate(spans) if end <= first]:
            raise ValueError(
                f"document {empty[0]} of {example.text!r} has no token of its own: a token of this "
                "tokenizer crosses both of its boundaries"
            )
        return Prompt(example, ids, spans, self)
