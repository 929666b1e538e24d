"""The main job: train a small SepFormer on the Python standard library's own source, generate, share, reload.

No downloads and no GPU: the text is the `.py` files found with `sysconfig`, split by file into train and validation.

    python examples/demo.py                 # 600 steps of about 0.4 s on 2 idle CPU cores
    python examples/demo.py --max-steps 20  # a smoke run
"""

import argparse
import os
import sysconfig
import time
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import evaluate  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cli_arguments import int_at_least, nonnegative_int, output_directory, positive_int  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, set_seed  # noqa: E402

from sepformer import SepFormerConfig, SepFormerForCausalLM, SepFormerTokenizer, prepare_for_hub  # noqa: E402
from sepformer.metrics import metric_path  # noqa: E402

SAMPLE_PROMPT = "def "
SAMPLE_TOKENS = 200  # or fewer: the sample stays within the training length


def stdlib_sources(max_bytes: int, validation_fraction: float) -> tuple[list[str], list[str]]:
    """Standard-library `.py` files, assigned to train or validation by a hash of their path (stable across runs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, validation, total = [], [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        bucket = zlib.crc32(str(path.relative_to(root)).encode()) % 1000
        (validation if bucket < validation_fraction * 1000 else train).append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not train or not validation:
        raise SystemExit(f"found too little Python source under {root} to make a train and a validation split")
    return train, validation


def byte_blocks(texts: list[str], tokenizer: SepFormerTokenizer, block_size: int) -> Dataset:
    """Concatenate `<s> file </s>` sequences and cut them into blocks of `block_size` tokens."""

    def tokenize(batch):
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        return {"input_ids": [[bos, *tokenizer.encode(text), eos] for text in batch["text"]]}

    def group(batch):
        stream = [token for ids in batch["input_ids"] for token in ids]
        usable = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    dataset = Dataset.from_dict({"text": texts}).map(tokenize, batched=True, remove_columns=["text"])
    return dataset.map(group, batched=True, batch_size=len(dataset))


def validation_perplexity(trainer: Trainer, validation: Dataset) -> dict:
    """Every validation token's loss, scored by the package's `perplexity` evaluate metric (loaded by path)."""
    prediction = trainer.predict(validation)  # logits (blocks, L, vocab) and labels (blocks, L)
    logits, labels = torch.from_numpy(prediction.predictions), torch.from_numpy(prediction.label_ids)
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")  # next-token NLL
    return evaluate.load(metric_path("perplexity"), "losses").compute(predictions=losses.tolist())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=output_directory, default="outputs/demo")
    parser.add_argument("--max-steps", type=positive_int, default=600)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    # the sample's prompt (<s> and its bytes) and at least one new token fit in L
    parser.add_argument(
        "--block-size",
        type=int_at_least(len(SAMPLE_PROMPT) + 2),
        default=256,
        help="training length L (max_position_embeddings)",
    )
    parser.add_argument(
        "--max-bytes", type=positive_int, default=6_000_000, help="how much standard-library source to read"
    )
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    return parser.parse_args(argv)


def blocks(args, tokenizer: SepFormerTokenizer) -> tuple[Dataset, Dataset]:
    """The training blocks and (up to 64) validation blocks of `--block-size` bytes."""
    train_texts, validation_texts = stdlib_sources(args.max_bytes, validation_fraction=0.05)
    train = byte_blocks(train_texts, tokenizer, args.block_size)
    validation = byte_blocks(validation_texts, tokenizer, args.block_size)
    validation = validation.select(range(min(len(validation), 64)))
    if len(train) < args.batch_size or not len(validation):
        raise SystemExit(
            f"--max-bytes {args.max_bytes} gives {len(train)} training and {len(validation)} validation "
            f"blocks of {args.block_size} bytes: at least --batch-size {args.batch_size} and 1 are needed"
        )
    print(
        f"data: {len(train_texts)} train files -> {len(train)} blocks, "
        f"{len(validation_texts)} validation files -> {len(validation)} blocks of {args.block_size} bytes"
    )
    return train, validation


def trained(model, train: Dataset, validation: Dataset, args) -> Trainer:
    """`Trainer` on the CPU: AdamW at 2e-3 with warm-up and cosine decay, validation loss every quarter of the run."""
    training_args = TrainingArguments(
        output_dir=os.path.join(args.output_dir, "trainer"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 20),
        weight_decay=0.1,
        max_grad_norm=1.0,
        eval_strategy="steps",
        eval_steps=max(1, args.max_steps // 4),
        logging_steps=max(1, args.max_steps // 20),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_drop_last=True,
        seed=args.seed,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=validation)
    started = time.time()
    train_result = trainer.train()
    print(f"\ntrained {args.max_steps} steps in {(time.time() - started) / 60:.1f} min")
    last_logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry][-1]
    print(f"train loss      {last_logged:.4f} (last logged; {train_result.training_loss:.4f} averaged over the run)")
    return trainer


def save_and_reload(model, tokenizer: SepFormerTokenizer, inputs, args) -> None:
    """Save as Hub custom code (with the model card), reload with `AutoModelForCausalLM`, compare the logits."""
    checkpoint = os.path.join(args.output_dir, "checkpoint")
    prepare_for_hub(model, tokenizer).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    model_card = Path(__file__).resolve().parent.parent / "model_card.md"
    if model_card.exists():  # the card that goes next to shared checkpoints
        (Path(checkpoint) / "README.md").write_text(model_card.read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    with torch.no_grad():
        if not torch.equal(reloaded(**inputs).logits, model(**inputs).logits):
            raise SystemExit(f"reloaded checkpoint {checkpoint} gives different logits")
    print(f"\nsaved as Hub custom code to {checkpoint} ({type(reloaded).__module__}); reloaded logits identical")


def main(argv=None):
    args = parse_args(argv)
    set_seed(args.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = SepFormerTokenizer()
    train, validation = blocks(args, tokenizer)
    config = SepFormerConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_attention_heads=4,
        num_hidden_layers=4,
        max_position_embeddings=args.block_size,
    )
    model = SepFormerForCausalLM(config)
    print(
        f"model: {model.num_parameters() / 1e6:.2f}M parameters, d_model={config.hidden_size}, "
        f"d_pos={config.position_size}, d_sem={config.semantic_size}, layers={config.num_hidden_layers}"
    )
    validation_result = validation_perplexity(trained(model, train, validation, args), validation)
    print(
        f"validation loss {validation_result['mean_loss']:.4f} ({validation_result['bits_per_token']:.3f} bits per "
        f"byte, perplexity {validation_result['perplexity']:.2f}; the package's `perplexity` metric)"
    )
    model.eval()
    inputs = tokenizer([tokenizer.bos_token + SAMPLE_PROMPT], return_tensors="pt", split_special_tokens=False)
    new_tokens = min(SAMPLE_TOKENS, args.block_size - inputs["input_ids"].shape[1])
    generated = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=True, temperature=0.7, top_k=40)
    print("\nsample:\n" + tokenizer.decode(generated[0], skip_special_tokens=True))
    save_and_reload(model, tokenizer, inputs, args)


if __name__ == "__main__":
    main()
