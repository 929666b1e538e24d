"""Byte-level tokenizer: ids 0-255 are the UTF-8 bytes, then pad, bos and eos."""

import itertools
import operator

from transformers.tokenization_python import AddedToken, PreTrainedTokenizer, Trie
from transformers.utils import to_py_obj

NUM_BYTES = 256


class SepFormerTokenizer(PreTrainedTokenizer):
    """UTF-8 bytes as tokens: no vocabulary file, no unknown token, `decode(encode(text)) == text` for any string.

    Special-token strings inside the text are encoded as their bytes (`split_special_tokens=True`), so user text can
    never inject a special token; tokens added with `add_tokens` (not special) are split out of the text and encoded
    as their ids, as transformers' fast tokenizers do. Lone surrogates (not valid UTF-8) round-trip through
    `surrogatepass`; byte sequences that are not valid UTF-8 (as a model may generate) decode to U+FFFD.

    Decoding an id outside the vocabulary (`0 <= id < len(tokenizer)`), an id that is not an integer, or an unknown
    keyword of `decode` raises, naming it and what is allowed.
    """

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, pad_token="<pad>", bos_token="<s>", eos_token="</s>", **kwargs):
        """The three special tokens (ids 256, 257, 258) may be renamed (a string or an `AddedToken`), not removed: the
        model's vocabulary holds their ids."""
        names = {"pad_token": pad_token, "bos_token": bos_token, "eos_token": eos_token}
        missing = [f"{name}={token!r}" for name, token in names.items() if not isinstance(token, str | AddedToken)]
        if missing:
            raise ValueError(
                f"SepFormerTokenizer {', '.join(missing)}: ids 256 (pad), 257 (bos) and 258 (eos) are always in the "
                "vocabulary; give each a name (a string or an AddedToken), or leave the defaults."
            )
        special = [
            AddedToken(token, special=True) if isinstance(token, str) else token
            for token in (pad_token, bos_token, eos_token)
        ]
        self._added_tokens_decoder = {NUM_BYTES + offset: token for offset, token in enumerate(special)}
        kwargs.setdefault("split_special_tokens", True)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(pad_token=special[0], bos_token=special[1], eos_token=special[2], **kwargs)

    @property
    def vocab_size(self) -> int:
        return NUM_BYTES

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(byte): byte for byte in range(NUM_BYTES)}, **self.added_tokens_encoder}

    def tokenize(self, text: str, **kwargs) -> list[str]:
        """transformers' `tokenize`, except that `split_special_tokens=True` (the default) splits only the special
        tokens into bytes, not the tokens added with `add_tokens` (transformers' slow tokenizers split those too)."""
        if not kwargs.get("split_special_tokens", self.split_special_tokens):
            return super().tokenize(text, **kwargs)
        tokens = []
        for piece in self._added_words_trie.split(text):
            tokens.extend([piece] if piece in self._added_words else super().tokenize(piece, **kwargs))
        return tokens

    def _update_trie(self, unique_no_split_tokens=None):
        super()._update_trie(unique_no_split_tokens)
        self._added_words = {token.content for token in self._added_tokens_decoder.values() if not token.special}
        self._added_words_trie = Trie(self._added_words)

    def _add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        """transformers' `_add_tokens`, refusing what the byte vocabulary cannot hold: a token that is one byte's
        character (it would take over that byte's id), and `lstrip`, `rstrip` or `single_word` on a token that is not
        special (`tokenize` splits such tokens out of the text as they are)."""
        for token in new_tokens or ():
            content = str(token)
            if len(content) == 1 and ord(content) < NUM_BYTES:
                raise ValueError(
                    f"cannot add the token {content!r}: it is byte {ord(content)}'s token already (the vocabulary "
                    "holds every byte); add tokens of several characters, or of one character past U+00FF."
                )
            plain = isinstance(token, AddedToken) and not (special_tokens or token.special)
            flags = [flag for flag in ("lstrip", "rstrip", "single_word") if plain and getattr(token, flag)]
            if flags:
                raise ValueError(
                    f"cannot add the token {content!r} with {', '.join(f'{flag}=True' for flag in flags)}: "
                    "SepFormerTokenizer splits added tokens out of the text as they are; add it without them."
                )
        return super()._add_tokens(new_tokens, special_tokens=special_tokens)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [chr(byte) for byte in text.encode("utf-8", errors="surrogatepass")]

    def _convert_token_to_id(self, token: str) -> int:
        if len(token) != 1 or ord(token) >= NUM_BYTES:
            raise ValueError(f"{token!r} is not a byte token: byte tokens are single characters U+0000-U+00FF.")
        return ord(token)

    def _convert_id_to_token(self, index: int) -> str:
        return chr(self._checked_id(index))

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        """As transformers', but every id is checked first: an integer inside the vocabulary (transformers would
        truncate a float and hand any integer to `chr`)."""
        ids = to_py_obj(ids)  # tensors and arrays, as `decode` does
        ids = [self._checked_id(index) for index in ids] if isinstance(ids, list | tuple) else self._checked_id(ids)
        return super().convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs):
        if kwargs:  # transformers passes them on and ignores them
            raise TypeError(
                f"decode got unknown keyword arguments {sorted(kwargs)}: SepFormerTokenizer.decode takes "
                "skip_special_tokens and clean_up_tokenization_spaces."
            )
        cleanup = clean_up_tokenization_spaces
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=cleanup)

    def _checked_id(self, index) -> int:
        try:
            if isinstance(index, bool):
                raise TypeError
            index = operator.index(index)  # Python and NumPy integers; not floats
        except TypeError:
            raise TypeError(
                f"token id {index!r} is a {type(index).__name__}, not a token id: {self._allowed_ids()}."
            ) from None
        if not 0 <= index < len(self):
            raise ValueError(f"token id {index} is outside the vocabulary: {self._allowed_ids()}.")
        return index

    def _allowed_ids(self) -> str:
        specials = ", ".join(f"{i} {token.content!r}" for i, token in sorted(self._added_tokens_decoder.items()))
        return f"token ids are integers 0..{len(self) - 1} (0-255 the bytes, then {specials})"

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(  # each run of byte tokens decoded together: a character may take several bytes
            "".join(run) if added else _decode_bytes(bytearray(map(ord, run)))
            for added, run in itertools.groupby(tokens, key=self.added_tokens_encoder.__contains__)
        )

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()


def _decode_bytes(data: bytearray) -> str:
    try:
        return data.decode("utf-8", errors="surrogatepass")
    except UnicodeDecodeError:  # generated bytes need not be valid UTF-8
        return data.decode("utf-8", errors="replace")


__all__ = ["SepFormerTokenizer"]
