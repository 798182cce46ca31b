"""pdpair router: prefill (max_tokens=1, do_remote_decode) then decode with prefill's kv_transfer_params.

Run: `python -m pdpair.router --port P --prefill URL --decode URL`. See app.py.
"""
