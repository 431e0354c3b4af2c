"""The Python client of tokenrelay's WebSocket protocol (docs/client.md, "Python client").

```python
from tokenrelay.client import AsyncClient, Client

async with AsyncClient("http://127.0.0.1:8000") as c:
    s = await c.chat([{"role": "user", "content": "Hi"}], max_tokens=64, temperature=0)
    async for text in s:  # resumes by itself after a dropped socket
        print(text, end="")

with Client("http://127.0.0.1:8000") as c:
    for text in c.chat([{"role": "user", "content": "Hi"}]):
        print(text, end="")
```

In the base install (no torch). The protocol logic (frames, the resume state machine,
the retry policy) is sans I/O: client/frames.py, client/state.py, client/retry.py.
"""

from tokenrelay.client.async_client import AsyncClient
from tokenrelay.client.errors import (
    AuthenticationError,
    BadRequestError,
    ConnectionFailed,
    InternalServerError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    TokenRelayError,
    UnavailableError,
)
from tokenrelay.client.frames import Token, ToolCallDelta, Usage
from tokenrelay.client.retry import RetryPolicy
from tokenrelay.client.stream import AsyncStream
from tokenrelay.client.sync_client import Client, Stream
from tokenrelay.core.wire.vocabulary import ErrorCode, FinishReason

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ConnectionFailed",
    "ErrorCode",
    "FinishReason",
    "InternalServerError",
    "NotFoundError",
    "OverloadedError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "RetryPolicy",
    "Stream",
    "Token",
    "TokenRelayError",
    "ToolCallDelta",
    "UnavailableError",
    "Usage",
]
