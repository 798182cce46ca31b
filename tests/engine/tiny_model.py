"""Build a tiny random Llama model plus tokenizer into a folder vLLM can load (no hub download).

hidden 64, 2 layers, 2 heads (head_dim 32: the CPU attention backend rejects 16), vocab 1000, float32, safetensors.
The weights are seeded, so every build is identical; the init scale is raised so greedy decoding has clear argmax
margins and two engines agree token for token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 1000
SEED = 1234
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the prompt, decode generates the answer.",
    "Kubernetes runs pods; an operator watches custom resources.",
    "KV caches are moved between engines with one-sided puts and signals.",
    "Hello world! 0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_model(target: Path, layers: int = 2) -> Path:
    """Write config, weights and tokenizer into `target` (created); returns `target`. `layers`: the benchmarks build
    deeper variants (layer-wise puts need layers to overlap); every test uses 2."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer(target)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(target, safe_serialization=True)
    # vLLM reads generation_config; keep it neutral so sampling params come only from requests.
    (target / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
    )
    return target


def build_tiny_tokenizer(target: Path):
    """Write the tiny model's tokenizer (and chat template) into `target` (created); returns it (a router test needs
    only this: a second, not the model's weights)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    target.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    # Pad to exactly the model's vocab so every id the model can emit decodes.
    missing = VOCAB_SIZE - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(missing)])
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target)
    return tokenizer


if __name__ == "__main__":
    print(build_tiny_model(Path(sys.argv[1])))
