"""ferry_client: call functions deployed on Ferry from Python (standard library only, Python 3.9+).

    from ferry_client import Ferry

    ferry = Ferry()                      # FERRY_URL, FERRY_TOKEN, FERRY_PROJECT
    hello = ferry.app("hello")
    hello.call("run", {"name": "Ada"})   # the result
    run = hello.spawn("run", {"name": "Ada"})
    run.result(timeout=60)
    for item in hello.stream("count", {"n": 3}):
        print(item)

Receivers of Ferry's webhooks verify them with ``verify_webhook(secret, headers, body)``.
"""

from .client import FINAL_STATES, App, Ferry, Run
from .errors import (
    AuthError,
    FerryConnectionError,
    FerryError,
    InvalidRequestError,
    NotFoundError,
    RunFailedError,
    UnavailableError,
)
from .webhooks import sign_webhook, verify_webhook

__version__ = "0.1.0"

__all__ = [
    "App",
    "AuthError",
    "FINAL_STATES",
    "Ferry",
    "FerryConnectionError",
    "FerryError",
    "InvalidRequestError",
    "NotFoundError",
    "Run",
    "RunFailedError",
    "UnavailableError",
    "sign_webhook",
    "verify_webhook",
]
