"""JSON-schema constrained decoding for the transformers backend, through lm-format-enforcer.

At every step of ``generate`` only the tokens that keep the output a prefix of a JSON document valid under the
schema are allowed (lm-format-enforcer's :class:`TokenEnforcer` walks the vocabulary's prefix tree with a
character-level JSON-schema parser), so a greedy output that ends with EOS is schema-valid by construction.

lm-format-enforcer's own transformers integration (``lmformatenforcer.integrations.transformers``) imports
``transformers.tokenization_utils``, which transformers 5 removed; what it does there is build the vocabulary
table (:func:`tokenizer_data`, the same rule) and wrap ``TokenEnforcer.get_allowed_tokens`` as a
``prefix_allowed_tokens_fn``, both done here against the tokenizer's public API.

Deterministic and batch-invariant: the allowed tokens of a row depend only on that row's own tokens (the
enforcer keys its states by the whole row, left padding included, and starts a fresh enforcer per batch), and
the parser settings are fixed here rather than read from ``LMFE_*`` environment variables.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

#: Most consecutive whitespace characters the parser allows between JSON tokens: enough for indented output,
#: and no room for the runaway whitespace that JSON-guided decoding is known for.
MAX_JSON_WHITESPACES = 4
#: Longest array when the schema gives no ``maxItems`` (the JustMem schemas always do).
MAX_JSON_ARRAY_LENGTH = 256

_DATA: dict[int, Any] = {}
_DATA_LOCK = threading.Lock()


def _decode(tok: Any, tokens: list[int]) -> str:
    # a token that ends inside a UTF-8 character decodes to U+FFFD; the enforcer waits for the next token
    return tok.decode(tokens).rstrip("\ufffd")


def tokenizer_data(tok: Any) -> Any:
    """lm-format-enforcer's vocabulary table for ``tok`` (one per tokenizer per process: building it decodes
    every token twice, a few seconds for a 49k vocabulary)."""
    from lmformatenforcer import TokenEnforcerTokenizerData

    with _DATA_LOCK:
        if id(tok) not in _DATA:
            special = set(tok.all_special_ids)
            zero = tok.encode("0", add_special_tokens=False)[-1]
            regular = []
            for i in range(len(tok)):
                if i in special:
                    continue
                # decoded after "0" and without its first character: keeps a word-start token's leading space
                after_zero = tok.decode([zero, i])[1:]
                regular.append((i, after_zero, len(after_zero) > len(tok.decode([i]))))
            eos = tok.eos_token_id
            _DATA[id(tok)] = (tok, TokenEnforcerTokenizerData(regular, functools.partial(_decode, tok), eos, False,
                                                              len(tok)))
        return _DATA[id(tok)][1]


def prefix_allowed_tokens_fn(tok: Any, schema: dict) -> Callable[[int, Any], list[int]]:
    """A ``prefix_allowed_tokens_fn`` for ``model.generate`` that holds every row to ``schema``. Make one per
    ``generate`` call: its enforcer takes the first sequence it sees of each row as that row's prompt."""
    from lmformatenforcer import JsonSchemaParser, TokenEnforcer
    from lmformatenforcer.characterlevelparser import CharacterLevelParserConfig

    data = tokenizer_data(tok)
    enforcer = TokenEnforcer(data, JsonSchemaParser(schema))
    enforcer.root_parser.config = CharacterLevelParserConfig(
        alphabet=data.tokenizer_alphabet, max_consecutive_whitespaces=MAX_JSON_WHITESPACES,
        force_json_field_order=True, max_json_array_length=MAX_JSON_ARRAY_LENGTH)

    def allowed(batch_id: int, sent: Any) -> list[int]:
        return enforcer.get_allowed_tokens(sent.tolist()).allowed_tokens

    return allowed
