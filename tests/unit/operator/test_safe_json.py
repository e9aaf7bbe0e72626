"""A job nested thousands deep must not crash the operator: its JSON is decoded with a bounded
depth (`safe_json`), kopf's watch decodes through it, and the spec's loader then refuses the job
naming the field (never a RecursionError). The real watch of a running operator is
tests/cluster/test_operator_tenant_bounds.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from operator_helpers import at, job

from rlhf_api.fields import MAX_FREE_FORM_DEPTH, MAX_FREE_FORM_PROPERTIES, SpecError
from rlhf_api.loader import parse_job
from rlhf_api.schema import openapi_schema
from rlhf_api.sections import RewardFunctionSpec
from rlhf_api.status import FAILED
from rlhf_operator import reconcile, safe_json
from rlhf_operator.status import get_condition


def nested(depth: int, leaf: Any = 1, key: str = "a") -> Any:
    value = leaf
    for _ in range(depth):
        value = {key: value}
    return value


def depth_of(value: Any) -> int:
    n = 0
    while isinstance(value, (dict, list)):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
        n += 1
    return n


@pytest.mark.parametrize(
    "doc",
    [
        {"a": 1, "b": [1, 2.5, None, True], "s": "x"},
        {"brackets in strings": "[[[[{{{{", "escaped": 'a\\"]]]]\\\\', "unicode": "é[ü"},
        nested(64),
        [[[[[]]]]],
        {},
        "plain",
    ],
)
def test_ordinary_json_decodes_as_json_loads_does(doc: Any) -> None:
    text = json.dumps(doc)
    assert safe_json.loads(text) == json.loads(text)
    assert safe_json.loads(text.encode()) == json.loads(text)


@pytest.mark.parametrize("depth", [65, 1000, 3000, 100_000])
def test_too_deep_json_is_cut_at_the_bound_not_a_recursion_error(depth: int) -> None:
    text = "{" + '"spec": ' + '{"a": ' * depth + "1" + "}" * depth + ', "kind": "RLTrainingJob"}'
    if depth >= 3000:
        with pytest.raises(RecursionError):
            json.loads(text)  # what kopf did before
    doc = safe_json.loads(text)
    assert doc["kind"] == "RLTrainingJob"
    assert depth_of(doc) == safe_json.MAX_DEPTH
    value = doc["spec"]
    while isinstance(value, dict):
        value = value["a"]
    assert value == safe_json.TOO_DEEP


@pytest.mark.parametrize(
    ("text", "deeper"),
    [
        (json.dumps({"s": "]]]]]]]]]]]]", "d": nested(5)}), True),  # closers in a string do not hide depth
        (json.dumps({"s": "[[[[[[[[[[[[", "d": nested(3)}), False),  # openers in a string add none
        (json.dumps({"s": 'q\\"[[[[[[[[', "d": nested(3)}), False),  # an escaped quote does not end it
        (json.dumps({"s": "q\\", "d": nested(5)}), True),  # an escaped backslash before the quote
    ],
)
def test_depth_is_measured_outside_strings(text: str, deeper: bool) -> None:
    assert safe_json.deeper_than(text, 4) is deeper


def test_malformed_json_still_raises_a_decode_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        safe_json.loads("{" * 100 + "]")


def test_kopf_decodes_its_watch_and_its_answers_through_safe_json() -> None:
    import aiohttp
    from kopf._cogs.clients import api

    safe_json.install_into_kopf()
    safe_json.install_into_kopf()  # idempotent
    assert api.json.loads is safe_json.loads
    assert api.json.dumps is json.dumps
    assert getattr(aiohttp.ClientResponse.json, "_rlhf_safe", False)


def test_kopfs_own_watch_stream_survives_a_5000_deep_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf's `api.stream` (the code its watches run) over a real HTTP answer whose first line is a
    job nested 5000 deep: the event arrives, cut at the bound, and the next event after it."""
    import asyncio

    import aiohttp
    from aiohttp import web
    from kopf._cogs.clients import api

    deep = '{"a": ' * 5000 + "1" + "}" * 5000
    lines = [
        '{"type": "ADDED", "object": {"kind": "RLTrainingJob", "spec": ' + deep + "}}",
        '{"type": "ADDED", "object": {"kind": "RLTrainingJob", "metadata": {"name": "other"}}}',
    ]

    async def watch(_: web.Request) -> web.Response:
        return web.Response(text="\n".join(lines) + "\n", content_type="application/json")

    async def run() -> list[Any]:
        app = web.Application()
        app.router.add_get("/watch", watch)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as session:

            async def request(**_: Any) -> aiohttp.ClientResponse:
                return await session.get(f"http://127.0.0.1:{port}/watch")

            monkeypatch.setattr(api, "request", request)
            try:
                return [ev async for ev in api.stream("/watch", settings=None, logger=None)]  # type: ignore[arg-type]
            finally:
                await runner.cleanup()

    safe_json.install_into_kopf()
    events = asyncio.run(run())
    assert [e["object"].get("metadata", {}).get("name") for e in events] == [None, "other"]
    assert depth_of(events[0]["object"]["spec"]) == safe_json.MAX_DEPTH - 2


@pytest.mark.parametrize("depth", [9, 40, 5000])
def test_a_job_with_deep_kwargs_fails_naming_the_field(depth: int) -> None:
    body = job()
    body["spec"]["reward"]["functions"][0]["kwargs"] = "KWARGS"
    text = json.dumps(body).replace('"KWARGS"', '{"a": ' * depth + "1" + "}" * depth)
    decoded = safe_json.loads(text)  # as the operator reads it from the API server
    out = reconcile.plan(decoded, [], at(0), admitted=True)
    cond = get_condition(out.status, FAILED) or {}
    assert cond.get("reason") == "InvalidSpec" and out.create == []
    assert "nested deeper than" in cond["message"]
    assert cond["message"].startswith("spec")


@pytest.mark.parametrize(
    ("field", "value", "ok"),
    [
        ("reward.functions.0.kwargs", {"n": 3, "names": ["a", "b"], "opts": {"x": {"y": 1}}}, True),
        ("reward.functions.0.kwargs", nested(MAX_FREE_FORM_DEPTH), True),
        ("reward.functions.0.kwargs", nested(MAX_FREE_FORM_DEPTH + 1), False),
        ("reward.functions.0.kwargs", {f"k{i}": i for i in range(65)}, False),
        ("reward.functions.0.kwargs", {"a": [{f"k{i}": i for i in range(65)}]}, False),
    ],
)
def test_free_form_fields_have_a_depth_and_a_size(field: str, value: Any, ok: bool) -> None:
    body = job()
    obj: Any = body["spec"]
    *head, last = field.split(".")
    for key in head:
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    obj[last] = value
    if ok:
        parse_job(body, admitted=True)
        return
    with pytest.raises(SpecError) as err:
        parse_job(body, admitted=True)
    assert any(e.startswith("spec.reward.functions[0].kwargs") for e in err.value.errors), err.value.errors


def test_free_form_schemas_bound_their_keys() -> None:
    schema = openapi_schema(RewardFunctionSpec)
    assert schema["properties"]["kwargs"]["maxProperties"] == MAX_FREE_FORM_PROPERTIES
