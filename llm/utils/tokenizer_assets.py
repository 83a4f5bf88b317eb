"""The tiny tokenizer committed under ``llm/assets/tiny_tokenizer/`` for tests and CPU runs.

Rebuild it (after ``python -m llm.data.make_sample_data``) from the repository root::

    python -m llm.utils.tokenizer_assets [--out-dir DIR]

Byte-level BPE (no unknown characters ever) with every digit its own token, so a small
model sees ``12`` as ``1 2`` and can learn column arithmetic. The PRM placeholder ``ки``
is one ordinary (non-special) added token, so it survives ``skip_special_tokens`` and
decodes back to text; the reward tokens ``+`` and ``-`` are single tokens of the byte
alphabet. Encoding with ``add_special_tokens=True`` prepends ``<s>``; nothing else is added.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

# The corpus and the PRM placeholder, as ``llm.data.make_sample_data`` writes them (not imported: utils does
# not depend on the data generator; tests/test_repository.py checks that both agree).
SAMPLE_DIR = Path(__file__).resolve().parents[1] / "data" / "sample"
PLACEHOLDER = "ки"
TINY_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"
VOCAB_SIZE = 647  # learned tokens; with the placeholder len(tokenizer) <= 648 (the tiny configs)
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MODEL_MAX_LENGTH = 1024


def build_tiny_tokenizer(corpus_texts: list[str]) -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE tokenizer on ``corpus_texts``.

    Special tokens get the fixed ids 0-6 (pad, bos, eos, unk, system, user, assistant);
    ``ки`` is added after training and so takes the id after the learned vocabulary.
    Training is single-pass and deterministic: the same texts give the same files.
    """
    tok = Tokenizer(models.BPE())
    # Digits first: each digit becomes its own pre-token, so BPE never merges "12".
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [PAD, BOS, EOS, UNK, *ROLE_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts, trainer=trainer)
    # Not special: PRM code finds it in decoded text and it must not vanish on decode.
    tok.add_tokens([AddedToken(PLACEHOLDER, normalized=False, special=False)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B:1",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


CORPUS_FILES = ("pairs_dev", "pairs_train", "prm_dev", "prm_train", "prompts")


def sample_corpus(sample_dir: Path = SAMPLE_DIR) -> list[str]:
    """Every question, answer and solution text of the training and dev sample files, in file order (the
    evaluation-only files, ProcessBench and best-of-N, reuse their words and are not part of the corpus)."""
    texts: list[str] = []
    for path in sorted(p for p in sample_dir.glob("*.jsonl") if p.stem in CORPUS_FILES):
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            for key in ("src", "tgt"):
                value = rec.get(key, [])
                texts.extend([value] if isinstance(value, str) else value)
            if "responses" in rec:
                texts.append("\n".join(rec["responses"]))
            texts.extend(rec.get("response", []))
    return texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample-dir", type=Path, default=SAMPLE_DIR, help="corpus: *.jsonl here")
    parser.add_argument("--out-dir", type=Path, default=TINY_TOKENIZER_DIR, help="where to save")
    args = parser.parse_args(argv)
    tok = build_tiny_tokenizer(sample_corpus(args.sample_dir))
    tok.save_pretrained(args.out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (PLACEHOLDER, "+", "-", PAD, BOS, EOS)}
    print(f"saved {args.out_dir}: {len(tok)} tokens; ids {ids}")


if __name__ == "__main__":
    main()
