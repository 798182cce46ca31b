"""The pair's side-channel Secret (pure): its key, derived from the operator's key, and its manifest.

Every Hello on a pair's side channel is authenticated with a key of the pair's own (docs/design.md, "The side
channel's authentication"); the connector refuses to start without it on prefill and decode. The operator writes it
into `<pair>-side-channel` (pods.side_channel_secret_name) once, before the pair's first engine pod, and never reads
it back: its RBAC has create, not get, on Secrets, so the key is derived, like the push token (push.pair_token), not
stored by the operator. The push token's Secret (`<pair>-peers`, push.token_secret) is separate and older.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any, Mapping

from pdpair.contract import SIDE_CHANNEL_SECRET_KEY

from pdpair.operator.build.pods import owned_metadata, side_channel_secret_name

SIDE_CHANNEL_COMPONENT = "side-channel-key"  # app.kubernetes.io/component of the Secret
# Domain separation from the push token (HMAC(key, uid)): the router holds the push token, and must not be able to
# compute the side-channel key from it, nor the other way round.
SIDE_CHANNEL_LABEL = b"side-channel\0"


def side_channel_key(operator_key: str, pair_uid: str) -> str:
    """A pair's side-channel key: HMAC-SHA256 of `side-channel\\0` + its uid under the operator's key
    (PDPAIR_PEERS_KEY), URL-safe base64 without padding: 43 characters, above the connector's 32-character minimum
    (connector/config.check_side_channel_key)."""
    digest = hmac.new(operator_key.encode(), SIDE_CHANNEL_LABEL + pair_uid.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def side_channel_secret(pair: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The pair's side-channel Secret (core/v1, Opaque, `stringData: {side-channel-key}`), in the pair's namespace,
    labelled like everything the pair owns and owned by it (the garbage collector deletes it with the pair)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": owned_metadata(pair, side_channel_secret_name(pair["metadata"]["name"]), SIDE_CHANNEL_COMPONENT),
        "type": "Opaque",
        "stringData": {SIDE_CHANNEL_SECRET_KEY: key},
    }
