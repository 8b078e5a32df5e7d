"""The tool-call formats: what each reads as calls, as failed calls, and as a final answer."""

import json

import pytest

from services.rollout.tool_parsers import TOOL_PARSERS


def args(call):
    return json.loads(call.arguments_json)


def test_hermes_reads_several_calls_and_names_each_broken_one():
    parser = TOOL_PARSERS.create("hermes")
    reply = parser.parse(
        'Let me compute.\n<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>{"arguments": {}}</tool_call>'
    )
    assert [c.name for c in reply.calls] == ["calculator", "search"]
    assert args(reply.calls[0]) == {"expression": "2+3"} and args(reply.calls[1]) == {"query": "x"}
    assert len(reply.errors) == 2 and "tool call 3: not valid JSON" in reply.errors[0]
    assert 'needs a "name"' in reply.errors[1] and not reply.final


def test_hermes_counts_a_call_cut_at_the_token_limit_and_a_plain_reply_is_final():
    parser = TOOL_PARSERS.create("hermes")
    cut = parser.parse('<tool_call>{"name": "calculator", "argu')
    assert cut.calls == [] and cut.errors == ["a <tool_call> without its </tool_call>"] and not cut.final
    assert parser.parse("<action>42</action>").final


@pytest.mark.parametrize(
    "text, names, errors",
    [
        ('{"name": "calculator", "arguments": {"expression": "1"}}', ["calculator"], 0),
        ('```json\n[{"name": "a", "arguments": {}}, {"name": "b"}]\n```', ["a", "b"], 0),
        ('[{"name": "a"}, 3]', ["a"], 1),
        ('{"name": "a", ', [], 1),
        ("<action>7</action>", [], 0),
    ],
)
def test_json_reads_a_reply_that_is_json_and_leaves_any_other_final(text, names, errors):
    reply = TOOL_PARSERS.create("json").parse(text)
    assert [c.name for c in reply.calls] == names and len(reply.errors) == errors
    assert reply.final == (not names and not errors)


def test_xml_action_reads_json_actions_as_calls_and_text_actions_as_the_answer():
    parser = TOOL_PARSERS.create("xml_action")
    reply = parser.parse('<action>{"name": "calculator", "arguments": {"expression": "9*9"}}</action>')
    assert [c.name for c in reply.calls] == ["calculator"] and args(reply.calls[0]) == {"expression": "9*9"}
    assert parser.parse("<action>81</action>").final
    assert parser.parse("<action>{oops</action>").errors
