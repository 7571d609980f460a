"""The tokenizer of the bundled sample: a byte-level BPE trained on its train split (digits one per token, distinct
pad / bos / eos, a ChatML-like chat template), so the recipe and the tests need no download."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    pass

from .sample import embedded_split_size, make_arithmetic_sample

EMBEDDED_SPECIAL_TOKENS = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|im_end|>", "im_start": "<|im_start|>"}
EMBEDDED_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_embedded_tokenizer(vocab_size: int = 512, num_samples: int = 4000, seed: int = 0):
    """A byte-level BPE tokenizer trained on the bundled sample's train split, as a `PreTrainedTokenizerFast`.

    Digits are split one per token (as Qwen's tokenizer does) so numbers are spelled, not memorised. Pad, bos and
    eos are distinct tokens: with pad == eos, collators that mask padding would also mask the real eos. The chat
    template is ChatML-like: ``<|bos|><|im_start|>user\\n{query}<|im_end|>\\n<|im_start|>assistant\\n``.
    Training is deterministic: the same arguments give the same vocabulary.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(EMBEDDED_SPECIAL_TOKENS.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rows = make_arithmetic_sample("train", min(num_samples, embedded_split_size("train", seed)), seed)
    # the role names are trained too, so the chat template's "user"/"assistant" are single tokens
    texts = (f"user\n{r['query']}\nassistant\n{r['response']}" for r in rows)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EMBEDDED_SPECIAL_TOKENS["bos"],
        eos_token=EMBEDDED_SPECIAL_TOKENS["eos"],
        pad_token=EMBEDDED_SPECIAL_TOKENS["pad"],
        additional_special_tokens=[EMBEDDED_SPECIAL_TOKENS["im_start"]],
        chat_template=EMBEDDED_CHAT_TEMPLATE,
        model_max_length=2048,
    )
