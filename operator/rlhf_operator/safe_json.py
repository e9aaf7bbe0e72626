"""JSON decoding that no tenant's object can turn into a crash of the shared operator.

The API server stores free-form fields (`x-kubernetes-preserve-unknown-fields`) nested as deep
as the author likes: no schema bounds their depth. Python's `json.loads` recurses once per level
and raises `RecursionError` near 1000; in kopf's watch stream that error ends the watch, and with
it the operator process, for every tenant, again at every start. Decoded just below that depth,
the object would still overflow later, in whatever walks it recursively (kopf's diffs and deep
copies, the spec's loader).

`loads` decodes as `json.loads` does, except that every array or object nested deeper than
`MAX_DEPTH` is replaced by the string `TOO_DEEP`: the document stays well formed, its depth is
bounded, and the job it belongs to is then refused by the spec's loader (a free-form field
deeper than `spec.MAX_FREE_FORM_DEPTH`, a document deeper than `spec.MAX_DOCUMENT_DEPTH`), with
a condition, like any other invalid spec. Objects of ordinary depth are decoded by `json.loads`
itself, after a count of their brackets (no object with fewer brackets than `MAX_DEPTH` can be
deeper).

`install_into_kopf` makes kopf's watch streams and its API answers decode through `loads`; the
operator's own client (`kube.Kube`) calls it directly.
"""

from __future__ import annotations

import json
import re
import types
from typing import Any

#: Deepest nesting decoded; deeper arrays and objects become `TOO_DEEP`. Well above any field of
#: the CRD (`spec.MAX_DOCUMENT_DEPTH`) and of a pod, well below Python's recursion limit.
MAX_DEPTH = 64
#: What stands for a value nested too deep.
TOO_DEEP = "<rlhf-operator: nested deeper than 64 levels, not decoded>"
#: A JSON string (escapes included) or a bracket, in one scan.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
#: Outside its strings, JSON is ASCII: this table deletes every character there but the brackets.
_ONLY_BRACKETS = {c: None for c in range(128) if chr(c) not in "[]{}"}


def loads(data: str | bytes | bytearray, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads(data)`, with everything nested deeper than `max_depth` replaced by `TOO_DEEP`."""
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    if text.count("[") + text.count("{") > max_depth and deeper_than(text, max_depth):
        text = cut_deep(text, max_depth)
    return json.loads(text)


def deeper_than(text: str, max_depth: int) -> bool:
    """Whether JSON `text` nests deeper than `max_depth`, at the speed of C string functions: the
    strings removed, then the brackets alone, from which each round removes the innermost pairs
    (one level) until nothing is left."""
    # Escaped backslashes first, then escaped quotes: every quote left delimits a string, and
    # every other piece lies outside the strings.
    plain = text.replace("\\\\", "").replace('\\"', "")
    skeleton = "".join(plain.split('"')[::2]).translate(_ONLY_BRACKETS)
    for _ in range(max_depth):
        shorter = skeleton.replace("[]", "").replace("{}", "")
        if not shorter or shorter == skeleton:  # done, or malformed (json.loads reports it)
            return False
        skeleton = shorter
    return True


def cut_deep(text: str, max_depth: int = MAX_DEPTH) -> str:
    """`text` (JSON) with every array or object at depth `max_depth + 1` replaced by the JSON
    string `TOO_DEEP`. Brackets inside strings are skipped (the token scan consumes whole strings);
    malformed text stays malformed, for `json.loads` to report."""
    out: list[str] = []
    last = 0
    depth = 0
    start = -1
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token[0] == '"':
            continue
        if token in "[{":
            depth += 1
            if depth == max_depth + 1:
                start = m.start()
        else:
            if depth == max_depth + 1 and start >= 0:
                out.append(text[last:start])
                out.append(json.dumps(TOO_DEEP))
                last = m.end()
                start = -1
            depth -= 1
    out.append(text[last:])
    return "".join(out)


def install_into_kopf() -> None:
    """Decode kopf's watch streams and API answers with `loads` (idempotent). kopf reads each line
    of a watch with `json.loads` of its `api` module and each answer with aiohttp's
    `ClientResponse.json`, whose default decoder is `json.loads`."""
    import aiohttp
    from kopf._cogs.clients import api

    if getattr(api.json, "loads", None) is not loads:
        api.json = types.SimpleNamespace(**{**vars(json), "loads": loads})  # type: ignore[assignment]
    response = aiohttp.ClientResponse
    if not getattr(response.json, "_rlhf_safe", False):
        original = response.json

        async def safe(self: aiohttp.ClientResponse, *, loads: Any = loads, **kwargs: Any) -> Any:
            return await original(self, loads=loads, **kwargs)

        safe._rlhf_safe = True  # type: ignore[attr-defined]
        response.json = safe  # type: ignore[method-assign]
