"""The calculator toolset: exact results, refusal of anything but arithmetic, bounded work."""

import asyncio
import time
from pathlib import Path

import pytest

from services.envs.tools import TOOLSETS, ToolContext, ToolError

CTX = ToolContext("episode", Path("."), 10.0)


def calc(expression: str, **options) -> str:
    cls = TOOLSETS.get("calculator")
    toolset = cls(cls.Options(**options))
    return asyncio.run(toolset.call("calculator", {"expression": expression}, CTX)).content


def refusal(expression: str, **options) -> ToolError:
    with pytest.raises(ToolError) as raised:
        calc(expression, **options)
    return raised.value


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("123456789123456789*987654321987654321", "121932631356500531347203169112635269"),
        ("2**200", str(2**200)),
        ("7/3", "7/3 ≈ 2.333333333333"),
        ("0.1 + 0.2", "3/10 = 0.3"),
        ("1.5e3 - 0.5", "2999/2 = 1499.5"),
        ("(2**64 - 1) // 3 % 1000", str((2**64 - 1) // 3 % 1000)),
        ("-7 % 3", "2"),
        ("2**-3", "1/8 = 0.125"),
        ("1/3*3", "1"),
        ("-(-(+4))", "4"),
    ],
)
def test_exact_results(expression, expected):
    assert calc(expression) == expected


def test_spec_names_one_tool_with_an_expression():
    cls = TOOLSETS.get("calculator")
    (spec,) = cls(cls.Options()).specs()
    assert spec.name == "calculator" and spec.parameters["required"] == ["expression"]


@pytest.mark.parametrize(
    ("expression", "what"),
    [
        ("__import__('os')", "function call"),
        ("(1).__class__", "attribute"),
        ("x + 1", "name"),
        ("'a' * 3", "str"),
        ("True + 1", "bool"),
        ("1 < 2", "Compare"),
        ("2j", "complex"),
        ("[1][0]", "subscript"),
    ],
)
def test_refuses_what_is_not_arithmetic(expression, what):
    error = refusal(expression)
    assert error.kind == "refused" and what in str(error)


def test_bounds_the_input_and_every_value():
    started = time.monotonic()
    assert "longer than 500" in str(refusal("1+" * 300 + "1"))
    assert "digits" in str(refusal("9**9**9"))
    assert "digits" in str(refusal("2**(10**600)"))
    assert "digits" in str(refusal("(10**900) * (10**900)"))
    assert "digits" in str(refusal("1e999999999"))
    assert "digits" in str(refusal("10**20", max_digits=20))
    assert "exact" in str(refusal("2**0.5"))
    assert time.monotonic() - started < 1.0
    assert calc("10**999") == "1" + "0" * 999
    assert calc("1**(10**500)") == "1"


def test_division_by_zero_fails():
    for expression in ("1/0", "5 // (2 - 2)", "0 ** -1", "3 % 0"):
        error = refusal(expression)
        assert error.kind == "failed" and "zero" in str(error)
