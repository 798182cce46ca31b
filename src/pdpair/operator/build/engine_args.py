"""The vLLM flags the operator owns, and the CRD rules that keep every spelling of them out of spec.<role>.args.

vLLM's FlexibleArgumentParser reads much more than the flag as written, so refusing exact names is not enough:
- argparse abbreviations: a prefix that matches one option is that option (`--por=9999` is `--port`, `-t 4` is `-tp`);
- underscores for dashes in the name (`--tensor_parallel_size`);
- dotted keys: `--flag.key=value` (or `--flag.key value`) becomes `--flag '{"key": value}'`, appended after every other
  argument, so it wins whatever the order (`--kv-transfer-config.kv_role=kv_both`);
- `--config FILE` reads flags, dotted keys included, from a YAML file that admission never sees.

Three guards, checked against vLLM's real parser by tests/unit/operator/test_engine_args.py:
1. engine_command (pods.py) puts the operator's flags after the user's args, and passes every pinnable owned flag,
   so for a plain repeated flag argparse keeps ours.
2. The CRD refuses, per args entry, any `--x`, `--x=...` or `--x.key...` where x is a non-empty prefix of an owned
   option name (dashes or underscores), the same for the short aliases, and a bare `--` (it would turn our flags into
   positionals). Refusing every prefix, not just the unambiguous ones, keeps the rule independent of which other
   options a vLLM version has; the test checks no real non-owned option is caught. A second rule refuses args whose
   last entry is a dotted key without `=`: vLLM takes the next entry as its value, and the next entry is our first flag.
   A third refuses `$(NAME)` references in args: the kubelet expands them after admission.
3. refused_args: the same rules in Python, applied by engine_command when it builds a pod, for specs that a
   CRD older than the operator admitted (Helm never upgrades CRDs).

tests/unit/test_crd_contract.py checks that the CRD holds exactly these rules and messages;
`python -m pdpair.operator.build.engine_args` prints them for pasting into the CRD.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class OwnedFlag:
    option: str                    # vLLM's long option string
    dest: str                      # its argparse dest in vLLM
    why: str                       # where the value comes from, or why a pair cannot change it
    aliases: tuple[str, ...] = ()  # vLLM's other option strings for the same dest (short forms)
    pinned: bool = True            # engine_command passes it after the user's args


OWNED_FLAGS: tuple[OwnedFlag, ...] = (
    OwnedFlag("--model", "model", "spec.model"),
    OwnedFlag("--served-model-name", "served_model_name", "spec.servedModelName (defaults to spec.model)"),
    OwnedFlag("--host", "host", "the operator probes and routes to the pod IP, so the engine listens on all addresses"),
    OwnedFlag("--uds", "uds", "a unix socket would replace the leased HTTP port"),
    OwnedFlag("--port", "port", "the leased HTTP port"),
    OwnedFlag("--tensor-parallel-size", "tensor_parallel_size", "spec.<role>.tensorParallelSize", aliases=("-tp",)),
    OwnedFlag("--pipeline-parallel-size", "pipeline_parallel_size",
              "side-channel ports are leased per tensor-parallel rank; more workers would share them",
              aliases=("-pp",)),
    OwnedFlag("--prefill-context-parallel-size", "prefill_context_parallel_size",
              "adds workers, like pipeline parallelism", aliases=("-pcp",)),
    OwnedFlag("--data-parallel-size", "data_parallel_size", "adds engine cores, like pipeline parallelism",
              aliases=("-dp",)),
    OwnedFlag("--kv-transfer-config", "kv_transfer_config", "the pdpair connector, from spec.connector"),
    OwnedFlag("--config", "config", "a YAML file of flags admission cannot see", pinned=False),
)

OWNED_OPTION_STRINGS: tuple[str, ...] = tuple(s for f in OWNED_FLAGS for s in (f.option, *f.aliases))


def _prefixes(name: str) -> str:
    """RE2 matching any non-empty prefix of name, a dash also spelled as an underscore: p(?:o(?:r(?:t)?)?)?"""
    pattern = ""
    for ch in reversed(name):
        atom = "[-_]" if ch == "-" else ch
        pattern = f"{atom}(?:{pattern})?" if pattern else atom
    return pattern


def owned_arg_pattern() -> str:
    """One args entry that vLLM reads as an owned flag (or that ends option parsing); RE2 and Python re alike,
    except that RE2's `$` is Python's `\\Z`."""
    longs = "|".join(_prefixes(f.option[2:]) for f in OWNED_FLAGS)
    shorts = "|".join(_prefixes(a[1:]) for f in OWNED_FLAGS for a in f.aliases)
    # `--(?:...)?`: a bare `--` (or `--=x`, `--.x`) is refused too.
    return f"^(?:--(?:{longs})?|-(?:{shorts}))(?:[.=]|$)"


def _flag_list() -> str:
    return ", ".join("/".join((f.option, *f.aliases)) for f in OWNED_FLAGS) + " and a bare --"


ARG_RULE = f"!self.matches('{owned_arg_pattern()}')"
ARG_MESSAGE = (
    "args must not contain an operator-owned vLLM flag in any spelling vLLM reads as one (a prefix of the name, "
    f"underscores for dashes, a --flag.key dotted key, a short alias): {_flag_list()}"
)
ARG_MESSAGE_EXPRESSION = (
    "'args entry ' + self + ' is an operator-owned flag as vLLM reads it (prefixes, underscores, --flag.key dotted "
    f"keys and short aliases count): {_flag_list()}. Set spec.model, spec.servedModelName, "
    "spec.<role>.tensorParallelSize or spec.connector instead; ports, listen address and parallel layout are fixed'"
)

# vLLM's FlexibleArgumentParser: an entry that starts with '-' and holds a '.' but no '=' is a dotted key whose value
# is the next entry.
LAST_ARG_RULE = (
    "self.size() == 0 || !(self[self.size() - 1].startsWith('-') && self[self.size() - 1].contains('.') "
    "&& !self[self.size() - 1].contains('='))"
)
LAST_ARG_MESSAGE = (
    "args must not end with a dotted key without '=' (such as --hf-overrides.key): vLLM would take the operator's "
    "first flag, which follows args, as its value; write --flag.key=value"
)

# The kubelet expands $(NAME) in a container's command from the container's env after admission (`$$` is a literal
# `$`), and the user's env values are free: an unescaped reference could carry any flag past ARG_RULE.
ENV_REFERENCE_PATTERN = "(^|[^$])([$][$])*[$][(]"
ENV_REFERENCE_RULE = f"!self.matches('{ENV_REFERENCE_PATTERN}')"
ENV_REFERENCE_MESSAGE = (
    "args entries must not reference an environment variable as $(NAME): the kubelet expands it after admission, so "
    "it could carry an operator-owned flag; write $$(NAME) for a literal $(NAME)"
)
ENV_REFERENCE_MESSAGE_EXPRESSION = (
    "'args entry ' + self + ' references an environment variable as $(NAME): the kubelet expands it after "
    "admission, so it could carry an operator-owned flag; write $$(NAME) for a literal $(NAME)'"
)


def takes_next_entry(arg: str) -> bool:
    """True for an entry vLLM reads as a dotted key whose value is the next entry (LAST_ARG_RULE in Python)."""
    return arg.startswith("-") and "." in arg and "=" not in arg


_OWNED_ARG = re.compile(owned_arg_pattern().replace("$", r"\Z"))  # RE2's `$` is Python's `\Z`
_ENV_REFERENCE = re.compile(ENV_REFERENCE_PATTERN)


def refused_args(args: Sequence[str]) -> list[str]:
    """The CRD's three args rules in Python (same patterns), for specs an older CRD admitted: Helm never upgrades
    CRDs. Empty when the CRD would accept args."""
    problems = [f"args[{i}] {arg!r} is an operator-owned flag as vLLM reads it" for i, arg in enumerate(args)
                if _OWNED_ARG.search(arg)]
    problems += [f"args[{i}] {arg!r} references an environment variable as $(NAME)" for i, arg in enumerate(args)
                 if _ENV_REFERENCE.search(arg)]
    if args and takes_next_entry(args[-1]):
        problems.append(f"args ends with the dotted key {args[-1]!r} without '=' (vLLM would take our first flag)")
    return problems


def crd_fragment() -> str:
    """The args rules as they sit in the CRD (JSON strings are valid YAML scalars)."""
    return (
        "args:\n"
        "  x-kubernetes-validations:\n"
        f"    - rule: {json.dumps(LAST_ARG_RULE)}\n"
        f"      message: {json.dumps(LAST_ARG_MESSAGE)}\n"
        "  items:\n"
        "    x-kubernetes-validations:\n"
        f"      - rule: {json.dumps(ARG_RULE)}\n"
        f"        messageExpression: {json.dumps(ARG_MESSAGE_EXPRESSION)}\n"
        f"        message: {json.dumps(ARG_MESSAGE)}\n"
        f"      - rule: {json.dumps(ENV_REFERENCE_RULE)}\n"
        f"        messageExpression: {json.dumps(ENV_REFERENCE_MESSAGE_EXPRESSION)}\n"
        f"        message: {json.dumps(ENV_REFERENCE_MESSAGE)}\n"
    )


if __name__ == "__main__":
    print(crd_fragment(), end="")
