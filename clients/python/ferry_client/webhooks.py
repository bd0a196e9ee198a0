"""Verifying Ferry's webhook deliveries (interface spec, section 5): ``X-Service-Webhook-Signature:
v1,<hex>``, the lowercase hex HMAC-SHA256 keyed by the secret the caller sent as ``X-Webhook-Secret``, of
``<X-Request-Id>.<X-Service-Webhook-Timestamp>.<raw body>``. The same rules as Ferry's own verifier
(``ferry/webhooks``, src/webhooks/signature.ts): a timestamp more than ``tolerance_seconds`` (300) from
now is refused, several space-separated signatures are accepted (secret rotation), and any doubt is
``False``, never an exception."""

import hashlib
import hmac
import re
import time
from typing import Mapping, Optional, Union

Bytes = Union[str, bytes, bytearray, memoryview]

DEFAULT_TOLERANCE_SECONDS = 300


def _bytes(value: Bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def _header(headers: Mapping, name: str) -> Optional[str]:
    getter = getattr(headers, "get", None)
    # Frameworks keep the sender's capitalization in plain dicts; compare names case-insensitively.
    for key in list(getattr(headers, "keys", lambda: [])()):
        if isinstance(key, str) and key.lower() == name:
            value = headers[key]
            return value[0] if isinstance(value, (list, tuple)) else value
    if getter is not None:
        value = getter(name)
        if value is not None:
            return value
    return None


def sign_webhook(secret: Bytes, request_id: str, timestamp: int, body: Bytes) -> str:
    """The signature header value Ferry sends for one delivery (for tests of a receiver)."""
    mac = hmac.new(_bytes(secret), ("%s.%d." % (request_id, timestamp)).encode("utf-8"), hashlib.sha256)
    mac.update(_bytes(body))
    return "v1," + mac.hexdigest()


def verify_webhook(
    secret: Bytes,
    headers: Mapping,
    body: Bytes,
    tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
    now: Optional[float] = None,
) -> bool:
    """True when the delivery carries a valid signature for ``secret`` over ``body`` (the raw bytes as
    received, before any JSON parsing) and its timestamp is within ``tolerance_seconds`` of ``now``."""
    try:
        request_id = _header(headers, "x-request-id")
        timestamp = (_header(headers, "x-service-webhook-timestamp") or "").strip()
        signature = _header(headers, "x-service-webhook-signature")
        if not request_id or not signature or not re.fullmatch(r"\d{1,15}", timestamp):
            return False
        current = time.time() if now is None else now
        if not abs(current - int(timestamp)) <= tolerance_seconds:
            return False
        mac = hmac.new(_bytes(secret), ("%s.%s." % (request_id, timestamp)).encode("utf-8"), hashlib.sha256)
        mac.update(_bytes(body))
        expected = mac.hexdigest()
        ok = False
        for part in signature.strip().split():
            if part.startswith("v1,") and hmac.compare_digest(part[3:].lower(), expected):
                ok = True
        return ok
    except Exception:  # noqa: BLE001 - a verifier never throws for bad input
        return False
