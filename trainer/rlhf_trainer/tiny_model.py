"""The tiny models every bootstrap recipe starts from, and the tests too: a character-level
tokenizer over printable ASCII and a randomly initialised tiny Llama sized for it. Nothing is
downloaded. The recipes that warm them up on a task are `bootstrap` (tiny-arithmetic) and
`tiny_calculator` (tiny-calculator)."""

from __future__ import annotations

from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
#: A minimal chat template so that `data.chatTemplate: true` works with bootstrapped tokenizers:
#: message contents joined by newlines, no role markers (the tiny model never saw any).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
)


def build_char_tokenizer() -> Any:
    """A character-level `PreTrainedTokenizerFast` over newline and printable ASCII (ids 0-3: pad,
    bos, eos, unk; anything else is unk)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3}
    for char in ["\n", *map(chr, range(32, 127))]:
        vocab[char] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()  # join characters back without spaces
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=512,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    max_positions: int = 128,
    seed: int = 0,
) -> Any:
    """A randomly initialised tiny Llama causal LM sized for `tokenizer` (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
