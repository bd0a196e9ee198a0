"""
Streaming from Python: a generator (or async generator) function streams its items.

    curl -N -X POST .../python-stream/generate -H 'accept: text/event-stream' \
         -H 'content-type: application/json' -d '{"prompt": "tell me a story"}'

answers one server-sent event per token, each the moment it is yielded. Without the Accept header the
tokens come back together as a JSON array once the generator is done.
"""

import asyncio
import time

WORDS = "Once upon a time a small ferry carried functions across the river, one token at a time.".split()


def generate(prompt: str = "", max_tokens: int = 16, delay: float = 0.2):
    """A plain generator: runs in a worker thread, so time.sleep does not hold up other runs."""
    print(f"generating up to {max_tokens} tokens for {prompt!r}")  # goes to this run's logs
    try:
        for i, word in enumerate(WORDS[:max_tokens]):
            time.sleep(delay)
            yield {"index": i, "token": word}
    finally:
        # Runs also when the caller disconnects before the end.
        print("generator closed")


async def countdown(start: int = 5, delay: float = 0.5):
    """An async generator: awaits without holding a thread."""
    for n in range(start, 0, -1):
        yield n
        await asyncio.sleep(delay)
    yield "liftoff"
