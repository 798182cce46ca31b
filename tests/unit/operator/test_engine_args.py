"""The owned-flag guard against vLLM's REAL argument parser (vllm.entrypoints.launchers.cli_args.make_arg_parser on a
FlexibleArgumentParser, as `python -m vllm.entrypoints.openai.api_server` builds it; no model is loaded).

For every spelling in tests/engine_args_corpus.py:
- refused by the CRD's args rule => on the old command (user args last) vLLM either reads a different owned setting
  or refuses the command line;
- accepted => vLLM reads the same owned settings, in the old order and the new one;
- the new order (engine_command: operator flags last) keeps every owned setting, except for the spellings that no
  order can beat (dotted keys, --config), which only admission stops.

The CRD regex is taken from the chart's CRD file and run with Python's re (RE2's `$` is Python's `\\Z`; nothing else in
it differs). The authoritative check of the CRD is tests/e2e/test_crd_validation.py, on a real kube-apiserver, with
the same corpus.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import pytest
import yaml

from pdpair.contract import ENV_HTTP_PORT, ROLE_DECODE
from pdpair.operator.build import engine_args
from pdpair.operator.build.engine_args import OWNED_FLAGS, OWNED_OPTION_STRINGS
from pdpair.operator.build.pods import ENGINE_ENTRYPOINT, engine_command, owned_engine_flags
from tests.engine_args_corpus import (
    BENIGN_SPELLINGS,
    CONFIG_FILE,
    CONFIG_FILE_TEXT,
    ENV_REFERENCE_SPELLINGS,
    ISSUE_SPELLINGS,
    LITERAL_DOLLAR_SPELLINGS,
    OWNED_SPELLINGS,
    TRAILING_DOTTED_SPELLINGS,
    Spelling,
    generated_owned_spellings,
    lookalike_spellings,
)

REPO = Path(__file__).resolve().parents[3]
CRD_PATH = REPO / "charts" / "pdpair" / "crds" / "inferencepairs.pdpair.io.yaml"
HTTP_PORT = "20001"  # what the kubelet puts for $(PDPAIR_HTTP_PORT)
SPEC = {"model": "/models/tiny", "servedModelName": "tiny", "image": "img:1",
        ROLE_DECODE: {"tensorParallelSize": 2}}


class Failed(NamedTuple):
    """vLLM refused the command line (argparse exit or an error in its own pre-processing)."""
    reason: str


def old_engine_command(spec: Mapping[str, Any], role: str) -> list[str]:
    """engine_command before the operator owned its flags, kept verbatim to show what user args could override: the user's args last."""
    role_spec = spec.get(role) or {}
    kv_config = {
        "kv_connector": "PdPairConnector",
        "kv_connector_module_path": "pdpair.connector",
        "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}[role],
    }
    cmd = [
        "python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec["model"],
        "--port", f"$({ENV_HTTP_PORT})",
        "--tensor-parallel-size", str(int(role_spec.get("tensorParallelSize", 1))),
        "--kv-transfer-config", json.dumps(kv_config, separators=(",", ":")),
    ]
    if spec.get("servedModelName"):
        cmd += ["--served-model-name", spec["servedModelName"]]
    cmd += [str(a) for a in role_spec.get("args") or []]
    return cmd


def new_engine_command(spec: Mapping[str, Any], role: str) -> list[str]:
    """engine_command's order without its own refusal (which the CRD's rules mirror), so refused args can be parsed."""
    return [*ENGINE_ENTRYPOINT, *(spec[role].get("args") or []), *owned_engine_flags(spec, role)]


def with_args(args: tuple[str, ...]) -> dict[str, Any]:
    return {**SPEC, ROLE_DECODE: {**SPEC[ROLE_DECODE], "args": list(args)}}


def argv(command: list[str]) -> list[str]:
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    return [HTTP_PORT if a == f"$({ENV_HTTP_PORT})" else a for a in command[3:]]


@pytest.fixture(scope="module")
def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm.entrypoints.openai.api_server"))


