"""The calculator tool: arithmetic on numbers, parsed (never `eval`ed) from the expression the policy wrote.

    evaluate("347 * 29")      -> "10063"
    evaluate("(2 + 3) / 4")   -> "1.25"
    evaluate("2 ** 0.5")      -> "1.4142135623730951"

Numbers (int, float), + - * / // % **, unary + and -, parentheses; anything else (names, calls, strings)
is a ValueError naming what it met. An expression such as 9 ** 9 ** 9 is legal and runs until the tool's
sandbox stops it (engines/environments/tools.py: timeout and memory limit), which is the point of running
it there: `evaluate` itself has no limits of its own.
"""

from __future__ import annotations

import ast
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> str:
    """The value of `expression` as text: integral results without a decimal point ("6", not "6.0").

    Raises ValueError (not arithmetic, or not parseable), ZeroDivisionError, OverflowError.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expected an expression as text, got {type(expression).__name__}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: {e.msg}") from None
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r} ({type(node).__name__})")
