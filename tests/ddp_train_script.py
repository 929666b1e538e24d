"""Data-parallel `Trainer` run of a tiny SepFormer, launched by `tests/test_training.py` under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_train_script.py OUTPUT_DIR

Every rank trains (gloo, CPU) and writes `params_rank{R}.pt` (its flattened parameters after training); the model is
saved with `trainer.save_model` to `OUTPUT_DIR/model`, and rank 0 writes `reference.pt` (world size, steps, and the
logits of the trained model on `REFERENCE_INPUT`). The helpers are also imported by the test for its single-process
reference run, so both runs use the same data and arguments.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Trainer, TrainingArguments, default_data_collator  # noqa: E402

from sepformer import SepFormerTokenizer  # noqa: E402

# Byte lengths chosen so that the label counts (bos + text + eos, shifted: len(text) + 1) are 2, 4, 8 and 16: no two
# examples have the same count and no split into two pairs has equal sums, so any per-micro-batch (or per-rank) mean
# differs from the mean over the whole batch.
TEXTS = ("a", "abc", "the cat", "the cat sat on ")
SEQ_LEN = 20
STEPS = 3
LEARNING_RATE = 0.5
REFERENCE_INPUT = [[257, 116, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116]]  # "<s>the cat sat"


def build_dataset(texts=TEXTS, seq_len: int = SEQ_LEN) -> Dataset:
    """`<s> text </s>` as bytes, right-padded to `seq_len`; labels are the ids with -100 on padding."""
    tokenizer = SepFormerTokenizer()
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for text in texts:
        ids = [tokenizer.bos_token_id, *tokenizer(text)["input_ids"], tokenizer.eos_token_id]
        assert len(ids) <= seq_len, text
        padding = seq_len - len(ids)
        rows["input_ids"].append(ids + [tokenizer.pad_token_id] * padding)
        rows["attention_mask"].append([1] * len(ids) + [0] * padding)
        rows["labels"].append(ids + [-100] * padding)
    return Dataset.from_dict(rows)


def training_arguments(output_dir: str, **overrides) -> TrainingArguments:
    """Plain SGD at a constant rate without clipping: parameters after a step are a linear function of the gradients,
    so a wrongly scaled or wrongly averaged gradient shows up directly (clipping would hide a global scale error)."""
    values = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        optim="sgd",
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])


def main(output_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import tiny_model

    model = tiny_model(seed=0)
    args = training_arguments(output_dir, ddp_backend="gloo", ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=args, train_dataset=build_dataset(), data_collator=default_data_collator)
    trainer.train()
    trainer.save_model(os.path.join(output_dir, "model"))

    rank = trainer.args.process_index
    torch.save(flat_parameters(model), os.path.join(output_dir, f"params_rank{rank}.pt"))
    if trainer.is_world_process_zero():
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor(REFERENCE_INPUT)).logits
        torch.save(
            {"world_size": trainer.args.world_size, "global_step": trainer.state.global_step, "logits": logits},
            os.path.join(output_dir, "reference.pt"),
        )


if __name__ == "__main__":
    main(sys.argv[1])