@pytest.fixture(scope="module")
def engine_reads(vllm_parser, tmp_path_factory):
    """argv -> the owned settings vLLM reads (engine args where the engine has them, else the CLI namespace)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    workdir = tmp_path_factory.mktemp("vllm-cwd")
    (workdir / CONFIG_FILE).write_text(CONFIG_FILE_TEXT)

    def read(args: list[str]) -> dict[str, Any] | Failed:
        err = io.StringIO()
        with contextlib.chdir(workdir), contextlib.redirect_stderr(err):
            try:
                namespace = vllm_parser.parse_args(list(args))
            except SystemExit:
                return Failed((err.getvalue().strip().splitlines() or ["argparse exit"])[-1])
            except Exception as exc:  # vLLM's pre-processing: IndexError on a trailing dotted key, bad config file
                return Failed(repr(exc))
        engine = AsyncEngineArgs.from_cli_args(namespace)
        settings: dict[str, Any] = {}
        for flag in OWNED_FLAGS:
            value = getattr(engine, flag.dest) if hasattr(engine, flag.dest) else getattr(namespace, flag.dest)
            if flag.dest == "kv_transfer_config" and value is not None:
                value = {k: v for k, v in vars(value).items() if k != "engine_id"}  # engine_id: a fresh uuid each time
            settings[flag.dest] = value
        return settings

    return read


@pytest.fixture(scope="module")
def baseline(engine_reads) -> dict[str, Any]:
    settings = engine_reads(argv(engine_command(SPEC, ROLE_DECODE)))
    assert not isinstance(settings, Failed), settings
    return settings


@pytest.fixture(scope="module")
def crd_refuses():
    """args -> True when the CRD's args rules refuse them: the two item regexes from the CRD file, and the last-entry
    rule through its Python twin engine_args.takes_next_entry."""
    crd = yaml.load(CRD_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 7,700 lines
    args_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        ROLE_DECODE]["properties"]["args"]
    owned_rule, env_rule = args_schema["items"]["x-kubernetes-validations"]
    regex = re.fullmatch(r"!self\.matches\('(.*)'\)", owned_rule["rule"]).group(1)
    assert regex.count("$") == 1
    owned = re.compile(regex.replace("$", r"\Z"))
    env_reference = re.compile(re.fullmatch(r"!self\.matches\('(.*)'\)", env_rule["rule"]).group(1))

    def refuses(args: tuple[str, ...]) -> bool:
        return (any(owned.search(a) or env_reference.search(a) for a in args)
                or (bool(args) and engine_args.takes_next_entry(args[-1])))

    return refuses


def changed(settings: dict[str, Any] | Failed, baseline: dict[str, Any]) -> set[str]:
    return set() if isinstance(settings, Failed) else {k for k, v in settings.items() if v != baseline[k]}


def is_dotted_or_config(spelling: Spelling) -> bool:
    flag = spelling.args[0]
    key = flag.split("=", 1)[0]
    return "." in key or key.replace("_", "-").lstrip("-") in {"config"[:n] for n in range(1, 7)}


# --- the owned set is vLLM's ------------------------------------------------------------------------------------

def test_owned_flags_are_all_of_vllms_option_strings_for_their_dests(vllm_parser):
    by_dest: dict[str, set[str]] = {}
    for action in vllm_parser._actions:
        by_dest.setdefault(action.dest, set()).update(action.option_strings)
    for flag in OWNED_FLAGS:
        assert by_dest.get(flag.dest) == {flag.option, *flag.aliases}, flag


def test_the_rule_catches_no_real_option_that_is_not_owned(vllm_parser, crd_refuses):
    others = sorted(set(vllm_parser._option_string_actions) - set(OWNED_OPTION_STRINGS))
    assert len(others) > 300  # the parser really is vLLM's
    spellings = [(o,) for o in others] + [(f"{o}=1",) for o in others]
    spellings += [(f"{o}.key=1",) for o in others if o.startswith("--")]
    spellings += [("--" + o[2:].replace("-", "_"),) for o in others if o.startswith("--")]
    assert [s for s in spellings if crd_refuses(s)] == []


def test_lookalikes_of_owned_names_are_not_refused(crd_refuses):
    lookalikes = lookalike_spellings()
    assert len(lookalikes) >= 4 * len(OWNED_OPTION_STRINGS)
    assert [s.id for s in lookalikes if crd_refuses(s.args)] == []


def test_engine_command_puts_every_pinned_owned_flag_after_the_user_args(vllm_parser):
    user = ("--max-model-len", "512", "--enforce-eager")
    command = argv(engine_command(with_args(user), ROLE_DECODE))
    assert command == argv(new_engine_command(with_args(user), ROLE_DECODE))
    assert tuple(command[:len(user)]) == user
    owned = command[len(user):]
    flags = [a for a in owned if a.startswith("--")]
    assert flags == [f.option for f in OWNED_FLAGS if f.pinned]


def test_new_command_reads_as_the_old_one_without_user_args(engine_reads, baseline):
    # Pinning host, uds, pp, pcp, dp and the served name to their defaults changes nothing vLLM reads.
    assert engine_reads(argv(old_engine_command(SPEC, ROLE_DECODE))) == baseline
    assert baseline["tensor_parallel_size"] == 2 and baseline["port"] == int(HTTP_PORT)
    assert baseline["kv_transfer_config"]["kv_role"] == "kv_consumer"


# --- regression: the issue's spellings --------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ISSUE_SPELLINGS, ids=[s.id for s in ISSUE_SPELLINGS])
def test_issue_spelling_overrode_the_old_command_and_is_refused(spelling, engine_reads, baseline, crd_refuses):
    old = engine_reads(argv(old_engine_command(with_args(spelling.args), ROLE_DECODE)))
    assert not isinstance(old, Failed), old
    assert changed(old, baseline), f"{spelling.args} did not change an owned setting on the old command"
    assert crd_refuses(spelling.args)


# --- every refused spelling matters; every accepted one is harmless -----------------------------------------------

def test_every_refused_spelling_overrides_or_breaks_the_old_command(engine_reads, baseline, crd_refuses):
    generated = generated_owned_spellings()
    assert len(generated) > 500
    not_refused, harmless = [], []
    overridden: set[str] = set()
    for spelling in OWNED_SPELLINGS + generated:
        if not crd_refuses(spelling.args):
            not_refused.append(spelling.id)
            continue
        old = engine_reads(argv(old_engine_command(with_args(spelling.args), ROLE_DECODE)))
        new = engine_reads(argv(new_engine_command(with_args(spelling.args), ROLE_DECODE)))
        # `--` is harmless at the end (old order) but turns the operator's flags into positionals in the new one.
        if isinstance(old, Failed) or isinstance(new, Failed) or changed(old, baseline) or changed(new, baseline):
            overridden |= changed(old, baseline)
        else:
            harmless.append(spelling.id)
    assert not_refused == []
    assert harmless == []
    # every owned flag could be overridden through args on the old command
    assert overridden == {f.dest for f in OWNED_FLAGS}


def test_new_order_keeps_owned_settings_except_for_dotted_keys_and_config(engine_reads, baseline):
    beaten_anyway = []
    for spelling in OWNED_SPELLINGS + generated_owned_spellings():
        new = engine_reads(argv(new_engine_command(with_args(spelling.args), ROLE_DECODE)))
        if changed(new, baseline):
            beaten_anyway.append(spelling)
    # Only spellings no order can beat change an owned setting now; admission (the CRD) is what stops them.
    assert [s.id for s in beaten_anyway if not is_dotted_or_config(s)] == []
    ids = {s.id for s in beaten_anyway}
    assert {"issue-kv-transfer-config-dotted", "config-file", "model-dotted"} <= ids


@pytest.mark.parametrize("spelling", BENIGN_SPELLINGS, ids=[s.id for s in BENIGN_SPELLINGS])
def test_benign_spelling_is_accepted_and_keeps_owned_settings(spelling, engine_reads, baseline, crd_refuses):
    assert not crd_refuses(spelling.args)
    settings = engine_reads(argv(engine_command(with_args(spelling.args), ROLE_DECODE)))
    assert not isinstance(settings, Failed), settings
    assert changed(settings, baseline) == set()


def test_a_positional_joined_the_served_names_on_the_old_command(engine_reads, baseline):
    # --served-model-name takes one or more values, and the old command ended with it: a bare user arg joined it.
    # No admission rule can tell a positional from a flag's value; the new order ends with a one-value flag.
    old = engine_reads(argv(old_engine_command(with_args(("other/model",)), ROLE_DECODE)))
    assert old["served_model_name"] == ["tiny", "other/model"]
    new = engine_reads(argv(engine_command(with_args(("other/model",)), ROLE_DECODE)))
    assert new == baseline


@pytest.mark.parametrize("spelling", TRAILING_DOTTED_SPELLINGS, ids=[s.id for s in TRAILING_DOTTED_SPELLINGS])
def test_trailing_dotted_key_would_eat_the_operators_first_flag_and_is_refused(spelling, engine_reads, baseline,
                                                                              crd_refuses):
    assert crd_refuses(spelling.args)
    assert not crd_refuses(spelling.args[:-1] + (spelling.args[-1] + "=1",))  # with its value it is fine
    new = engine_reads(argv(new_engine_command(with_args(spelling.args), ROLE_DECODE)))
    assert isinstance(new, Failed) or changed(new, baseline), new


def test_trailing_dotted_key_silently_drops_the_model_in_the_new_order(engine_reads, baseline):
    new = engine_reads(argv(new_engine_command(with_args(("--hf-overrides.foo",)), ROLE_DECODE)))
    assert changed(new, baseline) == {"model"}  # vLLM's default model instead of spec.model: why the rule exists


def test_env_references_are_refused_and_literal_dollars_are_not(crd_refuses):
    # The kubelet's expansion is not run here; tests/e2e/test_crd_validation.py checks the rule on the apiserver.
    assert [s.id for s in ENV_REFERENCE_SPELLINGS if not crd_refuses(s.args)] == []
    assert [s.id for s in LITERAL_DOLLAR_SPELLINGS if crd_refuses(s.args)] == []


def test_the_operators_own_check_agrees_with_the_crd_on_the_whole_corpus(crd_refuses):
    """engine_command refuses what an older CRD admitted; it must refuse exactly what the current CRD refuses."""
    corpus = [*OWNED_SPELLINGS, *generated_owned_spellings(), *BENIGN_SPELLINGS, *lookalike_spellings(),
              *TRAILING_DOTTED_SPELLINGS, *ENV_REFERENCE_SPELLINGS, *LITERAL_DOLLAR_SPELLINGS]
    disagree = [s.id for s in corpus if bool(engine_args.refused_args(s.args)) != crd_refuses(s.args)]
    assert disagree == []
    assert sum(bool(engine_args.refused_args(s.args)) for s in corpus) > 500
