"""Chat records: ShareGPT turns as messages, and where a rendered chat holds its assistant turns.

The drafter learns every assistant turn of a chat: the tokens of its content and the token
that follows it (the turn's end, which the target emits too), nothing of the other roles.
"""

from bisect import bisect_left, bisect_right

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
}


def sharegpt_messages(turns: list[dict]) -> list[dict]:
    """ShareGPT {"from", "value"} turns as {"role", "content"} messages."""
    messages = []
    for number, turn in enumerate(turns):
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise ValueError(f"ShareGPT turn {number} is from {turn.get('from')!r}, which has no "
                             f"chat role; fix: use one of {sorted(SHAREGPT_ROLES)}")
        messages.append({"role": role, "content": turn.get("value")})
    return messages


def check_messages(messages: list[dict]) -> None:
    for number, message in enumerate(messages):
        if not isinstance(message.get("content"), str):
            raise TypeError(f"message {number} ({message.get('role')}) has content "
                            f"{type(message.get('content')).__name__}, not text; fix: give every "
                            "message a string content")


def assistant_char_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """[start, end) of each non-empty assistant content in text, the messages rendered in order.

    Each message is looked up after the previous one; a non-assistant one that the rendering
    leaves out (a template may drop or rewrite a system message) is passed over.
    """
    spans, cursor = [], 0
    for number, message in enumerate(messages):
        content = message["content"]
        start = text.find(content, cursor)
        if message["role"] == "assistant" and start < 0:
            raise ValueError(
                f"assistant message {number} does not appear as is in the chat template's "
                "rendering (the template rewrites it, e.g. drops the reasoning of earlier "
                "turns); fix: remove the rewritten part from the data, or keep only the last "
                "assistant turn"
            )
        if start < 0:
            continue
        if message["role"] == "assistant" and content:
            spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def token_spans(
    offsets: list[tuple[int, int]], char_spans: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """[start, end) token ranges of char_spans given each token's character offsets: the tokens
    overlapping a range and the one token after it (the turn's end)."""
    starts, ends = [s for s, _ in offsets], [e for _, e in offsets]
    spans = []
    for start, end in char_spans:
        first = bisect_right(ends, start)
        last = bisect_left(starts, end)  # one past the last token overlapping the range
        spans.append((first, min(last + 1, len(offsets))))
    return spans
