import pytest

from services.rollout.action_parsers import PARSERS


@pytest.fixture
def parser():
    return PARSERS.create("xml_action")


@pytest.mark.parametrize(
    "text, action",
    [
        ("<action>left</action>", "left"),
        ("I think so. <action> craft 1 stick </action><|end|>", "craft 1 stick"),
        ("<action>line one\nline two</action>", "line one\nline two"),
    ],
)
def test_one_tag_pair_gives_the_stripped_inner_text(parser, text, action):
    parsed = parser.parse(text)
    assert parsed.valid and parsed.action == action


@pytest.mark.parametrize(
    "text, reason",
    [
        ("left", "found 0"),
        ("<action>left", "found 0"),
        ("<action>left</action><action>right</action>", "found 2"),
        ("<action>  </action>", "empty"),
        ("<Action>left</Action>", "found 0"),
    ],
)
def test_anything_else_is_invalid_with_a_reason(parser, text, reason):
    parsed = parser.parse(text)
    assert not parsed.valid and parsed.action == "" and reason in parsed.error


def test_overlong_action_is_invalid():
    parsed = PARSERS.create("xml_action", max_action_chars=5).parse("<action>abcdef</action>")
    assert not parsed.valid and "longer" in parsed.error


def test_custom_tag():
    assert PARSERS.create("xml_action", tag="answer").parse("<answer>42</answer>").action == "42"


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(KeyError, match="xml_action"):
        PARSERS.get("json")
