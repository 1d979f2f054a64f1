"""Requests as the server reads them, and the JSON it writes back."""

import pytest

from gali_cli.server.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Message,
    Reply,
    Usage,
    parse,
    read_json,
)


def test_content_parts_are_joined_by_line_breaks_and_each_starts_a_forward():
    message = Message.model_validate({"role": "user", "content": [{"type": "text", "text": "The document."},
                                                                   {"type": "text", "text": "When?"}]})
    assert message.text == "The document.\nWhen?" and message.cuts() == [len("The document.\n")]


@pytest.mark.parametrize("content, text", [
    (" " * 20 + "GNU GPL\n\nPreamble.\n\n\nWho may copy it?", "GNU GPL\n\nPreamble.\n\nWho may copy it?"),
    ([{"type": "text", "text": "\n  Doc.\n"}, {"type": "text", "text": "\nWhen?"}], "Doc.\n\nWhen?"),
    ("    def read(path):\n        return path", "    def read(path):\n        return path"),  # no question: as sent
])
def test_blank_space_around_a_document_is_dropped_as_gali_ask_drops_it(content, text):
    """gali ask strips its document; a client sends the file as read. The message is served as gali ask's prompt
    has it (issue 50: a document starting with spaces was read again), and its question still starts a forward."""
    message = Message.model_validate({"role": "user", "content": content})
    assert message.text == text
    if "\n\n" in text:
        assert [text[cut:] for cut in message.cuts()] == [text.rsplit("\n\n", 1)[1]]


@pytest.mark.parametrize("prompt, expected", [("Hi", "Hi"), (["Hi"], "Hi"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2])])
def test_a_completion_prompt_is_one_text_or_one_list_of_token_ids(prompt, expected):
    assert parse(CompletionRequest, {"model": "m", "prompt": prompt}).prompt == expected


@pytest.mark.parametrize("body, param, words", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ""}, "stop", "non-empty"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["Z" * 1_000_000] * 4}, "stop", "256"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop", "up to 4"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content", "text"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature", "number"),
    ({"model": 3, "messages": [{"role": "user", "content": "x"}]}, "model", "string"),
])
def test_validation_errors_name_the_field(body, param, words):
    with pytest.raises(APIError) as error:
        parse(ChatRequest, body)
    assert error.value.status == 400 and error.value.param == param and words in error.value.message
    assert error.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("n", 3), ("logprobs", True), ("top_logprobs", 2), ("logit_bias", {"1": 5}),
                                          ("response_format", {"type": "json_object"}), ("functions", [{}]),
                                          ("frequency_penalty", 0.5)])
def test_features_the_server_does_not_have_are_refused(field, value):
    chat = parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value})
    with pytest.raises(APIError, match=field):
        chat.check_supported()


def test_harmless_defaults_and_unknown_fields_are_accepted():
    chat = parse(ChatRequest, {"model": "m", "messages": [{"role": "developer", "content": "x"}], "n": 1,
                               "logprobs": False, "presence_penalty": 0, "user": "someone", "metadata": {"a": "b"},
                               "tool_choice": "none", "response_format": {"type": "text"}, "max_completion_tokens": 9,
                               "max_tokens": 3})
    chat.check_supported()
    assert chat.max_new_tokens == 9  # max_completion_tokens wins, as OpenAI's newer name


@pytest.mark.parametrize("body", [b"", b"{", b"null", b'"text"', b"\xff\xfe{}", b'{"a": Infinity}',
                                  b'{"a": "\\ud800"}', b'{"a": ["\\udc00 after a low half"]}',
                                  b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_a_body_must_be_a_json_object_in_valid_unicode_and_parseable_depth(body):
    with pytest.raises(APIError) as error:
        read_json(body)
    assert error.value.status == 400


def test_a_surrogate_pair_written_as_escapes_is_one_character():
    assert read_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}  # as json.dumps writes an emoji


def test_replies_in_openai_shapes():
    usage = Usage(prompt_tokens=10, cached_tokens=4, completion_tokens=2)
    chat, text = Reply(True, "demo"), Reply(False, "demo")
    whole = chat.whole("Hi", "stop", usage)
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    assert whole["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "logprobs": None,
                                 "finish_reason": "stop"}]
    assert whole["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                              "prompt_tokens_details": {"cached_tokens": 4}}
    assert chat.chunk("", first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk("", "length")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                       "finish_reason": "length"}
    assert text.chunk("x")["object"] == "text_completion" and text.usage_chunk(usage)["choices"] == []
    assert chat.chunk("a")["id"] == chat.chunk("b")["id"]  # one id for the whole stream
