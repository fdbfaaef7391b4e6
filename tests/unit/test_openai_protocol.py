import pytest

from ascendserve.protocol.openai import APIError, estimated_tokens, mm_parts, only_part, parse


def err(raw, kind="chat"):
    with pytest.raises(APIError) as info:
        parse(raw, kind)
    return info.value


@pytest.mark.parametrize("raw,needle", [
    (b"{not json", "not valid JSON"),
    (b"[1,2]", "must be a JSON object"),
    (b'{"messages": []}', "'model' is required"),
    (b'{"model": 1, "messages": [{"role": "user", "content": "x"}]}', "'model' must be a string"),
    (b'{"model": "m", "messages": "hi"}', "'messages' must be an array"),
    (b'{"model": "m", "messages": []}', "must not be empty"),
    (b'{"model": "m", "messages": [{"content": "x"}]}', "string 'role'"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "content must be"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "'stream' must be a boolean"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "'max_tokens' must be >= 1"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "must be an integer"),
])
def test_chat_bad_input_is_400(raw, needle):
    e = err(raw)
    assert e.status == 400 and needle in e.message
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_completions_prompt_checked():
    assert err(b'{"model": "m", "prompt": 3}', "completions").status == 400
    assert err(b'{"model": "m", "prompt": []}', "completions").status == 400
    assert parse(b'{"model": "m", "prompt": ["a", "b"], "extra_field": 1}', "completions")["extra_field"] == 1


def test_multimodal_parts_detected_for_every_kind():
    body = {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "audio_url", "audio_url": {"url": "http://x/a.wav"}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}},
        ]}]}
    parts = mm_parts(body)
    assert [p["type"] for _, _, p in parts] == ["image_url", "audio_url", "input_audio", "video_url"]
    assert mm_parts({"model": "m", "messages": [{"role": "user", "content": "text only"}]}) == []
    single = only_part(body, 1, 4)
    assert single["messages"] == [{"role": "user", "content": [body["messages"][1]["content"][4]]}]
    assert len(body["messages"][1]["content"]) == 5  # the original is untouched


def test_estimated_tokens_grow_with_text():
    small = estimated_tokens({"prompt": "x" * 40})
    big = estimated_tokens({"messages": [{"role": "user", "content": "x" * 4000}]})
    assert 0 < small < big
