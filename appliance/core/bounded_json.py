"""JSON read within bounds: nesting and integer digits, checked in one linear pass before it is parsed.

Why: json.loads recurses once per level of nesting (100,000 levels raise RecursionError, and a few hundred can still
overflow whatever recurses over the result next) and refuses an integer of more than 4,300 digits with a plain
ValueError. A checkpoint's config files and a request's JSON schema are read through here: beyond a bound they are
refused as malformed JSON (json.JSONDecodeError, with the position), never a traceback. No recursion here.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_NESTING = 64             # arrays and objects inside each other in a config file (real ones nest 2 or 3 deep)
MAX_INT_DIGITS = 100         # digits in a row in a number (tokenizer_config.json's model_max_length has 31)

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]|-?\d+', re.S)


def json_nesting(text: str, start: int = 0, limit: int | None = None) -> tuple[int, int]:
    """(the deepest nesting of arrays and objects, an index) of the JSON value that starts at `start` with `{` or
    `[`: the index is where the value ends (len(text) when it does not close), or with `limit`, where the nesting
    first passes it. Strings are skipped whole."""
    depth = deepest = 0
    for match in _TOKEN.finditer(text, start):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if limit is not None and depth > limit:
                return deepest, match.start()
        elif token in "]}":
            depth -= 1
            if depth == 0:
                return deepest, match.end()
    return deepest, len(text)


def loads(text: str, max_nesting: int = MAX_NESTING, max_int_digits: int = MAX_INT_DIGITS) -> Any:
    """json.loads, refusing (json.JSONDecodeError) a text nested deeper than max_nesting or holding an integer of
    more than max_int_digits digits."""
    start = next((m.start() for m in _TOKEN.finditer(text) if m.group()[0] in "[{"), len(text))
    deepest, at = json_nesting(text, start, max_nesting)
    if deepest > max_nesting:
        raise json.JSONDecodeError(f"arrays and objects nested more than {max_nesting} deep", text, at)
    for match in _TOKEN.finditer(text):
        digits = len(match.group().lstrip("-"))
        if match.group()[-1].isdigit() and digits > max_int_digits:
            raise json.JSONDecodeError(f"a number of {digits:,} digits in a row (at most {max_int_digits})", text,
                                       match.start())
    return json.loads(text)
