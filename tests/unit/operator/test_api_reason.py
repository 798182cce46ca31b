"""api_reason (pod_steps.py): the API server's Status reason and message, from a real client exception."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException

from pdpair.operator.act.pod_steps import REJECTED_STATUSES, api_reason


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


def test_a_throttled_pass_waits_the_retry_after_it_was_told_with_jitter_and_bounds():
    """429 (API Priority and Fairness): the pass is redone after the apiserver's Retry-After, within [0.2, 30] s and
    stretched by the caller's jitter (at most half); any other error is not a throttle (None)."""
    from pdpair.operator.act.reconciler import throttled_retry

    def throttled(retry_after):
        exc = _api_exception(429, "Too Many Requests", '{"kind": "Status", "code": 429}')
        exc.headers = {} if retry_after is None else {"Retry-After": retry_after}
        return exc

    assert throttled_retry(throttled("1"), 0.0) == 1.0
    assert throttled_retry(throttled("4"), 0.5) == 6.0
    assert throttled_retry(throttled("4"), 9.0) == 6.0  # the jitter is capped at half
    assert throttled_retry(throttled("3600"), 0.0) == 30.0
    assert throttled_retry(throttled("0"), 0.0) == 0.2
    assert throttled_retry(throttled(None), 0.0) == throttled_retry(throttled("soon"), 0.0) == 1.0
    assert throttled_retry(throttled("nan"), 0.0) == 1.0
    assert throttled_retry(_api_exception(409, "Conflict", "{}"), 0.0) is None
    assert throttled_retry(RuntimeError("boom"), 0.0) is None
