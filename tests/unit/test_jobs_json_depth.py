"""The job API's measure of how deep a request body's JSON nests (services.jobs.middleware.json_depth) and
the validation error handler's cut of the input it echoes (services.jobs.errors.finite_json)."""

import json
import time

import pytest

from services.jobs.errors import CUT, ECHO_DEPTH, finite_json
from services.jobs.middleware import json_depth


@pytest.mark.parametrize(
    "body,depth",
    [
        (b"", 0),
        (b"12", 0),
        (b'"[[["', 0),
        (b"{}", 1),
        (b'{"a": [1, {"b": []}], "c": {}}', 4),
        (b'{"a": "]]]]", "b": [[[]]]}', 4),  # closing brackets in a string do not end anything
        (b'{"a": "\\"[[[", "b": 1}', 1),  # an escaped quote does not end the string
        (b'{"a": "\\\\", "b": [[]]}', 3),  # an escaped backslash does not escape the closing quote
        (b'["unterminated [[[', 1),
        (b"[[[", 3),  # not JSON: measured anyway
    ],
)
def test_depth_counts_arrays_and_objects_outside_strings(body, depth):
    assert json_depth(body) == depth


def test_depth_of_what_json_dumps():
    value: object = {"k": "v[{"}
    for level in range(1, 200):
        assert json_depth(json.dumps(value).encode()) == level
        value = [value, {"s": "}]", "e": "\\"}]


@pytest.mark.parametrize(
    "body",
    [b'"\\"' * 350_000, b'"' + b"\\a" * 500_000, b"[" * 1_000_000, b'"' * 1_000_000],
    ids=["escaped-quotes", "escapes", "brackets", "quotes"],
)
def test_a_hostile_megabyte_is_measured_in_linear_time(body):
    start = time.perf_counter()
    json_depth(body)
    assert time.perf_counter() - start < 2.0


def test_the_echo_is_cut_at_echo_depth_and_keeps_non_finite_numbers_readable():
    deep: object = float("nan")
    for _ in range(1000):
        deep = {"a": [deep]}
    echoed = finite_json(deep)
    assert json_depth(json.dumps(echoed).encode()) == ECHO_DEPTH and CUT in json.dumps(echoed)
    assert finite_json([float("inf"), (1, float("-inf"))]) == ["Infinity", [1, "-Infinity"]]
