"""Spellings of spec.<role>.args for the owned-flag guard (pdpair.operator.build.engine_args), shared by two tests:
tests/unit/operator/test_engine_args.py runs them through vLLM's real argument parser, and
tests/e2e/test_crd_validation.py through the real kube-apiserver. Pure data: no vllm import.

In every spelling here the first entry is the one that matters (the flag); later entries are its value.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

from pdpair.operator.build.engine_args import OWNED_FLAGS, OwnedFlag


class Spelling(NamedTuple):
    id: str
    args: tuple[str, ...]


KV_EVIL = '{"kv_connector":"EvilConnector","kv_role":"kv_both"}'
# Relative: the unit test writes this file in its working directory (a YAML of flags, see CONFIG_FILE_TEXT).
CONFIG_FILE = "pdpair-test-vllm-config.yaml"
CONFIG_FILE_TEXT = "kv-transfer-config.kv_role: kv_both\nport: 9999\n"

# Each was accepted by the old CRD and changed the engine as vLLM read it.
ISSUE_SPELLINGS: tuple[Spelling, ...] = (
    Spelling("issue-por", ("--por=9999",)),
    Spelling("issue-tensor-parallel", ("--tensor-parallel=4",)),
    Spelling("issue-kv-transfer-conf", ("--kv-transfer-conf", KV_EVIL)),
    Spelling("issue-kv-transfer-config-dotted", ("--kv-transfer-config.kv_role=kv_both",)),
    Spelling("issue-served-model", ("--served-model=evil",)),
    Spelling("issue-pipeline-parallel", ("--pipeline-parallel=2",)),
)

# More refused spellings, written out (the generated ones below cover every prefix systematically).
MORE_OWNED_SPELLINGS: tuple[Spelling, ...] = (
    Spelling("port-space", ("--port", "9999")),
    Spelling("port-equals", ("--port=9999",)),
    Spelling("port-prefix-space", ("--por", "9999")),
    Spelling("port-ambiguous-prefix", ("--po", "9999")),
    Spelling("host-prefix", ("--ho=127.0.0.1",)),
    Spelling("host-dotted", ("--host.x=127.0.0.1",)),
    Spelling("uds", ("--uds", "/tmp/evil.sock")),
    Spelling("uds-prefix", ("--ud=/tmp/evil.sock",)),
    Spelling("model-space", ("--model", "evil/model")),
    Spelling("model-dotted", ("--model.revision=main",)),
    Spelling("model-ambiguous-prefix", ("--mod=evil/model",)),
    Spelling("served-model-name-underscores", ("--served_model_name", "evil")),
    Spelling("served-model-name-dotted", ("--served-model-name.x=evil",)),
    Spelling("served-model-name-short-prefix", ("--serv=evil",)),
    Spelling("tp-underscores", ("--tensor_parallel_size=4",)),
    Spelling("tp-underscore-prefix", ("--tensor_parallel=4",)),
    Spelling("tp-short-prefix", ("--tens", "4")),
    Spelling("tp-alias", ("-tp", "4")),
    Spelling("tp-alias-equals", ("-tp=4",)),
    Spelling("tp-alias-prefix", ("-t", "4")),
    Spelling("tp-alias-dotted", ("-tp.x=1",)),
    Spelling("kv-space", ("--kv-transfer-config", KV_EVIL)),
    Spelling("kv-underscores-equals", ("--kv_transfer_config=" + KV_EVIL,)),
    Spelling("kv-dotted-space", ("--kv-transfer-config.kv_role", "kv_both")),
    Spelling("kv-prefix-dotted", ("--kv-transfer-conf.kv_connector=EvilConnector",)),
    Spelling("kv-underscores-dotted-deep", ("--kv_transfer_config.kv_connector_extra_config.x=1",)),
    Spelling("kv-short-prefix", ("--kv-t", KV_EVIL)),
    Spelling("pp-space", ("--pipeline-parallel-size", "2")),
    Spelling("pp-alias", ("-pp", "2")),
    Spelling("pp-underscores", ("--pipeline_parallel_size=2",)),
    Spelling("pp-short-prefix", ("--pi=2",)),
    Spelling("pcp", ("--prefill-context-parallel-size", "2")),
    Spelling("pcp-alias", ("-pcp", "2")),
    Spelling("pcp-alias-prefix", ("-pc", "2")),
    Spelling("pcp-prefix", ("--prefill-context=2",)),
    Spelling("dp-space", ("--data-parallel-size", "2")),
    Spelling("dp-alias-equals", ("-dp=2",)),
    Spelling("dp-underscores", ("--data_parallel_size=2",)),
    Spelling("dp-ambiguous-prefix", ("--data-parallel=2",)),
    Spelling("config-file", ("--config", CONFIG_FILE)),
    Spelling("config-equals", ("--config=" + CONFIG_FILE,)),
    Spelling("config-ambiguous-prefix", ("--conf", CONFIG_FILE)),
    Spelling("end-of-options", ("--",)),
    Spelling("end-of-options-then-positional", ("--", "evil/model")),
    Spelling("p-ambiguous", ("--p=1",)),
    Spelling("alias-p-ambiguous", ("-p", "2")),
)

OWNED_SPELLINGS = ISSUE_SPELLINGS + MORE_OWNED_SPELLINGS

# Accepted: real vLLM options (parsed without error), lookalikes of owned names, non-owned dotted keys.
BENIGN_SPELLINGS: tuple[Spelling, ...] = (
    Spelling("max-model-len", ("--max-model-len", "512")),
    Spelling("max-model-len-equals", ("--max-model-len=512",)),
    Spelling("dtype", ("--dtype", "float32")),
    Spelling("enforce-eager", ("--enforce-eager",)),
    Spelling("model-impl", ("--model-impl", "vllm")),
    Spelling("model-loader-extra-config-underscores", ("--model_loader_extra_config={}",)),
    Spelling("tokenizer", ("--tokenizer", "/models/tok")),
    Spelling("dp-backend", ("--data-parallel-backend", "mp")),
    Spelling("dp-backend-alias", ("-dpb", "mp")),
    Spelling("dp-size-local", ("--data-parallel-size-local", "1")),
    Spelling("dcp", ("-dcp", "1")),
    Spelling("expert-parallel", ("--enable-expert-parallel",)),
    Spelling("expert-parallel-alias", ("-ep",)),
    Spelling("kv-cache-dtype", ("--kv-cache-dtype", "auto")),
    Spelling("hf-overrides-dotted", ("--hf-overrides.foo=1",)),
    Spelling("hf-overrides-dotted-space", ("--hf-overrides.foo", "1")),
    Spelling("config-format", ("--config-format", "auto")),
    Spelling("root-path", ("--root-path", "/v1x")),
    Spelling("no-prefix-caching", ("--no-enable-prefix-caching",)),
    Spelling("uvicorn-log-level", ("--uvicorn-log-level", "info")),
    Spelling("optimization-level", ("-O0",)),
    Spelling("seed", ("--seed", "0")),
    Spelling("gpu-memory-utilization", ("--gpu-memory-utilization", ".5")),
    Spelling("max-num-seqs-underscores", ("--max_num_seqs", "8")),
    # A positional is vLLM's model_tag, which `python -m vllm.entrypoints.openai.api_server` ignores.
    Spelling("positional", ("other/model",)),
)

# The last entry is a dotted key without '=': vLLM takes the next entry (the operator's first flag) as its value.
TRAILING_DOTTED_SPELLINGS: tuple[Spelling, ...] = (
    Spelling("trailing-dotted-key", ("--hf-overrides.foo",)),
    Spelling("trailing-dotted-key-after-others", ("--max-model-len", "512", "--hf-overrides.foo")),
    Spelling("trailing-negative-float", ("--seed", "-0.5")),
)

# Sample values vLLM accepts for each owned dest (so an override shows as a changed setting, not a parse error).
SAMPLE_VALUES = {
    "model": "evil/model",
    "served_model_name": "evil",
    "host": "127.0.0.1",
    "uds": "/tmp/evil.sock",
    "port": "9999",
    "tensor_parallel_size": "4",
    "pipeline_parallel_size": "2",
    "prefill_context_parallel_size": "2",
    "data_parallel_size": "2",
    "kv_transfer_config": KV_EVIL,
    "config": CONFIG_FILE,
}


def _spellings_of(flag: OwnedFlag, option: str) -> Iterator[Spelling]:
    value = SAMPLE_VALUES[flag.dest]
    dashes = "--" if option.startswith("--") else "-"
    name = option[len(dashes):]
    for end in range(1, len(name) + 1):
        prefix = dashes + name[:end]
        yield Spelling(f"{flag.dest}:{prefix}=", (f"{prefix}={value}",))
        yield Spelling(f"{flag.dest}:{prefix} value", (prefix, value))
        yield Spelling(f"{flag.dest}:{prefix}.key=", (f"{prefix}.key={value}",))
        yield Spelling(f"{flag.dest}:{prefix}.key value", (f"{prefix}.key", value))
        if dashes == "--" and "-" in prefix[2:]:
            yield Spelling(f"{flag.dest}:{prefix} underscores=", ("--" + prefix[2:].replace("-", "_") + f"={value}",))


def generated_owned_spellings() -> tuple[Spelling, ...]:
    """Every non-empty prefix of every owned option string and alias, each as --p=V, --p V, --p.key=V, --p.key V and
    (for dashed names) with underscores."""
    return tuple(spelling for flag in OWNED_FLAGS for option in (flag.option, *flag.aliases)
                 for spelling in _spellings_of(flag, option))


def lookalike_spellings() -> tuple[Spelling, ...]:
    """Longer names that start with an owned name (not prefixes of one): never refused. vLLM itself may not know them;
    that is the engine's error to report, not admission's."""
    out = []
    for flag in OWNED_FLAGS:
        for option in (flag.option, *flag.aliases):
            for tail in ("x", "-x", "_x", "s=1"):
                out.append(Spelling(f"{option}{tail}", (f"{option}{tail}",)))
    return tuple(out)


# The kubelet expands $(NAME) from the container's env after admission; `$$` is a literal `$`.
ENV_REFERENCE_SPELLINGS: tuple[Spelling, ...] = (
    Spelling("env-reference-as-flag", ("$(EXTRA_FLAG)",)),
    Spelling("env-reference-as-value", ("--api-key", "$(API_KEY)")),
    Spelling("env-reference-after-equals", ("--api-key=$(API_KEY)",)),
    Spelling("env-reference-after-literal-dollar", ("$$$(EXTRA_FLAG)",)),
)
LITERAL_DOLLAR_SPELLINGS: tuple[Spelling, ...] = (
    Spelling("escaped-env-reference", ("--api-key", "$$(API_KEY)")),
    Spelling("dollar-without-parenthesis", ("--api-key", "pa$word")),
    Spelling("dollar-brace", ("--api-key", "${API_KEY}")),
)
