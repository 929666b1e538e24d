"""Spans of tokens (calibration's and reordering's documents, PCW's windows) in a prompt: per batch row, `(start, end)`
counted from the row's first real token, end exclusive; with the prompt's padding, read from its padding mask."""

import torch
from torch.nn.utils.rnn import pad_sequence


def positions_from_mask(padding_mask: torch.Tensor) -> torch.LongTensor:
    """(b, n) each slot's position counted from its row's first real token (left padding gets negative values)."""
    return padding_mask.long().cumsum(-1) - 1


def default_position_ids(
    inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, past_key_values
) -> torch.LongTensor:
    """Absolute positions of the new tokens, counted from each row's first real token (padding slots get 0) where a 2D
    padding mask covers past and new tokens; without one, continuing from the cache."""
    seq_len = inputs_embeds.shape[1]
    if attention_mask is not None and attention_mask.dim() == 2:
        return positions_from_mask(attention_mask).clamp(min=0)[:, -seq_len:]
    past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
    return (torch.arange(seq_len, device=inputs_embeds.device) + past_seen_tokens).unsqueeze(0)  # (1, seq)


def prompt_lengths(padding_mask: torch.Tensor | None, batch: int, width: int) -> list[int]:
    """Each row's number of real tokens: `width` in every row without a padding mask."""
    return padding_mask.long().sum(-1).tolist() if padding_mask is not None else [width] * batch


def check_spans(name: str, spans, batch: int, lengths: list[int] | None) -> None:
    """One row of `spans` per batch row, each span ending within its row's prompt of `lengths[row]` tokens (not
    checked when `None`); `name` begins the error."""
    if len(spans) != batch:
        raise ValueError(f"{name} has spans for {len(spans)} rows; the batch has {batch} rows.")
    for row, (row_spans, length) in enumerate(zip(spans, lengths or (), strict=False)):
        for start, end in row_spans:
            if end > length:
                raise ValueError(
                    f"{name} span ({start}, {end}) of row {row} is out of range: the prompt of that row has {length} "
                    "tokens (spans count from its first real token)."
                )


def check_spans_in_prompt(options, call, spans_are: str) -> None:
    """`options.spans` (the `spans_are`) placed by the 2-D padding mask of `call` (a `CallContext`), inside its prompt;
    the lengths are checked at an eager prefill (a decoding step only adds tokens; in a traced call, reading them
    would guard the graph on the mask's values)."""
    if call.attention_mask is not None and call.attention_mask.dim() != 2:
        raise ValueError(
            f"{options.name} needs the 2D padding mask (batch, length) to place the {spans_are}; got a "
            f"{call.attention_mask.dim()}D attention_mask."
        )
    read = not call.continuing and not torch.compiler.is_compiling()
    lengths = prompt_lengths(call.attention_mask, call.batch, call.new_tokens) if read else None
    check_spans(options.name, options.spans, call.batch, lengths)


def check_mask_values(padding_mask: torch.Tensor, name: str = "") -> None:
    """A padding mask holds only 0s and 1s: its running sum is the positions (a 2 would skip one, a 0.5 be attended
    yet read as padding); `name` begins the error."""
    other = padding_mask[(padding_mask != 0) & (padding_mask != 1)]
    if other.numel():
        raise ValueError(
            f"{name}attention_mask contains {other[0].item()}: a 2-D padding mask holds only 0 (padding) and 1 (a "
            "token), as bool, int or float."
        )


def check_last_column_real(padding_mask: torch.Tensor, reader: str) -> None:
    """Refuse rows padded on the right, whose last column is a pad: `reader` (which begins the error) takes each row's
    last prompt token from there."""
    padded = (padding_mask[:, -1] == 0).nonzero().flatten().tolist()
    if padded:
        raise ValueError(
            f"{reader}, but rows {padded} end in padding there (attention_mask[:, -1] == 0): pad on the left "
            "(tokenizer padding_side='left')."
        )


def key_positions(padding_mask: torch.Tensor | None, kv: int, device: torch.device) -> torch.Tensor:
    """(b or 1, kv) each key's position counted from its row's first real token, -1 on left padding."""
    if padding_mask is None:
        return torch.arange(kv, device=device)[None]
    return positions_from_mask(padding_mask).masked_fill(padding_mask == 0, -1)


