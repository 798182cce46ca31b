"""api_reason (reconciler.py): the API server's Status reason and message, from a real client exception."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException

from pdpair.operator.reconciler import REJECTED_STATUSES, api_reason


def _api_exception(status, reason, body):
    exc = ApiException(status=status, reason=reason)
    exc.body = body  # as the client sets it from the HTTP response
    return exc


def test_the_status_message_names_the_field():
    status = {"kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422,
              "message": 'Pod "p" is invalid: spec.containers[0].resources.requests[cpu]: Invalid value: "-1": '
                         "must be greater than or equal to 0"}
    exc = _api_exception(422, "Unprocessable Entity", json.dumps(status))
    reason, message = api_reason(exc)
    assert reason == "Invalid"
    assert "spec.containers[0].resources.requests[cpu]" in message
    assert exc.status in REJECTED_STATUSES


def test_a_body_that_is_not_a_status_falls_back_to_the_exception():
    exc = _api_exception(403, "Forbidden", "<html>nope</html>")
    reason, message = api_reason(exc)
    assert reason == "Forbidden" and "403" in message
    reason, message = api_reason(RuntimeError("boom"))
    assert (reason, message) == ("RuntimeError", "boom")
