"""Stream ids and resume tokens: unguessable, and the token stored only as a hash."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_stream_id() -> str:
    """An unguessable stream id (128 random bits, URL-safe)."""
    return secrets.token_urlsafe(16)


def new_resume_token() -> str:
    """A secret resume token (256 random bits); only its hash is stored."""
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def token_matches(token: str, stored_hash: str) -> bool:
    """Constant-time check of a resume token against its stored hash."""
    return hmac.compare_digest(hash_token(token), stored_hash)
