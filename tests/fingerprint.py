"""A fingerprint of what the mitigations compute, to show that a change of their code changes nothing observable.

    python tests/fingerprint.py /tmp/before.pt                          # on the code before the change
    python tests/fingerprint.py /tmp/after.pt --compare /tmp/before.pt  # after it: every case that differs, and a count

For SepFormer and tiny random Llama, Qwen2 (grouped-query), Mistral (sliding window) and GPT-2 (the tests' builders),
each option alone and a few together, on one left-padded batch: the full forward's logits, greedy cached decoding
(tokens and scores), and beam search with two returned sequences; where a model refuses an option, the refusal's
message; and the messages of a few bad calls. Logits and scores compare within `TOLERANCE` of the largest (the same
computation in another order moves the last bits), tokens and messages exactly. Same machine and versions both times.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import tiny_model  # noqa: E402
from test_any_decoder import MODELS, SPANS, left_padded, mitigated  # noqa: E402

from sepformer import (  # noqa: E402
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    StableMask,
)

TOLERANCE = 1e-5
ROWS = (torch.arange(3, 15), torch.arange(20, 31), torch.arange(40, 52))  # prompts of 12, 11 and 12 tokens
BATCH = len(ROWS)


def option_cases() -> dict[str, dict]:
    """Each option's keywords (spans per row of the batch), alone and in the combinations whose order matters."""
    spans = (SPANS,) * BATCH
    alone = {
        "none": {},
        "stable_mask": {"stable_mask": StableMask(gamma=0.5)},
        "ms_poe": {"ms_poe": MSPoE()},
        "ms_poe_late_layers": {"ms_poe": MSPoE(r_min=1.0, r_max=1.5, layers=(2,))},
        "positional_scaling": {"positional_scaling": PositionalScaling(factor=0.0, channels=(0, 1, 2))},
        "attention_calibration": {"attention_calibration": AttentionCalibration(spans=spans, temperature=0.1)},
        "parallel_context_windows": {"parallel_context_windows": ParallelContextWindows(spans=spans)},
        "attention_buckets_scales": {"attention_buckets": AttentionBuckets(scales=(1.0, 0.8))},
        "attention_buckets_bases": {"attention_buckets": AttentionBuckets(bases=(10000.0, 20000.0))},
    }
    together = {
        "stable_mask+ms_poe": alone["stable_mask"] | alone["ms_poe"],
        "attention_calibration+ms_poe": alone["attention_calibration"] | alone["ms_poe"],
        "positional_scaling+stable_mask": alone["positional_scaling"] | alone["stable_mask"],
        "positional_scaling+attention_calibration": alone["positional_scaling"] | alone["attention_calibration"],
        "positional_scaling+ms_poe": alone["positional_scaling"] | alone["ms_poe"],
        "parallel_context_windows+attention_buckets_scales": alone["parallel_context_windows"]
        | alone["attention_buckets_scales"],
    }
    return alone | together


def models() -> dict:
    """SepFormer (three layers, as the others) and each family of the any-decoder tests, given `add_mitigations`."""
    return {"sepformer": tiny_model(num_hidden_layers=3)} | {name: mitigated(name) for name in MODELS}


def outputs(model, ids, mask, options: dict) -> dict:
    """The forward's logits, greedy decoding's tokens and scores, beam search's sequences; or the refusal."""
    greedy = dict(attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=4)
    try:
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, **options).logits
            decoded = model.generate(ids, **greedy, output_scores=True, return_dict_in_generate=True, **options)
            beams = model.generate(ids, **greedy, num_beams=2, num_return_sequences=2, **options)
    except (ValueError, TypeError) as error:
        return {"refused": str(error)}
    return {"logits": logits, "tokens": decoded.sequences, "scores": torch.stack(decoded.scores, 1), "beams": beams}


def bad_calls(model) -> dict[str, str]:
    """The messages of calls a user gets wrong, on a Llama given `add_mitigations`."""
    ids = torch.arange(3, 15)[None]
    calls = {
        "ms_poe r_max < r_min": lambda: MSPoE(r_min=1.5, r_max=1.2),
        "stable_mask gamma < 0": lambda: StableMask(gamma=-1.0),
        "spans past the prompt": lambda: model(ids, attention_calibration=AttentionCalibration(spans=(((0, 40),),))),
        "ms_poe layer out of range": lambda: model(ids, ms_poe=MSPoE(layers=(7,))),
        "positional_scaling without channels": lambda: model(ids, positional_scaling=PositionalScaling()),
        "buckets of bases and scales of other counts": lambda: AttentionBuckets(bases=(1e4, 2e4), scales=(1.0,)),
    }
    messages = {}
    for name, call in calls.items():
        try:
            with torch.no_grad():
                call()
            messages[name] = "accepted"
        except (ValueError, TypeError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def fingerprint() -> dict:
    ids, mask = left_padded(list(ROWS))
    prints = {}
    built = models()
    for model_name, model in built.items():
        print(model_name, file=sys.stderr, flush=True)
        for case, options in option_cases().items():
            prints[f"{model_name} {case}"] = outputs(model, ids, mask, options)
    prints["bad calls"] = bad_calls(built["llama"])
    return prints


def differences(reference: dict, current: dict) -> list[str]:
    """The cases whose outputs differ, each with what differs."""
    found = []
    for case in sorted(reference.keys() | current.keys()):
        before, after = reference.get(case), current.get(case)
        if before is None or after is None or before.keys() != after.keys():
            found.append(f"{case}: {sorted(before or {})} before, {sorted(after or {})} after")
            continue
        for name in before:
            old, new = before[name], after[name]
            if isinstance(old, torch.Tensor) and old.is_floating_point():
                same = old.shape == new.shape and torch.allclose(new, old, atol=TOLERANCE * old.abs().max(), rtol=0)
            else:
                same = torch.equal(old, new) if isinstance(old, torch.Tensor) else old == new
            if not same:
                found.append(f"{case}: {name} differs")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="where to write this fingerprint (torch.save)")
    parser.add_argument("--compare", type=Path, help="a fingerprint written before: print what differs")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    prints = fingerprint()
    torch.save(prints, args.output)
    refused = sum("refused" in outputs for outputs in prints.values())
    print(f"{len(prints)} cases ({refused} refused) written to {args.output}")
    if args.compare is None:
        return 0
    found = differences(torch.load(args.compare), prints)
    print("\n".join(found) + f"\n{len(found)} differ from {args.compare}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
