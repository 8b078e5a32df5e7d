"""The `calculator` toolset: exact arithmetic on one expression, without running code.

The expression is parsed with `ast` and only numeric literals, + - * / // % **, unary + and - and parentheses are
evaluated, on `Fraction`s: a decimal literal is read exactly from its text (0.1 is 1/10), so results are exact. Work
is bounded: the input by `max_chars`, every intermediate value by `max_digits` digits (numerator and denominator),
checked before a power is computed and after every other operation, whose operands are then within the bound."""

from __future__ import annotations

import ast
import math
import operator
import re
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

from pydantic import Field

from services.envs.tools.base import TOOLSETS, ToolContext, ToolError, ToolOptions, ToolOutput, Toolset, ToolSpec

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = "only numbers, + - * / // % **, unary + and -, and parentheses are allowed"
_DECIMAL = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE]([+-]?\d+))?")
_SIGNIFICANT_DIGITS = 13
_WHAT = {ast.Name: "a name", ast.Call: "a function call", ast.Attribute: "an attribute", ast.Subscript: "a subscript"}


class CalculatorOptions(ToolOptions):
    max_chars: int = Field(500, ge=1)
    """The longest expression accepted."""
    # Python refuses to print ints over 4300 digits (sys.int_info.str_digits_check_threshold)
    max_digits: int = Field(1000, ge=1, le=4000)
    """The most digits any value (numerator or denominator) may have, the result and every step to it."""


@TOOLSETS.register("calculator")
class Calculator(Toolset):
    type = "calculator"
    Options = CalculatorOptions

    def specs(self) -> list[ToolSpec]:
        return [
            ToolSpec(
                name="calculator",
                description=(
                    "Evaluates an arithmetic expression exactly: integers, decimals, + - * / // % ** and parentheses "
                    "(e.g. `(2**64 - 1) / 3`). Non-integer results are given as a fraction and a decimal."
                ),
                parameters={
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "The arithmetic expression."}},
                    "required": ["expression"],
                    "additionalProperties": False,
                },
            )
        ]

    async def call(self, name: str, arguments: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        return ToolOutput(render(evaluate(arguments["expression"], self.options)))


def evaluate(expression: str, options: CalculatorOptions) -> Fraction:
    """The exact value of `expression`; ToolError where it is refused or cannot be computed."""
    if len(expression) > options.max_chars:
        raise ToolError(f"the expression is longer than {options.max_chars} characters", "refused")
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ToolError(f"not an arithmetic expression; {_ALLOWED}", "refused") from None
    try:
        return _Evaluator(source, options.max_digits).eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero", "failed") from None
    except RecursionError:
        raise ToolError("the expression nests too deeply", "refused") from None


def render(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    with localcontext() as context:
        context.prec = _SIGNIFICANT_DIGITS
        decimal = Decimal(value.numerator) / Decimal(value.denominator)
    sign = "=" if Fraction(decimal) == value else "≈"
    return f"{value} {sign} {decimal}"


class _Evaluator:
    def __init__(self, source: str, max_digits: int):
        self.source = source
        self.max_digits = max_digits

    def eval(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return self._checked(self._literal(node))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.eval(node.operand))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            return self._power(self.eval(node.left), self.eval(node.right))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return self._checked(Fraction(_BINARY[type(node.op)](self.eval(node.left), self.eval(node.right))))
        raise self._refused(node, _WHAT.get(type(node), type(node).__name__))

    def _literal(self, node: ast.Constant) -> Fraction:
        if type(node.value) is int:
            return Fraction(node.value)
        if type(node.value) is float:
            text = (ast.get_source_segment(self.source, node) or "").replace("_", "")
            match = _DECIMAL.fullmatch(text)
            if match is None:
                raise ToolError(f"unreadable number {text!r}", "refused")
            # a literal like 1e999999999 would build a huge power of ten before any size check
            if match.group(1) is not None and abs(int(match.group(1))) > self.max_digits + len(text):
                raise ToolError(f"{text} has more than {self.max_digits} digits", "refused")
            return Fraction(text)
        raise self._refused(node, type(node.value).__name__)

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise ToolError("only integer exponents are supported (the result would not be exact)", "refused")
        power = exponent.numerator
        if base in (0, 1, -1) or power == 0:
            return base**power
        # |base| or its denominator is at least 2, so each unit of the exponent adds at least log10(2) digits
        largest = max(abs(base.numerator), base.denominator)
        if abs(power) > 4 * self.max_digits or abs(power) * math.log10(largest) >= self.max_digits:
            raise ToolError(f"the power would have more than {self.max_digits} digits", "refused")
        return self._checked(base**power)

    def _checked(self, value: Fraction) -> Fraction:
        bits = max(abs(value.numerator).bit_length(), value.denominator.bit_length())
        if (bits - 1) * math.log10(2) >= self.max_digits:
            raise ToolError(f"a value has more than {self.max_digits} digits", "refused")
        return value

    def _refused(self, node: ast.AST, what: str) -> ToolError:
        segment = ast.get_source_segment(self.source, node) or ""
        return ToolError(f"not allowed: `{segment[:40]}` ({what}); {_ALLOWED}", "refused")