def key_documents(spans: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(b, kv, K) one-hot: which of the (b, K, 2) spans each key at `positions` (b or 1, kv) lies in."""
    starts, ends = spans[..., 0][:, None], spans[..., 1][:, None]  # (b, 1, K)
    inside = (positions[..., None] >= starts) & (positions[..., None] < ends)
    return inside.float()  # calibration re-weights rows of probabilities kept in float32


def default_dummy_token(config) -> int | None:
    """The token the default dummy document repeats: `pad_token_id`, or where the config has none (Llama 3, Mistral and
    most configs built in code) the first `eos_token_id`; `None` when that token is not in the vocabulary. Both mark
    where text is absent, so a run of them is a document with no content."""
    token, eos = config.pad_token_id, config.eos_token_id
    if token is None:
        token = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    return token if isinstance(token, int) and 0 <= token < config.vocab_size else None


def check_dummy_document(options, config) -> None:
    """`options.dummy_document` (or the default, `default_dummy_token` repeated) is made of ids in the vocabulary."""
    vocabulary = f"the vocabulary 0..{config.vocab_size - 1}"
    if options.dummy_document is None and default_dummy_token(config) is None:
        raise ValueError(
            f"{options.name}'s default dummy document repeats pad_token_id (or eos_token_id where pad_token_id is "
            f"None), which is not in {vocabulary} (pad_token_id={config.pad_token_id}, eos_token_id="
            f"{config.eos_token_id}): give dummy_document=(token ids) explicitly."
        )
    bad = [token for token in options.dummy_document or () if not 0 <= token < config.vocab_size]
    if bad:
        raise ValueError(f"{options.name} dummy_document has ids {bad} outside {vocabulary}.")


def dummy_batch(spans, dummy_document, dummy_token: int, input_ids: torch.Tensor, mask: torch.Tensor | None):
    """One left-padded sequence per (row, document): the prompt with the dummy document in place of document `k`
    (`dummy_document`, or `dummy_token` repeated to the document's length when `None`), as calibration's dummy
    passes and reordering's `by="calibrated"` read it.

    Returns ids and padding mask (rows × K, width) and the dummy's keys (rows × K, width), row-major.
    """
    if dummy_document is None:  # the dummy as long as each document: every row keeps its tokens' places
        positions = key_positions(mask, input_ids.shape[1], input_ids.device)  # (b or 1, n), -1 on padding
        spans = torch.tensor(spans, device=input_ids.device)  # (b, K, 2)
        probe = key_documents(spans, positions).bool().transpose(1, 2).flatten(0, 1)  # (b · K, n), row-major
        ids = input_ids.repeat_interleave(spans.shape[1], 0).masked_fill(probe, dummy_token)
        padding = torch.ones_like(input_ids) if mask is None else mask
        return ids, padding.repeat_interleave(spans.shape[1], 0), probe
    sequences, probes = [], []
    for row, row_spans in enumerate(spans):
        tokens = input_ids[row] if mask is None else input_ids[row][mask[row].bool()]
        for start, end in row_spans:
            dummy = tokens.new_tensor(dummy_document)
            sequences.append(torch.cat((tokens[:start], dummy, tokens[end:])))
            slots = torch.arange(len(sequences[-1]), device=input_ids.device)
            probes.append((slots >= start) & (slots < start + len(dummy)))
    ids = pad_sequence(sequences, batch_first=True, padding_side="left")
    padding = pad_sequence([torch.ones_like(sequence) for sequence in sequences], batch_first=True, padding_side="left")
    return ids, padding, pad_sequence(probes, batch_first=True, padding_side="left")


def check_default_positions(call, acting: str) -> None:
    """Refuse, at prefill, `position_ids` other than those counted from each row's first real token, where a method
    (`acting`: what it does) works from those. Not read at a decoding step (its positions come from generate, and
    reading them would wait for the device), nor in a traced call (a guard on their values)."""
    if call.position_ids is None or call.continuing or torch.compiler.is_compiling():
        return
    padding = call.attention_mask is None or call.attention_mask.dim() == 2  # a 4D mask's padding is not read
    default = key_positions(call.attention_mask if padding else None, call.new_tokens, call.position_ids.device)
    position_ids, default = torch.broadcast_tensors(call.position_ids, default)  # default: -1 on padding
    differs = ((position_ids != default) & (default >= 0)).any(-1)
    if differs.any():
        row = int(differs.nonzero()[0])
        fix = (
            "leave position_ids out (the default positions)"
            if padding
            else "the call's attention_mask is 4D, which does not say where each row starts (generate builds such "
            "masks with a static cache on some models): give a 2D padding mask, as with the default dynamic cache"
        )
        raise ValueError(
            f"{acting} from the positions counted from each row's first real token, but the call's position_ids are "
            f"others ({position_ids[row, :8].tolist()}... in row {row}): {fix}."
        )
