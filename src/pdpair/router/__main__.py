"""`python -m pdpair.router --port P --prefill URL --decode URL` (also installed as `pdpair-router`).

Repeat --prefill and --decode for several instances of a role: each request goes to one decode and one prefill
chosen by load; an instance's index is its place among its role's flags.

With the environment variable PDPAIR_PEERS_TOKEN set, the operator pushes the instance sets to
`PUT /pdpair/v1/peers` (bearer that token; see app.py), and --prefill/--decode are optional (the set until the first
push).

With VLLM_API_KEY set (the pair's spec.apiKeySecret), clients must send `Authorization: Bearer <key>` and the router
sends it to the engines (see app.py); empty or unset: no key."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from collections.abc import Mapping

from aiohttp import web

from pdpair.contract import ENV_API_KEY, ENV_PEERS_TOKEN
from pdpair.router.app import make_app
from pdpair.router.config import RouterConfig, check_body_bytes, check_count, check_timeout


def _port(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port in 0..65535")
    return value


def _bytes(raw: str) -> int:
    try:
        return check_body_bytes("the limit", int(raw))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of bytes >= 1") from None


def _count(raw: str) -> int:
    try:
        return check_count("the count", int(raw))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer >= 0") from None


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
    try:
        return check_timeout("the timeout", value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{raw!r}: must be a finite number of seconds > 0") from exc


# Each default is declared once, on RouterConfig.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RouterConfig)}


def build_parser() -> argparse.ArgumentParser:
    seconds = {name: f"{value:g}" for name, value in _DEFAULTS.items() if name.endswith("_seconds")}
    parser = argparse.ArgumentParser(prog="pdpair-router", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=_port, required=True, help="port to listen on, 0..65535 (0: kernel picks)")
    parser.add_argument("--prefill", action="append", default=None, metavar="URL",
                        help="prefill engine base URL, e.g. http://10.0.0.5:8000; repeat it for several prefills "
                             f"(required unless {ENV_PEERS_TOKEN} is set: then the set until the operator's push)")
    parser.add_argument("--decode", action="append", default=None, metavar="URL",
                        help=f"decode engine base URL; repeat it for several decodes (required unless {ENV_PEERS_TOKEN} "
                             "is set)")
    parser.add_argument(
        "--prefill-ready", action="append", default=None, metavar="URL",
        help="a prefill's own readiness URL (the operator gives its pod's /readyz), once per --prefill in the same "
             "order; the router's /readyz passes while one prefill and one decode pass theirs (default: each "
             "instance's URL + /health)")
    parser.add_argument(
        "--decode-ready", action="append", default=None, metavar="URL",
        help="a decode's own readiness URL, once per --decode in the same order (default: each instance's URL + "
             "/health)")
    parser.add_argument(
        "--prefill-kv-events", action="append", default=None, metavar="tcp://HOST:PORT",
        help="a prefill's KV events endpoint (its engine's --kv-events-config endpoint; the replay endpoint at PORT + "
             "1), once per --prefill in the same order: the prefill is chosen by the blocks it holds (with "
             "--prefix-affinity and --tokenizer) (default: none, the approximate index)")
    parser.add_argument(
        "--decode-kv-events", action="append", default=None, metavar="tcp://HOST:PORT",
        help="a decode's KV events endpoint, once per --decode in the same order (default: none)")
    parser.add_argument(
        "--kv-events-topic", default=_DEFAULTS["kv_events_topic"], metavar="TOPIC",
        help="the engines' --kv-events-config topic (default: empty, vLLM's)")
    parser.add_argument(
        "--tokenizer", default=_DEFAULTS["tokenizer"], metavar="PATH",
        help="the model's tokenizer (a directory, or a name loadable offline), for the prompt's token ids that "
             "the KV events are matched against (default: none)")
    parser.add_argument("--prefill-timeout", type=_seconds, default=_DEFAULTS["prefill_timeout_seconds"],
                        help=f"seconds for the prefill answer (default {seconds['prefill_timeout_seconds']})")
    parser.add_argument("--decode-timeout", type=_seconds, default=_DEFAULTS["decode_timeout_seconds"],
                        help=f"seconds for the whole decode answer (default {seconds['decode_timeout_seconds']})")
    parser.add_argument("--connect-timeout", type=_seconds, default=_DEFAULTS["connect_timeout_seconds"],
                        help=f"seconds to connect to either engine (default {seconds['connect_timeout_seconds']})")
    parser.add_argument(
        "--idle-connection-timeout", type=_seconds, default=_DEFAULTS["idle_connection_seconds"],
        help="seconds a kept-alive connection to an engine may idle and still be reused; keep it below the engines' "
             f"keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) (default {seconds['idle_connection_seconds']})")
    parser.add_argument(
        "--failure-cooldown", type=_seconds, default=_DEFAULTS["failure_cooldown_seconds"],
        help="seconds an instance that failed a request (refused, reset, 5xx, timeout) is not chosen while another "
             f"instance of its role is available (default {seconds['failure_cooldown_seconds']})")
    parser.add_argument(
        "--debug-routing", action="store_true", default=_DEFAULTS["debug_routing"],
        help="honour the request header X-Pdpair-Route: <prefill index>,<decode index> (0-based, in the order of "
             "the flags), which forces the instances; for tests of every combination (default off)")
    parser.add_argument(
        "--log-choices", action="store_true", default=_DEFAULTS["log_choices"],
        help="log one INFO line per request: its id, the chosen prefill and decode, the outstanding counts seen "
             "(default off)")
    parser.add_argument(
        "--local-prompt-tokens", type=_count, default=_DEFAULTS["local_prompt_tokens"], metavar="N",
        help="selective disaggregation: a prompt estimated shorter than N tokens goes to a decode instance alone "
             "(decode computes it, as a single engine would), and N then follows the router's measurements of both "
             "ways (pdpair.router.split); 0 splits every request and learns nothing (default "
             f"{_DEFAULTS['local_prompt_tokens']})")
    parser.add_argument(
        "--learn-split-threshold", action=argparse.BooleanOptionalAction,
        default=_DEFAULTS["learn_split_threshold"],
        help="let the --local-prompt-tokens threshold follow the router's measurements (exploring the other way once "
             "in a while); --no-learn-split-threshold keeps it fixed (default "
             f"{'on' if _DEFAULTS['learn_split_threshold'] else 'off'})")
    parser.add_argument(
        "--concurrent-legs", action=argparse.BooleanOptionalAction, default=_DEFAULTS["concurrent_legs"],
        help="send decode its request together with prefill's (decode allocates and pulls while prefill computes) "
             "instead of once prefill answered; a prefill is sent both legs at once after its first answer "
             f"(default {'on' if _DEFAULTS['concurrent_legs'] else 'off'}; --no-concurrent-legs: in sequence)")
    parser.add_argument(
        "--prefix-affinity", action=argparse.BooleanOptionalAction, default=_DEFAULTS["prefix_affinity"],
        help="send a prompt to the prefill this router sent its longest prefix to (so it pays only the uncached "
             "part), among the prefills within one request of the least loaded "
             f"(default {'on' if _DEFAULTS['prefix_affinity'] else 'off'})")
    parser.add_argument(
        "--max-body-bytes", type=_bytes, default=_DEFAULTS["max_body_bytes"],
        help="the largest request body accepted; a larger one is answered 413 before it is read (default "
             f"{_DEFAULTS['max_body_bytes']}, 4 MiB: a 128k-token prompt is under 1 MiB; raise it for inline images)")
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RouterConfig:
    """The config of these flags and of the environment (`environ`, default os.environ): PDPAIR_PEERS_TOKEN and
    VLLM_API_KEY, read here once."""
    environ = os.environ if environ is None else environ
    return RouterConfig(
        prefill_urls=tuple(args.prefill or ()), decode_urls=tuple(args.decode or ()),
        peers_token=environ.get(ENV_PEERS_TOKEN) or None, api_key=environ.get(ENV_API_KEY) or None,
        prefill_ready_urls=tuple(args.prefill_ready or ()), decode_ready_urls=tuple(args.decode_ready or ()),
        prefill_timeout_seconds=args.prefill_timeout, decode_timeout_seconds=args.decode_timeout,
        connect_timeout_seconds=args.connect_timeout, idle_connection_seconds=args.idle_connection_timeout,
        failure_cooldown_seconds=args.failure_cooldown, debug_routing=args.debug_routing, log_choices=args.log_choices,
        max_body_bytes=args.max_body_bytes, local_prompt_tokens=args.local_prompt_tokens,
        learn_split_threshold=args.learn_split_threshold,
        prefill_kv_events=tuple(args.prefill_kv_events or ()), decode_kv_events=tuple(args.decode_kv_events or ()),
        kv_events_topic=args.kv_events_topic, tokenizer=args.tokenizer,
        concurrent_legs=args.concurrent_legs, prefix_affinity=args.prefix_affinity,
    )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = make_app(config_from_args(args))
    except ValueError as exc:
        parser.error(str(exc))
    web.run_app(app, host=args.host, port=args.port, print=None, loop=_event_loop())


def _event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (the engine image has it: vLLM's API server runs on it), else
    asyncio's: every request's hop through the router is a few callbacks on this loop, and uvloop runs them faster."""
    try:
        import uvloop
    except ImportError:
        logging.getLogger("pdpair.router").info("event loop: asyncio (uvloop is not installed)")
        return asyncio.new_event_loop()
    logging.getLogger("pdpair.router").info("event loop: uvloop %s", uvloop.__version__)
    return uvloop.new_event_loop()


if __name__ == "__main__":
    main()
