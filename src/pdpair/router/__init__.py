"""pdpair router: prefill (max_tokens=1, do_remote_decode) then decode with prefill's kv_transfer_params.

Run: `python -m pdpair.router --port P --prefill URL --decode URL` (repeat --prefill / --decode for several
instances: each request goes to the least loaded). See app.py.
"""
